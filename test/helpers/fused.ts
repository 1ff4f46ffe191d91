/**
 * Shared by the fused-graph suites (onnxruntime-node here, WebGPU in Node in
 * test/gpu): a reference over the dequantized weights, and a walk of
 * prefill + decode calls checked step by step against the float64 reference.
 */
import { expect } from 'vitest';
import type { WeightSource } from '../../src/model/graph.ts';
import { dequantizeQ4, quantizeQ4 } from '../../src/model/quantize.ts';
import { FUSED_Q4_SCHEME } from '../../src/model/fused-graph.ts';
import { ReferenceModel, newRefCache } from '../../src/model/reference.ts';
import type { ForwardResult } from '../../src/shard/contract.ts';
import { maxAbsDiff, type Fixture } from './shard.ts';

/** Weights as the 4-bit kernel sees them: every projection (and the LM head) quantized then dequantized. */
export function dequantizedWeights(src: WeightSource): WeightSource {
  const cache = new Map<string, { shape: readonly number[]; data: Float32Array }>();
  return (name) => {
    const w = src(name);
    if (!(/_proj\.weight$/.test(name) || name === 'lm_head.weight') || w.shape.length !== 2) return w;
    let d = cache.get(name);
    if (!d) {
      d = { shape: w.shape, data: dequantizeQ4(quantizeQ4(w.data, w.shape[0]!, w.shape[1]!, FUSED_Q4_SCHEME)) };
      cache.set(name, d);
    }
    return d;
  };
}

export interface Runner {
  forward(req: { session?: string; position?: number; tokenIds?: readonly number[]; activation?: { data: Float32Array; shape: readonly number[] }; startLayer?: number; endLayer?: number; sampling?: { temperature?: number } }): Promise<ForwardResult>;
}

/**
 * Feeds `chunks` of token ids through `run` (a whole model: embedding to
 * head) as one session and checks each call's logits against the reference
 * on `weights`, relative to the logits' scale. Returns the worst error.
 */
export async function walkAgainstReference(f: Fixture, weights: WeightSource, run: Runner, chunks: number[][], tol: number, session = 'walk'): Promise<number> {
  const ref = new ReferenceModel(f.cfg, weights);
  const cache = newRefCache(f.cfg);
  const V = f.cfg.vocabSize;
  let position = 0;
  let worst = 0;
  for (const ids of chunks) {
    const want = ref.forward(ids, position, cache).subarray((ids.length - 1) * V);
    const got = await run.forward({ session, position, tokenIds: ids, sampling: { temperature: 0 } });
    if (got.kind !== 'token') throw new Error('expected a token');
    const { err, scale } = maxAbsDiff(got.logits, want);
    worst = Math.max(worst, err / Math.max(1, scale));
    expect(err, `position ${position}`).toBeLessThanOrEqual(tol * Math.max(1, scale));
    let best = 0;
    for (let j = 1; j < V; j++) if (want[j]! > want[best]!) best = j;
    // Greedy agrees unless the reference's top two are closer than the tolerance.
    const sorted = [...want].sort((a, b) => b - a);
    if (sorted[0]! - sorted[1]! > 2 * tol * Math.max(1, scale)) expect(got.tokenId).toBe(best);
    position += ids.length;
  }
  return worst;
}
