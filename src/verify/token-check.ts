/**
 * Whether a last hop's token is the one its logits give: the checker
 * recomputes the logits of each step and measures how far the claimed
 * token is from being the sampled one (docs/verification.md). Two numbers,
 * each 0 for the token the checker itself would pick:
 *
 * - `deficit`: top logit − the claimed token's logit (logit units). Greedy
 *   sampling picks the top logit, so an honest claim's deficit is 0 up to
 *   the rounding between two backends, which only matters at a near-tie.
 * - `gap` (temperature > 0): how far the seeded draw u lies from the claimed
 *   token's interval of cumulative probability, as a fraction of the mass.
 *   An honest claim draws u inside its own token's interval; a checker on
 *   slightly different logits sees the intervals move by about the rounding.
 */
import { drawUniform, validateSampling, type SamplingParams } from '../shard/sampling.ts';

export interface TokenCheck {
  /** Top logit minus the claimed token's (≥ 0). */
  deficit: number;
  /** For temperature > 0: distance of the draw from the claimed token's mass interval, a fraction of the mass; 0 for greedy. */
  gap: number;
  /** The checker's own pick under the same sampling. */
  sampled: number;
  /** The claimed token's log-probability under the checker's logits (softmax of the raw logits, as a hop answers it). */
  logprob: number;
}

export function checkToken(logits: ArrayLike<number>, claimed: number, params: SamplingParams, position: number): TokenCheck {
  validateSampling(params);
  const n = logits.length;
  if (!(Number.isInteger(claimed) && claimed >= 0 && claimed < n)) return { deficit: Infinity, gap: 1, sampled: argmax(logits), logprob: -Infinity };
  const top = argmax(logits);
  const deficit = logits[top]! - logits[claimed]!;
  const logprob = logSoftmax(logits, claimed, logits[top]!);
  const t = params.temperature ?? 0;
  if (t === 0) return { deficit: Number.isNaN(deficit) ? Infinity : deficit, gap: 0, sampled: top, logprob };

  // The same order and cuts as sampling.ts drawFromSorted: logit descending, id ascending, top_k, then the nucleus.
  let order = Array.from({ length: n }, (_, i) => i).sort((a, b) => logits[b]! - logits[a]! || a - b);
  const k = params.topK ?? 0;
  if (k > 0 && k < order.length) order = order.slice(0, k);
  const max = logits[order[0]!]! / t;
  const w = order.map((i) => Math.exp(logits[i]! / t - max));
  const all = w.reduce((a, b) => a + b, 0);
  const topP = params.topP ?? 1;
  let kept = w.length;
  let keptMass = all;
  if (topP < 1) {
    let acc = 0;
    kept = 0;
    while (kept < w.length) {
      acc += w[kept]!;
      kept++;
      if (acc >= topP * all) break;
    }
    keptMass = acc;
  }
  const u = drawUniform(params.seed ?? 0, position) * keptMass;
  let sampled = order[kept - 1]!;
  let acc = 0;
  for (let i = 0; i < kept; i++) {
    acc += w[i]!;
    if (u < acc) {
      sampled = order[i]!;
      break;
    }
  }
  // The claimed token's interval over the whole ordered list (a cut token's lies past the kept mass).
  let lo = 0;
  let found = -1;
  for (let i = 0; i < order.length; i++) {
    if (order[i] === claimed) {
      found = i;
      break;
    }
    lo += w[i]!;
  }
  if (found < 0) return { deficit, gap: 1, sampled, logprob };
  const hi = lo + w[found]!;
  const gap = u < lo ? (lo - u) / all : u >= hi ? (u - hi) / all : 0;
  return { deficit, gap, sampled, logprob };
}

/** log softmax of the raw logits at `index` (as sampling.ts logSoftmaxAt), given the top logit. */
function logSoftmax(logits: ArrayLike<number>, index: number, max: number): number {
  let sum = 0;
  for (let i = 0; i < logits.length; i++) sum += Math.exp(logits[i]! - max);
  return logits[index]! - max - Math.log(sum);
}

export function argmax(xs: ArrayLike<number>): number {
  let best = 0;
  for (let i = 1; i < xs.length; i++) if (xs[i]! > xs[best]!) best = i;
  return best;
}
