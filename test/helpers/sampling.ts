/**
 * The sampling sweep shared by the CPU and WebGPU tests of the device
 * sampler: for one row of logits, every (temperature, seed, top_k, top_p)
 * combination decided from the sampler graph's candidates must be the token
 * sampling.ts draws over the full logits. sampleToken sorts the whole
 * vocabulary per call (~150k ids); the sweep sorts once per row, cuts
 * sampling.ts's own nucleus on that order once per (temperature, top_k,
 * top_p) and draws each seed from it with drawFromNucleus (drawFromSorted's
 * two halves: what sampleToken does), and checks that shortcut against
 * sampleToken itself on a sample.
 */
import type { Candidates } from '../../src/shard/candidate-sampling.ts';
import { sampleFromCandidates } from '../../src/shard/candidate-sampling.ts';
import { drawFromNucleus, nucleus, sampleToken, type SamplingParams } from '../../src/shard/sampling.ts';

export const SWEEP = {
  temperatures: [0.05, 0.3, 0.7, 1, 1.5],
  seeds: Array.from({ length: 12 }, (_, i) => i * 7919 + 1),
  topKs: [0, 20, 50, 256, 300],
  topPs: [1, 0.95, 0.8],
};

export interface SweepResult {
  decided: number;
  fallbacks: number;
  reasons: Record<string, number>;
  fallbacksByTopK: Record<number, number>;
  /** Combinations whose candidate token differs from sampling.ts's (must stay empty). */
  mismatches: string[];
  /** |exp(device logsumexp_t) / f64 normalizer − 1|, worst over temperatures. */
  worstNormalizerError: number;
}

export async function sweepRow(logits: Float32Array, position: number, candidatesAt: (temperature: number) => Promise<Candidates>): Promise<SweepResult> {
  const order = Array.from({ length: logits.length }, (_, i) => i).sort((a, b) => logits[b]! - logits[a]! || a - b);
  const r: SweepResult = { decided: 0, fallbacks: 0, reasons: {}, fallbacksByTopK: {}, mismatches: [], worstNormalizerError: 0 };
  let checked = 0;
  for (const temperature of SWEEP.temperatures) {
    const c = await candidatesAt(temperature);
    const max = logits[order[0]!]! / temperature;
    let total = 0;
    for (const i of order) total += Math.exp(logits[i]! / temperature - max);
    r.worstNormalizerError = Math.max(r.worstNormalizerError, Math.abs(Math.exp(c.logSumExpT) / total - 1));
    for (const topK of SWEEP.topKs) {
      const kept = topK > 0 && topK < order.length ? order.slice(0, topK) : order;
      for (const topP of SWEEP.topPs) {
        // drawFromSorted's nucleus, cut once for all seeds (it does not depend on the seed).
        const cut = nucleus(kept, (i) => logits[i]!, temperature, topP);
        for (const seed of SWEEP.seeds) {
          const params: SamplingParams = { temperature, seed, topK, topP };
          const want = drawFromNucleus(cut, seed, position);
          if (seed === SWEEP.seeds[0] && checked++ < 30) {
            const full = sampleToken(logits, params, position).tokenId;
            if (full !== want) throw new Error(`the sweep's shortcut disagrees with sampleToken at ${JSON.stringify(params)}`);
          }
          const got = sampleFromCandidates(c, params, position);
          if ('fallback' in got) {
            r.fallbacks++;
            r.reasons[got.fallback] = (r.reasons[got.fallback] ?? 0) + 1;
            r.fallbacksByTopK[topK] = (r.fallbacksByTopK[topK] ?? 0) + 1;
          } else {
            r.decided++;
            if (got.sampled.tokenId !== want) r.mismatches.push(`${JSON.stringify(params)}: ${got.sampled.tokenId} vs ${want}`);
          }
        }
      }
    }
  }
  return r;
}

/** Logits like a trained head's at a real vocabulary size: a wide tail and a handful of strong tokens. */
export function peakedLogits(vocab: number, seed: number): Float32Array {
  let s = seed >>> 0 || 1;
  const next = () => {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    return (s >>> 0) / 4294967296;
  };
  const out = new Float32Array(vocab);
  for (let i = 0; i < vocab; i++) {
    const g = Math.sqrt(-2 * Math.log(next() + 1e-12)) * Math.cos(2 * Math.PI * next());
    out[i] = 2.5 * g + (next() < 2e-4 ? 14 + 6 * next() : 0);
  }
  return out;
}
