/**
 * Batching at one hop, in process (issue 11): what a batched decode step
 * costs against the same sessions' steps one at a time, on the `small`
 * fixture's layers 0-4 (a third of the model: one node of the split mesh)
 * over onnxruntime-node with one intra-op thread, for
 *   - plain   the per-layer graphs with B rows packed along the sequence and
 *             a block mask (src/shard/packed-batch.ts)
 *   - fused   the contrib-op graph, GroupQueryAttention over a batch with
 *             per-session seqlens_k, caches gathered (src/shard/fused-batch.ts)
 * B sessions at positions 24..24+B (different on purpose). Per B: median ms
 * of one batched step, median ms of B lone steps, and their ratio (the
 * speed-up batching gives this hop). Table on stdout, JSON in
 * bench/results/batch.json.
 *
 *   npx tsx bench/batch.ts [--quick] [--position N]
 */
import { fileURLToPath } from 'node:url';
import { createNodeBackend } from '../src/cli/onnx-node.ts';
import { fixtureConfig, makeModel } from '../src/model/fixture.ts';
import type { ForwardRequest, ForwardResult } from '../src/shard/executor.ts';
import { ShardExecutor } from '../src/shard/executor.ts';
import { FusedShardExecutor } from '../src/shard/fused-executor.ts';
import { weightsFromFiles } from '../test/helpers/weights.ts';
import { fmt, printTable, quantile, writeResult } from './lib/stats.ts';

const argv = process.argv.slice(2);
const quick = argv.includes('--quick');
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

async function make(kind: 'plain' | 'fused', maxBatch: number): Promise<Exec> {
  const common = { config: cfg, backend, weights: () => weights, startLayer: 0, endLayer: END, maxContext: 1024, kvBudgetBytes: 1024 * 2 ** 20, maxBatch };
  return kind === 'plain' ? ShardExecutor.create({ ...common, segmentBoundaries: [] }) : FusedShardExecutor.create({ ...common, projections: 'f32' });
}

/** Sessions s0..s{B-1} prefilled to BASE+i tokens. */
async function open(ex: Exec, B: number, tag: string): Promise<number[]> {
  const pos: number[] = [];
  for (let i = 0; i < B; i++) {
    const n = BASE + i;
    await ex.forward({ session: `${tag}${i}`, position: 0, tokenIds: Array.from({ length: n }, (_, k) => 3 + ((k * 7 + i) % 500)) });
    pos.push(n);
  }
  return pos;
}

/**
 * Median ms of one step of all B sessions: on `alone` one after another, on
 * `batched` submitted at once (one run); the two interleaved step by step,
 * so that a busy machine slows both alike.
 */
async function time(alone: Exec, batched: Exec, B: number): Promise<{ alone: number; batched: number }> {
  const pa = await open(alone, B, `a${B}-`);
  const pb = await open(batched, B, `b${B}-`);
  const act = new Float32Array(cfg.hiddenSize).fill(0.01);
  const step = (tag: string, pos: number[], i: number): ForwardRequest => ({ session: `${tag}${B}-${i}`, position: pos[i]!, activation: { data: act, shape: [1, 1, cfg.hiddenSize] } });
  const sa: number[] = [];
  const sb: number[] = [];
  for (let r = 0; r < REPS + 2; r++) {
    let t0 = performance.now();
    for (let i = 0; i < B; i++) await alone.forward(step('a', pa, i));
    const a = performance.now() - t0;
    t0 = performance.now();
    await Promise.all(Array.from({ length: B }, (_, i) => batched.forward(step('b', pb, i))));
    const b = performance.now() - t0;
    if (r >= 2) {
      // Two warm-up steps.
      sa.push(a);
      sb.push(b);
    }
    for (let i = 0; i < B; i++) {
      pa[i]!++;
      pb[i]!++;
    }
  }
  for (let i = 0; i < B; i++) {
    alone.dropSession(`a${B}-${i}`);
    batched.dropSession(`b${B}-${i}`);
  }
  return { alone: quantile(sa.sort((x, y) => x - y), 0.5), batched: quantile(sb.sort((x, y) => x - y), 0.5) };
}

interface Row {
  kind: 'plain' | 'fused';
  batch: number;
  batched_ms: number;
  alone_ms: number;
  speedup: number;
  batched_ms_per_session: number;
}

const rows: Row[] = [];
for (const kind of ['plain', 'fused'] as const) {
  const batched = await make(kind, 16);
  const alone = await make(kind, 1);
  for (const B of SIZES) {
    process.stderr.write(`[batch] ${kind} B=${B}\n`);
    const { alone: a, batched: b } = await time(alone, batched, B);
    rows.push({ kind, batch: B, batched_ms: +b.toFixed(2), alone_ms: +a.toFixed(2), speedup: +(a / b).toFixed(2), batched_ms_per_session: +(b / B).toFixed(2) });
  }
  await batched.release();
  await alone.release();
}
printTable(
  `one hop, small layers 0-${END}, onnxruntime-node 1 thread, sessions at positions ${BASE}..${BASE + 15}; medians of ${REPS} steps`,
  ['graphs', 'sessions', 'B alone ms', 'batched ms', 'speed-up', 'batched ms/session'],
  rows.map((r) => [r.kind, String(r.batch), r.alone_ms, r.batched_ms, fmt(r.speedup), r.batched_ms_per_session]),
);
writeResult(`${here}results/batch.json`, { bench: 'batch', quick, position: BASE, layers: [0, END], rows });
