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
 *
 * A token a sampling drafter's verification emitted (src/shard/speculative.ts,
 * Leviathan's rule) is judged by that rule instead (checkRuleToken): `gap`
 * is then how far the acceptance draw and the residual draw lie from giving
 * the claimed token, in the same units (probability mass).
 */
import { drawUniform, validateSampling, type SamplingParams } from '../shard/sampling.ts';
import { judgeStochastic, speculativeUniform, targetDistribution, type SparseDist } from '../shard/speculative.ts';

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

/**
 * A token that Leviathan's rule emitted at a row whose proposal `proposal`
 * was drawn from `q` (a sampling drafter's step, src/shard/speculative.ts):
 * `accepted` says what the claim means — the proposal was accepted here (an
 * accepted draft, or the last row's accepted `next`), or it was rejected and
 * `claimed` is the residual draw. The checker recomputes the rule on its own
 * logits with the request's seed: `sampled` is its token, `gap` how far the
 * acceptance draw v lies on the wrong side of min(1, p(d)/q(d)), plus (a
 * rejection) how far the residual draw lies from the claimed token's interval
 * of the residual mass max(0, p − q); 0 for the token the rule gives, at most 1.
 */
export function checkRuleToken(logits: Float32Array, claimed: number, proposal: number, q: SparseDist, params: SamplingParams, position: number, accepted: boolean): TokenCheck {
  const plain = checkToken(logits, claimed, { ...params, temperature: 0 }, position);
  const judged = judgeStochastic(logits, params, proposal, q, position);
  const seed = params.seed ?? 0;
  const { order, weights, total } = targetDistribution(logits, params);
  const qOf = new Map<number, number>();
  q.ids.forEach((id, i) => qOf.set(id, q.probs[i]!));
  const at = order.indexOf(proposal);
  const a = Math.min(1, (at < 0 ? 0 : weights[at]! / total) / qOf.get(proposal)!);
  const v = speculativeUniform(seed, 'accept', position);
  const out = (gap: number): TokenCheck => ({ deficit: plain.deficit, gap: Number.isNaN(gap) ? 1 : Math.min(1, gap), sampled: judged.token, logprob: plain.logprob });
  if (accepted) return out(claimed !== proposal ? 1 : v < a ? 0 : v - a);
  // A rejection never draws the proposal again (its residual mass is 0 once p(d) < q(d)).
  if (claimed === proposal) return out(1);
  const rejectGap = v >= a ? 0 : a - v;
  const resid = order.map((id, i) => Math.max(0, weights[i]! / total - (qOf.get(id) ?? 0)));
  const mass = resid.reduce((x, y) => x + y, 0);
  const k = order.indexOf(claimed);
  if (!(mass > 0) || k < 0 || !(resid[k]! > 0)) return out(1);
  let lo = 0;
  for (let i = 0; i < k; i++) lo += resid[i]!;
  const hi = lo + resid[k]!;
  const u = speculativeUniform(seed, 'residual', position) * mass;
  return out(rejectGap + (u < lo ? lo - u : u >= hi ? u - hi : 0));
}
