/**
 * Graph capture for decode steps (capture-lane.ts) on WebGPU in Node (Dawn
 * over SwiftShader, correctness only): several sessions interleaved, each
 * prefilled uncaptured, then decoded through the captured graph with the
 * greedy token fed back, every token and logit checked against the float64
 * reference; KV growth, an uncaptured chunk in the middle of captured steps,
 * and a session dropped while the lane holds it. That decode steps replay is
 * counted from onnxruntime's own log: a replayed step dispatches no layer
 * program. Bytes per step are measured.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ortLog } from '../helpers/ort-log-tap.ts';
import type { OnnxBackend } from '../../src/shard/backend.ts';
import type { FusedShardExecutor } from '../../src/shard/fused-executor.ts';
import type { WeightSource } from '../../src/model/graph.ts';
import { ReferenceModel, newRefCache } from '../../src/model/reference.ts';
import { dequantizedWeights } from '../helpers/fused.ts';
import { fixture, maxAbsDiff } from '../helpers/shard.ts';
import { sharedWebGpu } from '../helpers/webgpu-backend.ts';


const { FusedShardExecutor: Fused } = await import('../../src/shard/fused-executor.ts');

const TOL = 1e-4;
const f = fixture('tiny');
const V = f.cfg.vocabSize;

let counting: OnnxBackend;

beforeAll(async () => {
  counting = (await sharedWebGpu()).backend;
}, 600_000);

afterAll(() => {
  ortLog.tapping = false;
});

function argmax(a: ArrayLike<number>): number {
  let best = 0;
  for (let j = 1; j < a.length; j++) if (a[j]! > a[best]!) best = j;
  return best;
}

/** One chat: the executor's session and the float64 reference's, advanced together. */
class Chat {
  readonly cache = newRefCache(f.cfg);
  position = 0;
  next = 0;
  constructor(
    readonly id: string,
    private readonly ref: ReferenceModel,
  ) {}

  /** Runs `ids` (uncaptured when more than one) or the last greedy token, and checks logits and token. */
  async run(ex: FusedShardExecutor, ids: number[] = [this.next]): Promise<void> {
    const want = this.ref.forward(ids, this.position, this.cache).subarray((ids.length - 1) * V);
    const got = await ex.forward({ session: this.id, position: this.position, tokenIds: ids, sampling: { temperature: 0 } });
    if (got.kind !== 'token') throw new Error('expected a token');
    const { err, scale } = maxAbsDiff(got.logits, want);
    expect(err, `${this.id} at ${this.position}`).toBeLessThanOrEqual(TOL * Math.max(1, scale));
    expect(got.tokenId, `${this.id} at ${this.position}`).toBe(argmax(want));
    this.position += ids.length;
    this.next = got.tokenId;
  }
}

async function interleaved(ex: FusedShardExecutor, weights: WeightSource, steps: number): Promise<void> {
  const ref = new ReferenceModel(f.cfg, weights);
  const chats = [new Chat('a', ref), new Chat('b', ref), new Chat('c', ref)];
  await chats[0]!.run(ex, [5, 9, 33, 100, 7]);
  await chats[1]!.run(ex, [44, 12, 13]);
  await chats[2]!.run(ex, [200, 3, 3, 8, 9, 10, 11]);
  for (let step = 0; step < steps; step++) {
    for (const c of chats) await c.run(ex);
    // In the middle, an uncaptured chunk for the chat the lane holds: its rows must come back first.
    if (step === Math.floor(steps / 2)) await chats[2]!.run(ex, [17, 18, 19]);
  }
  // Steps queued together run as one uncaptured batch (fused-batch.ts): the lane's owner takes its rows back first.
  await Promise.all(chats.map((c) => c.run(ex)));
  for (const c of chats) await c.run(ex);
  // A chat dropped while the lane holds it; the next takes the lane without copying into freed buffers.
  expect(ex.dropSession('c')).toBe(true);
  for (const c of chats.slice(0, 2)) await c.run(ex);
}

describe('graph capture for decode steps (WebGPU in Node, SwiftShader)', () => {
  it('f32: three interleaved sessions, prefill then 12 captured steps each, tokens and logits equal the reference; KV grows while the lane holds rows', async () => {
    // Blocks of 8: every chat outgrows its first block during the captured steps (the third its second too).
    const ex = await Fused.create({ config: f.cfg, backend: counting, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 96, returnLogits: true, graphCapture: true, kvBlockTokens: 8 });
    try {
      await interleaved(ex, f.weights, 12);
      const stats = ex.captureStats()!;
      // Every one-token step ran captured except those that ran in a batch.
      const sizes = ex.batchStats().sizes;
      const batched = sizes.reduce((sum, runs, n) => sum + (n >= 2 ? n * runs : 0), 0);
      expect(batched).toBeGreaterThanOrEqual(2);
      expect(stats.steps).toBe(3 * 12 + 3 + 3 + 2 - batched);
      // Every captured step changed hands (three chats in turn).
      expect(ex.kvStats().reservedBytes).toBeGreaterThan(0);
    } finally {
      await ex.release();
    }
  }, 900_000);

  it('the graph recorded at position 0 (a one-token first call) serves later positions, past 64, and other sessions', async () => {
    const ex = await Fused.create({ config: f.cfg, backend: counting, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 160, returnLogits: true, graphCapture: true });
    try {
      const ref = new ReferenceModel(f.cfg, f.weights);
      const first = new Chat('first', ref);
      await first.run(ex, [7]); // captured at position 0: the graph is recorded here
      for (let i = 0; i < 10; i++) await first.run(ex);
      // Past 64 positions (more attention tiles than when the graph was recorded at position 0).
      const other = new Chat('other', ref);
      await other.run(ex, Array.from({ length: 70 }, (_, i) => 3 + ((i * 41) % 500)));
      for (let i = 0; i < 10; i++) {
        await other.run(ex);
        await first.run(ex);
      }
      expect(ex.captureStats()!.steps).toBe(31);
    } finally {
      await ex.release();
    }
  }, 900_000);

  it('4-bit over two segments: captured steps equal the reference on the dequantized weights; a replayed step dispatches no layer program and moves 28 bytes', async () => {
    const ex = await Fused.create({ config: f.cfg, backend: counting, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'q4', maxContext: 96, returnLogits: true, graphCapture: true, segmentBoundaries: [2] });
    try {
      const weights = dequantizedWeights(f.weights);
      // Four steps: the long captured run (KV growth, the lane changing hands) is the f32 test's; this one needs the
      // lane's hand-overs, the uncaptured chunk, the batch and the drop on 4-bit segments.
      await interleaved(ex, weights, 4);
      // One more session's steady state: prefill, two steps (the first records), then count one.
      const chat = new Chat('d', new ReferenceModel(f.cfg, weights));
      const count = () => ortLog.lines.filter((l) => l.includes('Starting program')).length;
      ortLog.lines.length = 0;
      ortLog.tapping = true;
      await chat.run(ex, [1, 2, 3, 4]);
      ortLog.tapping = false;
      // The uncaptured prefill dispatches the layers' programs one by one (the log does show them).
      const prefillPrograms = count();
      expect(prefillPrograms).toBeGreaterThan(4 * f.cfg.numLayers);
      await chat.run(ex);
      await chat.run(ex);
      ex.returnLogits = false;
      const before = ex.transferStats();
      ortLog.lines.length = 0;
      ortLog.tapping = true;
      const want = new ReferenceModel(f.cfg, weights);
      const r = await ex.forward({ session: 'd', position: chat.position, tokenIds: [chat.next], sampling: { temperature: 0 } });
      ortLog.tapping = false;
      const after = ex.transferStats();
      if (r.kind !== 'token') throw new Error('expected a token');
      expect(r.tokenId).toBe(argmax(want.forward([chat.next], chat.position, chat.cache)));
      const programs = ortLog.lines.filter((l) => l.includes('Starting program')).map((l) => /Starting program "([A-Za-z0-9]+)/.exec(l)?.[1] ?? '?');
      // Only the embedding's Gather and the head's programs run one by one; the layers replay.
      const outside = ['Gather', 'Gather', 'LayerNorm', 'MatMul', 'ArgMax', 'ReduceMax', 'ReduceLogSumExp', 'Sub'];
      console.log(`programs dispatched: uncaptured 4-token prefill ${prefillPrograms}, captured decode step ${programs.length} (${programs.join(' ')})`);
      expect(programs.length, programs.join(' ')).toBeLessThanOrEqual(outside.length);
      for (const p of programs) expect(p).toMatch(/^(Gather|LayerNorm|SkipLayerNorm|MatMul|MatMulNBits|ArgMax|Reduce|Sub|Transpose)/);
      // In: the token id (8) and the two counters (4 + 4); out: the token and its log-probability.
      console.log(`bytes per captured greedy decode step: up ${after.up - before.up}, down ${after.down - before.down}`);
      expect(after.up - before.up).toBe(16);
      expect(after.down - before.down).toBe(12);
    } finally {
      await ex.release();
    }
  }, 900_000);
});
