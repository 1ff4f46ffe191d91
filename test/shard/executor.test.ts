/**
 * Executor behaviour around the KV caches and bad input: room by
 * declaration, admission (503) instead of eviction, growth by blocks, the
 * idle TTL, the 409 position check and replay, typed validation errors,
 * caches written in place, and loading weights through the safetensors
 * Range reader.
 */
import { describe, expect, it } from 'vitest';
import { MeshError } from '../../src/protocol/errors.ts';
import { PositionMismatchError } from '../../src/shard/errors.ts';
import { readerWeightLoader } from '../../src/shard/weights.ts';
import { ShardExecutor } from '../../src/shard/executor.ts';
import { SafetensorsReader } from '../../src/model/safetensors.ts';
import { memoryFetch } from '../../src/model/memory-fetch.ts';
import { ReferenceModel, newRefCache } from '../../src/model/reference.ts';
import { executor, fixture, maxAbsDiff, nodeBackend } from '../helpers/shard.ts';

const f = fixture('tiny');
const h = f.cfg.hiddenSize;

async function rejection(p: Promise<unknown>): Promise<MeshError> {
  try {
    await p;
  } catch (e) {
    expect(e).toBeInstanceOf(MeshError);
    return e as MeshError;
  }
  throw new Error('expected a rejection');
}

describe('KV memory by declaration, admission instead of eviction', () => {
  /** Bytes one position costs on `layers` layers of tiny (f32 keys and values). */
  const perToken = (layers: number) => 2 * layers * f.cfg.numKvHeads * f.cfg.headDim * 4;

  it('reserves what a session declares, refuses a session that does not fit with 503 MESH_ERR_BUSY, and never evicts a live one', async () => {
    // Room for exactly two sessions declared at 64 positions (one block each) on 2 layers.
    const ex = await executor(f, 0, 2, { maxContext: 256, kvBudgetBytes: 2 * 64 * perToken(2), kvBlockTokens: 64 });
    await ex.forward({ session: 'a', position: 0, sessionTokens: 40, tokenIds: [5, 6] });
    await ex.forward({ session: 'b', position: 0, sessionTokens: 64, tokenIds: [5, 6] });
    expect(ex.kvStats()).toMatchObject({ sessions: 2, reservedBytes: 2 * 64 * perToken(2), freeBytes: 0 });
    const err = await rejection(ex.forward({ session: 'c', position: 0, sessionTokens: 10, tokenIds: [5] }));
    expect(err).toMatchObject({ code: 'MESH_ERR_BUSY', status: 503 });
    expect(err.details).toMatchObject({ retry_after_ms: 1000, kv_free_bytes: 0, kv_needed_bytes: 64 * perToken(2) });
    // Both live sessions go on where they were: nothing was evicted to try to fit c.
    await ex.forward({ session: 'a', position: 2, tokenIds: [7] });
    await ex.forward({ session: 'b', position: 2, tokenIds: [7] });
    expect(ex.kvStats()).toMatchObject({ sessions: 2, evictions: 0, refusals: 1 });
    expect(ex.dropSession('a')).toBe(true);
    await ex.forward({ session: 'c', position: 0, sessionTokens: 10, tokenIds: [5] });
    expect(ex.sessionLength('c')).toBe(1);
  });

  it('drops sessions idle past the TTL only when room is needed, longest idle first', async () => {
    let now = 1000;
    const ex = await executor(f, 0, 1, { maxContext: 256, kvBudgetBytes: 2 * 64 * perToken(1), kvBlockTokens: 64, kvTtlMs: 5000, now: () => now });
    await ex.forward({ session: 'old', position: 0, tokenIds: [5, 6, 7] });
    now += 1000;
    await ex.forward({ session: 'older-use', position: 0, tokenIds: [5] });
    now += 1000;
    await ex.forward({ session: 'old', position: 3, tokenIds: [8] }); // 'old' is now the most recently used
    now += 6000; // both idle past the TTL: their room counts as free
    expect(ex.kvStats()).toMatchObject({ sessions: 2, evictions: 0, freeBytes: 2 * 64 * perToken(1) });
    // A new session needs one block: only the longest idle one goes.
    await ex.forward({ session: 'new', position: 0, tokenIds: [5] });
    expect(ex.kvStats()).toMatchObject({ sessions: 2, evictions: 1 });
    const err = await rejection(ex.forward({ session: 'older-use', position: 1, tokenIds: [9] }));
    expect(err).toBeInstanceOf(PositionMismatchError);
    expect((err as PositionMismatchError).actualLength).toBe(0);
    now += 6000;
    // Idle past the TTL again, but nothing needs its room: it is still served.
    await ex.forward({ session: 'old', position: 4, tokenIds: [9] });
    expect(ex.sessionLength('old')).toBe(5);
    expect(ex.kvStats().evictions).toBe(1);
  });

  it('grows an undeclared session by whole blocks, keeping its cache: logits match the float64 reference across each growth', async () => {
    const ref = new ReferenceModel(f.cfg, f.weights);
    const cache = newRefCache(f.cfg);
    const L = f.cfg.numLayers;
    const V = f.cfg.vocabSize;
    const ex = await executor(f, 0, L, { maxContext: 64, kvBlockTokens: 4 });
    const prompt = [5, 9, 11, 3, 8, 21];
    let r = await ex.forward({ session: 'g', position: 0, tokenIds: prompt });
    let want = ref.forward(prompt, 0, cache).subarray((prompt.length - 1) * V);
    const reserved: number[] = [ex.kvStats().reservedBytes];
    for (let pos = prompt.length; pos < prompt.length + 7; pos++) {
      if (r.kind !== 'token') throw new Error('expected a token');
      const { err, scale } = maxAbsDiff(r.logits, want);
      expect(err).toBeLessThanOrEqual(1e-4 * scale);
      want = ref.forward([r.tokenId], pos, cache);
      r = await ex.forward({ session: 'g', position: pos, tokenIds: [r.tokenId] });
      reserved.push(ex.kvStats().reservedBytes);
    }
    // 6 prompt rows took 2 blocks (8 positions); positions 8 and 12 each took one more.
    const block = 4 * perToken(L);
    expect(reserved).toEqual([2, 2, 2, 3, 3, 3, 3, 4].map((b) => b * block));
  });

  it('refuses to grow a session past the free room (503, the session keeps what it holds) and past the context (413)', async () => {
    const ex = await executor(f, 0, 1, { maxContext: 16, kvBudgetBytes: 12 * perToken(1), kvBlockTokens: 4 });
    await ex.forward({ session: 'a', position: 0, sessionTokens: 8, tokenIds: [1, 2, 3, 4, 5, 6, 7, 8] });
    await ex.forward({ session: 'b', position: 0, tokenIds: [1, 2] });
    const err = await rejection(ex.forward({ session: 'a', position: 8, tokenIds: [9] }));
    expect(err).toMatchObject({ code: 'MESH_ERR_BUSY', status: 503 });
    expect(ex.sessionLength('a')).toBe(8);
    ex.dropSession('b');
    await ex.forward({ session: 'a', position: 8, tokenIds: [9] });
    expect(ex.sessionLength('a')).toBe(9);
    expect((await rejection(ex.forward({ session: 'a', position: 9, tokenIds: [1, 2, 3, 4, 5, 6, 7, 8] }))).code).toBe('MESH_ERR_TOO_LARGE');
  });

  it('refuses a session bigger than the whole KV budget with 413', async () => {
    const ex = await executor(f, 0, 1, { maxContext: 64, kvBudgetBytes: 1000 });
    const err = await rejection(ex.forward({ session: 's', position: 0, tokenIds: [5] }));
    expect(err.code).toBe('MESH_ERR_TOO_LARGE');
  });

  it('gives the KV caches what the weights leave of a memory budget, and a new budget applies to new sessions only', async () => {
    const probe = await executor(f, 0, 2);
    const budget = probe.weightBytes + 64 * perToken(2);
    const ex = await executor(f, 0, 2, { memoryBudgetBytes: budget, kvBlockTokens: 64 });
    expect(ex.kvStats().budgetBytes).toBe(64 * perToken(2));
    await ex.forward({ session: 'a', position: 0, tokenIds: [5] });
    ex.setMemoryBudget(probe.weightBytes); // nothing left for KV
    expect(ex.kvStats()).toMatchObject({ budgetBytes: 0, sessions: 1 });
    await ex.forward({ session: 'a', position: 1, tokenIds: [6] }); // the live session keeps its room
    expect((await rejection(ex.forward({ session: 'b', position: 0, tokenIds: [5] }))).code).toBe('MESH_ERR_TOO_LARGE');
  });
});

describe('409 position check', () => {
  it('reports the actual length and accepts a replay from there', async () => {
    const ex = await executor(f, 0, f.cfg.numLayers);
    await ex.forward({ session: 's', position: 0, tokenIds: [5, 6, 7] });
    const err = await rejection(ex.forward({ session: 's', position: 5, tokenIds: [8] }));
    expect(err).toBeInstanceOf(PositionMismatchError);
    expect(err.code).toBe('MESH_ERR_POSITION_MISMATCH');
    expect(err.status).toBe(409);
    expect((err as PositionMismatchError).actualLength).toBe(3);
    const replay = await ex.forward({ session: 's', position: 3, tokenIds: [8, 9] });
    const oneShot = await ex.forward({ tokenIds: [5, 6, 7, 8, 9] });
    if (replay.kind !== 'token' || oneShot.kind !== 'token') throw new Error('expected tokens');
    const { err: e, scale } = maxAbsDiff(replay.logits, oneShot.logits);
    expect(e).toBeLessThanOrEqual(1e-4 * scale);
  });

  it('an unknown session at position > 0 is a 409 with length 0', async () => {
    const ex = await executor(f, 0, 1);
    const err = await rejection(ex.forward({ session: 'nope', position: 4, tokenIds: [5] }));
    expect((err as PositionMismatchError).actualLength).toBe(0);
  });

  it('writes the cache in place: buffers keep their identity across steps', async () => {
    const ex = await executor(f, 0, 2);
    await ex.forward({ session: 's', position: 0, tokenIds: [5, 6] });
    const kv = (ex as unknown as { kv: { get(id: string): { cache: { keys: unknown[] } } } }).kv;
    const before = kv.get('s')!.cache.keys[0];
    for (let p = 2; p < 6; p++) await ex.forward({ session: 's', position: p, tokenIds: [7] });
    expect(kv.get('s')!.cache.keys[0]).toBe(before);
  });
});

describe('validation errors', () => {
  it('rejects NaN / Inf activations with MESH_ERR_NON_FINITE and keeps serving', async () => {
    const ex = await executor(f, 1, 3);
    const data = new Float32Array(2 * h).fill(0.5);
    data[h + 3] = NaN;
    const err = await rejection(ex.forward({ activation: { data, shape: [1, 2, h] } }));
    expect(err).toMatchObject({ code: 'MESH_ERR_NON_FINITE', status: 400 });
    expect(err.details).toMatchObject({ index: h + 3 });
    data[h + 3] = Infinity;
    expect((await rejection(ex.forward({ activation: { data, shape: [1, 2, h] } }))).code).toBe('MESH_ERR_NON_FINITE');
    data[h + 3] = 0;
    expect((await ex.forward({ activation: { data, shape: [1, 2, h] } })).kind).toBe('activation');
  });

  it('rejects wrong shapes with MESH_ERR_BAD_SHAPE', async () => {
    const ex = await executor(f, 1, 3);
    for (const shape of [[1, 2, h + 1], [2, 1, h], [1, 0, h], [1, 2]]) {
      const err = await rejection(ex.forward({ activation: { data: new Float32Array(2 * h), shape } }));
      expect(err.code).toBe('MESH_ERR_BAD_SHAPE');
    }
    const err = await rejection(ex.forward({ activation: { data: new Float32Array(3 * h), shape: [1, 2, h] } }));
    expect(err.code).toBe('MESH_ERR_BAD_SHAPE');
  });

  it('rejects layers outside the held range with MESH_ERR_LAYER_RANGE (416)', async () => {
    const ex = await executor(f, 1, 3);
    const activation = { data: new Float32Array(h), shape: [1, 1, h] };
    for (const [startLayer, endLayer] of [[0, 2], [1, 4], [2, 2], [3, 3]]) {
      const err = await rejection(ex.forward({ activation, startLayer, endLayer }));
      expect(err).toMatchObject({ code: 'MESH_ERR_LAYER_RANGE', status: 416 });
      expect(err.details).toMatchObject({ start_layer: 1, end_layer: 3 });
    }
    // Token ids need the embedding, which this shard does not hold.
    expect((await rejection(ex.forward({ tokenIds: [5] }))).code).toBe('MESH_ERR_LAYER_RANGE');
  });

  it('rejects a fused range asked to start inside it, and bad sampling parameters', async () => {
    const ex = await executor(f, 0, 4, { segmentBoundaries: [] });
    const err = await rejection(ex.forward({ activation: { data: new Float32Array(h), shape: [1, 1, h] }, startLayer: 2 }));
    expect(err.code).toBe('MESH_ERR_LAYER_RANGE');
    const bad = await rejection(ex.forward({ tokenIds: [5], sampling: { temperature: -1 } }));
    expect(bad.code).toBe('MESH_ERR_BAD_REQUEST');
    expect((await rejection(ex.forward({ tokenIds: [f.cfg.vocabSize] }))).code).toBe('MESH_ERR_BAD_REQUEST');
  });

  it('rejects positions past the preallocated context', async () => {
    const ex = await executor(f, 0, 1, { maxContext: 8 });
    await ex.forward({ session: 's', position: 0, tokenIds: [1, 2, 3, 4, 5, 6] });
    expect((await rejection(ex.forward({ session: 's', position: 6, tokenIds: [1, 2, 3] }))).code).toBe('MESH_ERR_TOO_LARGE');
  });
});

describe('sampling through the executor', () => {
  it('a replay from (seed, position) draws the same token', async () => {
    const ex = await executor(f, 0, f.cfg.numLayers);
    const sampling = { temperature: 1.2, topP: 0.95, topK: 50, seed: 1234 };
    const first: number[] = [];
    let r = await ex.forward({ session: 'x', position: 0, tokenIds: [5, 6, 7], sampling });
    for (let p = 3; p < 10; p++) {
      if (r.kind !== 'token') throw new Error('expected a token');
      first.push(r.tokenId);
      r = await ex.forward({ session: 'x', position: p, tokenIds: [r.tokenId], sampling });
    }
    // Replay on a fresh session from the middle: prompt + tokens so far, then continue.
    const prefix = [5, 6, 7, ...first.slice(0, 3)];
    let r2 = await ex.forward({ session: 'y', position: 0, tokenIds: prefix, sampling });
    const again: number[] = [];
    for (let p = prefix.length; p < 10; p++) {
      if (r2.kind !== 'token') throw new Error('expected a token');
      again.push(r2.tokenId);
      r2 = await ex.forward({ session: 'y', position: p, tokenIds: [r2.tokenId], sampling });
    }
    expect(again).toEqual(first.slice(3));
  });
});

describe('weights through the safetensors Range reader', () => {
  it('builds a middle shard from a sharded checkpoint, fetching only its layers', async () => {
    const small = fixture('small');
    const stats = { requests: 0, bytesSent: 0 };
    const reader = await SafetensorsReader.open(memoryFetch(small.files, stats), 'mem://small/');
    const viaReader = await ShardExecutor.create({ config: small.cfg, backend: nodeBackend, weights: readerWeightLoader(reader), startLayer: 4, endLayer: 6, maxContext: 64 });
    const direct = await executor(small, 4, 6);
    const total = [...small.files.values()].reduce((s, b) => s + b.byteLength, 0);
    expect(stats.bytesSent).toBeLessThan(total / 4);
    const act = { data: new Float32Array(3 * small.cfg.hiddenSize).map((_, i) => Math.sin(i)), shape: [1, 3, small.cfg.hiddenSize] };
    const a = await viaReader.forward({ activation: act });
    const b = await direct.forward({ activation: act });
    if (a.kind !== 'activation' || b.kind !== 'activation') throw new Error('expected activations');
    expect(Array.from(a.data)).toEqual(Array.from(b.data));
  });
});
