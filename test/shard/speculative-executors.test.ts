/**
 * Speculative decoding on every executor kind that runs on a CPU here
 * (test/gpu has WebGPU): a verification step (several rows, the drafts in
 * `draft`) accepts exactly the float64 reference's greedy tokens, the next
 * step's rollback cuts the rejected rows, truncateSession does the same as
 * an operation, and a replay of a verification chunk padded to its width
 * rebuilds a bit-identical cache.
 */
import { describe, expect, it } from 'vitest';
import { createWasmBackend } from '../../src/host/node/onnx-wasm.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { MeshError } from '../../src/protocol/errors.ts';
import type { ForwardRequest, ForwardResult } from '../../src/shard/contract.ts';
import { createSpanExecutor, type SpanGraphs } from '../../src/shard/span-executor.ts';
import type { OnnxBackend } from '../../src/shard/backend.ts';
import { executor, fixture, nodeBackend, prompts } from '../helpers/shard.ts';

const f = fixture('tiny');
const ref = new ReferenceModel(f.cfg, f.weights);
const PROMPT = prompts(f.cfg.vocabSize, 3, 7)[2]!;
const P = PROMPT.length;
/** The reference's greedy continuation. */
const R = ref.greedy(PROMPT, 14);
const wrong = (t: number) => (t + 1) % f.cfg.vocabSize;

interface Exec {
  forward(req: ForwardRequest): Promise<ForwardResult>;
  truncateSession(id: string, length: number): boolean;
  sessionLength(id: string): number;
  release(): Promise<void>;
}

const wasm = createWasmBackend({ numThreads: 1 });
const KINDS: Array<{ name: string; make: () => Promise<Exec> }> = [
  { name: 'plain (onnxruntime-node)', make: () => executor(f, 0, f.cfg.numLayers) },
  ...(
    [
      ['fused f32 (onnxruntime-node, logits on the host)', nodeBackend, { kind: 'fused', projections: 'f32' }],
      ['fused f32 (onnxruntime-web WASM)', wasm, { kind: 'fused', projections: 'f32' }],
    ] as Array<[string, OnnxBackend, SpanGraphs]>
  ).map(([name, backend, graphs]) => ({
    name,
    make: async () => (await createSpanExecutor({ config: f.cfg, backend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, graphs, maxContext: 256, memoryBudgetBytes: 64 * 2 ** 20 })) as unknown as Exec,
  })),
];

async function token(ex: Exec, req: ForwardRequest) {
  const r = await ex.forward({ sampling: {}, ...req });
  if (r.kind !== 'token') throw new Error('expected a token');
  return r;
}

describe.each(KINDS)('speculative decoding on $name', ({ make }) => {
  it('verification steps accept exactly the reference\'s greedy tokens; rollback cuts the rejected rows', async () => {
    const ex = await make();
    try {
      const s = 'spec';
      // The prompt with three drafts, the third wrong: two accepted, the reference's third token after them.
      let r = await token(ex, { session: s, position: 0, tokenIds: [...PROMPT, R[0]!, R[1]!, wrong(R[2]!)], draft: { ids: [R[0]!, R[1]!, wrong(R[2]!)] } });
      expect(r.spec).toMatchObject({ accepted: 2, tokenIds: R.slice(0, 3) });
      expect(r.tokenId).toBe(R[2]);
      expect(ex.sessionLength(s)).toBe(P + 3);
      // All three right, and the bonus token; the rejected row of the last step is cut first.
      r = await token(ex, { session: s, position: P + 2, rollbackFrom: P + 3, tokenIds: [R[2]!, R[3]!, R[4]!, R[5]!], draft: { ids: [R[3]!, R[4]!, R[5]!] } });
      expect(r.spec).toMatchObject({ accepted: 3, tokenIds: R.slice(3, 7) });
      // A plain step after a full acceptance: nothing to cut.
      r = await token(ex, { session: s, position: P + 6, tokenIds: [R[6]!] });
      expect(r.tokenId).toBe(R[7]);
      expect(r.spec).toBeUndefined();
      // Nothing accepted: the one token after the last accepted one.
      r = await token(ex, { session: s, position: P + 7, tokenIds: [R[7]!, wrong(R[8]!)], draft: { ids: [wrong(R[8]!)] } });
      expect(r.spec).toMatchObject({ accepted: 0, tokenIds: [R[8]] });
      r = await token(ex, { session: s, position: P + 8, rollbackFrom: P + 9, tokenIds: [R[8]!] });
      expect(r.tokenId).toBe(R[9]);
      expect(ex.sessionLength(s)).toBe(P + 9);
      // A stale step (it ran at P + 2 long ago): its rollback bound is below what the cache holds: 409, nothing cut.
      await expect(ex.forward({ session: s, position: P + 2, rollbackFrom: P + 3, tokenIds: [R[2]!], sampling: {} })).rejects.toMatchObject({ code: 'MESH_ERR_POSITION_MISMATCH' });
      expect(ex.sessionLength(s)).toBe(P + 9);
      // A step past the cache is a 409 with or without a rollback.
      await expect(ex.forward({ session: s, position: P + 12, rollbackFrom: P + 14, tokenIds: [R[2]!], sampling: {} })).rejects.toMatchObject({ code: 'MESH_ERR_POSITION_MISMATCH' });
      // The same verification step twice (a retry): idempotent, the same answer.
      const again = { session: s, position: P + 9, rollbackFrom: P + 12, tokenIds: [R[9]!, R[10]!, R[11]!], draft: { ids: [R[10]!, R[11]!] } };
      const a = await token(ex, again);
      const b = await token(ex, again);
      expect(a.spec).toEqual(b.spec);
      expect(a.spec!.tokenIds).toEqual(R.slice(10, 13));
    } finally {
      await ex.release();
    }
  });

  it('truncateSession cuts every layer back: the next step runs there, the old position is a 409', async () => {
    const ex = await make();
    try {
      await token(ex, { session: 't', position: 0, tokenIds: [...PROMPT, ...R.slice(0, 6)] });
      expect(ex.truncateSession('t', P + 3)).toBe(true);
      expect(ex.sessionLength('t')).toBe(P + 3);
      expect((await token(ex, { session: 't', position: P + 3, tokenIds: [R[3]!] })).tokenId).toBe(R[4]);
      await expect(ex.forward({ session: 't', position: P + 6, tokenIds: [R[6]!] })).rejects.toBeInstanceOf(MeshError);
      // Never longer, never negative; an unknown session is false.
      expect(ex.truncateSession('t', P + 50)).toBe(true);
      expect(ex.sessionLength('t')).toBe(P + 4);
      expect(ex.truncateSession('t', -1)).toBe(false);
      expect(ex.truncateSession('nobody', 0)).toBe(false);
    } finally {
      await ex.release();
    }
  });

  it('a replay of a verification chunk padded to its width (copies of its last kept row) rebuilds the cache bit for bit', async () => {
    const ex = await make();
    try {
      // As run: the prompt with drafts [R0, R1, x, x], two kept; then a step at P + 2.
      await token(ex, { session: 'a', position: 0, tokenIds: [...PROMPT, R[0]!, R[1]!, wrong(R[2]!), 7], draft: { ids: [R[0]!, R[1]!, wrong(R[2]!), 7] } });
      const ran = await token(ex, { session: 'a', position: P + 2, rollbackFrom: P + 4, tokenIds: [R[2]!], sampling: { temperature: 0 } });
      // Replayed: the kept rows padded to the same width with the last kept one, then the same step.
      await token(ex, { session: 'b', position: 0, tokenIds: [...PROMPT, R[0]!, R[1]!, R[1]!, R[1]!] });
      const replayed = await token(ex, { session: 'b', position: P + 2, rollbackFrom: P + 4, tokenIds: [R[2]!], sampling: { temperature: 0 } });
      expect(replayed.logprob).toBe(ran.logprob);
      if (ran.logits.length > 0) expect(Buffer.from(replayed.logits.buffer, replayed.logits.byteOffset, replayed.logits.byteLength).equals(Buffer.from(ran.logits.buffer, ran.logits.byteOffset, ran.logits.byteLength))).toBe(true);
    } finally {
      await ex.release();
    }
  });

  it('refuses a bad draft with 400 before running anything', async () => {
    const ex = await make();
    try {
      // Two drafts judge three rows: a two-row step cannot carry them.
      await expect(ex.forward({ session: 'x', position: 0, tokenIds: [5, 6], draft: { ids: [5, 6] } })).rejects.toMatchObject({ code: 'MESH_ERR_BAD_REQUEST' });
      await expect(ex.forward({ session: 'x', position: 0, tokenIds: [...PROMPT, 5], draft: { ids: [f.cfg.vocabSize] } })).rejects.toMatchObject({ code: 'MESH_ERR_BAD_REQUEST' });
      expect(ex.sessionLength('x')).toBe(0);
    } finally {
      await ex.release();
    }
  });
});

describe('speculative decoding across a split (activations in, as a hop gets them)', () => {
  it('a hop\'s replay of a padded verification chunk is bit-identical, and its verification matches the head\'s', async () => {
    const head = await executor(f, 0, 2);
    const tail = await executor(f, 2, f.cfg.numLayers);
    try {
      const rows = async (s: string, position: number, ids: number[], rollbackFrom?: number) => {
        const r = await head.forward({ session: s, position, tokenIds: ids, ...(rollbackFrom ? { rollbackFrom } : {}) });
        if (r.kind !== 'activation') throw new Error('expected an activation');
        return r;
      };
      const h = f.cfg.hiddenSize;
      const step1 = await rows('a', 0, [...PROMPT, R[0]!, wrong(R[1]!)]);
      const v = await tail.forward({ session: 'a', position: 0, activation: step1, draft: { ids: [R[0]!, wrong(R[1]!)] }, sampling: {} });
      expect(v.kind === 'token' && v.spec).toMatchObject({ accepted: 1, tokenIds: [R[0], R[1]] });
      const step2 = await rows('a', P + 1, [R[1]!], P + 2);
      const ran = await tail.forward({ session: 'a', position: P + 1, rollbackFrom: P + 2, activation: step2, sampling: {} });
      // The hop's history keeps the accepted rows only; the replay pads the chunk with its last kept row.
      const kept = step1.data.subarray(0, (P + 1) * h);
      const padded = new Float32Array((P + 2) * h);
      padded.set(kept);
      padded.set(kept.subarray(P * h), (P + 1) * h);
      await tail.forward({ session: 'b', position: 0, activation: { data: padded, shape: [1, P + 2, h] }, sampling: {} });
      const replayed = await tail.forward({ session: 'b', position: P + 1, rollbackFrom: P + 2, activation: step2, sampling: {} });
      if (ran.kind !== 'token' || replayed.kind !== 'token') throw new Error('expected tokens');
      expect(ran.tokenId).toBe(R[2]);
      expect(Buffer.from(replayed.logits.buffer).equals(Buffer.from(ran.logits.buffer))).toBe(true);
    } finally {
      await head.release();
      await tail.release();
    }
  });
});

describe('batched steps with rollbacks (one row each)', () => {
  for (const batchLayout of ['padded', 'packed'] as const) {
    it(`${batchLayout}: sessions cut back in one batch give the reference's tokens`, async () => {
      const ex = await executor(f, 0, f.cfg.numLayers, { batchLayout });
      try {
        const ps = prompts(f.cfg.vocabSize, 4, 11);
        const refs = ps.map((p) => ref.greedy(p, 4));
        // Each session verifies two drafts, the second wrong: one accepted, the cache one row long.
        const firsts = await Promise.all(ps.map((p, i) => token(ex, { session: `b${i}`, position: 0, tokenIds: [...p, refs[i]![0]!, wrong(refs[i]![1]!)], draft: { ids: [refs[i]![0]!, wrong(refs[i]![1]!)] } })));
        firsts.forEach((r, i) => expect(r.spec!.tokenIds).toEqual(refs[i]!.slice(0, 2)));
        const before = ex.batchStats().sizes.slice();
        // One-row steps with a rollback, submitted in one tick: one batch.
        const next = await Promise.all(ps.map((p, i) => token(ex, { session: `b${i}`, position: p.length + 1, rollbackFrom: p.length + 2, tokenIds: [refs[i]![1]!] })));
        next.forEach((r, i) => expect(r.tokenId).toBe(refs[i]![2]));
        expect(ex.batchStats().sizes[4]! - (before[4] ?? 0)).toBe(1);
      } finally {
        await ex.release();
      }
    });
  }

  // Fused graphs cannot: onnxruntime's GroupQueryAttention refuses a batch of several rows over a past
  // ("batch_size must be 1 when sequence_length > 1 and past context is given"), so a fused verification runs alone.
  it('plain: sessions with different k share one batch (one-row steps beside verifications), each exact', async () => {
    const ex = await executor(f, 0, f.cfg.numLayers);
    try {
      const ps = prompts(f.cfg.vocabSize, 4, 13);
      const refs = ps.map((p) => ref.greedy(p, 8));
      // Prompts first (alone), then one batch: k = 0, 2 (one wrong), 4 (all right), 1 (wrong).
      await Promise.all(ps.map((p, i) => token(ex, { session: `k${i}`, position: 0, tokenIds: p })));
      const before = ex.batchStats().sizes.slice();
      const steps: ForwardRequest[] = [
        { tokenIds: [refs[0]![0]!] },
        { tokenIds: [refs[1]![0]!, refs[1]![1]!, wrong(refs[1]![2]!)], draft: { ids: [refs[1]![1]!, wrong(refs[1]![2]!)] } },
        { tokenIds: refs[2]!.slice(0, 5), draft: { ids: refs[2]!.slice(1, 5) } },
        { tokenIds: [refs[3]![0]!, wrong(refs[3]![1]!)], draft: { ids: [wrong(refs[3]![1]!)] } },
      ];
      const got = await Promise.all(steps.map((st, i) => token(ex, { session: `k${i}`, position: ps[i]!.length, ...st })));
      expect(ex.batchStats().sizes[4]! - (before[4] ?? 0)).toBe(1);
      expect(got[0]!.tokenId).toBe(refs[0]![1]);
      expect(got[1]!.spec).toMatchObject({ accepted: 1, tokenIds: refs[1]!.slice(1, 3) });
      expect(got[2]!.spec).toMatchObject({ accepted: 4, tokenIds: refs[2]!.slice(1, 6) });
      expect(got[3]!.spec).toMatchObject({ accepted: 0, tokenIds: [refs[3]![1]] });
      // And on: each session cut back where its verification stopped, in one more batch.
      const kept = [1, 2, 5, 1];
      const next = await Promise.all(ps.map((p, i) => token(ex, { session: `k${i}`, position: p.length + kept[i]!, rollbackFrom: p.length + steps[i]!.tokenIds!.length, tokenIds: [refs[i]![kept[i]!]!] })));
      next.forEach((r, i) => expect(r.tokenId).toBe(refs[i]![kept[i]! + 1]));
    } finally {
      await ex.release();
    }
  });

  it('fused (onnxruntime-node): the same', async () => {
    const ex = (await createSpanExecutor({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, graphs: { kind: 'fused', projections: 'f32' }, maxContext: 256, memoryBudgetBytes: 64 * 2 ** 20 })) as unknown as Exec & { batchStats(): { sizes: number[] } };
    try {
      const ps = prompts(f.cfg.vocabSize, 4, 11);
      const refs = ps.map((p) => ref.greedy(p, 4));
      await Promise.all(ps.map((p, i) => token(ex, { session: `b${i}`, position: 0, tokenIds: [...p, refs[i]![0]!, wrong(refs[i]![1]!)], draft: { ids: [refs[i]![0]!, wrong(refs[i]![1]!)] } })));
      const before = ex.batchStats().sizes.slice();
      const next = await Promise.all(ps.map((p, i) => token(ex, { session: `b${i}`, position: p.length + 1, rollbackFrom: p.length + 2, tokenIds: [refs[i]![1]!] })));
      next.forEach((r, i) => expect(r.tokenId).toBe(refs[i]![2]));
      expect(ex.batchStats().sizes[4]! - (before[4] ?? 0)).toBe(1);
    } finally {
      await ex.release();
    }
  });
});
