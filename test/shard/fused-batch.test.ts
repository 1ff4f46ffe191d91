/**
 * Batching in the fused executor (GroupQueryAttention with per-session
 * seqlens_k, caches gathered into one batch tensor) on onnxruntime-node's
 * CPU kernels: sessions at different positions stepped together get the
 * same greedy tokens as alone and logits within f32 tolerance of the
 * float64 reference, through a split span (activation out, token out); a
 * malformed member fails alone. WebGPU runs the same walk in test/gpu.
 */
import { describe, expect, it } from 'vitest';
import { createWasmBackend } from '../../src/host/node/onnx-wasm.ts';
import type { MeshError } from '../../src/protocol/errors.ts';
import { FusedShardExecutor, type FusedExecutorOptions } from '../../src/shard/fused-executor.ts';
import { decodeTogether } from '../helpers/batch.ts';
import { dequantizedWeights } from '../helpers/fused.ts';
import { fixture, nodeBackend, type Fixture } from '../helpers/shard.ts';

const TOL = 2e-5;

function fused(f: Fixture, start: number, end: number, extra: Partial<FusedExecutorOptions> = {}): Promise<FusedShardExecutor> {
  return FusedShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer: start, endLayer: end, projections: 'f32', maxContext: 256, ...extra });
}

describe('batched decode steps in the fused executor (onnxruntime-node CPU)', () => {
  it.each(['f32', 'q4'] as const)('%s projections: sessions at their own positions get the tokens they get alone, through a split span', async (projections) => {
    const f = fixture('tiny');
    const weights = projections === 'q4' ? dequantizedWeights(f.weights) : f.weights;
    const sessions = 6;
    const steps = 5;
    // Small blocks: sessions grow their caches while batched (gathered from buffers of different capacities).
    const make = (maxBatch: number) => Promise.all([fused(f, 0, 2, { projections, maxBatch, kvBlockTokens: 8 }), fused(f, 2, 4, { projections, maxBatch, kvBlockTokens: 8 })]);
    const batched = await make(16);
    const alone = await make(1);
    const got = await decodeTogether(f, weights, batched, sessions, steps, TOL);
    const want = await decodeTogether(f, weights, alone, sessions, steps, TOL);
    expect(got).toEqual(want);
    for (const ex of batched) expect(ex.batchStats().sizes[sessions]).toBe(steps);
    for (const ex of alone) expect(ex.batchStats().batches).toBe(sessions + steps * sessions);
    await Promise.all([...batched, ...alone].map((e) => e.release()));
  });

  it('reuses its gather buffers across batches that grow and shrink (rows past a session hold stale data, never read)', async () => {
    // A CPU backend gathers into buffers the executor keeps (batch-scratch.ts). After 6 sessions, a 2-session batch of
    // similar length reuses the same memory, its rows past each session's length still holding the 6-session batch's rows:
    // GQA must bound each row by its seqlens_k, or these tokens differ from alone.
    const f = fixture('tiny');
    const make = (maxBatch: number) => Promise.all([fused(f, 0, 2, { maxBatch, kvBlockTokens: 8 }), fused(f, 2, 4, { maxBatch, kvBlockTokens: 8 })]);
    const batched = await make(16);
    const alone = await make(1);
    const want6 = await decodeTogether(f, f.weights, alone, 6, 4, TOL, 'a');
    const want2 = await decodeTogether(f, f.weights, alone, 2, 4, TOL, 'b');
    expect(await decodeTogether(f, f.weights, batched, 6, 4, TOL, 'a')).toEqual(want6);
    expect(await decodeTogether(f, f.weights, batched, 2, 4, TOL, 'b')).toEqual(want2);
    expect(await decodeTogether(f, f.weights, batched, 6, 4, TOL, 'c')).toEqual(want6);
    for (const ex of batched) expect(ex.batchStats().sizes[2]).toBe(4);
    await Promise.all([...batched, ...alone].map((e) => e.release()));
  });

  it('on onnxruntime-web WASM (what a browser node serves with) too', async () => {
    const f = fixture('tiny');
    const backend = createWasmBackend({ numThreads: 1 });
    const make = (maxBatch: number) => Promise.all([fused(f, 0, 2, { backend, maxBatch, kvBlockTokens: 8 }), fused(f, 2, 4, { backend, maxBatch, kvBlockTokens: 8 })]);
    const batched = await make(16);
    const alone = await make(1);
    const got = await decodeTogether(f, f.weights, batched, 4, 3, TOL, 'w');
    const want = await decodeTogether(f, f.weights, alone, 4, 3, TOL, 'w');
    expect(got).toEqual(want);
    for (const ex of batched) expect(ex.batchStats().sizes[4]).toBe(3);
    await Promise.all([...batched, ...alone].map((e) => e.release()));
  });

  it('fails a malformed member alone', async () => {
    const f = fixture('tiny');
    const ex = await fused(f, 0, f.cfg.numLayers);
    await ex.forward({ session: 'a', position: 0, tokenIds: [5, 6, 7] });
    await ex.forward({ session: 'b', position: 0, tokenIds: [8, 9] });
    const settled = await Promise.allSettled([
      ex.forward({ session: 'warm', position: 0, tokenIds: [4] }),
      ex.forward({ session: 'a', position: 3, tokenIds: [10] }),
      ex.forward({ session: 'b', position: 7, tokenIds: [11] }), // wrong position
      ex.forward({ session: 'c', position: 2, tokenIds: [f.cfg.vocabSize + 5] }), // token outside the vocabulary
      ex.forward({ session: 'b2', position: 1, tokenIds: [12] }), // never opened
    ]);
    expect(settled.map((r) => (r.status === 'rejected' ? (r.reason as MeshError).code : 'ok'))).toEqual(['ok', 'ok', 'MESH_ERR_POSITION_MISMATCH', 'MESH_ERR_BAD_REQUEST', 'MESH_ERR_POSITION_MISMATCH']);
    expect(ex.batchStats().sizes[4]).toBe(1);
    // a's step matches a lone executor's.
    const lone = await fused(f, 0, f.cfg.numLayers, { maxBatch: 1 });
    await lone.forward({ session: 'a', position: 0, tokenIds: [5, 6, 7] });
    const want = await lone.forward({ session: 'a', position: 3, tokenIds: [10] });
    const got = (settled[1] as PromiseFulfilledResult<Awaited<ReturnType<typeof ex.forward>>>).value;
    if (got.kind !== 'token' || want.kind !== 'token') throw new Error('expected tokens');
    expect(got.tokenId).toBe(want.tokenId);
    expect(ex.sessionLength('b')).toBe(2);
    await Promise.all([ex.release(), lone.release()]);
  });
});
