/**
 * The fused-operator executor on onnxruntime-node's CPU kernels
 * (GroupQueryAttention with the past/present buffer shared, SkipSimplified-
 * LayerNormalization, MatMulNBits): every call checked against the float64
 * reference — on the checkpoint's weights for f32 projections, on the
 * dequantized weights for 4-bit ones — across prefill, decode, chunked
 * calls, KV growth past a block, split spans and bad input.
 */
import { describe, expect, it } from 'vitest';
import type { MeshError } from '../src/protocol/errors.ts';
import { FusedShardExecutor, type FusedExecutorOptions } from '../src/shard/fused-executor.ts';
import { PositionMismatchError } from '../src/shard/errors.ts';
import { ReferenceModel, newRefCache } from '../src/model/reference.ts';
import { fusedUnsupportedReason } from '../src/model/fused-graph.ts';
import { dequantizedWeights, walkAgainstReference } from './helpers/fused.ts';
import { fixture, maxAbsDiff, nodeBackend, type Fixture } from './helpers/shard.ts';

const TOL = 2e-5;

function fused(f: Fixture, start: number, end: number, extra: Partial<FusedExecutorOptions> = {}): Promise<FusedShardExecutor> {
  return FusedShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer: start, endLayer: end, projections: 'f32', maxContext: 256, ...extra });
}

const CHUNKS = [[5, 9, 33, 100, 7], [44], [12, 13, 14], [200], [201]];

describe('fused graphs against the float64 reference', () => {
  it('f32 projections: tiny (llama3 rope scaling, tied head) through prefill, decode and chunks', async () => {
    const f = fixture('tiny');
    const ex = await fused(f, 0, f.cfg.numLayers);
    await walkAgainstReference(f, f.weights, ex, CHUNKS, TOL);
    await ex.release();
  });

  it('f32 projections: tiny-qwen2 (q/k/v biases, untied head)', async () => {
    const f = fixture('tiny-qwen2');
    expect(fusedUnsupportedReason(f.cfg)).toBeNull();
    const ex = await fused(f, 0, f.cfg.numLayers);
    await walkAgainstReference(f, f.weights, ex, CHUNKS, TOL);
    await ex.release();
  });

  it.each(['tiny', 'tiny-qwen2'] as const)('4-bit projections on %s match the reference on the dequantized weights (the quantizer apart from the kernel)', async (preset) => {
    const f = fixture(preset);
    const ex = await fused(f, 0, f.cfg.numLayers, { projections: 'q4' });
    const f32 = await fused(f, 0, f.cfg.numLayers);
    expect(ex.weightBytes).toBeLessThan(f32.weightBytes / 2);
    await f32.release();
    await walkAgainstReference(f, dequantizedWeights(f.weights), ex, CHUNKS, TOL);
    await ex.release();
  });

  it('a span split in two executors and across segments gives the activation of the whole model', async () => {
    const f = fixture('tiny');
    const a = await fused(f, 0, 2, { projections: 'q4', segmentBoundaries: [1] });
    const b = await fused(f, 2, 4, { projections: 'q4' });
    const ref = new ReferenceModel(f.cfg, dequantizedWeights(f.weights));
    const cache = newRefCache(f.cfg);
    let position = 0;
    for (const ids of CHUNKS) {
      const mid = await a.forward({ session: 's', position, tokenIds: ids });
      if (mid.kind !== 'activation') throw new Error('expected an activation');
      const want = ref.layers(0, 2, ref.embed(ids), ids.length, position, cache);
      const d = maxAbsDiff(mid.data, want);
      expect(d.err).toBeLessThanOrEqual(TOL * Math.max(1, d.scale));
      const tok = await b.forward({ session: 's', position, activation: { data: mid.data, shape: mid.shape } });
      expect(tok.kind).toBe('token');
      ref.layers(2, 4, want, ids.length, position, cache);
      position += ids.length;
    }
    await Promise.all([a.release(), b.release()]);
  });

  it('grows a session past its first block without losing a row', async () => {
    const f = fixture('tiny');
    const ex = await fused(f, 0, f.cfg.numLayers);
    const prompt = Array.from({ length: 60 }, (_, i) => 3 + ((i * 37) % 500));
    const chunks = [prompt, [7], [8], [9, 10, 11, 12, 13], [14]]; // crosses 64 positions
    await walkAgainstReference(f, f.weights, ex, chunks, TOL);
    expect(ex.kvStats().bytesUsed).toBe(2 * f.cfg.numLayers * 128 * f.cfg.numKvHeads * f.cfg.headDim * 4);
    await ex.release();
  });
});

describe('fused executor: sessions and bad input', () => {
  it('answers a wrong position with 409 and the actual length, then accepts the replay', async () => {
    const f = fixture('tiny');
    const ex = await fused(f, 0, f.cfg.numLayers);
    await ex.forward({ session: 's', position: 0, tokenIds: [5, 6, 7] });
    const err = await ex.forward({ session: 's', position: 5, tokenIds: [8] }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(PositionMismatchError);
    expect((err as PositionMismatchError).actualLength).toBe(3);
    const replay = await ex.forward({ session: 's', position: 3, tokenIds: [8, 9] });
    const oneShot = await ex.forward({ tokenIds: [5, 6, 7, 8, 9] });
    if (replay.kind !== 'token' || oneShot.kind !== 'token') throw new Error('expected tokens');
    const { err: e, scale } = maxAbsDiff(replay.logits, oneShot.logits);
    expect(e).toBeLessThanOrEqual(1e-4 * scale);
    expect(ex.kvStats().sessions).toBe(1); // the stateless call left nothing behind
    await ex.release();
  });

  it('rejects NaN, bad shapes, foreign layers and oversized calls with typed errors, and keeps serving', async () => {
    const f = fixture('tiny');
    const ex = await fused(f, 0, 2, { maxContext: 64 });
    const h = f.cfg.hiddenSize;
    const bad = new Float32Array(h);
    bad[3] = NaN;
    const codes = await Promise.all([
      ex.forward({ session: 'x', activation: { data: bad, shape: [1, 1, h] } }).catch((e: MeshError) => e.code),
      ex.forward({ activation: { data: new Float32Array(h), shape: [1, 2, h] } }).catch((e: MeshError) => e.code),
      ex.forward({ tokenIds: [1], startLayer: 1 }).catch((e: MeshError) => e.code),
      ex.forward({ session: 'y', tokenIds: Array.from({ length: 65 }, () => 5) }).catch((e: MeshError) => e.code),
      ex.forward({ tokenIds: [f.cfg.vocabSize] }).catch((e: MeshError) => e.code),
    ]);
    expect(codes).toEqual(['MESH_ERR_NON_FINITE', 'MESH_ERR_BAD_SHAPE', 'MESH_ERR_LAYER_RANGE', 'MESH_ERR_TOO_LARGE', 'MESH_ERR_BAD_REQUEST']);
    const ok = await ex.forward({ session: 'x', position: 0, tokenIds: [5, 6] });
    expect(ok.kind).toBe('activation');
    await ex.release();
  });

  it('evicts the least recently used session when the budget is full', async () => {
    const f = fixture('tiny');
    const probe = await fused(f, 0, 1, { maxContext: 64 });
    const per = probe.kvStats().bytesPerSession;
    await probe.release();
    const ex = await fused(f, 0, 1, { maxContext: 64, kvBudgetBytes: 2 * per });
    await ex.forward({ session: 'a', position: 0, tokenIds: [5] });
    await ex.forward({ session: 'b', position: 0, tokenIds: [5] });
    await ex.forward({ session: 'a', position: 1, tokenIds: [6] });
    await ex.forward({ session: 'c', position: 0, tokenIds: [5] });
    expect(ex.kvStats()).toMatchObject({ sessions: 2, evictions: 1 });
    expect(ex.sessionLength('b')).toBe(0);
    expect(ex.sessionLength('a')).toBe(2);
    await ex.release();
  });
});
