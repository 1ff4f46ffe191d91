/**
 * bench/cross-relay — what a hop costs when caller and target sit on two
 * relays of a cluster, against both on one relay. Side by side in one run,
 * real processes on loopback (nats-server, `meshnet relay --nats`, peers):
 *
 *   1. one hop, 8 KiB bf16 activation, one request in flight, p50/p99:
 *        same relay            caller ─▶ A ─▶ target
 *        cross, trunk          caller ─▶ A ══▶ B ─▶ target   (relay-to-relay WebSocket)
 *        cross, NATS           caller ─▶ C ─▶ nats ─▶ D ─▶ target
 *      target: cross (trunk) ≤ same + 0.3 ms at p50;
 *   2. the chained 3-node mesh (`small`, 12 layers, relay paths only: no
 *      endpoints, no links), decode tokens/s with every node on relay A
 *      against head and tail on A and the middle node on B (two of the
 *      three pushes of a step cross), alternating runs, medians;
 *      target: cross ≥ 0.9 × same, and the same tokens;
 *   3. failover: relay B killed (SIGKILL) under the split mesh's middle
 *      node (`--relay B,A`): time until it is registered at A under the
 *      same peer id, and until a chat on the same route completes again
 *      with the same tokens.
 *
 *   npx tsx bench/cross-relay.ts [--quick] [--hops-only]
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { NodeWebSocketConstructor } from '../src/host/node/socket.ts';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import { Identity } from '../src/net/identity.ts';
import { RelayClient } from '../src/net/relay-client.ts';
import { encodeTensor } from '../src/protocol/tensor.ts';
import type { GenerateEvent, RouteHop } from '../src/protocol/tracker.ts';
import { startNats } from '../test/helpers/cluster.ts';
import { generateDirect, hopOf, signedRouteHeaders, startNode, type NodeProc } from '../test/helpers/mesh.ts';
import { startRelayProcess, type RelayProcess } from '../test/helpers/relay-process.ts';
import { firstDivergence, median, printTable, summarize, writeResult } from './lib/stats.ts';

const quick = process.argv.includes('--quick');
const hopsOnly = process.argv.includes('--hops-only');
const root = fileURLToPath(new URL('..', import.meta.url));
const HOP_ROUNDS = quick ? 1500 : 6000;
const MESH_RUNS = quick ? 2 : 5;
const NEW_TOKENS = quick ? 32 : 64;
const PAYLOAD = 8192;
const activation = encodeTensor(Float32Array.from({ length: PAYLOAD / 2 }, (_, i) => Math.sin(i)), 'bf16');
const request = { method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': '1,1,4096', 'x-meshnet-dtype': 'bf16' }, body: activation };
const PROMPT = [{ role: 'user', content: 'Write a short story about a lighthouse keeper and a storm at sea.' }];

async function echoPeer(relayUrl: string): Promise<{ child: ChildProcess; peerId: string }> {
  const child = spawn(process.execPath, ['--import', 'tsx', 'bench/lib/echo-peer.ts', relayUrl], { cwd: root, stdio: ['ignore', 'pipe', 'inherit'] });
  const line = await new Promise<string>((resolve, reject) => {
    createInterface({ input: child.stdout! }).once('line', resolve);
    child.once('exit', (c) => reject(new Error(`echo peer exited ${c}`)));
  });
  return { child, peerId: (JSON.parse(line) as { peer_id: string }).peer_id };
}

async function caller(relayUrl: string): Promise<RelayClient> {
  const c = new RelayClient({ relayUrl, WebSocket: NodeWebSocketConstructor, identity: await Identity.generate() });
  c.start();
  await c.ready(10_000);
  return c;
}

type HopMode = 'same relay' | 'cross, trunk' | 'cross, NATS';

async function hops(natsUrl: string): Promise<Record<HopMode, ReturnType<typeof summarize>>> {
  const relays: RelayProcess[] = await Promise.all([
    startRelayProcess(['--nats', natsUrl, '--cluster', 'trunk', '--cluster-path', 'link']),
    startRelayProcess(['--nats', natsUrl, '--cluster', 'trunk', '--cluster-path', 'link']),
    startRelayProcess(['--nats', natsUrl, '--cluster', 'viaNats', '--cluster-path', 'nats']),
    startRelayProcess(['--nats', natsUrl, '--cluster', 'viaNats', '--cluster-path', 'nats']),
  ]);
  const [A, B, C, D] = relays as [RelayProcess, RelayProcess, RelayProcess, RelayProcess];
  const peers = await Promise.all([echoPeer(A.url), echoPeer(B.url), echoPeer(D.url)]);
  const [onA, onB, onD] = peers;
  const cA = await caller(A.url);
  const cC = await caller(C.url);
  const modes: Array<[HopMode, () => Promise<unknown>]> = [
    ['same relay', () => cA.request(onA.peerId, request, { timeoutMs: 10_000 })],
    ['cross, trunk', () => cA.request(onB.peerId, request, { timeoutMs: 10_000 })],
    ['cross, NATS', () => cC.request(onD.peerId, request, { timeoutMs: 10_000 })],
  ];
  try {
    // Warm up: lookups, the trunk, JIT.
    for (let i = 0; i < 300; i++) for (const [, f] of modes) await f();
    const samples = Object.fromEntries(modes.map(([m]) => [m, [] as number[]])) as Record<HopMode, number[]>;
    for (let i = 0; i < HOP_ROUNDS; i++) {
      // Interleaved, in a rotating order: drift of the machine hits every mode alike.
      for (let k = 0; k < modes.length; k++) {
        const [m, f] = modes[(i + k) % modes.length]!;
        const t0 = performance.now();
        const r = (await f()) as { status: number; body: Uint8Array };
        samples[m].push(performance.now() - t0);
        if (r.status !== 200 || r.body.byteLength !== PAYLOAD) throw new Error(`${m}: bad answer ${r.status}, ${r.body.byteLength} bytes`);
      }
    }
    return Object.fromEntries(Object.entries(samples).map(([m, s]) => [m, summarize(s)])) as Record<HopMode, ReturnType<typeof summarize>>;
  } finally {
    cA.close();
    cC.close();
    for (const p of peers) p.child.kill();
    await Promise.all(relays.map((r) => r.stop()));
  }
}

interface MeshRun {
  decodeTps: number;
  ids: number[];
  /** performance.now() at the first token. */
  firstTokenAt: number;
}

interface Failover {
  reregistered_ms: number;
  /** From the kill to the first token of the first chat that completed after it. */
  first_token_ms: number;
  same_tokens: boolean;
  failed_attempts: number;
}

async function mesh(natsUrl: string): Promise<{ same: MeshRun[]; cross: MeshRun[]; failover: Failover }> {
  const dir = await ensureModel('small');
  const st = await startStaticServer({ root: dir });
  const A = await startRelayProcess(['--nats', natsUrl, '--cluster', 'mesh']);
  const B = await startRelayProcess(['--nats', natsUrl, '--cluster', 'mesh']);
  const work = mkdtempSync(join(tmpdir(), 'meshnet-bench-cross-'));
  const nodes: NodeProc[] = [];
  try {
    const trackerId = await Identity.generate();
    const keyFile = join(work, 'tracker-key.json');
    writeFileSync(keyFile, JSON.stringify(await trackerId.export()));
    const common = ['--model', 'small', '--model-url', st.url, '--budget-mb', '2048', '--threads', '1', '--max-context', '512', '--no-links', '--tracker-key', (await import('../src/protocol/base64.ts')).encodeBase64Url(trackerId.publicKey)];
    const spec: Array<[string, RelayProcess]> = [
      ['0-4', A],
      ['4-8', A],
      ['8-12', A],
      ['0-4', A],
      ['4-8', B],
      ['8-12', A],
    ];
    // Every node may fail over to the other relay (the middle node of the split mesh does, in part 3).
    const relayList = (r: RelayProcess) => (r === A ? `${A.url},${B.url}` : `${B.url},${A.url}`);
    for (let i = 0; i < spec.length; i += 2) nodes.push(...(await Promise.all(spec.slice(i, i + 2).map(([s, r]) => startNode([...common, '--relay', relayList(r), '--layers', s])))));
    const [h1, m1, t1, h2, m2, t2] = nodes as [NodeProc, NodeProc, NodeProc, NodeProc, NodeProc, NodeProc];
    let runId = 0;
    const run = async (head: NodeProc, hops: RouteHop[]): Promise<MeshRun> => {
      const headers = await signedRouteHeaders(trackerId, head, hops);
      let tFirst = 0;
      let tLast = 0;
      const ids: number[] = [];
      for await (const ev of generateDirect(head.endpoint, headers, { messages: PROMPT, max_tokens: NEW_TOKENS, temperature: 0, session_id: `cross-${++runId}` }) as AsyncIterable<GenerateEvent>) {
        if (ev.type === 'token') {
          tLast = performance.now();
          if (ids.length === 0) tFirst = tLast;
          ids.push(ev.token_id);
        } else if (ev.type === 'error') throw new Error(`${ev.code}: ${ev.message}`);
      }
      return { decodeTps: ((ids.length - 1) * 1000) / (tLast - tFirst), ids, firstTokenAt: tFirst };
    };
    const same = () => run(h1, [hopOf(m1, 4, 8, 'relay'), hopOf(t1, 8, 12, 'relay')]);
    const cross = () => run(h2, [hopOf(m2, 4, 8, 'relay'), hopOf(t2, 8, 12, 'relay')]);
    await same();
    await cross();
    const out = { same: [] as MeshRun[], cross: [] as MeshRun[] };
    for (let i = 0; i < MESH_RUNS; i++) {
      if (i % 2 === 0) {
        out.same.push(await same());
        out.cross.push(await cross());
      } else {
        out.cross.push(await cross());
        out.same.push(await same());
      }
    }
    // Part 3: the middle node's relay dies under it.
    const peersOnA = async () => ((await (await fetch(`${A.url.replace(/^ws/, 'http')}/peers`)).json()) as { peers: Array<{ peer_id: string }> }).peers.map((p) => p.peer_id);
    const t0 = performance.now();
    await B.stop('SIGKILL');
    while (!(await peersOnA()).includes(m2.peerId)) {
      if (performance.now() - t0 > 30_000) throw new Error('the middle node did not move to relay A within 30 s');
      await new Promise((r) => setTimeout(r, 20));
    }
    const reregistered = performance.now() - t0;
    // Its relay_addr changed: the route names the new one (as the tracker's next route would, from its heartbeat).
    const m2now = { ...m2, relayAddr: `${A.url}/rpc/${m2.peerId}` };
    let again: MeshRun | undefined;
    let failedAttempts = 0;
    while (again === undefined) {
      if (failedAttempts > 0) await new Promise((r) => setTimeout(r, 100));
      again = await run(h2, [hopOf(m2now, 4, 8, 'relay'), hopOf(t2, 8, 12, 'relay')]).catch((e: unknown) => (process.env.MESHNET_BENCH_DEBUG && console.error(`retry after ${(performance.now() - t0).toFixed(0)} ms: ${(e as Error).message}`), failedAttempts++, undefined));
      if (performance.now() - t0 > 60_000) throw new Error('no chat within 60 s of the relay kill');
    }
    const failover = { reregistered_ms: reregistered, first_token_ms: again.firstTokenAt - t0, same_tokens: firstDivergence(again.ids, out.cross[0]!.ids) === null, failed_attempts: failedAttempts };
    return { ...out, failover };
  } finally {
    await Promise.all(nodes.map((n) => n.stop()));
    await Promise.all([A.stop(), B.stop()]);
    await st.close();
    rmSync(work, { recursive: true, force: true });
  }
}

async function main(): Promise<void> {
  const loadBefore = loadavg()[0]!;
  const nats = await startNats();
  try {
    const h = await hops(nats.url);
    const same = h['same relay'].p50;
    printTable(`one hop, 8 KiB, ${HOP_ROUNDS} rounds each, interleaved (ms)`, ['path', 'p50', 'p99', 'mean', 'p50 - same'], Object.entries(h).map(([m, s]) => [m, s.p50, s.p99, s.mean, s.p50 - same]));
    let meshResult: Record<string, unknown> | undefined;
    if (!hopsOnly) {
      const m = await mesh(nats.url);
      const sameTps = median(m.same.map((r) => r.decodeTps));
      const crossTps = median(m.cross.map((r) => r.decodeTps));
      const diverge = firstDivergence(m.same[0]!.ids, m.cross[0]!.ids);
      printTable(`chained 3-node mesh (small), ${NEW_TOKENS} tokens, ${MESH_RUNS} runs each, medians`, ['placement', 'decode tok/s', 'ratio', 'first divergence'], [
        ['all on relay A', sameTps, 1, '-'],
        ['middle node on relay B', crossTps, crossTps / sameTps, diverge === null ? 'none' : String(diverge)],
      ]);
      printTable('failover: relay B killed under the middle node (ms from the kill)', ['re-registered at A', 'first token of a chat again', 'failed attempts', 'same tokens'], [[m.failover.reregistered_ms, m.failover.first_token_ms, m.failover.failed_attempts, String(m.failover.same_tokens)]]);
      meshResult = { failover: m.failover, same_decode_tps: m.same.map((r) => r.decodeTps), cross_decode_tps: m.cross.map((r) => r.decodeTps), same_median: sameTps, cross_median: crossTps, ratio: crossTps / sameTps, first_divergence: diverge, tokens: NEW_TOKENS };
    }
    writeResult(join(root, 'bench/results/cross-relay.json'), {
      quick,
      load_before: loadBefore,
      load_after: loadavg()[0],
      hop_rounds: HOP_ROUNDS,
      hops: h,
      cross_trunk_minus_same_p50_ms: h['cross, trunk'].p50 - same,
      cross_nats_minus_same_p50_ms: h['cross, NATS'].p50 - same,
      ...(meshResult ? { mesh: meshResult } : {}),
    });
  } finally {
    await nats.stop();
  }
}

await main();
