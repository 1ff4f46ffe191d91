/**
 * The demo's default model through a browser mesh: the shipped
 * `fortunes-tiny` (learned weights) served by three headless Chromium pages
 * (src/cli/browser-mesh.ts, WASM) behind a real tracker and relay, with the
 * demo's budget for three pages and the default wire dtype (bf16). Each
 * streamed chat is the float64 reference's greedy answer, token for token:
 * on learned weights the logits are peaked, so a wrong kernel or a bad hop
 * shows as a different quote, not as a near-tie. The pages chain by default
 * (the pages after the head count chained steps); pages opened with
 * `?hop=star` drive every hop from the head (they count none).
 */
import { expect, test } from '@playwright/test';
import OpenAI from 'openai';
import { startBrowserMesh, type BrowserMesh } from '../src/cli/browser-mesh.ts';
import { pageBudget } from '../src/cli/demo.ts';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import { loadModelSpec } from '../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../src/tracker/options.ts';
import { FORTUNES_DIR, fortunesTiny } from '../test/helpers/fortunes-tiny.ts';
import { chainForwardsAfterHead, startTrackerProc, until, type TrackerProc } from '../test/helpers/mesh.ts';
import { appUrl, startRelayProcess, type RelayProcess } from './support/mesh.ts';

const PROMPTS = ['Tell me a fortune about science.', 'Tell me a short story about a fox who shares her GPU.', 'Tell me a fortune about computers.'];
const MAX_TOKENS = 32;

let relay: RelayProcess;
let model: StaticServer;
let tracker: TrackerProc;
let starTracker: TrackerProc | undefined;
let mesh: BrowserMesh | undefined;
let wants: Array<{ ids: number[]; text: string }> = [];

test.beforeAll(async () => {
  // Before any socket opens: the float64 reference is seconds of synchronous work.
  wants = PROMPTS.map((p) => fortunesTiny().greedy(p, MAX_TOKENS));
  [relay, model] = await Promise.all([startRelayProcess(), startStaticServer({ root: FORTUNES_DIR, port: 0, host: '127.0.0.1' })]);
  tracker = await startTrackerProc(['--model', `fortunes-tiny=${model.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000']);
});

test.afterAll(async () => {
  await mesh?.close();
  await tracker?.stop();
  await starTracker?.stop();
  await Promise.all([relay?.stop(), model?.close()]);
});

test('three browser pages serve fortunes-tiny and stream the float64 reference\'s greedy answers', async () => {
  test.setTimeout(240_000);
  const budgetMb = pageBudget(await loadModelSpec('fortunes-tiny', `${model.url}/`, fetch, resolveTrackerOptions({})), 3, undefined);
  const logs: string[] = [];
  mesh = await startBrowserMesh({ nodes: 3, trackerUrl: tracker.url, relayUrl: relay.url, appUrl: appUrl(), model: 'fortunes-tiny', backend: 'wasm', budgetMb, threads: 1, pollMs: 200, log: (m) => logs.push(m) });
  await mesh.waitServing(120_000).catch((e: Error) => {
    throw new Error(`${e.message}: ${JSON.stringify(mesh!.rows())} ${logs.join('; ')}`);
  });
  await until(async () => ((await (await fetch(`${tracker.url}/api/availability?model=fortunes-tiny`)).json()) as { models: Array<{ complete: boolean }> }).models[0]?.complete, 30_000, 'every layer served');
  // Every page holds a share: the budget is the least with which three pages hold the model.
  for (const r of mesh.rows()) expect(r.layers, JSON.stringify(mesh.rows())).toBeTruthy();

  const client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
  for (const [k, prompt] of PROMPTS.entries()) {
    const stream = await client.chat.completions.create({ model: 'fortunes-tiny', messages: [{ role: 'user', content: prompt }], max_tokens: MAX_TOKENS, temperature: 0, stream: true });
    const ids: number[] = [];
    let text = '';
    for await (const c of stream) {
      const ch = c.choices[0] as (OpenAI.Chat.Completions.ChatCompletionChunk.Choice & { token_ids?: number[] }) | undefined;
      ids.push(...(ch?.token_ids ?? []));
      text += ch?.delta.content ?? '';
    }
    console.log(`[fortunes-tiny, 3 browser pages] ${JSON.stringify(prompt)} → ${JSON.stringify(text)}`);
    expect(ids).toEqual(wants[k]!.ids);
    expect(text).toBe(wants[k]!.text);
  }
  const d = (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { recent_routes: Array<{ kind: string; hops: unknown[] }> };
  expect(d.recent_routes.find((r) => r.kind === 'generate')?.hops).toHaveLength(3);
  // The pages chain by default: both pages after the head took chained steps.
  const chained = await chainForwardsAfterHead(tracker.url);
  expect(chained).toHaveLength(2);
  for (const c of chained) expect(c).toBeGreaterThan(0);
});

test('three ?hop=star pages: the head drives every hop, the pages after it count no chained step, same answer', async () => {
  test.setTimeout(240_000);
  await mesh?.close();
  mesh = undefined;
  // A tracker of its own: the first mesh's pages are gone, and nothing of them may be routed to.
  starTracker = await startTrackerProc(['--model', `fortunes-tiny=${model.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000']);
  const t = starTracker;
  const budgetMb = pageBudget(await loadModelSpec('fortunes-tiny', `${model.url}/`, fetch, resolveTrackerOptions({})), 3, undefined);
  const logs: string[] = [];
  mesh = await startBrowserMesh({ nodes: 3, trackerUrl: t.url, relayUrl: relay.url, appUrl: appUrl(), model: 'fortunes-tiny', backend: 'wasm', budgetMb, threads: 1, hop: 'star', pollMs: 200, log: (m) => logs.push(m) });
  await mesh.waitServing(120_000).catch((e: Error) => {
    throw new Error(`${e.message}: ${JSON.stringify(mesh!.rows())} ${logs.join('; ')}`);
  });
  await until(async () => ((await (await fetch(`${t.url}/api/availability?model=fortunes-tiny`)).json()) as { models: Array<{ complete: boolean }> }).models[0]?.complete, 30_000, 'every layer served');
  const client = new OpenAI({ baseURL: `${t.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
  const res = await client.chat.completions.create({ model: 'fortunes-tiny', messages: [{ role: 'user', content: PROMPTS[0]! }], max_tokens: MAX_TOKENS, temperature: 0 });
  expect(res.choices[0]?.message.content).toBe(wants[0]!.text);
  const d = (await (await fetch(`${t.url}/api/dashboard`)).json()) as { recent_routes: Array<{ kind: string; hops: unknown[] }> };
  // Three hops: with two downstream hops the default would have chained (one downstream hop is a star either way).
  expect(d.recent_routes.find((r) => r.kind === 'generate')?.hops).toHaveLength(3);
  expect(await chainForwardsAfterHead(t.url)).toEqual([0, 0]);
});
