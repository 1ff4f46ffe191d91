/**
 * Volunteers who lie, caught on a mesh of real processes (docs/verification.md):
 * a relay, a tracker with spot-checks on, and four nodes on the shipped
 * fortunes-tiny with overlapping spans — a head H [0, 3), and three holders
 * of the last layers: X [3, 6), Y [3, 6), Z [2, 6). X is a lying node
 * (test/helpers/lying-node.ts: the Node.js host with a fault wrapped around
 * its span; a new node, with a new identity, for every lying mode, hosted
 * one after another by one process per layout). Chats run
 * steadily through the OpenAI API; the tracker routes about a third of
 * them through X, plans checks (every session of a new node), the head
 * has Y or Z recompute X's steps in one prefill and the other arbitrate,
 * and the tracker judges the signed evidence.
 *
 * Per mode: X is quarantined within 60 s of traffic; no honest node is
 * accused; every answer that went through X before says so (its
 * verification is "wrong"); and afterwards greedy answers are the float64
 * reference's, token for token (f32 on the wire).
 */
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { FORTUNES_DIR, fortunesTiny } from '../helpers/fortunes-tiny.ts';
import type { LyingMode } from '../helpers/faults.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { spawnMeshnet, startNode, startTrackerProc, stopMesh, until, type NodeProc, type Proc, type TrackerProc } from '../helpers/mesh.ts';

const LYING_NODE = fileURLToPath(new URL('../helpers/lying-node.ts', import.meta.url));
const TOPICS = ['science', 'cats', 'the sea', 'money', 'love', 'work', 'music', 'time', 'rain', 'dogs', 'coffee', 'luck'];

interface Verification {
  status: string;
  generations: Array<{ id: string; status: string; url: string; hops: Array<{ peer_id: string; status: string; role: string }> }>;
}

interface ChatResult {
  at: number;
  prompt: string;
  ids: number[];
  verification: Verification | undefined;
}

interface Layout {
  title: string;
  /** The honest nodes' spans ('a-b', [a, b)), the head first. */
  honest: string[];
  /** The liar's span [a, b). */
  liar: [number, number];
  /** Indexes into `honest` of the other holders of the liar's span. */
  holders: [number, number];
  modes: LyingMode[];
  /** Routes have two hops after the head: steps go down the chain (hops push to each other). */
  chained?: boolean;
}

const LAYOUTS: Layout[] = [
  // Four nodes, overlapping spans: routes are H → one of X, Y, Z (a star: one hop after the head).
  { title: 'a last hop on a 4-node mesh', honest: ['0-3', '3-6', '2-6'], liar: [3, 6], holders: [1, 2], modes: ['noise', 'zero', 'wrong-layers', 'tampered', 'q4-as-f32', 'one-in-20', 'second-best', 'honest-then-noise'] },
  // Five nodes: routes are H → one of X, Y, Z → W, chained (the hops push to each other; attestations ride with the step).
  { title: 'a middle hop of a chained 5-node mesh', honest: ['0-2', '2-4', '2-4', '4-6'], liar: [2, 4], holders: [1, 2], modes: ['noise', 'zero'], chained: true },
];

const fortunes = fortunesTiny();
// The checkpoint's server and the relay serve both layouts; each layout has a tracker and nodes of its own.
let st: StaticServer;
let relay: RelayProcess;
beforeAll(async () => {
  st = await startStaticServer({ root: FORTUNES_DIR });
  relay = await startRelayProcess();
}, 60_000);
afterAll(async () => {
  await stopMesh({ relay, st });
});

/** The float64 reference's greedy answers, by prompt (over half a second of work each: once for both layouts). */
const refs = new Map<string, number[]>();
const ref = (prompt: string) => {
  let ids = refs.get(prompt);
  if (!ids) refs.set(prompt, (ids = fortunes.greedy(prompt, 16).ids));
  return ids;
};

describe.each(LAYOUTS)('lying volunteers: $title', (layout) => {
  let tracker: TrackerProc;
  const nodes: NodeProc[] = [];
  /** Hosts this layout's lying nodes, one after another (commands on its stdin). */
  let liars: Proc;
  let runs = 0;
  /** Detection time per mode, s (printed at the end for docs/verification.md). */
  const detections: Array<{ mode: string; seconds: number; chats: number; checks: number }> = [];

  beforeAll(async () => {
    // Loads its modules while the references are computed.
    liars = spawnMeshnet([], { NODE_OPTIONS: '--import tsx' }, LYING_NODE, [], 'pipe');
    // The references first: synchronous float64 work would stall sockets later.
    for (const t of TOPICS) ref(`Tell me a fortune about ${t}.`);
    tracker = await startTrackerProc(['--model', `fortunes-tiny=${st.url}`, '--relay', relay.url, '--wire-dtype', 'f32', '--heartbeat-interval-ms', '500']);
    const common = ['--tracker', tracker.url, '--relay', relay.url, '--model-url', st.url, '--wire-dtype', 'f32', '--max-context', '256'];
    // Started together (each waits for its own span): the order of `nodes` is the order of `honest`.
    nodes.push(...(await Promise.all(layout.honest.map((layers) => startNode([...common, '--layers', layers])))));
  }, 180_000);

  afterAll(async () => {
    console.log(`detection by lying mode: ${JSON.stringify(detections)}`);
    const end = (await (await fetch(`${tracker.url}/api/verification`)).json()) as { compared_rows: unknown; pass_distance_max: unknown };
    console.log(`${layout.title}: rows compared in passing checks ${JSON.stringify(end.compared_rows)}, largest passing distances ${JSON.stringify(end.pass_distance_max)}`);
    await liars.stop();
    await stopMesh({ nodes, tracker });
  });

  async function chat(prompt: string): Promise<ChatResult> {
    const res = await fetch(`${tracker.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'fortunes-tiny', messages: [{ role: 'user', content: prompt }], max_tokens: 16, temperature: 0 }),
    });
    const body = (await res.json()) as { choices?: Array<{ token_ids: number[] }>; usage?: { verification?: Verification }; error?: { message: string } };
    if (res.status !== 200) throw new Error(`chat answered ${res.status}: ${body.error?.message}`);
    return { at: Date.now(), prompt, ids: body.choices![0]!.token_ids, verification: body.usage?.verification };
  }

  /** Chats, three at a time, until `stop()` says so (or `ms` pass, or `max` chats are done). */
  async function traffic(stop: () => Promise<boolean>, ms: number, max = Infinity): Promise<ChatResult[]> {
    const out: ChatResult[] = [];
    const deadline = Date.now() + ms;
    let done = false;
    let n = 0;
    const worker = async () => {
      while (!done && Date.now() < deadline && n < max) {
        const topic = TOPICS[n++ % TOPICS.length]!;
        out.push(await chat(`Tell me a fortune about ${topic}.`));
      }
    };
    const watcher = (async () => {
      while (!done && Date.now() < deadline) {
        if (await stop().catch(() => false)) done = true;
        else await new Promise((r) => setTimeout(r, 250));
      }
      done = true;
    })();
    await Promise.all([Promise.all([worker(), worker(), worker()]).then(() => (done = true)), watcher]);
    return out;
  }

  async function verificationSummary(): Promise<{ nodes: Record<string, { offences: number; quarantined_until: number | null; passes: number; consecutive: number }>; offences: Array<{ peer: string; at: number; role: 'hop' | 'checker'; checker: { peer: string }; arbiter?: { peer: string } }> }> {
    return (await (await fetch(`${tracker.url}/api/verification`)).json()) as never;
  }

  /** A new lying node (a new identity), once it serves; the one before it, if still up, is closed first. */
  async function startLiar(mode: LyingMode): Promise<{ peerId: string; servingAt: number; events: () => Array<Record<string, unknown>>; stop: () => Promise<void> }> {
    // honest-then-noise: honest long enough to pass the 10 checks of a new node, then lying on every step.
    const cfg = { mode, tracker: tracker.url, relay: relay.url, model: 'fortunes-tiny', numLayers: 6, layers: layout.liar, modelUrl: st.url, wireDtype: 'f32', maxContext: 256, honestSessions: 14 };
    const run = ++runs;
    liars.child.stdin!.write(`${JSON.stringify({ start: cfg })}\n`);
    const l = await liars.waitFor((e) => e.event === 'listening' && e.run === run, 60_000);
    await liars.waitFor((e) => e.event === 'serving' && e.run === run, 60_000);
    return {
      peerId: l.peer_id as string,
      servingAt: Date.now(),
      events: () => liars.events.filter((e) => e.run === run),
      stop: async () => {
        liars.child.stdin!.write(`${JSON.stringify({ close: true })}\n`);
        await liars.waitFor((e) => e.event === 'closed' && e.run === run, 30_000);
      },
    };
  }

  it.each(layout.modes)('lying by %s: quarantined within 60 s, with evidence; nothing it computed is passed off as checked; later answers are the reference\'s', async (mode) => {
    const liar = await startLiar(mode);
    // The tracker routes over the liar once its heartbeat says what it serves.
    await until(async () => ((await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { nodes: Array<{ peer_id: string; status: string }> }).nodes.some((n) => n.peer_id === liar.peerId && n.status === 'serving'), 20_000, 'the liar serving');
    const trafficStart = Date.now();
    const before = await traffic(async () => (await verificationSummary()).nodes[liar.peerId]?.quarantined_until != null, 150_000);
    const v = await verificationSummary();
    const offence = v.offences.find((o) => o.peer === liar.peerId);
    expect(offence, `no offence of the liar after ${before.length} chats`).toBeDefined();
    // From the first lie it told (an output mode) or the start of traffic (its weights lie from the start).
    const firstLie = liar.events().find((e) => e.event === 'first-lie')?.at as number | undefined;
    const t0 = Math.max(trafficStart, firstLie ?? 0);
    const detectedS = (offence!.at - t0) / 1000;
    const honestChecks = mode === 'honest-then-noise' ? (await verificationSummary()).nodes[liar.peerId]!.passes : 0;
    detections.push({ mode: `${layout.liar.join('-')} ${mode}`, seconds: Math.round(detectedS * 10) / 10, chats: before.length, checks: honestChecks });
    console.log(`${layout.title}, lying mode ${mode}: quarantined ${detectedS.toFixed(1)} s after ${firstLie ? 'its first lie' : 'traffic started'}, after ${before.length} chats`);
    expect(detectedS).toBeLessThan(60);
    // Honest long enough to pass the 10 checks a new node gets, before it lied.
    if (mode === 'honest-then-noise') expect(honestChecks).toBeGreaterThanOrEqual(10);
    // Found lying as a hop (the other two holders of [3, 6) checked and arbitrated), or — a node whose
    // weights are wrong computes wrong checks too — as the checker of an honest hop (the third arbitrated).
    const honestHolders = new Set(layout.holders.map((i) => nodes[i]!.peerId));
    if (offence!.role === 'hop') expect(new Set([offence!.checker.peer, offence!.arbiter?.peer])).toEqual(honestHolders);
    else {
      expect(offence!.checker.peer).toBe(liar.peerId);
      expect(honestHolders.has(offence!.arbiter!.peer)).toBe(true);
    }
    for (const n of nodes) expect(v.nodes[n.peerId]?.offences ?? 0).toBe(0);

    // Every answer that went through the liar is accounted for: its part checked clean on that very
    // generation (then the answer is the reference's), or wrong (found so by its own check or a later one).
    const through = before.filter((c) => c.verification?.generations.some((g) => g.hops.some((h) => h.peer_id === liar.peerId)));
    // Found lying as a hop, it carried at least the chat whose check caught it. A liar whose weights are
    // wrong may be caught first as the checker of an honest hop, before any chat went through it (one run
    // of this file in six, here): then there is no answer of its to account for.
    if (offence!.role === 'hop') expect(through.length).toBeGreaterThan(0);
    let wrong = 0;
    for (const c of through) {
      const g = c.verification!.generations[0]!;
      const now = (await (await fetch(`${tracker.url}${g.url}`)).json()) as Verification['generations'][number];
      const hop = now.hops.find((h) => h.peer_id === liar.peerId)!;
      expect(['clean', 'wrong']).toContain(hop.status);
      if (hop.status === 'clean') expect(c.ids).toEqual(ref(c.prompt));
      else {
        wrong++;
        expect(now.status).toBe('wrong');
      }
    }
    if (through.length > 0) expect(wrong).toBeGreaterThan(0);

    // Afterwards: no route through the liar, and greedy answers are the reference's (9 chats, every topic's route drawn afresh).
    const after = await traffic(async () => false, 30_000, 9);
    expect(after.length).toBe(9);
    for (const c of after) {
      expect(c.verification!.generations[0]!.hops.map((h) => h.peer_id)).not.toContain(liar.peerId);
      expect(c.ids).toEqual(ref(c.prompt));
    }
    if (layout.chained) {
      // The steps went down the chain (the last hop took chained /forwards), so the attestations rode with them.
      const info = (await (await fetch(`${nodes.at(-1)!.endpoint}/info`)).json()) as { chain_forwards: number };
      expect(info.chain_forwards).toBeGreaterThan(0);
    }
    await liar.stop();
  }, 300_000);
});
