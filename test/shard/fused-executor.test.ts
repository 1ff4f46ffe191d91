/**
 * The fused-operator executor on onnxruntime-node's CPU kernels
 * (GroupQueryAttention with the past/present buffer shared, SkipSimplified-
 * LayerNormalization, MatMulNBits): every call checked against the float64
 * reference — on the checkpoint's weights for f32 projections, on the
 * dequantized weights for 4-bit ones — across prefill, decode, chunked
 * calls, KV growth past a block, split spans and bad input; and KV room
 * admitted by declaration on the shared ledger (503 MESH_ERR_BUSY, never an
 * eviction of a live session).
 */
import { describe, expect, it } from 'vitest';
import { MeshError } from '../../src/protocol/errors.ts';
import { FusedShardExecutor, type FusedExecutorOptions } from '../../src/shard/fused-executor.ts';
import { PositionMismatchError } from '../../src/shard/errors.ts';
import { ReferenceModel, newRefCache } from '../../src/model/reference.ts';
import { fusedUnsupportedReason } from '../../src/model/fused-graph.ts';
import { dequantizedWeights, walkAgainstReference } from '../helpers/fused.ts';
import { fixture, maxAbsDiff, nodeBackend, type Fixture } from '../helpers/shard.ts';

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
    // 68 positions in blocks of 64: two blocks, granted by the ledger.
    expect(ex.kvStats().reservedBytes).toBe(2 * f.cfg.numLayers * 128 * f.cfg.numKvHeads * f.cfg.headDim * 4);
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
});

describe('fused executor: KV room by declaration on the ledger', () => {
  const f = fixture('tiny');
  /** Bytes one position costs on `layers` layers of tiny (f32 keys and values). */
  const perToken = (layers: number) => 2 * layers * f.cfg.numKvHeads * f.cfg.headDim * 4;
  const L = f.cfg.numLayers;
  const V = f.cfg.vocabSize;

  async function refused(p: Promise<unknown>): Promise<MeshError> {
    const e = await p.then(
      () => undefined,
      (err: unknown) => err,
    );
    expect(e).toBeInstanceOf(MeshError);
    return e as MeshError;
  }

  /** The reference's logits for the last of `ids`, run from position 0. */
  function refLast(ids: number[]): Float64Array {
    return new ReferenceModel(f.cfg, f.weights).forward(ids, 0, newRefCache(f.cfg)).subarray((ids.length - 1) * V);
  }

  it('reserves what a session declares, refuses one that does not fit with 503 MESH_ERR_BUSY, and never evicts a live one', async () => {
    // Room for exactly two sessions of one 64-position block each.
    const ex = await fused(f, 0, L, { kvBudgetBytes: 2 * 64 * perToken(L), kvBlockTokens: 64 });
    await ex.forward({ session: 'a', position: 0, sessionTokens: 40, tokenIds: [5, 6] });
    await ex.forward({ session: 'b', position: 0, sessionTokens: 64, tokenIds: [9, 8, 7] });
    expect(ex.kvStats()).toMatchObject({ sessions: 2, reservedBytes: 2 * 64 * perToken(L), freeBytes: 0 });
    const err = await refused(ex.forward({ session: 'c', position: 0, sessionTokens: 10, tokenIds: [5] }));
    expect(err).toMatchObject({ code: 'MESH_ERR_BUSY', status: 503 });
    expect(err.details).toMatchObject({ retry_after_ms: 1000, kv_free_bytes: 0, kv_needed_bytes: 64 * perToken(L) });
    // A stateless call needs room for its rows too: refused the same way, not by evicting.
    expect((await refused(ex.forward({ tokenIds: [1, 2] }))).code).toBe('MESH_ERR_BUSY');
    // Both live sessions go on where they were, with their caches intact.
    const a = await ex.forward({ session: 'a', position: 2, tokenIds: [7] });
    const b = await ex.forward({ session: 'b', position: 3, tokenIds: [6] });
    if (a.kind !== 'token' || b.kind !== 'token') throw new Error('expected tokens');
    for (const [got, ids] of [
      [a.logits, [5, 6, 7]],
      [b.logits, [9, 8, 7, 6]],
    ] as const) {
      const { err: e, scale } = maxAbsDiff(got, refLast([...ids]));
      expect(e).toBeLessThanOrEqual(TOL * Math.max(1, scale));
    }
    expect(ex.kvStats()).toMatchObject({ sessions: 2, evictions: 0, refusals: 2 });
    expect(ex.dropSession('a')).toBe(true);
    await ex.forward({ session: 'c', position: 0, sessionTokens: 10, tokenIds: [5] });
    expect([ex.sessionLength('b'), ex.sessionLength('c')]).toEqual([4, 1]);
    await ex.release();
  });

  it('sizes a declared session once: decoding up to its declaration never grows it', async () => {
    const ex = await fused(f, 0, L, { kvBlockTokens: 32 });
    await ex.forward({ session: 's', position: 0, sessionTokens: 70, tokenIds: [3, 4, 5, 6] });
    const reserved = ex.kvStats().reservedBytes;
    expect(reserved).toBe(96 * perToken(L)); // 70 rounded up to whole blocks of 32
    for (let pos = 4; pos < 70; pos += 11) await ex.forward({ session: 's', position: pos, tokenIds: Array.from({ length: 11 }, (_, i) => (pos + i) % V) });
    expect(ex.kvStats().reservedBytes).toBe(reserved);
    // Past its declaration it grows by whole blocks, like an undeclared session.
    await ex.forward({ session: 's', position: 70, tokenIds: Array.from({ length: 30 }, (_, i) => i + 1) });
    expect(ex.kvStats().reservedBytes).toBe(128 * perToken(L));
    await ex.release();
  });

  it('drops a session idle past the TTL only when a new one needs its room', async () => {
    let now = 1000;
    const ex = await fused(f, 0, 1, { kvBudgetBytes: 64 * perToken(1), kvBlockTokens: 64, kvTtlMs: 5000, now: () => now });
    await ex.forward({ session: 'idle', position: 0, tokenIds: [5, 6] });
    now += 4000;
    expect((await refused(ex.forward({ session: 'new', position: 0, tokenIds: [5] }))).code).toBe('MESH_ERR_BUSY');
    now += 2000; // 6 s idle: its room may go now
    await ex.forward({ session: 'new', position: 0, tokenIds: [5] });
    expect(ex.kvStats()).toMatchObject({ sessions: 1, evictions: 1 });
    const gone = await ex.forward({ session: 'idle', position: 2, tokenIds: [7] }).catch((e: unknown) => e);
    expect(gone).toBeInstanceOf(PositionMismatchError);
    await ex.release();
  });

  it('gives the KV caches what the weights leave of a memory budget; a lowered budget keeps live sessions and refuses new ones', async () => {
    const probe = await fused(f, 0, 2);
    const weights = probe.weightBytes;
    await probe.release();
    const ex = await fused(f, 0, 2, { memoryBudgetBytes: weights + 64 * perToken(2), kvBlockTokens: 64 });
    expect(ex.kvStats().budgetBytes).toBe(64 * perToken(2));
    await ex.forward({ session: 'a', position: 0, tokenIds: [5] });
    ex.setMemoryBudget(weights);
    expect(ex.kvStats()).toMatchObject({ budgetBytes: 0, sessions: 1 });
    await ex.forward({ session: 'a', position: 1, tokenIds: [6] });
    expect((await refused(ex.forward({ session: 'b', position: 0, tokenIds: [5] }))).code).toBe('MESH_ERR_TOO_LARGE');
    expect((await refused(ex.forward({ session: 'b', position: 0, sessionTokens: -1, tokenIds: [5] }))).code).toBe('MESH_ERR_BAD_REQUEST');
    await ex.release();
  });
});
