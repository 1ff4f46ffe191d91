/**
 * Where onnxruntime-node's time goes in one packed batched decode step
 * (docs/architecture.md, "Batching at a hop"): a plain layer graph of `small` run at B sessions of P past
 * rows each, packed as packed-batch.ts does, with ORT's profiler on; per-op
 * kernel time summed by op type, per session.
 *
 *   npx tsx bench/ort-ops.ts [--layers 1] [--past 60] [--reps 20]
 */
import { readFileSync, readdirSync, rmSync } from 'node:fs';
import * as ort from 'onnxruntime-node';
import { fixtureConfig, makeModel } from '../src/model/fixture.ts';
import { IO, buildLayersGraph, maskValue } from '../src/model/graph.ts';
import { ropeInvFreq, ropeTables } from '../src/model/rope.ts';
import { weightsFromFiles } from '../test/helpers/weights.ts';

const argv = process.argv.slice(2);
const arg = (k: string, d: number) => (argv.includes(k) ? Number(argv[argv.indexOf(k) + 1]) : d);
const LAYERS = arg('--layers', 1);
const PAST = arg('--past', 60);
const REPS = arg('--reps', 20);
const SIZES = [1, 8];
const LAYOUT = argv.includes('--padded') ? 'padded' : 'packed';
const byName = argv.includes('--by-name');
const cfg = fixtureConfig('small');
const weights = weightsFromFiles(makeModel('small', 0));
const built = buildLayersGraph(cfg, weights, 0, LAYERS);
const { numKvHeads: KV, headDim: D, hiddenSize: h } = cfg;
const groups = cfg.numHeads / KV;

function feeds(B: number): Record<string, ort.Tensor> {
  const padded = LAYOUT === 'padded';
  const total = padded ? PAST : B * PAST;
  void total;
  const cols = total + (padded ? 1 : B);
  const rows = padded ? 1 : B;
  const mask = new Float32Array(groups * B * cols).fill(maskValue('f32'));
  for (let i = 0; i < B; i++) {
    if (padded) {
      mask.fill(0, i * groups * cols, i * groups * cols + PAST);
      mask[i * groups * cols + PAST] = 0;
      for (let g = 1; g < groups; g++) mask.copyWithin((i * groups + g) * cols, i * groups * cols, (i * groups + 1) * cols);
      continue;
    }
    mask.fill(0, i * cols + i * PAST, i * cols + (i + 1) * PAST);
    mask[i * cols + total + i] = 0;
  }
  if (!padded) for (let g = 1; g < groups; g++) mask.copyWithin(g * B * cols, 0, B * cols);
  const bd = padded ? [B, 1] : [1, B];
  const pd = padded ? [B, PAST] : [1, total];
  const inv = ropeInvFreq(cfg);
  const cos = new Float32Array(B * D);
  const sin = new Float32Array(B * D);
  for (let i = 0; i < B; i++) {
    const t = ropeTables(inv, PAST, 1);
    cos.set(t.cos, i * D);
    sin.set(t.sin, i * D);
  }
  const f: Record<string, ort.Tensor> = {
    [IO.hidden]: new ort.Tensor('float32', new Float32Array(B * h).map(() => Math.random() - 0.5), [...bd, h]),
    [IO.ropeCos]: new ort.Tensor('float32', cos, [...bd, 1, D]),
    [IO.ropeSin]: new ort.Tensor('float32', sin, [...bd, 1, D]),
    [IO.mask]: new ort.Tensor('float32', mask, [padded ? B : 1, 1, groups * rows, cols]),
  };
  for (let l = 0; l < LAYERS; l++) {
    f[IO.pastKey(l)] = new ort.Tensor('float32', new Float32Array(B * PAST * KV * D).map(() => Math.random() - 0.5), [...pd, KV, D]);
    f[IO.pastValue(l)] = new ort.Tensor('float32', new Float32Array(B * PAST * KV * D).map(() => Math.random() - 0.5), [...pd, KV, D]);
  }
  return f;
}

const prefix = '/tmp/i11f/ortprof';
for (const B of SIZES) {
  const s = await ort.InferenceSession.create(built.bytes, {
    graphOptimizationLevel: 'all', intraOpNumThreads: 1, interOpNumThreads: 1, executionMode: 'sequential',
    enableProfiling: true, profileFilePrefix: `${prefix}-b${B}`,
    extra: { session: { intra_op: { allow_spinning: '0' }, inter_op: { allow_spinning: '0' } } },
  } as ort.InferenceSession.SessionOptions);
  const f = feeds(B);
  for (let r = 0; r < 3; r++) await s.run(f);
  const c0 = process.cpuUsage();
  const t0 = performance.now();
  for (let r = 0; r < REPS; r++) await s.run(f);
  const wall = (performance.now() - t0) / REPS;
  const c = process.cpuUsage(c0);
  await s.release();
  const file = readdirSync('/tmp/i11f').filter((n) => n.startsWith(`ortprof-b${B}_`)).map((n) => `/tmp/i11f/${n}`)[0];
  const cpu = (c.user + c.system) / 1000 / REPS;
  const byOp = new Map<string, number>();
  let total = 0;
  if (file) {
    const ev = JSON.parse(readFileSync(file, 'utf8')) as Array<{ cat: string; name: string; dur: number; args?: { op_name?: string } }>;
    for (const e of ev) {
      if (e.cat !== 'Node' || !e.name.endsWith('_kernel_time')) continue;
      const op = `${e.args?.op_name ?? '?'}${byName ? ' ' + e.name.replace(/_kernel_time$/, '') : ''}`;
      byOp.set(op, (byOp.get(op) ?? 0) + e.dur);
      total += e.dur;
    }
    rmSync(file);
  }
  const runs = REPS + 3;
  console.log(`${LAYOUT} B=${B} past=${PAST} layers=${LAYERS}: wall ${wall.toFixed(3)} ms/run, cpu ${cpu.toFixed(3)} ms/run, ${(cpu / B).toFixed(3)} ms/session; kernels ${(total / runs / 1000).toFixed(3)} ms/run`);
  for (const [op, us] of [...byOp].sort((a, b) => b[1] - a[1])) console.log(`  ${op.padEnd(34)} ${(us / runs / 1000).toFixed(3)} ms/run  ${(us / runs / 1000 / B).toFixed(3)} ms/session`);
}
