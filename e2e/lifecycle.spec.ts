/**
 * The donor's tab as Chromium lives it, on a 3-page fortunes-tiny mesh
 * behind a real tracker and relay (WASM). The middle page is a real tab:
 * opened in the default context of a Chromium attached over CDP
 * (src/cli/cdp-chromium.ts), where `Page.setWebLifecycleState` freezes it
 * for real — a `newContext()` page answers the same call and freezes
 * nothing.
 *
 *   freeze mid-chat   the page's beacon tells the tracker at once (≤ 1 s),
 *                     the chat ends with the float64 reference's tokens,
 *                     and after `active` the page is routed to and answers
 *                     again within 5 s, with no weight byte downloaded
 *   … with a spare    a Node.js node holding the same layers joins while the
 *                     page is frozen: the chat goes on through it
 *   pause             drains: the chat in flight finishes through the page,
 *                     the button counts the grace down, a new chat finds no
 *                     route through it; Resume serves again, 0 bytes
 *   duty cycle        50 % halves the throughput the tracker counts on
 *   closing           pagehide's beacon drains the node at once; the page
 *                     reopened restores identity and span from IndexedDB
 *                     without a download, after the tracker forgot it
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

test.describe.configure({ mode: 'serial' });

test.beforeAll(async () => {
  test.setTimeout(300_000);
  // Before any socket opens: the float64 reference is seconds of synchronous work.
  want = fortunesTiny().greedy(PROMPT, MAX_TOKENS).ids;
  [relay, model] = await Promise.all([startRelayProcess(), startStaticServer({ root: FORTUNES_DIR, port: 0, host: '127.0.0.1' })]);
  tracker = await startTrackerProc(['--model', `fortunes-tiny=${model.url}`, '--relay', relay.url, '--heartbeat-interval-ms', String(HEARTBEAT_MS)]);
  caller = await startCaller(relay);
  const budgetMb = pageBudget(await loadModelSpec('fortunes-tiny', `${model.url}/`, fetch, resolveTrackerOptions({})), 3, undefined);
  // Page 1 (opened second) is the real tab; the tracker gives it the middle span.
  mesh = await startBrowserMesh({ nodes: 3, trackerUrl: tracker.url, relayUrl: relay.url, appUrl: appUrl(), model: 'fortunes-tiny', backend: 'wasm', budgetMb, threads: 1, pollMs: 500, realTab: { page: 1 } });
  await mesh.waitServing(180_000);
  const page = mesh.page(1)!;
  const st = await status(page);
  const span: [number, number] = [st.model!.startLayer, st.model!.endLayer];
  expect(span[0], 'the real tab holds the middle span').toBeGreaterThan(0);
  expect(span[1]).toBeLessThan(st.model!.numLayers);
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

test('frozen mid-chat while a spare holds the same layers: the chat goes on through the spare before the page is back', async () => {
  test.setTimeout(180_000);
  let continued = 0;
  const ids = await chat(async (n) => {
    await setLifecycle(mid.page, 'frozen');
    await until(async () => (await node(mid.peer))?.draining, 10_000, 'the drain');
    spare = await startNode(['--relay', relay.url, '--tracker', tracker.url, '--model', 'fortunes-tiny', '--layers', `${mid.span[0]}-${mid.span[1]}`, '--model-url', `${model.url}/`]);
    await until(async () => (await node(spare!.peerId))?.status === 'serving', 30_000, 'the spare serving');
    continued = n;
  });
  // Done while still frozen: every token after the freeze came through the spare.
  expect((await node(mid.peer))?.draining).toBe(true);
  await setLifecycle(mid.page, 'active');
  expect(continued).toBeGreaterThan(0);
  expect(ids).toEqual(want);
  await until(async () => (await node(mid.peer))?.status === 'serving', 10_000, 'the page back');
  await spare?.stop();
  spare = undefined;
});

test('Pause drains: the chat in flight finishes, the button counts the grace down, no new chat comes; Resume serves at once with 0 bytes', async () => {
  test.setTimeout(180_000);
  const bytes0 = model.stats.bytesSent;
  // A frozen-then-resumed tab stays hidden, and a hidden tab draws no frames: bring it to the front to click.
  await mid.page.bringToFront();
  const pause = mid.page.locator('#pause');
  let label = '';
  let newChat = 0;
  const ids = await chat(async () => {
    await pause.click();
    await until(async () => (await node(mid.peer))?.draining, 5_000, 'the drain');
    label = (await pause.textContent()) ?? '';
    // A new chat has no route: the only holder of the middle layers takes no new session.
    newChat = (await fetch(`${tracker.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'fortunes-tiny', messages: [{ role: 'user', content: 'hi' }], max_tokens: 4 }) })).status;
  });
  expect(ids).toEqual(want);
  expect(label).toMatch(/^Pausing… \d+ s$/);
  expect(newChat).toBe(503);
  await expect(mid.page.locator('#state')).toHaveText('Paused');
  await expect(pause).toHaveText('Resume', { timeout: 20_000 });
  expect(await mid.page.evaluate(async () => (await navigator.locks.query()).held?.some((l) => l.name === 'meshnet:donating'))).toBe(false);
  await pause.click();
  await until(async () => {
    const n = await node(mid.peer);
    return n && !n.draining;
  }, 5_000, 'routable again');
  expect(await chat()).toEqual(want);
  expect(model.stats.bytesSent - bytes0).toBe(0);
  await expect(mid.page.locator('#lock')).toHaveText(/Holding a Web Lock/);
  // Kept in IndexedDB: the donor's choice survives a reload.
  expect(await mid.page.evaluate(() => window.meshnet!.engine.status().then((s) => s.donor.paused))).toBe(false);
});

test('a 50 % duty cycle halves the throughput the tracker counts on for the page', async () => {
  test.setTimeout(120_000);
  const before = (await node(mid.peer))!;
  await mid.page.bringToFront();
  await mid.page.locator('#duty').fill('50');
  await mid.page.locator('#duty').dispatchEvent('change');
  await expect(mid.page.locator('#duty-value')).toHaveText('50 %');
  // The tracker smooths layer_ms over heartbeats: let it settle.
  const after = await until(async () => {
    const n = await node(mid.peer);
    return n && n.duty_cycle === 0.5 && Math.abs(n.throughput / before.throughput - 0.5) < 0.05 ? n : undefined;
  }, 30_000, 'the tracker to count half the throughput');
  console.log(`[lifecycle] duty 100 % → 50 %: throughput ${before.throughput} → ${after.throughput} layer-steps/s (${(after.throughput / before.throughput).toFixed(3)}×)`);
  // Still serving right.
  expect(await chat()).toEqual(want);
  await mid.page.locator('#duty').fill('100');
  await mid.page.locator('#duty').dispatchEvent('change');
  await until(async () => (await node(mid.peer))?.duty_cycle === 1, 10_000, 'the cap lifted');
});

test('closing the page drains it at once (pagehide beacon); reopened after the tracker forgot it, it restores its span from IndexedDB without a download', async () => {
  test.setTimeout(180_000);
  const ctx = mid.page.context();
  const url = mid.page.url();
  const bytes0 = model.stats.bytesSent;
  const t0 = Date.now();
  await mid.page.close({ runBeforeUnload: true });
  const drained = await until(async () => (await node(mid.peer))?.draining_since ?? undefined, 10_000, 'the drain');
  expect(drained - t0).toBeLessThanOrEqual(1_000);
  // Silent from now on: dropped by the heartbeat timeout, as any page that vanishes.
  await until(async () => !(await node(mid.peer)), 3 * HEARTBEAT_MS + 10_000, 'the tracker to drop it');
  const page = await ctx.newPage();
  await page.goto(url);
  const back = await until(async () => {
    const s = await status(page).catch(() => undefined);
    return s?.state === 'serving' ? s : undefined;
  }, 60_000, 'the page serving again');
  expect(back.peerId).toBe(mid.peer);
  expect([back.model!.startLayer, back.model!.endLayer]).toEqual(mid.span);
  expect(back.fetchedBytes).toBe(0);
  expect(model.stats.bytesSent - bytes0).toBe(0);
  mid = { ...mid, page };
  await until(async () => (await node(mid.peer))?.status === 'serving', 10_000, 'registered again');
  expect(await chat()).toEqual(want);
});
