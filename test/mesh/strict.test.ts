/**
 * Strict mode on a mesh of real processes (docs/verification.md §6): a
 * relay, a tracker with spot-checks OFF (so nothing but strict mode stands
 * between the client and the liar), fortunes-tiny, three heads [0, 3) and
 * three holders of [3, 6), one of which lies (test/helpers/lying-node.ts:
 * its last hop answers the second-best token on every step). Every strict
 * chat runs on two routes that share no node; when the liar is on one of
 * them the routes disagree at the first token, a third disjoint route
 * decides, and the losing route goes on without its nodes.
 *
 * Every greedy answer is the float64 reference's, token for token, whether
 * or not the liar was drawn; the usage block says the answer was strict and
 * counts the disputes; at least one chat had the liar on a route (a dispute).
 */
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { FORTUNES_DIR, fortunesTiny } from '../helpers/fortunes-tiny.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { spawnMeshnet, startNode, startTrackerProc, stopMesh, until, type NodeProc, type Proc, type TrackerProc } from '../helpers/mesh.ts';

const LYING_NODE = fileURLToPath(new URL('../helpers/lying-node.ts', import.meta.url));
const TOPICS = ['science', 'cats', 'the sea', 'money', 'love', 'work', 'music', 'time', 'rain', 'dogs', 'coffee', 'luck'];
const MAX_TOKENS = 12;

interface StrictUsage {
  status: string;
  mode: string;
  generations: Array<{ index: number; status: string; tokens_agreed: number; disputes: number }>;
}

describe('strict mode on a mesh with a liar', () => {
  let st: StaticServer;
  let relay: RelayProcess;
  let tracker: TrackerProc;
  const nodes: NodeProc[] = [];
  let liar: Proc | undefined;
  const fortunes = fortunesTiny();
  const refs = new Map<string, number[]>();

  beforeAll(async () => {
    for (const t of TOPICS) refs.set(t, fortunes.greedy(`Tell me a fortune about ${t}.`, MAX_TOKENS).ids);
    st = await startStaticServer({ root: FORTUNES_DIR });
    relay = await startRelayProcess();
    tracker = await startTrackerProc(['--model', `fortunes-tiny=${st.url}`, '--relay', relay.url, '--wire-dtype', 'f32', '--heartbeat-interval-ms', '500', '--no-checks']);
    const common = ['--tracker', tracker.url, '--relay', relay.url, '--model-url', st.url, '--wire-dtype', 'f32', '--max-context', '256'];
    for (const layers of ['0-3', '0-3', '0-3', '3-6', '3-6']) nodes.push(await startNode([...common, '--layers', layers]));
    const cfg = { mode: 'second-best', tracker: tracker.url, relay: relay.url, model: 'fortunes-tiny', numLayers: 6, layers: [3, 6], modelUrl: st.url, wireDtype: 'f32', maxContext: 256 };
    liar = spawnMeshnet([JSON.stringify(cfg)], { NODE_OPTIONS: '--import tsx' }, LYING_NODE);
    await liar.waitFor((e) => e.event === 'serving', 60_000);
    await until(async () => ((await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { nodes: Array<{ status: string }> }).nodes.filter((n) => n.status === 'serving').length === 6, 30_000, 'six serving nodes');
  }, 180_000);

  afterAll(async () => {
    await liar?.stop();
    await stopMesh({ nodes, tracker, relay, st });
  });

  async function chat(topic: string, verification: string): Promise<{ status: number; ids: number[]; usage?: StrictUsage; error?: string }> {
    const res = await fetch(`${tracker.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'fortunes-tiny', messages: [{ role: 'user', content: `Tell me a fortune about ${topic}.` }], max_tokens: MAX_TOKENS, temperature: 0, verification }),
    });
    const body = (await res.json()) as { choices?: Array<{ token_ids: number[] }>; usage?: { verification?: StrictUsage }; error?: { message: string } };
    return { status: res.status, ids: body.choices?.[0]?.token_ids ?? [], ...(body.usage?.verification ? { usage: body.usage.verification } : {}), ...(body.error ? { error: body.error.message } : {}) };
  }

  it('answers the reference every time, the liar outvoted by a third disjoint route', async () => {
    let disputed = 0;
    let chats = 0;
    // Routes are drawn by the tracker: chat until the liar has been on a route a few times (or give up).
    for (let i = 0; i < 30 && disputed < 3; i++) {
      const topic = TOPICS[i % TOPICS.length]!;
      const r = await chat(topic, 'strict');
      chats++;
      expect(r.status, r.error).toBe(200);
      expect(r.ids).toEqual(refs.get(topic));
      expect(r.usage).toMatchObject({ status: 'clean', mode: 'strict' });
      const g = r.usage!.generations[0]!;
      expect(g.tokens_agreed + g.disputes).toBeGreaterThanOrEqual(r.ids.length);
      if (g.disputes > 0) disputed++;
    }
    console.log(`strict mode: ${disputed} of ${chats} chats had the liar on a route and were decided by a third`);
    expect(disputed).toBeGreaterThan(0);
  }, 240_000);

  it('without strict mode (checks off), an answer through the liar is wrong — what strict mode guards against', async () => {
    // The control: the same mesh, default verification. Some answers go through the liar and differ from the reference.
    let wrong = 0;
    for (let i = 0; i < 30 && wrong === 0; i++) {
      const topic = TOPICS[i % TOPICS.length]!;
      const r = await chat(topic, 'default');
      expect(r.status, r.error).toBe(200);
      if (JSON.stringify(r.ids) !== JSON.stringify(refs.get(topic))) wrong++;
    }
    expect(wrong).toBeGreaterThan(0);
  }, 240_000);
});
