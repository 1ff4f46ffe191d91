/**
 * Batching at a hop (issue 11): one-token steps of sessions at different
 * positions, queued together, run as one batch, and each session gets what
 * it gets alone — the same greedy tokens, logits within f32 tolerance of the
 * float64 reference — on onnxruntime-node and onnxruntime-web's WASM backend,
 * through a two-hop split (activation out of the first hop, token out of the
 * last). A malformed member fails alone.
 */
import { describe, expect, it } from 'vitest';
import { createWasmBackend } from '../../src/host/node/onnx-wasm.ts';
import { ReferenceModel, newRefCache, type RefKvCache } from '../../src/model/reference.ts';
import type { MeshError } from '../../src/protocol/errors.ts';
import type { OnnxBackend } from '../../src/shard/backend.ts';
import type { ForwardResult, ShardExecutor } from '../../src/shard/executor.ts';
import { batchLayout } from '../../src/shard/packed-batch.ts';
import { executor, fixture, maxAbsDiff, nodeBackend, prompts } from '../helpers/shard.ts';

const F32_TOL = 1e-4;
const f = fixture('tiny');
const V = f.cfg.vocabSize;
const h = f.cfg.hiddenSize;
const SPLIT = 2;

function expectClose(got: ArrayLike<number>, want: ArrayLike<number>, what: string): void {
  const { err, scale } = maxAbsDiff(got, want);
  expect(err, `${what}: max abs error ${err} vs scale ${scale}`).toBeLessThanOrEqual(F32_TOL * scale);
}

function token(r: ForwardResult): Extract<ForwardResult, { kind: 'token' }> {
  if (r.kind !== 'token') throw new Error('expected a token');
  return r;
}

function activation(r: ForwardResult): Extract<ForwardResult, { kind: 'activation' }> {
  if (r.kind !== 'activation') throw new Error('expected an activation');
  return r;
}

/** Two hops of the tiny model: [0, SPLIT) with the embedding, [SPLIT, N) with the head. */
async function twoHops(backend: OnnxBackend, maxBatch: number): Promise<[ShardExecutor, ShardExecutor]> {
  return [await executor(f, 0, SPLIT, { backend, maxBatch }), await executor(f, SPLIT, f.cfg.numLayers, { backend, maxBatch })];
}

/** One step of `session` through both hops. */
async function step(hops: [ShardExecutor, ShardExecutor], session: string, position: number, ids: number[]): Promise<Extract<ForwardResult, { kind: 'token' }>> {
  const a = activation(await hops[0].forward({ session, position, tokenIds: ids }));
  return token(await hops[1].forward({ session, position, activation: { data: a.data, shape: a.shape } }));
}

/**
 * Prompts of different lengths, prefilled one by one, then `steps` decode
 * steps with every session's step submitted at once (so all but the first
 * queue and run as one batch per hop). Every step is checked against the
 * float64 reference; returns each session's greedy tokens.
 */
async function decodeTogether(hops: [ShardExecutor, ShardExecutor], sessions: number, steps: number, prefix = 's', ps = prompts(V, sessions, 7)): Promise<number[][]> {
  const ref = new ReferenceModel(f.cfg, f.weights);
  const caches: RefKvCache[] = ps.map(() => newRefCache(f.cfg));
  const tokens: number[][] = ps.map(() => []);
  const pos = ps.map((p) => p.length);
  for (let s = 0; s < sessions; s++) {
    const r = await step(hops, `${prefix}${s}`, 0, ps[s]!);
    expectClose(r.logits, ref.forward(ps[s]!, 0, caches[s]!).subarray((ps[s]!.length - 1) * V), `prefill ${s}`);
    tokens[s]!.push(r.tokenId);
  }
  for (let t = 0; t < steps; t++) {
    // Hop 1 for everyone at once, then hop 2 for everyone at once: both hops see a queue.
    const acts = await Promise.all(tokens.map((tk, s) => hops[0].forward({ session: `${prefix}${s}`, position: pos[s]!, tokenIds: [tk.at(-1)!] })));
    const outs = await Promise.all(acts.map((a, s) => hops[1].forward({ session: `${prefix}${s}`, position: pos[s]!, activation: { data: activation(a).data, shape: [1, 1, h] } })));
    outs.forEach((o, s) => {
      const r = token(o);
      expectClose(r.logits, ref.forward([tokens[s]!.at(-1)!], pos[s]!, caches[s]!), `session ${s} step ${t}`);
      tokens[s]!.push(r.tokenId);
      pos[s]!++;
    });
  }
  return tokens;
}

const backends: Array<[string, () => OnnxBackend]> = [
  ['onnxruntime-node', () => nodeBackend],
  ['onnxruntime-web wasm', () => createWasmBackend({ numThreads: 1 })],
];

describe.each(backends)('batched decode steps on %s', (_name, backend) => {
  it('gives each session at its own position the tokens it gets alone', async () => {
    const sessions = 6;
    const steps = 5;
    const batched = await twoHops(backend(), 16);
    const alone = await twoHops(backend(), 1);
    const got = await decodeTogether(batched, sessions, steps);
    const want = await decodeTogether(alone, sessions, steps);
    expect(got).toEqual(want);
    // The batches really formed: per step, every session's request (submitted in one tick) in one run.
    for (const ex of batched) {
      const st = ex.batchStats();
      expect(st.sizes[sessions]).toBe(steps);
      expect(st.requests).toBe(sessions + steps * sessions);
    }
    for (const ex of alone) expect(ex.batchStats()).toMatchObject({ maxBatch: 1, batches: sessions + steps * sessions });
    await Promise.all([...batched, ...alone].map((e) => e.release()));
  });

  it('runs even pasts padded and one long past packed, each session as alone', async () => {
    // packed-batch.ts picks a layout per batch: pasts padded to the longest along the batch axis, or packed one after
    // another along the sequence when one past dwarfs the rest. Both must give every session its lone tokens and logits.
    const steps = 4;
    const lens = { padded: [9, 11, 10, 12, 9, 10], packed: [60, 2, 3, 2, 2, 3] };
    for (const [layout, ls] of Object.entries(lens)) {
      const ps = ls.map((n, s) => Array.from({ length: n }, (_, k) => 3 + ((k * 13 + s * 7) % (V - 3))));
      for (const at of [ls, ls.map((n) => n + steps - 1)]) expect(batchLayout(at), `layout at ${at.join(',')}`).toBe(layout);
      const batched = await twoHops(backend(), 16);
      const alone = await twoHops(backend(), 1);
      const got = await decodeTogether(batched, ls.length, steps, layout, ps);
      expect(got).toEqual(await decodeTogether(alone, ls.length, steps, layout, ps));
      for (const ex of batched) expect(ex.batchStats().sizes[ls.length]).toBe(steps);
      await Promise.all([...batched, ...alone].map((e) => e.release()));
    }
  });

  it('reuses its packed input buffers across batches that grow and shrink', async () => {
    // The executor keeps the packed pasts and mask between steps (batch-scratch.ts): a batch after a larger one reads
    // a buffer whose tail holds the larger batch's rows, and one after a smaller one grows it. Each must still equal alone.
    const batched = await twoHops(backend(), 16);
    const alone = await twoHops(backend(), 1);
    const want6 = await decodeTogether(alone, 6, 4, 'a');
    const want2 = await decodeTogether(alone, 2, 4, 'b');
    expect(await decodeTogether(batched, 6, 4, 'a')).toEqual(want6);
    expect(await decodeTogether(batched, 2, 4, 'b')).toEqual(want2);
    expect(await decodeTogether(batched, 6, 4, 'c')).toEqual(want6);
    for (const ex of batched) expect(ex.batchStats().sizes[2]).toBe(4);
    await Promise.all([...batched, ...alone].map((e) => e.release()));
  });
});

describe('a batch with malformed members', () => {
  it('fails each bad session alone and serves the rest exactly', async () => {
    const [h1, h2] = await twoHops(nodeBackend, 16);
    const ref = new ReferenceModel(f.cfg, f.weights);
    const ps = prompts(V, 3, 3);
    const caches = ps.map(() => newRefCache(f.cfg));
    const last: number[] = [];
    for (let s = 0; s < 3; s++) {
      const r = await step([h1, h2], `g${s}`, 0, ps[s]!);
      ref.forward(ps[s]!, 0, caches[s]!);
      last.push(r.tokenId);
    }
    const acts = await Promise.all(last.map((t, s) => h1.forward({ session: `g${s}`, position: ps[s]!.length, tokenIds: [t] }).then(activation)));
    const nan = new Float32Array(h).fill(0.5);
    nan[3] = NaN;
    const settled = await Promise.allSettled([
      h2.forward({ session: 'g0', position: ps[0]!.length, activation: { data: acts[0]!.data, shape: [1, 1, h] } }),
      h2.forward({ session: 'g1', position: ps[1]!.length + 5, activation: { data: acts[1]!.data, shape: [1, 1, h] } }), // wrong position
      h2.forward({ session: 'bad-nan', position: 0, activation: { data: nan, shape: [1, 1, h] } }),
      h2.forward({ session: 'bad-shape', position: 0, activation: { data: new Float32Array(h - 1), shape: [1, 1, h] } }),
      h2.forward({ session: 'unknown', position: 4, activation: { data: acts[2]!.data, shape: [1, 1, h] } }), // never opened
      h2.forward({ session: 'g2', position: ps[2]!.length, activation: { data: acts[2]!.data, shape: [1, 1, h] } }),
    ]);
    const code = (r: PromiseSettledResult<unknown>) => (r.status === 'rejected' ? (r.reason as MeshError).code : 'ok');
    expect(settled.map(code)).toEqual(['ok', 'MESH_ERR_POSITION_MISMATCH', 'MESH_ERR_NON_FINITE', 'MESH_ERR_BAD_SHAPE', 'MESH_ERR_POSITION_MISMATCH', 'ok']);
    expect(h2.batchStats().sizes[6]).toBe(1); // all six ran as one batch
    for (const [i, s] of [
      [0, 0],
      [5, 2],
    ] as const) {
      const r = token((settled[i] as PromiseFulfilledResult<ForwardResult>).value);
      expectClose(r.logits, ref.forward([last[s]!], ps[s]!.length, caches[s]!), `session g${s}`);
    }
    // The failed session lost nothing: it goes on at its true position.
    expect(h2.sessionLength('g1')).toBe(ps[1]!.length);
    const r1 = token(await h2.forward({ session: 'g1', position: ps[1]!.length, activation: { data: acts[1]!.data, shape: [1, 1, h] } }));
    expectClose(r1.logits, ref.forward([last[1]!], ps[1]!.length, caches[1]!), 'session g1 after its failure');
    expect(h2.kvStats().sessions).toBe(3); // no KV left behind by the refused members
    await Promise.all([h1.release(), h2.release()]);
  });

  it('never puts two steps of one session in a batch, and keeps a session in order', async () => {
    const ex = await executor(f, 0, f.cfg.numLayers, { maxBatch: 16 });
    const ref = new ReferenceModel(f.cfg, f.weights);
    const cache = newRefCache(f.cfg);
    await ex.forward({ session: 'x', position: 0, tokenIds: [5, 6, 7] });
    ref.forward([5, 6, 7], 0, cache);
    const [a, b, c] = await Promise.all([
      ex.forward({ session: 'y', position: 0, tokenIds: [9] }),
      ex.forward({ session: 'x', position: 3, tokenIds: [8] }),
      ex.forward({ session: 'x', position: 4, tokenIds: [10] }),
    ]);
    expect([a, b, c].map((r) => r.kind)).toEqual(['token', 'token', 'token']);
    expectClose(token(b).logits, ref.forward([8], 3, cache), 'x at 3');
    expectClose(token(c).logits, ref.forward([10], 4, cache), 'x at 4');
    await ex.release();
  });
});

describe('requests that join a running batch', () => {
  /**
   * onnxruntime-node under a hook: the first run of a graph with `rows` rows (the batch's first
   * layer) after `arm()` calls `onBatch` before it computes, so requests submitted there are queued
   * while the batch runs — what happens at a hop when a chat's step arrives just after a convoy's started.
   */
  function hooked(rows: number, onBatch: () => void): OnnxBackend & { arm(): void } {
    let fired = true;
    return {
      arm: () => (fired = false),
      name: 'hooked onnxruntime-node',
      async createSession(model, options) {
        const s = await nodeBackend.createSession(model, options);
        return {
          ...s,
          inputNames: s.inputNames,
          outputNames: s.outputNames,
          run(feeds) {
            const hidden = feeds['hidden_states'];
            if (!fired && hidden && hidden.data.length === rows * h) {
              fired = true;
              onBatch();
            }
            return s.run(feeds);
          },
        };
      },
    };
  }

  it('catch up on the layers they missed and get what they get alone; a bad one fails alone', async () => {
    const ref = new ReferenceModel(f.cfg, f.weights);
    const ps = prompts(V, 8, 5);
    const caches = ps.map(() => newRefCache(f.cfg));
    // Settled as they are made: a joiner that fails does so while the batch runs.
    let late: Promise<Array<PromiseSettledResult<ForwardResult>>> = Promise.resolve([]);
    const next: number[] = [];
    // One graph per layer (the default): a batch has layer boundaries to be joined at.
    const backend = hooked(5, () => {
        late = Promise.allSettled([
          ...[5, 6, 7].map((s) => ex.forward({ session: `j${s}`, position: ps[s]!.length, tokenIds: [next[s]!] })),
          ex.forward({ session: 'j0', position: ps[0]!.length + 1, tokenIds: [9] }), // j0's next step: after its own, never in its batch
          ex.forward({ session: 'j1', position: ps[1]!.length + 7, tokenIds: [9] }), // wrong position: queued behind j1's real step
          ex.forward({ session: 'nobody', position: 3, tokenIds: [9] }), // never opened: joins, fails alone
        ]);
    });
    const ex = await executor(f, 0, f.cfg.numLayers, { maxBatch: 16, backend });
    for (let s = 0; s < 8; s++) {
      const r = token(await ex.forward({ session: `j${s}`, position: 0, tokenIds: ps[s]! }));
      ref.forward(ps[s]!, 0, caches[s]!);
      next.push(r.tokenId);
    }
    backend.arm();
    const batch = await Promise.all([0, 1, 2, 3, 4].map((s) => ex.forward({ session: `j${s}`, position: ps[s]!.length, tokenIds: [next[s]!] })));
    const settled = await late;
    const code = (r: PromiseSettledResult<unknown>) => (r.status === 'rejected' ? (r.reason as MeshError).code : 'ok');
    expect(settled.map(code)).toEqual(['ok', 'ok', 'ok', 'ok', 'MESH_ERR_POSITION_MISMATCH', 'MESH_ERR_POSITION_MISMATCH']);
    const st = ex.batchStats();
    expect(st.sizes[5]).toBe(1); // the batch started with five…
    expect(st.joined).toBe(4); // …and j5, j6, j7 and the unknown session joined it (j0's and j1's next steps did not)
    expect(st.requests).toBe(st.sizes.reduce((n, runs, size) => n + runs * size, 0));
    for (let s = 0; s < 8; s++) {
      const r = token(s < 5 ? batch[s]! : (settled[s - 5] as PromiseFulfilledResult<ForwardResult>).value);
      expectClose(r.logits, ref.forward([next[s]!], ps[s]!.length, caches[s]!), `session j${s}`);
    }
    expectClose(token((settled[3] as PromiseFulfilledResult<ForwardResult>).value).logits, ref.forward([9], ps[0]!.length + 1, caches[0]!), 'j0 after its step');
    for (let s = 0; s < 8; s++) expect(ex.sessionLength(`j${s}`)).toBe(ps[s]!.length + (s === 0 ? 2 : 1));
    expect(ex.kvStats().sessions).toBe(8);
    await ex.release();
  });

  it('gives joined sessions the greedy tokens they get alone, step after step', async () => {
    // Sessions 0-4 step together; 5-7 are always submitted once that batch is running, so they join it every step.
    const ps = prompts(V, 8, 9);
    const steps = 4;
    const run = async (maxBatch: number): Promise<{ tokens: number[][]; joined: number }> => {
      const tokens: number[][] = ps.map(() => []);
      const pos = ps.map((p) => p.length);
      let late: () => Array<Promise<ForwardResult>> = () => [];
      let pending: Array<Promise<ForwardResult>> = [];
      let armed = false;
      const ex = await executor(f, 0, f.cfg.numLayers, {
        maxBatch,
        backend: {
          name: 'hooked',
          async createSession(model, options) {
            const s = await nodeBackend.createSession(model, options);
            return { ...s, inputNames: s.inputNames, outputNames: s.outputNames, run: (feeds) => {
              if (armed) {
                armed = false;
                pending = late();
              }
              return s.run(feeds);
            } };
          },
        },
      });
      for (let s = 0; s < 8; s++) tokens[s]!.push(token(await ex.forward({ session: `t${s}`, position: 0, tokenIds: ps[s]! })).tokenId);
      for (let t = 0; t < steps; t++) {
        late = () => [5, 6, 7].map((s) => ex.forward({ session: `t${s}`, position: pos[s]!, tokenIds: [tokens[s]!.at(-1)!] }));
        armed = true;
        const first = await Promise.all([0, 1, 2, 3, 4].map((s) => ex.forward({ session: `t${s}`, position: pos[s]!, tokenIds: [tokens[s]!.at(-1)!] })));
        const rest = await Promise.all(pending);
        [...first, ...rest].forEach((r, s) => {
          tokens[s]!.push(token(r).tokenId);
          pos[s]!++;
        });
      }
      const joined = ex.batchStats().joined;
      await ex.release();
      return { tokens, joined };
    };
    const batched = await run(16);
    const alone = await run(1);
    expect(batched.joined).toBe(3 * steps);
    expect(alone.joined).toBe(0);
    expect(batched.tokens).toEqual(alone.tokens);
  });
});
