/**
 * The donor's tab as Chromium lives it, on a 3-page fortunes-tiny mesh
 * behind a real tracker and relay (WASM). Page 0 is a real tab:
 * opened in the default context of a Chromium attached over CDP
 * (src/cli/cdp-chromium.ts), where `Page.setWebLifecycleState` freezes it
 * for real — a `newContext()` page answers the same call and freezes
 * nothing.
 *
 *   freeze mid-chat   the page's beacon tells the tracker at once (≤ 1 s),
 *                     the chat ends with the float64 reference's tokens,
 *                     and after `active` the page is routed to and answers
 *                     again within 5 s, with no weight byte downloaded
 *   then, one test    Pause mid-chat drains: that chat finishes through the
 *                     page, a new one finds no route, the button counts the
 *                     grace down, then reads Resume (the Web Lock let go);
 *                     a 50 % duty cycle halves the throughput the tracker
 *                     counts on; Resume serves again. Closed, the pagehide
 *                     beacon drains it at once; reopened after the tracker
 *                     dropped it (within its rejoin grace: no other page is
 *                     grown over its layers meanwhile), it restores identity
 *                     and span from IndexedDB, and nobody downloads a byte. Frozen mid-chat again, a
 *                     Node.js spare holding its layers joins and takes the
 *                     chat on while the page is still frozen.
 */
import { expect, test, type Page } from '@playwright/test';
import OpenAI from 'openai';
import { setLifecycle } from '../src/cli/cdp-chromium.ts';
import { startBrowserMesh, type BrowserMesh } from '../src/cli/browser-mesh.ts';
import { pageBudget } from '../src/cli/demo.ts';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import type { NodeStatus } from '../src/host/browser/engine.ts';
import type { RelayClient } from '../src/net/relay-client.ts';
import { encodeTensor } from '../src/protocol/tensor.ts';
import { loadModelSpec } from '../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../src/tracker/options.ts';
import { FORTUNES_DIR, fortunesTiny } from '../test/helpers/fortunes-tiny.ts';
import { startNode, startTrackerProc, until, type NodeProc, type TrackerProc } from '../test/helpers/mesh.ts';
import { appUrl, startCaller, startRelayProcess, type RelayProcess } from './support/mesh.ts';

// The reference's greedy answer to this prompt runs past 64 tokens: long enough to freeze a page in the middle of it.
const PROMPT = 'Tell me a fortune about computers.';
const MAX_TOKENS = 64;
const HEARTBEAT_MS = 1000;

type NodeRow = { peer_id: string; status: string; draining: boolean; draining_since: number | null; throughput: number; layer_ms: number; duty_cycle: number; serving: { start_layer: number; end_layer: number } | null };

let relay: RelayProcess;
let model: StaticServer;
let tracker: TrackerProc;
let mesh: BrowserMesh | undefined;
let caller: RelayClient | undefined;
let spare: NodeProc | undefined;
let want: number[] = [];
let mid: { page: Page; peer: string; span: [number, number] };

async function nodes(): Promise<NodeRow[]> {
  const a = (await (await fetch(`${tracker.url}/api/availability?model=fortunes-tiny`)).json()) as { models: Array<{ nodes: NodeRow[] }> };
  return a.models[0]!.nodes;
}
async function node(peer: string): Promise<NodeRow | undefined> {
  return (await nodes()).find((n) => n.peer_id === peer);
}
async function status(page: Page): Promise<NodeStatus> {
  return page.evaluate(() => window.meshnet!.engine.status());
}

/** A one-token stateless /forward over the relay into the page's span: 200 when it serves. */
async function answers(peer: string, span: [number, number]): Promise<boolean> {
  const hidden = fortunesTiny().cfg.hiddenSize;
  const body = encodeTensor(new Float32Array(hidden).fill(0.01), 'bf16');
  const res = await caller!.request(peer, { method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': `1,1,${hidden}`, 'x-meshnet-dtype': 'bf16', 'x-meshnet-start-layer': String(span[0]), 'x-meshnet-end-layer': String(span[1]) }, body }, { timeoutMs: 5_000 });
  return res.status === 200;
}

/**
 * Streams a chat; `during(n)` runs (awaited, the stream buffering meanwhile) after the n-th token arrives.
 * Returns the token ids.
 */
async function chat(during?: (tokens: number) => Promise<void>): Promise<number[]> {
  const client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 120_000 });
  const stream = await client.chat.completions.create({ model: 'fortunes-tiny', messages: [{ role: 'user', content: PROMPT }], max_tokens: MAX_TOKENS, temperature: 0, stream: true });
  const ids: number[] = [];
  for await (const c of stream) {
    const ch = c.choices[0] as (OpenAI.Chat.Completions.ChatCompletionChunk.Choice & { token_ids?: number[] }) | undefined;
    const before = ids.length;
    ids.push(...(ch?.token_ids ?? []));
    if (during && before < 4 && ids.length >= 4) await during(ids.length);
  }
  return ids;
}

/** A chat the tracker must refuse at once: no route (the only holder of some layers takes no new session). */
async function refused(): Promise<number> {
  const r = await fetch(`${tracker.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'fortunes-tiny', messages: [{ role: 'user', content: 'hi' }], max_tokens: 4 }) });
  return r.status;
}

/** What the node announced per layer in its latest heartbeat, ms (the dashboard's history of them). */
async function announcedLayerMs(peer: string): Promise<number> {
  const d = (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { nodes: Array<{ peer_id: string; rpm_history: Array<{ layer_ms: number }> }> };
  return d.nodes.find((n) => n.peer_id === peer)!.rpm_history.at(-1)!.layer_ms;
}

/*
 * A tab frozen and resumed by CDP stays hidden (bringToFront does not show it again here), and a hidden
 * tab draws no frames, so Playwright's click, which waits for the element to be stable across frames,
 * never returns. The donor's controls are worked by their DOM events instead: the same listeners run.
 */
async function press(page: Page, id: string): Promise<void> {
  await page.locator(`#${id}`).dispatchEvent('click');
}

async function setDuty(page: Page, pct: number): Promise<void> {
  await page.locator('#duty').evaluate((e, v) => {
    (e as HTMLInputElement).value = v;
    e.dispatchEvent(new Event('change'));
  }, String(pct));
  await expect(page.locator('#duty-value')).toHaveText(`${pct} %`);
}

async function holdsLock(page: Page): Promise<boolean> {
  return page.evaluate(async () => (await navigator.locks.query()).held?.some((l) => l.name === 'meshnet:donating') ?? false);
}

test.describe.configure({ mode: 'serial' });

test.beforeAll(async () => {
  test.setTimeout(300_000);
  // Before any socket opens: the float64 reference is seconds of synchronous work.
  want = fortunesTiny().greedy(PROMPT, MAX_TOKENS).ids;
  [relay, model] = await Promise.all([startRelayProcess(), startStaticServer({ root: FORTUNES_DIR, port: 0, host: '127.0.0.1' })]);
  tracker = await startTrackerProc(['--model', `fortunes-tiny=${model.url}`, '--relay', relay.url, '--heartbeat-interval-ms', String(HEARTBEAT_MS)]);
  caller = await startCaller(relay);
  const budgetMb = pageBudget(await loadModelSpec('fortunes-tiny', `${model.url}/`, fetch, resolveTrackerOptions({})), 3, undefined);
  // Pages are assigned in order (browser-mesh.ts), and the first one given a span never gets layer 0
  // (a window from 0 also holds the embeddings, so the tracker starts the first one after it): page 0,
  // the real tab, holds layers no other page holds, and is not the head.
  mesh = await startBrowserMesh({ nodes: 3, trackerUrl: tracker.url, relayUrl: relay.url, appUrl: appUrl(), model: 'fortunes-tiny', backend: 'wasm', budgetMb, threads: 1, pollMs: 500, realTab: { page: 0 } });
  await mesh.waitServing(180_000);
  const page = mesh.page(0)!;
  const st = await status(page);
  const span: [number, number] = [st.model!.startLayer, st.model!.endLayer];
  // Not the head (layer 0): freezing it must route around it, not lose the chat's head.
  expect(span[0], 'the real tab does not hold layer 0').toBeGreaterThan(0);
  mid = { page, peer: st.peerId!, span };
  await until(async () => ((await (await fetch(`${tracker.url}/api/availability?model=fortunes-tiny`)).json()) as { models: Array<{ complete: boolean }> }).models[0]?.complete, 30_000, 'every layer served');
  // Warm: one chat through every page (and a layer_ms from each).
  expect(await chat()).toEqual(want);
});

test.afterAll(async () => {
  await spare?.stop();
  caller?.close();
  await mesh?.close();
  await tracker?.stop();
  await Promise.all([relay?.stop(), model?.close()]);
});

test('frozen mid-chat: routed around within 1 s, the chat ends with the reference\'s tokens, back within 5 s with 0 bytes downloaded', async () => {
  test.setTimeout(180_000);
  const bytes0 = model.stats.bytesSent;
  const fetched0 = (await status(mid.page)).fetchedBytes;
  let routedAroundMs = NaN;
  let backMs = NaN;
  const ids = await chat(async () => {
    const t0 = Date.now();
    await setLifecycle(mid.page, 'frozen');
    const drained = await until(async () => (await node(mid.peer))?.draining_since ?? undefined, 10_000, 'the tracker to see the drain');
    routedAroundMs = drained - t0;
    // No route may use it now: the only holder of its layers drains, so none exists.
    const route = await fetch(`${tracker.url}/api/route?model=fortunes-tiny`);
    expect(route.status).toBe(503);
    // Frozen for 2 s: under the 3 heartbeats after which the tracker would drop it (the next test covers a longer freeze).
    await new Promise((r) => setTimeout(r, 2_000));
    const t1 = Date.now();
    await setLifecycle(mid.page, 'active');
    await until(async () => {
      const n = await node(mid.peer);
      return n && !n.draining && n.status === 'serving' && (await answers(mid.peer, mid.span));
    }, 15_000, 'the page to be routed to and answer again');
    backMs = Date.now() - t1;
  });
  console.log(`[lifecycle] freeze → routed around ${routedAroundMs} ms; active → serving ${backMs} ms`);
  expect(ids).toEqual(want);
  expect(routedAroundMs).toBeLessThanOrEqual(1_000);
  expect(backMs).toBeLessThanOrEqual(5_000);
  expect(model.stats.bytesSent - bytes0).toBe(0);
  expect((await status(mid.page)).fetchedBytes).toBe(fetched0);
  // The page itself saw the freeze and told the tracker.
  const events = await mid.page.evaluate(() => window.meshnet!.controller.lifecycle!.events.map((e) => [e.event, e.beacon]));
  expect(events.slice(-2)).toEqual([
    ['frozen', true],
    ['resumed', false],
  ]);
});


test('the donor in control, then the tab closed and frozen again: Pause drains and a 50 % duty cycle halves the throughput; closed, it drains at once and reopens with its span and no download; frozen again, a spare that joins takes the chat on', async () => {
  test.setTimeout(180_000);
  const t0 = Date.now();
  const laps: string[] = [];
  const lap = (what: string) => laps.push(`${what} ${((Date.now() - t0) / 1000).toFixed(1)} s`);
  const bytes0 = model.stats.bytesSent;
  const fetched0 = (await status(mid.page)).fetchedBytes;

  // Pause mid-chat. The chat in flight holds a session on the page, so it finishes through it (the route
  // may use only the end of the page's span); a new chat finds no route; the button counts the grace down.
  const pause = mid.page.locator('#pause');
  let newChat = 0;
  const inFlight = await chat(async () => {
    await press(mid.page, 'pause');
    await until(async () => (await node(mid.peer))?.draining, 5_000, 'the tracker to see the drain');
    await expect(pause).toHaveText(/^Pausing… \d+ s$/, { timeout: 5_000 });
    newChat = await refused();
  });
  expect(inFlight).toEqual(want);
  expect(newChat).toBe(503);
  lap('paused chat done');

  // Nothing runs now, so what the page measures per layer stays put: a 50 % cap doubles what it announces,
  // and the tracker's throughput for it halves. The drain finishes meanwhile (no step for a few seconds).
  await new Promise((r) => setTimeout(r, HEARTBEAT_MS + 200));
  const full = await announcedLayerMs(mid.peer);
  expect(full).toBeGreaterThan(0);
  await setDuty(mid.page, 50);
  await expect(mid.page.locator('#state')).toHaveText('Paused');
  await expect(pause).toHaveText('Resume', { timeout: 15_000 });
  lap('Resume shown');
  expect(await holdsLock(mid.page), 'a paused tab lets go of the Web Lock').toBe(false);
  const halved = await until(async () => {
    const n = await node(mid.peer);
    return n && n.duty_cycle === 0.5 && Math.abs(n.throughput / (1000 / full) - 0.5) < 0.05 ? n : undefined;
  }, 20_000, 'the tracker to count half the throughput');
  console.log(`[lifecycle] duty 100 % → 50 %: throughput ${(1000 / full).toFixed(1)} → ${halved.throughput} layer-steps/s (${(halved.throughput / (1000 / full)).toFixed(3)}×)`);
  lap('throughput halved');
  await setDuty(mid.page, 100);
  await press(mid.page, 'pause');
  await until(async () => {
    const n = await node(mid.peer);
    return n && !n.draining && n.duty_cycle === 1;
  }, 5_000, 'routable again at full duty');
  await until(() => holdsLock(mid.page), 5_000, 'the Web Lock again');
  expect((await status(mid.page)).donor.paused).toBe(false);
  // Paused and resumed, nothing was downloaded by anyone.
  expect(model.stats.bytesSent - bytes0).toBe(0);
  expect((await status(mid.page)).fetchedBytes).toBe(fetched0);
  lap('resumed');

  // Closed: the pagehide beacon drains it at once; silent from then on, the tracker drops it as any page
  // that vanishes. Reopened, it restores identity and span from IndexedDB without a download.
  const ctx = mid.page.context();
  const url = mid.page.url();
  const tClose = Date.now();
  await mid.page.close({ runBeforeUnload: true });
  const closedDrain = await until(async () => (await node(mid.peer))?.draining_since ?? undefined, 10_000, 'the drain on close');
  expect(closedDrain - tClose).toBeLessThanOrEqual(1_000);
  await until(async () => !(await node(mid.peer)), 3 * HEARTBEAT_MS + 10_000, 'the tracker to drop it');
  lap('closed and dropped');
  const page = await ctx.newPage();
  await page.goto(url);
  const back = await until(async () => {
    const s = await status(page).catch(() => undefined);
    return s?.state === 'serving' ? s : undefined;
  }, 60_000, 'the page serving again');
  expect(back.peerId).toBe(mid.peer);
  expect([back.model!.startLayer, back.model!.endLayer]).toEqual(mid.span);
  expect(back.fetchedBytes).toBe(0);
  mid = { ...mid, page };
  await until(async () => {
    const n = await node(mid.peer);
    return n && n.status === 'serving' && !n.draining;
  }, 10_000, 'registered again, serving');
  // Nobody downloaded: while it was gone its layers lay bare, and within the tracker's rejoin grace no other
  // page was grown over them (a move is the last resort; the page came back with its span).
  expect(model.stats.bytesSent - bytes0).toBe(0);
  lap('reopened');

  // Frozen mid-chat again (its beacon: this is the second freeze of this tab's peer), and a Node.js node
  // holding the same layers joins meanwhile: the head replaces the frozen hop with it and the chat
  // ends with the reference's tokens while the page is still frozen.
  let continued = 0;
  const ids = await chat(async (n) => {
    await setLifecycle(mid.page, 'frozen');
    await until(async () => (await node(mid.peer))?.draining, 5_000, 'the tracker to see the second freeze');
    spare = await startNode(['--relay', relay.url, '--tracker', tracker.url, '--model', 'fortunes-tiny', '--layers', `${mid.span[0]}-${mid.span[1]}`, '--model-url', `${model.url}/`]);
    await until(async () => (await node(spare!.peerId))?.status === 'serving', 30_000, 'the spare serving');
    continued = n;
  });
  // Done while still frozen. The page is still draining, or, frozen past 3 heartbeats, dropped: no route uses it.
  const frozen = await node(mid.peer);
  expect(frozen === undefined || frozen.draining).toBe(true);
  lap('spare took the chat');
  await setLifecycle(mid.page, 'active');
  expect(continued).toBeGreaterThan(0);
  expect(ids).toEqual(want);
  await until(async () => (await node(mid.peer))?.status === 'serving', 10_000, 'the page back');
  lap('back');
  console.log(`[lifecycle] ${laps.join('; ')}`);
});
