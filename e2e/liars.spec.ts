/**
 * A browser page in a mesh that catches a liar (docs/verification.md): a
 * relay, a tracker with spot-checks on, fortunes-tiny, and four nodes — a
 * Node.js head H [0, 3), a lying Node.js node X [3, 6) (1 % noise; test
 * code only: test/helpers/lying-node.ts), an honest Node.js node Y [3, 6),
 * and a donor page (WASM, the fused f32 graphs) whose budget holds all six
 * layers. The page is a checker and an arbiter of X (it receives POST /check
 * over the relay and signs its answer in the worker), and a hop whose own
 * steps X and Y check (WASM against onnxruntime-node: a heterogeneous pair).
 *
 * X is quarantined within 60 s of steady chats with the page's signed
 * answer in the evidence; the page is never accused; afterwards the greedy
 * answers are the float64 reference's (f32 on the wire).
 */
import { expect, test, type BrowserContext, type Page } from '@playwright/test';
import { fileURLToPath } from 'node:url';
import type { StaticServer } from '../src/cli/static-server.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import type { NodeStatus } from '../src/host/browser/engine.ts';
import { spawnMeshnet, startNode, startTrackerProc, until, type NodeProc, type Proc, type TrackerProc } from '../test/helpers/mesh.ts';
import { FORTUNES_DIR, fortunesTiny } from '../test/helpers/fortunes-tiny.ts';
import { appUrl, startRelayProcess, status, type RelayProcess } from './support/mesh.ts';

const LYING_NODE = fileURLToPath(new URL('../test/helpers/lying-node.ts', import.meta.url));
const TOPICS = ['science', 'cats', 'the sea', 'money', 'love', 'work', 'music', 'time'];

let relay: RelayProcess;
let st: StaticServer;
let tracker: TrackerProc;
const nodes: NodeProc[] = [];
let liar: Proc & { peerId: string };
let context: BrowserContext;
let page: Page;
let pagePeer: string;
const refs = new Map<string, number[]>();

interface Summary {
  nodes: Record<string, { checks: number; passes: number; offences: number; quarantined_until: number | null }>;
  offences: Array<{ peer: string; at: number; role: string; checker: { peer: string }; arbiter?: { peer: string } }>;
  compared_rows?: Record<string, number>;
  pass_distance_max?: Record<string, number>;
}

test.beforeAll(async ({ browser }) => {
  test.setTimeout(240_000);
  for (const t of TOPICS) refs.set(t, fortunesTiny().greedy(`Tell me a fortune about ${t}.`, 16).ids);
  st = await startStaticServer({ root: FORTUNES_DIR, port: 0, host: '127.0.0.1' });
  relay = await startRelayProcess();
  tracker = await startTrackerProc(['--model', `fortunes-tiny=${st.url}`, '--relay', relay.url, '--wire-dtype', 'f32', '--heartbeat-interval-ms', '500', '--route-slack', '1000']);
  const common = ['--tracker', tracker.url, '--relay', relay.url, '--model-url', st.url, '--wire-dtype', 'f32', '--max-context', '256'];
  nodes.push(await startNode([...common, '--layers', '0-3']));
  nodes.push(await startNode([...common, '--layers', '3-6']));
  // Every route gets traffic in proportion to its throughput (--route-slack): on a fast machine the page
  // alone, holding all six layers, costs under half of any two-hop route, and the default slack would then
  // send no chat through the liar at all (a CI run: 1,160 chats, none through it).
  // The page: a budget that holds the whole model, so the tracker gives it every layer.
  context = await browser.newContext({ serviceWorkers: 'block' });
  page = await context.newPage();
  await page.goto(`${appUrl()}?${new URLSearchParams({ relay: relay.url, tracker: tracker.url, model: 'fortunes-tiny', budget: '96', backend: 'wasm', threads: '1', rtc: 'off' })}`);
  const s = await until(async () => {
    const x: NodeStatus = await status(page);
    if (x.state === 'error') throw new Error(`page failed: ${x.error?.code}: ${x.error?.message}`);
    return x.state === 'serving' ? x : undefined;
  }, 120_000, 'the page serving');
  pagePeer = s.peerId!;
  const cfg = { mode: 'noise', tracker: tracker.url, relay: relay.url, model: 'fortunes-tiny', numLayers: 6, layers: [3, 6], modelUrl: st.url, wireDtype: 'f32', maxContext: 256 };
  const p = spawnMeshnet([JSON.stringify(cfg)], { NODE_OPTIONS: '--import tsx' }, LYING_NODE);
  const l = await p.waitFor((e) => e.event === 'serving', 60_000);
  liar = Object.assign(p, { peerId: l.peer_id as string });
});

test.afterAll(async () => {
  await context?.close();
  await liar?.stop();
  await Promise.all(nodes.map((n) => n.stop()));
  await tracker?.stop();
  await relay?.stop();
  await st?.close();
});

async function chat(topic: string): Promise<{ topic: string; ids: number[]; hops: string[] }> {
  const res = await fetch(`${tracker.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'fortunes-tiny', messages: [{ role: 'user', content: `Tell me a fortune about ${topic}.` }], max_tokens: 16, temperature: 0 }),
  });
  const body = (await res.json()) as { choices: Array<{ token_ids: number[] }>; usage: { verification?: { generations: Array<{ hops: Array<{ peer_id: string }> }> } } };
  expect(res.status).toBe(200);
  return { topic, ids: body.choices[0]!.token_ids, hops: body.usage.verification?.generations[0]?.hops.map((h) => h.peer_id) ?? [] };
}

const summary = async (): Promise<Summary> => (await (await fetch(`${tracker.url}/api/verification`)).json()) as Summary;

test('the page checks and arbitrates a lying Node.js node into quarantine, is checked itself and never accused', async () => {
  test.setTimeout(240_000);
  await until(async () => ((await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { nodes: Array<{ peer_id: string; status: string }> }).nodes.filter((n) => n.status === 'serving').length === 4, 30_000, 'four serving nodes');
  const t0 = Date.now();
  let n = 0;
  let done = false;
  const results: Array<Awaited<ReturnType<typeof chat>>> = [];
  const worker = async () => {
    while (!done && Date.now() - t0 < 120_000) results.push(await chat(TOPICS[n++ % TOPICS.length]!));
  };
  const watcher = (async () => {
    while (!done && Date.now() - t0 < 120_000) {
      if ((await summary()).nodes[liar.peerId]?.quarantined_until) done = true;
      else await new Promise((r) => setTimeout(r, 250));
    }
    done = true;
  })();
  await Promise.all([worker(), worker(), watcher]);
  const v = await summary();
  const name = (id: string) => (id === liar.peerId ? 'X' : id === pagePeer ? 'page' : id === nodes[0]!.peerId ? 'H' : id === nodes[1]!.peerId ? 'Y' : id.slice(0, 6));
  const routes: Record<string, number> = {};
  for (const r of results) routes[r.hops.map(name).join('>')] = (routes[r.hops.map(name).join('>')] ?? 0) + 1;
  console.log(`browser mesh: routes taken ${JSON.stringify(routes)}`);
  const off = v.offences.find((o) => o.peer === liar.peerId);
  expect(off, `no offence of the liar after ${results.length} chats`).toBeDefined();
  console.log(`browser mesh: liar quarantined ${((off!.at - t0) / 1000).toFixed(1)} s into traffic, after ${results.length} chats; page checks ${JSON.stringify(v.nodes[pagePeer])}`);
  expect(off!.at - t0).toBeLessThan(60_000);
  // The page took part in judging it (as checker or arbiter), and nobody honest was accused.
  expect([off!.checker.peer, off!.arbiter?.peer]).toContain(pagePeer);
  for (const id of [pagePeer, ...nodes.map((x) => x.peerId)]) expect(v.nodes[id]?.offences ?? 0).toBe(0);

  // Afterwards: the liar is out of every route and answers are the reference's; the page's own steps are checked and pass.
  const after: Array<Awaited<ReturnType<typeof chat>>> = [];
  const t1 = Date.now();
  while (Date.now() - t1 < 30_000 && ((await summary()).nodes[pagePeer]?.passes ?? 0) < 3) after.push(await chat(TOPICS[n++ % TOPICS.length]!));
  for (const c of after) {
    expect(c.hops).not.toContain(liar.peerId);
    expect(c.ids).toEqual(refs.get(c.topic));
  }
  const end = await summary();
  console.log(`browser mesh: rows compared in passing checks ${JSON.stringify(end.compared_rows)}, largest passing distances ${JSON.stringify(end.pass_distance_max)}`);
  const page0 = end.nodes[pagePeer]!;
  expect(page0.passes).toBeGreaterThan(0);
  expect(page0.offences).toBe(0);
});
