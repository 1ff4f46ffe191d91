/**
 * Restarts under a browser mesh: three headless Chromium pages serving the
 * shipped `fortunes-tiny` behind a real relay and tracker (the demo's budget
 * for three pages, so every chat crosses every page over the relay).
 *
 * - The relay is SIGKILLed mid-chat and a new one started on its port a
 *   second later: the chat in flight completes with the float64 reference's
 *   text (waited out and resumed on the same head, not failed over), every
 *   page is registered with the new relay within seconds, a new chat
 *   succeeds, and no page downloaded weights again.
 * - The tracker is SIGKILLed and restarted on its port: a new chat succeeds
 *   within a few seconds of its return (the pages' watch streams tell them),
 *   with no download either.
 */
import { expect, test } from '@playwright/test';
import { createServer } from 'node:net';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startBrowserMesh, type BrowserMesh } from '../src/cli/browser-mesh.ts';
import { pageBudget } from '../src/cli/demo.ts';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import { loadModelSpec } from '../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../src/tracker/options.ts';
import { FORTUNES_DIR, fortunesTiny } from '../test/helpers/fortunes-tiny.ts';
import { startTrackerProc, until, type TrackerProc } from '../test/helpers/mesh.ts';
import { appUrl, startRelayProcess, type RelayProcess } from './support/mesh.ts';

const PROMPT = 'Tell me a short story about a fox who shares her GPU.';
const MAX_TOKENS = 32;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => resolve(port));
    });
  });
}

async function chat(trackerUrl: string, onToken?: (n: number) => void): Promise<{ ids: number[]; text: string; error?: string; maxGapMs: number }> {
  const out: { ids: number[]; text: string; error?: string; maxGapMs: number } = { ids: [], text: '', maxGapMs: 0 };
  const res = await fetch(`${trackerUrl}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'fortunes-tiny', messages: [{ role: 'user', content: PROMPT }], max_tokens: MAX_TOKENS, temperature: 0, stream: true }),
  }).catch((e: Error) => e);
  if (res instanceof Error) return { ...out, error: res.message };
  if (!res.ok || !res.body) return { ...out, error: `HTTP ${res.status}: ${await res.text()}` };
  let last = performance.now();
  let buf = '';
  const dec = new TextDecoder();
  try {
    for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
      out.maxGapMs = Math.max(out.maxGapMs, performance.now() - last);
      last = performance.now();
      buf += dec.decode(chunk, { stream: true });
      let i: number;
      while ((i = buf.indexOf('\n\n')) >= 0) {
        const line = buf.slice(0, i).trim();
        buf = buf.slice(i + 2);
        if (!line.startsWith('data:') || line.includes('[DONE]')) continue;
        const m = JSON.parse(line.slice(5)) as { error?: { message: string }; choices?: Array<{ delta: { content?: string }; token_ids?: number[] }> };
        if (m.error) out.error = m.error.message;
        const c = m.choices?.[0];
        if (c?.token_ids?.length) {
          out.ids.push(...c.token_ids);
          onToken?.(out.ids.length);
        }
        out.text += c?.delta.content ?? '';
      }
    }
  } catch (e) {
    out.error = (e as Error).message;
  }
  return out;
}

async function firstGoodChat(trackerUrl: string, limitMs: number): Promise<number> {
  const t0 = performance.now();
  while (performance.now() - t0 < limitMs) {
    const r = await chat(trackerUrl);
    if (!r.error && r.ids.length > 0) return performance.now() - t0;
    await sleep(50);
  }
  throw new Error(`no chat succeeded within ${limitMs} ms`);
}

let relay: RelayProcess;
let relayPort: number;
let tracker: TrackerProc;
let trackerPort: number;
let model: StaticServer;
let mesh: BrowserMesh | undefined;
let work: string;
let want: { ids: number[]; text: string };

const startTracker = () => startTrackerProc(['--port', String(trackerPort), '--model', `fortunes-tiny=${model.url}`, '--relay', relay.url, '--key-file', join(work, 'tracker.key')]);

test.beforeAll(async () => {
  want = fortunesTiny().greedy(PROMPT, MAX_TOKENS);
  work = mkdtempSync(join(tmpdir(), 'meshnet-e2e-restart-'));
  [relayPort, trackerPort] = [await freePort(), await freePort()];
  [relay, model] = await Promise.all([startRelayProcess(['--port', String(relayPort)]), startStaticServer({ root: FORTUNES_DIR, port: 0, host: '127.0.0.1' })]);
  tracker = await startTracker();
});

test.afterAll(async () => {
  await mesh?.close();
  await tracker?.stop();
  await Promise.all([relay?.stop(), model?.close()]);
  rmSync(work, { recursive: true, force: true });
});

test('a relay restart mid-chat loses no chat on three pages, and a tracker restart is found at once; no page downloads weights again', async () => {
  test.setTimeout(300_000);
  const budgetMb = pageBudget(await loadModelSpec('fortunes-tiny', `${model.url}/`, fetch, resolveTrackerOptions({})), 3, undefined);
  mesh = await startBrowserMesh({ nodes: 3, trackerUrl: tracker.url, relayUrl: relay.url, appUrl: appUrl(), model: 'fortunes-tiny', backend: 'wasm', budgetMb, threads: 1, pollMs: 500 });
  await mesh.waitServing(120_000);
  await until(async () => (await fetch(`${tracker.url}/api/route?model=fortunes-tiny`)).ok, 30_000, 'a complete route');
  await firstGoodChat(tracker.url, 30_000);
  const peers = ((await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { nodes: Array<{ peer_id: string }> }).nodes.map((n) => n.peer_id);
  expect(peers).toHaveLength(3);
  const ranges0 = model.stats.ranges.length;

  // The relay dies after the chat's third token and is back on its port a second later.
  let third!: () => void;
  const atThree = new Promise<void>((r) => (third = r));
  const inflight = chat(tracker.url, (n) => n >= 3 && third());
  await atThree;
  await relay.stop('SIGKILL');
  await sleep(1_000);
  relay = await startRelayProcess(['--port', String(relayPort)]);
  const back = performance.now();
  const firstNew = firstGoodChat(tracker.url, 30_000);
  const pagesBack = until(async () => {
    const on = ((await (await fetch(`${relay.httpUrl}/peers`)).json()) as { peers: Array<{ peer_id: string }> }).peers.map((p) => p.peer_id);
    return peers.every((p) => on.includes(p)) && performance.now() - back;
  }, 10_000, 'every page back on the relay');
  const done = await inflight;
  expect(done.error).toBeUndefined();
  expect(done.ids).toEqual(want.ids);
  expect(done.text).toBe(want.text);
  const backMs = await pagesBack;
  const newMs = await firstNew;
  console.log(`[restart, 3 pages] relay: the chat paused ${Math.round(done.maxGapMs)} ms; pages back ${Math.round(backMs)} ms and a new chat done ${Math.round(newMs)} ms after the relay's return`);
  expect(done.maxGapMs).toBeLessThan(10_000);
  // Within about a second of its return (the schedule's 800 ms + the handshake; a loaded machine gets slack).
  expect(backMs).toBeLessThan(3_000);

  // The tracker dies and is back on its port a second later.
  await tracker.stop('SIGKILL');
  await sleep(1_000);
  tracker = await startTracker();
  const trackerMs = await firstGoodChat(tracker.url, 30_000);
  console.log(`[restart, 3 pages] tracker: a new chat done ${Math.round(trackerMs)} ms after its return`);
  expect(trackerMs).toBeLessThan(8_000);

  // Nothing downloaded again: pages kept their spans through both (the restarted tracker reads only the checkpoint's config and header).
  const tensorReads = model.stats.ranges.slice(ranges0).filter((r) => r.path.endsWith('.safetensors') && !/^bytes=(0|8)-/.test(r.range ?? ''));
  expect(tensorReads).toEqual([]);
  for (const r of mesh.rows()) expect(r.restarts).toBe(0);
});
