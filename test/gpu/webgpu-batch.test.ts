/**
 * Batching at a hop on WebGPU (Dawn in Node over SwiftShader, as
 * webgpu-node.test.ts): the fused executor steps sessions at different
 * positions together — their caches gathered into one batch tensor on the
 * device, GroupQueryAttention with a seqlens_k per session — and each gets
 * the greedy tokens it gets alone, with logits within tolerance of the
 * float64 reference, through a split span (activation out, token out).
 * Batches stay under 32 rows (the onnxruntime-web fault at ≥ 32 rows).
 * The plain executor (what a page with shader-f16, or a model the fused
 * graphs refuse, serves with) batches on WebGPU too: its layer graphs'
 * batch axis with padded pasts, and the packed layout for uneven ones.
 */
import { beforeAll, describe, expect, it } from 'vitest';
import type { OnnxBackend } from '../../src/shard/backend.ts';
import type { FusedShardExecutor } from '../../src/shard/fused-executor.ts';
import type { ShardExecutor } from '../../src/shard/executor.ts';
import { decodeTogether } from '../helpers/batch.ts';
import { dequantizedWeights } from '../helpers/fused.ts';
import { fixture } from '../helpers/shard.ts';
import { sharedWebGpu } from '../helpers/webgpu-backend.ts';

const { FusedShardExecutor: Fused } = await import('../../src/shard/fused-executor.ts');
const { ShardExecutor: Plain } = await import('../../src/shard/executor.ts');

// SwiftShader's f32 kernels sum in another order than float64.
const TOL = 1e-4;
const f = fixture('tiny');

let backend: OnnxBackend;

beforeAll(async () => {
  backend = (await sharedWebGpu()).backend;
}, 600_000);

/**
 * Runs `decode` (every step awaited before the next) on executors that batch, and checks that
 * it did run alone: batches of one only, a prefill and `steps` steps for each session per hop.
 */
async function aloneOn(hops: ReadonlyArray<FusedShardExecutor | ShardExecutor>, sessions: number, steps: number, decode: () => Promise<number[][]>): Promise<number[][]> {
  const before = hops.map((ex) => ex.batchStats().sizes);
  const tokens = await decode();
  hops.forEach((ex, i) => {
    const after = ex.batchStats().sizes;
    expect(after[1]! - before[i]![1]!).toBe(sessions * (1 + steps));
    expect(after.slice(2)).toEqual(before[i]!.slice(2));
  });
  return tokens;
}

describe('batched decode steps in the fused executor on WebGPU', () => {
  it.each(['f32', 'q4'] as const)('%s: sessions at their own positions get the tokens they get alone', async (projections) => {
    const weights = projections === 'q4' ? dequantizedWeights(f.weights) : f.weights;
    // Three prompts of 3, 8 and 13 tokens: positions in one, at the end of and past the first 8-token KV block.
    const sessions = 3;
    const steps = 3;
    // One at a time: onnxruntime-web creates one WebGPU session at a time. The sessions' runs
    // alone go through the same executors (each graph compiled once on SwiftShader, not twice).
    const hops: FusedShardExecutor[] = [];
    for (const a of [0, 2]) hops.push(await Fused.create({ config: f.cfg, backend, weights: () => f.weights, startLayer: a, endLayer: a + 2, projections, maxContext: 128, maxBatch: 16, kvBlockTokens: 8, returnLogits: true }));
    try {
      expect(hops[0]!.onDevice).toBe(true);
      const got = await decodeTogether(f, weights, hops, sessions, steps, TOL, 'gb');
      for (const ex of hops) expect(ex.batchStats().sizes[sessions]).toBe(steps);
      const want = await aloneOn(hops, sessions, steps, () => decodeTogether(f, weights, hops, sessions, steps, TOL, 'ga', false));
      expect(got).toEqual(want);
    } finally {
      await Promise.all(hops.map((e) => e.release()));
    }
  }, 600_000);

  it.each(['padded', 'packed'] as const)('plain graphs, %s pasts: sessions get the tokens they get alone', async (layout) => {
    const sessions = 3;
    const steps = 3;
    const hops: ShardExecutor[] = [];
    for (const a of [0, 2]) hops.push(await Plain.create({ config: f.cfg, backend, weights: () => f.weights, startLayer: a, endLayer: a + 2, maxContext: 128, maxBatch: 16, batchLayout: layout }));
    try {
      const got = await decodeTogether(f, f.weights, hops, sessions, steps, TOL, `pb${layout}`);
      for (const ex of hops) expect(ex.batchStats().sizes[sessions]).toBe(steps);
      const want = await aloneOn(hops, sessions, steps, () => decodeTogether(f, f.weights, hops, sessions, steps, TOL, `pa${layout}`, false));
      expect(got).toEqual(want);
    } finally {
      await Promise.all(hops.map((e) => e.release()));
    }
  }, 600_000);
});
