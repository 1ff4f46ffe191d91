/**
 * Sampling at temperature > 0 from what a device sends back instead of the
 * vocabulary's logits (src/model/sampler-graph.ts): the K largest logits
 * with their ids, and log Σ exp((l − max)/T) over the whole vocabulary in
 * f32. The answer is the token sampling.ts would draw over the full logits
 * for the same seed and position, bit for bit, or null when these numbers
 * cannot prove which token that is; the caller then downloads the logits for
 * that step and asks sampling.ts.
 *
 * What is exact and what is not:
 * - The candidates' logits are the device's f32 logits themselves, so their
 *   weights and running sums, computed here with sampling.ts's own f64
 *   arithmetic (drawFromSorted) in the same order, are the same bits.
 * - The order is only known for candidates strictly above the smallest one
 *   (a token left out may tie with it): the "certain" prefix.
 * - The mass outside the candidates is known only through the device's f32
 *   log-sum-exp, so the normalizer `total` is an interval. Every decision
 *   that depends on it (the nucleus cut, the slot u = draw·total falls in)
 *   is taken at both ends; if the ends disagree, or the decision lands past
 *   the certain prefix, the step falls back. f64 rounding is monotone, so
 *   agreement at both ends means agreement at sampling.ts's own total.
 */
import { drawFromSorted, drawUniform, type Sampled, type SamplingParams } from './sampling.ts';

export interface Candidates {
  /** Logits of the candidates (any order; the device gives them largest first). */
  values: ArrayLike<number>;
  ids: ArrayLike<number | bigint>;
  /** log Σ_v exp((l_v − l_max)/T) over the whole vocabulary, at the step's temperature. */
  logSumExpT: number;
  /** log Σ_v exp(l_v − l_max) over the whole vocabulary (the log-softmax normalizer). */
  logSumExp: number;
  vocabSize: number;
}

/**
 * Relative error allowed for the device's f32 normalizer exp(logSumExpT).
 * Measured over 151,936 logits: ≤ 3e-6 on WebGPU (SwiftShader), ≤ 2e-4 on
 * onnxruntime's CPU EP (its f32 sums run long in few lanes). 2e-3 keeps a
 * 10× margin over the worst seen; a wider band only makes the fallback fire
 * more often, a narrower one could pick a wrong token.
 */
export const NORMALIZER_REL_TOL = 2e-3;

export type CandidateOutcome = { sampled: Sampled } | { fallback: string };

/** The token sampling.ts would pick over the full logits, or why the candidates cannot tell. */
export function sampleFromCandidates(c: Candidates, params: SamplingParams, position: number, relTol = NORMALIZER_REL_TOL): CandidateOutcome {
  const temperature = params.temperature ?? 0;
  if (!(temperature > 0)) throw new RangeError('candidate sampling is for temperature > 0 (greedy picks on the device)');
  const n = c.values.length;
  if (n === 0 || c.ids.length !== n) return { fallback: 'no candidates' };
  const ids = Array.from(c.ids, Number);
  const value = new Map<number, number>();
  for (let i = 0; i < n; i++) {
    const v = c.values[i]!;
    // NaN or ±∞ logits: sampling.ts's own behaviour over them is what the caller must reproduce.
    if (!Number.isFinite(v)) return { fallback: 'a non-finite logit' };
    value.set(ids[i]!, v);
  }
  if (value.size !== n || ids.some((id) => !(Number.isInteger(id) && id >= 0 && id < c.vocabSize))) return { fallback: 'candidate ids are not distinct vocabulary ids' };
  if (!Number.isFinite(c.logSumExpT) || !Number.isFinite(c.logSumExp)) return { fallback: 'a non-finite normalizer' };

  const logitOf = (id: number) => value.get(id)!;
  const order = ids.slice().sort((a, b) => logitOf(b) - logitOf(a) || a - b);
  const complete = n === c.vocabSize;
  // Tokens left out are ≤ the smallest candidate; those above it are all here, in their true order.
  const floor = logitOf(order[n - 1]!);
  let certain = complete ? n : 0;
  if (!complete) while (certain < n && logitOf(order[certain]!) > floor) certain++;

  const seed = params.seed ?? 0;
  const topP = params.topP ?? 1;
  const k = params.topK ?? 0;
  const sampled = (id: number): CandidateOutcome => ({ sampled: { tokenId: id, logprob: logitOf(id) - logitOf(order[0]!) - c.logSumExp } });
  if (complete || (k > 0 && k < c.vocabSize)) {
    // A top-k cut the candidates hold (or the whole vocabulary): nothing is left to estimate.
    const kept = complete && !(k > 0 && k < n) ? order : order.slice(0, k);
    if (kept.length > certain) return { fallback: `top_k ${k} reaches past the ${certain} candidates whose order is certain` };
    return sampled(drawFromSorted(kept, logitOf, temperature, topP, seed, position));
  }

  // No top-k cut: the normalizer sums the whole vocabulary. Running sums over the certain prefix
  // with drawFromSorted's arithmetic (weights relative to the top one, summed in order from 0).
  const max = logitOf(order[0]!) / temperature;
  const acc: number[] = [];
  let sum = 0;
  for (let i = 0; i < certain; i++) {
    sum += Math.exp(logitOf(order[i]!) / temperature - max);
    acc.push(sum);
  }
  const estimate = Math.exp(c.logSumExpT);
  const lo = Math.max(sum, estimate * (1 - relTol));
  const hi = estimate * (1 + relTol);
  if (!(lo <= hi)) return { fallback: 'the device normalizer is below the candidates own mass' };
  const firstReaching = (x: number, strict: boolean) => acc.findIndex((a) => (strict ? x < a : a >= x));

  if (topP < 1) {
    const a = firstReaching(topP * lo, false);
    const b = firstReaching(topP * hi, false);
    if (b < 0) return { fallback: 'the nucleus reaches past the certain candidates' };
    if (a !== b) return { fallback: 'the nucleus edge is within the normalizer tolerance' };
    // Exact from here on: sampling.ts's total becomes the kept prefix's own mass, acc[b].
    return sampled(drawWithin(order.slice(0, b + 1), acc, acc[b]!, seed, position));
  }
  const d = drawUniform(seed, position);
  const a = firstReaching(d * lo, true);
  const b = firstReaching(d * hi, true);
  if (b < 0) return { fallback: 'the draw falls in the mass outside the certain candidates' };
  if (a !== b) return { fallback: 'the draw is within the normalizer tolerance of a boundary' };
  return sampled(order[b]!);
}

/** sampling.ts's last loop over an exactly known prefix and its running sums. */
function drawWithin(kept: readonly number[], acc: readonly number[], total: number, seed: number, position: number): number {
  const u = drawUniform(seed, position) * total;
  for (let i = 0; i < kept.length; i++) if (u < acc[i]!) return kept[i]!;
  return kept[kept.length - 1]!;
}
