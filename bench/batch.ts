/**
 * Batching at one hop, in process (issue 11): what a batched decode step
 * costs against the same sessions' steps one at a time, on the `small`
 * fixture's layers 0-4 (a third of the model: one node of the split mesh)
 * over onnxruntime-node with one intra-op thread, for
 *   - plain   the plain layer graphs, the batch's pasts padded to the
 *             longest along the graphs' batch axis, or packed along the
 *             sequence with a block mask when very uneven (packed-batch.ts)
 *   - packed  the same graphs with the packed layout forced (what every
 *             batch ran before the padded layout), run interleaved with
 *             `plain` so that the two compare on the same load
 *   - fused   the contrib-op graph, GroupQueryAttention over a batch with
 *             per-session seqlens_k, caches gathered (src/shard/fused-batch.ts)
 * B sessions at positions P..P+B (different on purpose). Per B: median ms
 * of one batched step, median ms of B lone steps, their ratio (the speed-up
 * batching gives this hop), and the process CPU ms per session of a batched
 * step (CPU time moves less than wall time on a shared machine). Table on
 * stdout, JSON in bench/results/batch.json.
 *
 *   npx tsx bench/batch.ts [--quick] [--position P] [--per-layer]
 *
 * --per-layer: one plain graph per layer (4 runs a step), as a mesh node
 * serves its span; default one graph for the 4 layers.
 */
import { fileURLToPath } from 'node:url';
import { createNodeBackend } from '../src/host/node/onnx.ts';
import { fixtureConfig, makeModel } from '../src/model/fixture.ts';
import type { ForwardRequest, ForwardResult } from '../src/shard/executor.ts';
import { ShardExecutor } from '../src/shard/executor.ts';
import { FusedShardExecutor } from '../src/shard/fused-executor.ts';
import { weightsFromFiles } from '../test/helpers/weights.ts';
import { fmt, printTable, quantile, writeResult } from './lib/stats.ts';

const argv = process.argv.slice(2);
const quick = argv.includes('--quick');
const perLayer = argv.includes('--per-layer');
const BASE = Number(argv.includes('--position') ? argv[argv.indexOf('--position') + 1] : 24);
const SIZES = [1, 2, 4, 8, 16];
const REPS = quick ? 7 : 21;
const here = fileURLToPath(new URL('.', import.meta.url));

interface Exec {
  forward(r: ForwardRequest): Promise<ForwardResult>;
  dropSession(id: string): boolean;
  release(): Promise<void>;
}

const cfg = fixtureConfig('small');
const weights = weightsFromFiles(makeModel('small', 0));
const backend = createNodeBackend({ intraOpNumThreads: 1 });
const END = 4;

type Kind = 'plain' | 'packed' | 'fused';

async function make(kind: Kind, maxBatch: number): Promise<Exec> {
  const common = { config: cfg, backend, weights: () => weights, startLayer: 0, endLayer: END, maxContext: 1024, kvBudgetBytes: 1024 * 2 ** 20, maxBatch };
  if (kind === 'fused') return FusedShardExecutor.create({ ...common, projections: 'f32' });
  return ShardExecutor.create({ ...common, segmentBoundaries: perLayer ? [1, 2, 3] : [], batchLayout: kind === 'packed' ? 'packed' : 'auto' });
}

/** Sessions {tag}0..{tag}{B-1} prefilled to BASE+i tokens. */
async function open(ex: Exec, B: number, tag: string): Promise<number[]> {
  const pos: number[] = [];
  for (let i = 0; i < B; i++) {
    const n = BASE + i;
    await ex.forward({ session: `${tag}${i}`, position: 0, tokenIds: Array.from({ length: n }, (_, k) => 3 + ((k * 7 + i) % 500)) });
    pos.push(n);
  }
  return pos;
}

const cpuNow = () => {
  const c = process.cpuUsage();
  return (c.user + c.system) / 1000;
};
const median = (xs: number[]) => quantile([...xs].sort((x, y) => x - y), 0.5);

/**
 * Median wall and CPU ms of one step of all B sessions: on `alone` one after
 * another, on each of `batched` submitted at once (one run); all interleaved
 * step by step, so that a busy machine slows them alike.
 */
async function time(alone: Exec, batched: Exec[], B: number): Promise<{ alone: number; batched: Array<{ wall: number; cpu: number }> }> {
  const all = [alone, ...batched];
  const pos = await Promise.all(all.map((ex, e) => open(ex, B, `e${e}-${B}-`)));
  const act = new Float32Array(cfg.hiddenSize).fill(0.01);
  const step = (e: number, i: number): ForwardRequest => ({ session: `e${e}-${B}-${i}`, position: pos[e]![i]!, activation: { data: act, shape: [1, 1, cfg.hiddenSize] } });
  const wall: number[][] = all.map(() => []);
  const cpu: number[][] = all.map(() => []);
  for (let r = 0; r < REPS + 2; r++) {
    for (let e = 0; e < all.length; e++) {
      const t0 = performance.now();
      const c0 = cpuNow();
      if (e === 0) for (let i = 0; i < B; i++) await alone.forward(step(0, i));
      else await Promise.all(Array.from({ length: B }, (_, i) => all[e]!.forward(step(e, i))));
      // Two warm-up steps.
      if (r >= 2) {
        wall[e]!.push(performance.now() - t0);
        cpu[e]!.push(cpuNow() - c0);
      }
      for (let i = 0; i < B; i++) pos[e]![i]!++;
    }
  }
  all.forEach((ex, e) => {
    for (let i = 0; i < B; i++) ex.dropSession(`e${e}-${B}-${i}`);
  });
  return { alone: median(wall[0]!), batched: batched.map((_, k) => ({ wall: median(wall[k + 1]!), cpu: median(cpu[k + 1]!) })) };
}

interface Row {
  kind: Kind;
  batch: number;
  batched_ms: number;
  alone_ms: number;
  speedup: number;
  batched_ms_per_session: number;
  batched_cpu_ms_per_session: number;
}

const rows: Row[] = [];
for (const kinds of [['plain', 'packed'], ['fused']] as Kind[][]) {
  const batched = await Promise.all(kinds.map((k) => make(k, 16)));
  const alone = await make(kinds[0]!, 1);
  for (const B of SIZES) {
    process.stderr.write(`[batch] ${kinds.join('+')} B=${B}\n`);
    const t = await time(alone, batched, B);
    kinds.forEach((kind, k) => {
      const b = t.batched[k]!;
      rows.push({ kind, batch: B, batched_ms: +b.wall.toFixed(2), alone_ms: +t.alone.toFixed(2), speedup: +(t.alone / b.wall).toFixed(2), batched_ms_per_session: +(b.wall / B).toFixed(3), batched_cpu_ms_per_session: +(b.cpu / B).toFixed(3) });
    });
  }
  await Promise.all([...batched, alone].map((e) => e.release()));
}
printTable(
  `one hop, small layers 0-${END} (${perLayer ? 'one plain graph per layer' : 'one plain graph'}), onnxruntime-node 1 thread, sessions at positions ${BASE}..${BASE + 15}; medians of ${REPS} steps`,
  ['graphs', 'sessions', 'B alone ms', 'batched ms', 'speed-up', 'batched ms/session', 'batched CPU ms/session'],
  rows.map((r) => [r.kind, String(r.batch), r.alone_ms, r.batched_ms, fmt(r.speedup), r.batched_ms_per_session, r.batched_cpu_ms_per_session]),
);
writeResult(`${here}results/batch.json`, { bench: 'batch', quick, position: BASE, per_layer: perLayer, layers: [0, END], rows });
