/**
 * Speculative decoding at the last hop: the rule that decides which drafted
 * tokens to accept from the logits of a multi-row verification step, and
 * which token follows them. Pure arithmetic over logits; the executors call
 * it with the rows they computed (docs/architecture.md, "Speculative
 * decoding").
 *
 * Rows: a verification step feeds [t0, d1 … dk] at position P, so row r's
 * logits are the target's distribution for the token at p_r = P + 1 + r, and
 * the draft proposes ids[r] for that position (ids[r] was fed as row r + 1,
 * except an extra last proposal, which only the last row judges).
 *
 * Randomness. sampling.ts draws the token at position p from
 * u = drawUniform(seed, p). Two kinds of drafts:
 *
 * - Point-mass drafts (prompt lookup, a prediction, a draft model run
 *   greedily): q = δ(d). Leviathan et al.'s rule for such a q is "accept d
 *   with probability p(d), else draw from p without d". We take
 *   x = sampleToken(row r, seed, p_r) — exactly the token speculation off
 *   draws there — and accept iff x = d, else emit x: P(accept) = p(d), and a
 *   rejection leaves x distributed as p given x ≠ d. So this IS the rule, and
 *   its tokens are, seed for seed, those of speculation off (greedy too).
 * - Stochastic drafts (a draft model sampling at T > 0) carry q, the sparse
 *   distribution each proposal was drawn from. Leviathan / Chen: accept d
 *   when v < min(1, p(d)/q(d)), else draw from norm(max(0, p − q)); the
 *   output is distributed exactly as p. d, v and the residual draw use three
 *   streams of their own, each a function of (seed, position) alone
 *   (speculativeUniform), and a drafter proposes for the last row too, so
 *   every position's token is a function of (seed, position, context) alone:
 *   reproducible whatever k, batching or failover did, though not the token
 *   speculation off would draw there (no rule can be both that and keep
 *   Σ min(p, q) acceptance).
 */
import { badRequestError } from './errors.ts';
import { drawUniform, logSoftmaxAt, nucleus, sampleToken, sortedCandidates, validateSampling, type SamplingParams } from './sampling.ts';

/** A sparse distribution: `probs[i]` is the probability of `ids[i]`; they sum to 1. */
export interface SparseDist {
  ids: readonly number[];
  probs: readonly number[];
}

/**
 * What the head drafted for a verification step (X-Meshnet-Draft). The
 * step's last ids.length + 1 rows are judged: row r proposes ids[r] (fed as
 * row r + 1), and the last row `next`, when given.
 */
export interface DraftProposal {
  /** The drafts fed as rows (d1..dk, k ≥ 0). */
  ids: readonly number[];
  /** A proposal for the last row's token, not fed (a stochastic drafter's k+1-th). */
  next?: number;
  /** Stochastic drafts: the distribution each proposal (ids, then next) was drawn from. Absent: point-mass drafts. */
  q?: readonly SparseDist[];
}

/** The proposals in row order: the fed drafts, then `next`. */
function proposals(d: DraftProposal): readonly number[] {
  return d.next === undefined ? d.ids : [...d.ids, d.next];
}

export interface Verified {
  /** Fed drafts accepted (≤ rows − 1). */
  accepted: number;
  /** The tokens this step emits, in order: the accepted drafts, then one more (accepted + 1 in all). */
  tokenIds: number[];
  /** Each emitted token's log-probability under the model (raw logits, as sampleToken reports). */
  logprobs: number[];
}

/** Most drafted tokens one step may carry (the adaptive k's upper bound). */
export const MAX_DRAFT = 16;
/** Most entries of one proposal's sparse q. */
export const MAX_Q_ENTRIES = 64;
/** How far a sparse q's mass may sit from 1 (it is normalised by the drafter, then sent as JSON numbers, which round-trip exactly). */
const Q_SUM_TOL = 1e-6;

/** The random streams of stochastic drafts, apart from the plain sampler's (drawUniform(seed, p)). */
export type SpecStream = 'draft' | 'accept' | 'residual';
const STREAM_SALT: Record<SpecStream, number> = { draft: 0x5eed0001, accept: 0x5eed0002, residual: 0x5eed0003 };
const derived = new Map<string, number>();

/**
 * Uniform in [0, 1) for `stream` at `position`, from the request's seed
 * alone: the draft model's sample, the acceptance test and the residual
 * draw each have their own stream, and none is the plain sampler's. The
 * stream's seed is a 53-bit draw of the request's seed at a salt no real
 * position reaches (≥ 1.59e9).
 */
export function speculativeUniform(seed: number, stream: SpecStream, position: number): number {
  const key = `${seed}:${stream}`;
  let s = derived.get(key);
  if (s === undefined) {
    s = Math.floor(drawUniform(seed, STREAM_SALT[stream]) * 2 ** 53);
    if (derived.size >= 1024) derived.clear();
    derived.set(key, s);
  }
  return drawUniform(s, position);
}

/** The checks a draft gets before any row is judged (a bad draft is the caller's fault: 400); `seq`: the step's rows. */
export function checkDraft(draft: DraftProposal, seq: number, vocabSize: number): void {
  const all = proposals(draft);
  const n = all.length;
  if (draft.ids.length > MAX_DRAFT) throw badRequestError(`a verification step carries at most ${MAX_DRAFT} drafted tokens, not ${draft.ids.length}`);
  if (draft.ids.length + 1 > seq) throw badRequestError(`a draft of ${draft.ids.length} tokens needs ${draft.ids.length + 1} rows; the step has ${seq}`);
  for (const id of all) if (!(Number.isInteger(id) && id >= 0 && id < vocabSize)) throw badRequestError(`drafted token ${id} is outside 0..${vocabSize - 1}`);
  if (draft.q === undefined) return;
  if (draft.q.length !== n) throw badRequestError(`a stochastic draft gives one q per proposed token: ${n} proposals, ${draft.q.length} distributions`);
  draft.q.forEach((q, r) => {
    if (q.ids.length !== q.probs.length || q.ids.length === 0 || q.ids.length > MAX_Q_ENTRIES) throw badRequestError(`draft q[${r}] needs 1..${MAX_Q_ENTRIES} ids with one probability each`);
    const seen = new Set<number>();
    let sum = 0;
    q.ids.forEach((id, i) => {
      const p = q.probs[i]!;
      if (!(Number.isInteger(id) && id >= 0 && id < vocabSize) || seen.has(id)) throw badRequestError(`draft q[${r}] names id ${id} twice or outside the vocabulary`);
      if (!(Number.isFinite(p) && p > 0 && p <= 1)) throw badRequestError(`draft q[${r}] gives id ${id} probability ${p}; each must be in (0, 1]`);
      seen.add(id);
      sum += p;
    });
    if (Math.abs(sum - 1) > Q_SUM_TOL) throw badRequestError(`draft q[${r}] sums to ${sum}, not 1`);
    if (!seen.has(all[r]!)) throw badRequestError(`drafted token ${all[r]} at row ${r} is not in the q it was drawn from`);
  });
}

/**
 * The target's distribution as sampling.ts draws from it: candidates in
 * sampling order (logit descending, id ascending), cut to top_k and the
 * nucleus, with drawFromSorted's f64 weights; probabilities are weight / total.
 */
export function targetDistribution(logits: Float32Array, params: SamplingParams): { order: readonly number[]; weights: number[]; total: number } {
  const temperature = params.temperature ?? 0;
  if (!(temperature > 0)) throw new RangeError('the target distribution is for temperature > 0');
  return nucleus(sortedCandidates(logits, params.topK ?? 0), (i) => logits[i]!, temperature, params.topP ?? 1);
}

/** Whether a step's draft is judged by Leviathan's rule (a sampling drafter's, at T > 0), not by the plain sampler's draw. */
export function isStochasticDraft(draft: DraftProposal | undefined, params: SamplingParams): boolean {
  return draft?.q !== undefined && (params.temperature ?? 0) > 0;
}

/** A draft's proposals in row order: the fed drafts, then `next`. */
export function draftProposals(d: DraftProposal): readonly number[] {
  return proposals(d);
}

/**
 * Leviathan's rule for one proposal `d` drawn from `q` against row logits:
 * the accepted proposal, or the residual draw.
 */
export function judgeStochastic(logits: Float32Array, params: SamplingParams, d: number, q: SparseDist, position: number): { token: number; accepted: boolean } {
  const seed = params.seed ?? 0;
  const { order, weights, total } = targetDistribution(logits, params);
  const qOf = new Map<number, number>();
  q.ids.forEach((id, i) => qOf.set(id, q.probs[i]!));
  const at = order.indexOf(d);
  const pd = at < 0 ? 0 : weights[at]! / total;
  const v = speculativeUniform(seed, 'accept', position);
  if (v < Math.min(1, pd / qOf.get(d)!)) return { token: d, accepted: true };
  // Residual max(0, p − q), in the target's sampling order; its mass is > 0 whenever a rejection can happen.
  const resid = order.map((id, i) => Math.max(0, weights[i]! / total - (qOf.get(id) ?? 0)));
  const mass = resid.reduce((a, b) => a + b, 0);
  if (!(mass > 0)) return { token: d, accepted: true }; // p ≤ q everywhere only when p = q (up to rounding): then d is p's draw
  const u = speculativeUniform(seed, 'residual', position) * mass;
  let acc = 0;
  for (let i = 0; i < order.length; i++) {
    acc += resid[i]!;
    if (u < acc && resid[i]! > 0) return { token: order[i]!, accepted: false };
  }
  // Rounding left u at the very top: the last token with residual mass.
  for (let i = order.length - 1; i >= 0; i--) if (resid[i]! > 0) return { token: order[i]!, accepted: false };
  return { token: d, accepted: true };
}

/**
 * Judges a verification step: `rowLogits(r)` is the logits of the r-th
 * judged row (the step's last draft.ids.length + 1 rows), whose token sits
 * at `firstPosition` + r. Emits the accepted drafts and the token after
 * them; the caches are cut back to the first judged row's position +
 * accepted + 1 (by the next step's rollback).
 */
export function verifyDraft(rowLogits: (row: number) => Float32Array, draft: DraftProposal, params: SamplingParams, firstPosition: number, vocabSize: number): Verified {
  validateSampling(params);
  const rows = draft.ids.length + 1;
  checkDraft(draft, rows, vocabSize);
  const all = proposals(draft);
  const stochastic = isStochasticDraft(draft, params);
  const tokenIds: number[] = [];
  const logprobs: number[] = [];
  let accepted = 0;
  for (let r = 0; r < rows; r++) {
    const logits = rowLogits(r);
    const position = firstPosition + r;
    const proposed = r < all.length ? all[r]! : undefined;
    let token: number;
    let ok: boolean;
    if (proposed !== undefined && stochastic) {
      const j = judgeStochastic(logits, params, proposed, draft.q![r]!, position);
      token = j.token;
      ok = j.accepted;
    } else {
      // Greedy and point-mass drafts: speculation off's own draw, accepted when it is the proposal.
      token = sampleToken(logits, params, position).tokenId;
      ok = proposed !== undefined && token === proposed;
    }
    tokenIds.push(token);
    logprobs.push(logSoftmaxAt(logits, token));
    // A proposal for the last row was not fed: accepted or not, nothing follows it in this step.
    if (!ok || r === rows - 1) break;
    accepted++;
  }
  return { accepted, tokenIds, logprobs };
}

/**
 * A stochastic drafter's proposal from its own logits: its distribution at
 * the request's temperature, top_k and top_p (targetDistribution), cut to the
 * `entries` most likely and renormalised, and the token drawn from exactly
 * that q with the 'draft' stream at `position`. Greedy: the argmax.
 */
export function proposeFromLogits(logits: Float32Array, params: SamplingParams, position: number, entries = MAX_Q_ENTRIES): { id: number; q: SparseDist } {
  if (!((params.temperature ?? 0) > 0)) {
    // Greedy: the draft's argmax, all its mass on it (the verifier judges greedily and ignores q).
    const id = sampleToken(logits, {}, position).tokenId;
    return { id, q: { ids: [id], probs: [1] } };
  }
  const { order, weights } = targetDistribution(logits, params);
  const n = Math.min(entries, order.length);
  let mass = 0;
  for (let i = 0; i < n; i++) mass += weights[i]!;
  const ids = order.slice(0, n);
  const probs = weights.slice(0, n).map((w) => w / mass);
  // Renormalised in f64: the sum is 1 within a few ulps, which checkDraft allows.
  const u = speculativeUniform(params.seed ?? 0, 'draft', position);
  let acc = 0;
  let id = ids[n - 1]!;
  for (let i = 0; i < n; i++) {
    acc += probs[i]!;
    if (u < acc) {
      id = ids[i]!;
      break;
    }
  }
  return { id, q: { ids, probs } };
}

/** Rows of a step's output the LM head must give logits for: the judged ones with a draft, else the last. */
export function judgedRows(draft: DraftProposal | undefined): number {
  return draft ? draft.ids.length + 1 : 1;
}

/**
 * A step's token answer from the logits of its last judgedRows(draft) rows
 * ([rows × vocab], row-major), the first of whose tokens sits at
 * `firstPosition`: sampling.ts's draw on the last row, or a verification.
 */
export function tokenFromRows(logits: Float32Array, vocabSize: number, draft: DraftProposal | undefined, params: SamplingParams, firstPosition: number): { tokenId: number; logprob: number; logits: Float32Array; spec?: Verified } {
  const row = (r: number) => logits.subarray(r * vocabSize, (r + 1) * vocabSize);
  if (!draft) {
    const { tokenId, logprob } = sampleToken(row(0), params, firstPosition);
    return { tokenId, logprob, logits: row(0) };
  }
  const spec = verifyDraft(row, draft, params, firstPosition, vocabSize);
  const last = spec.tokenIds.length - 1;
  return { tokenId: spec.tokenIds[last]!, logprob: spec.logprobs[last]!, logits: row(last), spec };
}

/**
 * A greedy verification from what a device's head graph picked per judged
 * row (its ArgMax, lowest id on ties, as sampleToken; and that token's
 * log-probability): the logits never leave the device.
 */
export function verifyGreedyPicks(picks: ArrayLike<number | bigint>, logprobs: ArrayLike<number>, draft: DraftProposal, vocabSize: number): Verified {
  checkDraft(draft, draft.ids.length + 1, vocabSize);
  const tokenIds: number[] = [];
  const lps: number[] = [];
  let accepted = 0;
  for (let r = 0; r <= draft.ids.length; r++) {
    const t = Number(picks[r]);
    tokenIds.push(t);
    lps.push(Number(logprobs[r]));
    if (r === draft.ids.length || t !== draft.ids[r]) break;
    accepted++;
  }
  return { accepted, tokenIds, logprobs: lps };
}
