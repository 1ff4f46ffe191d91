/**
 * Token sampling: greedy, temperature, top-k, top-p. The random draw for the
 * token at position p comes from hash(seed, p), not from a stream advanced
 * per call, so a hop replaying a session from (seed, position) — after a
 * failover — draws exactly the token the lost hop would have drawn.
 */
import { badRequestError } from './errors.ts';

export interface SamplingParams {
  /** 0 or absent: greedy. */
  temperature?: number;
  /** 0 or absent: no top-k cut. */
  topK?: number;
  /** 1 or absent: no nucleus cut. */
  topP?: number;
  seed?: number;
}

export interface Sampled {
  tokenId: number;
  /** log-probability of the token under the model (softmax of raw logits, before temperature and cuts). */
  logprob: number;
}

function fmix32(h: number): number {
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

/** Uniform in [0, 1) from (seed, position) alone; 53 random bits. */
export function drawUniform(seed: number, position: number): number {
  const lo = seed >>> 0;
  const hi = Math.floor(seed / 4294967296) >>> 0;
  let a = fmix32(lo ^ 0x9e3779b9);
  a = fmix32(a ^ Math.imul(hi, 0x85ebca6b) ^ 0x27d4eb2f);
  a = fmix32(a ^ (position >>> 0));
  const b = fmix32(a ^ 0x6a09e667);
  return ((a >>> 5) * 67108864 + (b >>> 6)) / 9007199254740992;
}

export function validateSampling(p: SamplingParams): void {
  const t = p.temperature ?? 0;
  if (!(Number.isFinite(t) && t >= 0)) throw badRequestError(`temperature ${t} must be a finite number >= 0`);
  const k = p.topK ?? 0;
  if (!(Number.isInteger(k) && k >= 0)) throw badRequestError(`top_k ${k} must be an integer >= 0`);
  const tp = p.topP ?? 1;
  if (!(Number.isFinite(tp) && tp > 0 && tp <= 1)) throw badRequestError(`top_p ${tp} must be in (0, 1]`);
  const s = p.seed ?? 0;
  if (!(Number.isSafeInteger(s) && s >= 0)) throw badRequestError(`seed ${s} must be a non-negative safe integer`);
}

export function logSoftmaxAt(logits: Float32Array, index: number): number {
  let max = -Infinity;
  for (let i = 0; i < logits.length; i++) if (logits[i]! > max) max = logits[i]!;
  let sum = 0;
  for (let i = 0; i < logits.length; i++) sum += Math.exp(logits[i]! - max);
  return logits[index]! - max - Math.log(sum);
}

/**
 * Samples the token that will sit at `position` (the absolute index of the
 * new token in the sequence). Ties in greedy go to the lowest id.
 */
export function sampleToken(logits: Float32Array, params: SamplingParams, position: number): Sampled {
  validateSampling(params);
  const temperature = params.temperature ?? 0;
  if (temperature === 0) {
    let best = 0;
    for (let i = 1; i < logits.length; i++) if (logits[i]! > logits[best]!) best = i;
    return { tokenId: best, logprob: logSoftmaxAt(logits, best) };
  }
  const chosen = drawFromSorted(sortedCandidates(logits, params.topK ?? 0), (i) => logits[i]!, temperature, params.topP ?? 1, params.seed ?? 0, position);
  return { tokenId: chosen, logprob: logSoftmaxAt(logits, chosen) };
}

/** Candidates sorted by logit, descending (index order breaks ties, so the order is total), cut to top_k (0: all). */
export function sortedCandidates(logits: Float32Array, topK: number): number[] {
  const order = Array.from({ length: logits.length }, (_, i) => i).sort((a, b) => logits[b]! - logits[a]! || a - b);
  return topK > 0 && topK < order.length ? order.slice(0, topK) : order;
}

/**
 * Sorted candidates' f64 weights exp(l/T − max), cut to the nucleus: the
 * smallest prefix whose mass reaches top_p (the token that crosses it stays
 * in). The one arithmetic every sampler here draws from (drawFromSorted) and
 * speculation judges against (speculative.ts).
 */
export function nucleus(order: readonly number[], logitOf: (id: number) => number, temperature: number, topP: number): { order: readonly number[]; weights: number[]; total: number } {
  let kept = order;
  const max = logitOf(kept[0]!) / temperature;
  const weights = kept.map((i) => Math.exp(logitOf(i) / temperature - max));
  let total = weights.reduce((a, b) => a + b, 0);
  if (topP < 1) {
    let acc = 0;
    let keep = 0;
    while (keep < weights.length) {
      acc += weights[keep]!;
      keep++;
      if (acc >= topP * total) break;
    }
    kept = kept.slice(0, keep);
    weights.length = keep;
    total = acc;
  }
  return { order: kept, weights, total };
}

/**
 * The draw over candidates already in sampling order (logit descending, id
 * ascending) and already cut to top_k: weights exp(l/T − max), the nucleus
 * cut, then the first candidate whose running mass passes u. Shared by
 * sampleToken and the device path (candidate-sampling.ts), which must do
 * exactly this arithmetic to pick the same token.
 */
export function drawFromSorted(order: readonly number[], logitOf: (id: number) => number, temperature: number, topP: number, seed: number, position: number): number {
  return drawFromNucleus(nucleus(order, logitOf, temperature, topP), seed, position);
}

/** drawFromSorted's draw on a nucleus already cut (one nucleus serves every seed and position). */
export function drawFromNucleus({ order: kept, weights, total }: ReturnType<typeof nucleus>, seed: number, position: number): number {
  const u = drawUniform(seed, position) * total;
  let acc = 0;
  let chosen = kept[kept.length - 1]!;
  for (let i = 0; i < kept.length; i++) {
    acc += weights[i]!;
    if (u < acc) {
      chosen = kept[i]!;
      break;
    }
  }
  return chosen;
}
