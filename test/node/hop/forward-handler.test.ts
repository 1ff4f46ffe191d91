import { describe, expect, it, beforeAll } from 'vitest';
import { createForwardHandler, type ForwardEvent } from '../../../src/node/hop/forward-handler.ts';
import type { MeshRequest, MeshResponse } from '../../../src/protocol/envelopes.ts';
import { decodeTensor, encodeTensor } from '../../../src/protocol/tensor.ts';
import { ReferenceModel, newRefCache } from '../../../src/model/reference.ts';
import type { ShardExecutor } from '../../../src/shard/executor.ts';
import { executor, fixture, maxAbsDiff } from '../../helpers/shard.ts';

const f = fixture('tiny');
const H = f.cfg.hiddenSize;
const ref = new ReferenceModel(f.cfg, f.weights);

function body(res: MeshResponse): Uint8Array {
  if (!(res.body instanceof Uint8Array)) throw new Error('streamed body');
  return res.body;
}
function jsonOf(res: MeshResponse): { error?: { code: string; message: string; actual_length?: number }; [k: string]: unknown } {
  return JSON.parse(new TextDecoder().decode(body(res)));
}
function activation(seq: number, seed = 3): Float32Array {
  const x = ref.embed(Array.from({ length: seq }, (_, i) => 3 + ((i * 37 + seed) % 500)));
  return Float32Array.from(x);
}
function post(headers: Record<string, string>, bytes: Uint8Array): MeshRequest {
  return { method: 'POST', path: '/forward', headers, body: bytes };
}

describe('createForwardHandler', () => {
  let mid: ShardExecutor;
  let last: ShardExecutor;
  const events: ForwardEvent[] = [];
  let paused = false;
  let handle: (r: MeshRequest) => Promise<MeshResponse>;
  let handleLast: (r: MeshRequest) => Promise<MeshResponse>;

  beforeAll(async () => {
    mid = await executor(f, 1, 3);
    last = await executor(f, 2, 4);
    handle = createForwardHandler(mid, { model: 'tiny', backend: 'onnxruntime-node/cpu', isPaused: () => paused, onForward: (e) => events.push(e) });
    handleLast = createForwardHandler(last, { model: 'tiny', backend: 'onnxruntime-node/cpu', decode: (id) => `<${id}>` });
  });

  it('answers an f32 activation with the float64 reference output of its layers (|err| ≤ 1e-4 × scale)', async () => {
    const x = activation(5);
    const res = await handle(post({ 'x-meshnet-shape': `1,5,${H}`, 'x-meshnet-dtype': 'f32' }, encodeTensor(x, 'f32')));
    expect(res.status).toBe(200);
    expect(res.headers['x-meshnet-shape']).toBe(`1,5,${H}`);
    expect(res.headers['x-meshnet-dtype']).toBe('f32');
    const want = ref.layers(1, 3, Float64Array.from(x), 5, 0, newRefCache(f.cfg));
    const { err, scale } = maxAbsDiff(decodeTensor(body(res), 'f32'), want);
    expect(err).toBeLessThanOrEqual(1e-4 * Math.max(1, scale));
    expect(events.at(-1)).toMatchObject({ status: 200, tokens: 5 });
  });

  it('defaults to bf16 and answers in the dtype it received', async () => {
    const x = activation(2);
    const res = await handle(post({ 'x-meshnet-shape': `1,2,${H}` }, encodeTensor(x, 'bf16')));
    expect(res.status).toBe(200);
    expect(res.headers['x-meshnet-dtype']).toBe('bf16');
    expect(body(res).byteLength).toBe(2 * H * 2);
  });

  it('keeps a session across calls and matches the reference step by step', async () => {
    const x = activation(4, 9);
    const cache = newRefCache(f.cfg);
    const want = ref.layers(1, 3, Float64Array.from(x), 4, 0, cache);
    // Prompt of 3, then one token at position 3.
    const r1 = await handle(post({ 'x-meshnet-shape': `1,3,${H}`, 'x-meshnet-dtype': 'f32', 'x-meshnet-session': 's1', 'x-meshnet-position': '0' }, encodeTensor(x.subarray(0, 3 * H), 'f32')));
    const r2 = await handle(post({ 'x-meshnet-shape': `1,1,${H}`, 'x-meshnet-dtype': 'f32', 'x-meshnet-session': 's1', 'x-meshnet-position': '3' }, encodeTensor(x.subarray(3 * H), 'f32')));
    expect([r1.status, r2.status]).toEqual([200, 200]);
    const { err, scale } = maxAbsDiff(decodeTensor(body(r2), 'f32'), want.subarray(3 * H));
    expect(err).toBeLessThanOrEqual(1e-4 * Math.max(1, scale));
  });

  it('reserves the declared X-Meshnet-Session-Tokens, and refuses a session without room with 503 MESH_ERR_BUSY and Retry-After before computing', async () => {
    const perToken = 2 * 2 * f.cfg.numKvHeads * f.cfg.headDim * 4;
    const small = await executor(f, 1, 3, { kvBudgetBytes: 128 * perToken, kvBlockTokens: 64 });
    const seen: ForwardEvent[] = [];
    const h = createForwardHandler(small, { model: 'tiny', backend: 'test', onForward: (e) => seen.push(e) });
    const x = encodeTensor(activation(3), 'bf16');
    const open = (session: string, tokens: string) => h(post({ 'x-meshnet-shape': `1,3,${H}`, 'x-meshnet-session': session, 'x-meshnet-position': '0', 'x-meshnet-session-tokens': tokens }, x));
    expect((await open('a', '100')).status).toBe(200);
    expect(small.kvStats().reservedBytes).toBe(128 * perToken);
    const busy = await open('b', '10');
    expect(busy.status).toBe(503);
    expect(busy.headers['retry-after']).toBe('1');
    expect(jsonOf(busy).error).toMatchObject({ code: 'MESH_ERR_BUSY', retry_after_ms: 1000, kv_free_bytes: 0 });
    expect(seen.at(-1)).toMatchObject({ status: 503, tokens: 0 });
    const info = jsonOf(await h({ method: 'GET', path: '/info', headers: {}, body: new Uint8Array(0) }));
    expect(info.kv).toMatchObject({ sessions: 1, budget_bytes: 128 * perToken, reserved_bytes: 128 * perToken, used_bytes: 3 * perToken, free_bytes: 0, bytes_per_token: perToken, block_tokens: 64, refusals: 1, evictions: 0 });
    for (const bad of ['-1', 'many', '1e3']) expect((await open('c', bad)).status).toBe(400);
  });

  it('answers 409 with the actual length when the position does not match the session', async () => {
    const res = await handle(post({ 'x-meshnet-shape': `1,1,${H}`, 'x-meshnet-dtype': 'f32', 'x-meshnet-session': 's1', 'x-meshnet-position': '7' }, encodeTensor(activation(1), 'f32')));
    expect(res.status).toBe(409);
    expect(jsonOf(res).error).toMatchObject({ code: 'MESH_ERR_POSITION_MISMATCH', actual_length: 4 });
  });

  it('answers 400 when the body length does not match the shape', async () => {
    const res = await handle(post({ 'x-meshnet-shape': `1,3,${H}`, 'x-meshnet-dtype': 'f32' }, new Uint8Array(2 * H * 4)));
    expect(res.status).toBe(400);
    expect(jsonOf(res).error?.code).toBe('MESH_ERR_BAD_SHAPE');
  });

  it('answers 400 for NaN or Inf in the activation and keeps serving', async () => {
    const x = activation(2);
    x[5] = Number.NaN;
    const bad = await handle(post({ 'x-meshnet-shape': `1,2,${H}`, 'x-meshnet-dtype': 'f32' }, encodeTensor(x, 'f32')));
    expect(bad.status).toBe(400);
    expect(jsonOf(bad).error?.code).toBe('MESH_ERR_NON_FINITE');
    x[5] = Number.POSITIVE_INFINITY;
    expect((await handle(post({ 'x-meshnet-shape': `1,2,${H}`, 'x-meshnet-dtype': 'f32' }, encodeTensor(x, 'f32')))).status).toBe(400);
    const ok = await handle(post({ 'x-meshnet-shape': `1,2,${H}`, 'x-meshnet-dtype': 'f32' }, encodeTensor(activation(2), 'f32')));
    expect(ok.status).toBe(200);
  });

  it('answers 400 for an unknown dtype, a malformed shape, a wrong hidden size, bad sampling JSON', async () => {
    const x = encodeTensor(activation(1), 'f32');
    const cases: Array<Record<string, string>> = [
      { 'x-meshnet-shape': `1,1,${H}`, 'x-meshnet-dtype': 'f64' },
      { 'x-meshnet-shape': `1,x,${H}`, 'x-meshnet-dtype': 'f32' },
      { 'x-meshnet-shape': `1,1,${H / 2},2`, 'x-meshnet-dtype': 'f32' },
      { 'x-meshnet-shape': `1,2,${H / 2}`, 'x-meshnet-dtype': 'f32' },
      { 'x-meshnet-shape': `1,1,${H}`, 'x-meshnet-dtype': 'f32', 'x-meshnet-sampling': '{temperature' },
      { 'x-meshnet-shape': `1,1,${H}`, 'x-meshnet-dtype': 'f32', 'x-meshnet-session': 'no position' },
    ];
    for (const headers of cases) {
      const res = await handle(post(headers, x));
      expect(res.status, JSON.stringify(headers)).toBe(400);
      expect(jsonOf(res).error?.message.length).toBeGreaterThan(0);
    }
  });

  it('answers 416 for layers outside the held range', async () => {
    const x = encodeTensor(activation(1), 'f32');
    for (const [s, e] of [['0', '2'], ['1', '4'], ['2', '2']]) {
      const res = await handle(post({ 'x-meshnet-shape': `1,1,${H}`, 'x-meshnet-dtype': 'f32', 'x-meshnet-start-layer': s!, 'x-meshnet-end-layer': e! }, x));
      expect(res.status).toBe(416);
      expect(jsonOf(res).error?.code).toBe('MESH_ERR_LAYER_RANGE');
    }
  });

  it('runs from a start layer inside the range (overlap) to the reference of just those layers', async () => {
    const x = activation(3);
    const res = await handle(post({ 'x-meshnet-shape': `1,3,${H}`, 'x-meshnet-dtype': 'f32', 'x-meshnet-start-layer': '2' }, encodeTensor(x, 'f32')));
    expect(res.status).toBe(200);
    const want = ref.layers(2, 3, Float64Array.from(x), 3, 0, newRefCache(f.cfg));
    const { err, scale } = maxAbsDiff(decodeTensor(body(res), 'f32'), want);
    expect(err).toBeLessThanOrEqual(1e-4 * Math.max(1, scale));
  });

  it('returns the greedy token as JSON on the last hop, with its text and logprob', async () => {
    const ids = [5, 17, 99, 240];
    const x = Float32Array.from(ref.layers(0, 2, ref.embed(ids), ids.length, 0, newRefCache(f.cfg)));
    const res = await handleLast(post({ 'x-meshnet-shape': `1,4,${H}`, 'x-meshnet-dtype': 'f32', 'x-meshnet-sampling': '{"temperature":0}' }, encodeTensor(x, 'f32')));
    expect(res.status).toBe(200);
    const j = jsonOf(res) as { token_id: number; text: string; logprob: number };
    expect(j.token_id).toBe(ref.greedy(ids, 1)[0]);
    expect(j.text).toBe(`<${j.token_id}>`);
    expect(j.logprob).toBeLessThanOrEqual(0);
  });

  it('answers 503 while paused, and /health says so', async () => {
    paused = true;
    try {
      const res = await handle(post({ 'x-meshnet-shape': `1,1,${H}`, 'x-meshnet-dtype': 'f32' }, encodeTensor(activation(1), 'f32')));
      expect(res.status).toBe(503);
      const health = await handle({ method: 'GET', path: '/health', headers: {}, body: new Uint8Array() });
      expect(jsonOf(health)).toMatchObject({ status: 'paused' });
    } finally {
      paused = false;
    }
  });

  it('serves /info with the layer range and drops sessions on DELETE (404 when unknown)', async () => {
    const info = jsonOf(await handle({ method: 'GET', path: '/info', headers: {}, body: new Uint8Array() }));
    expect(info).toMatchObject({ model: 'tiny', start_layer: 1, end_layer: 3, num_layers: 4, hidden_size: H, holds_head: false });
    expect((await handle({ method: 'DELETE', path: '/sessions/s1', headers: {}, body: new Uint8Array() })).status).toBe(204);
    const again = await handle({ method: 'DELETE', path: '/sessions/s1', headers: {}, body: new Uint8Array() });
    expect(again.status).toBe(404);
    expect(jsonOf(again).error?.code).toBe('MESH_ERR_NOT_FOUND');
  });

  it('answers 404 for unknown paths and 405 for wrong methods', async () => {
    expect((await handle({ method: 'GET', path: '/nope', headers: {}, body: new Uint8Array() })).status).toBe(404);
    expect((await handle({ method: 'GET', path: '/forward', headers: {}, body: new Uint8Array() })).status).toBe(405);
  });
});
