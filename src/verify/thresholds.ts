/**
 * When two honest nodes' outputs count as the same: per pair of weight
 * formats, from the calibration in docs/verification.md
 * (bench/verify-calibration.ts). A node's format and backend come from its
 * heartbeats, so every check is judged by the threshold of its own pair.
 *
 * The rule behind the numbers: each threshold sits well above the largest
 * honest distance measured for its pair (12,400 rows over every pairing of
 * onnxruntime-node, WASM and WebGPU, f32 and 4-bit; the margin is 6.7× for
 * f32 pairs, 3.4× for 4-bit pairs, 3× for 4-bit against f32) and below the
 * smallest lie the issue names that the pair can see at all (a check judges
 * a step by its worst row: every row of every lie measured is over). A 4-bit
 * node checked by an f32 one (or the reverse) differs by its quantization
 * already (~10 % relative): small lies hide under that, so a 4-bit node is
 * checked by another 4-bit node wherever one holds its layers. Across formats
 * a sampled pick cannot be judged at all (the seeded draw lands on another
 * token up to 72 % of the mass away): `tokenGap` 1 never fires, and only the
 * log-probability the last hop answered is compared.
 */

export type WeightFormat = 'f32' | 'f16' | 'q4';

/** What the tracker knows of a node that decides how its outputs may differ from another's. */
export interface NodeClass {
  format: WeightFormat;
  /** The backend as the node announces it (onnxruntime-node, wasm, webgpu, …). */
  backend: string;
}

export type PairClass = 'exact' | 'q4' | 'mixed';

export interface Thresholds {
  /** Largest relative L2 of a row (src/verify/distance.ts) an honest pair reaches, times the margin. */
  rowRel: number;
  /** Largest deficit of a greedy last hop's token (top logit − its logit). */
  tokenDeficit: number;
  /** Largest gap of a sampled last hop's draw from its token's interval (a fraction of the mass). */
  tokenGap: number;
  /** Largest difference of the log-probability a last hop answered for its token from the checker's (nats). */
  tokenLogprob: number;
}

/**
 * The thresholds by pair (docs/verification.md has the data):
 * - exact: both full precision (f32; f16 activations count here, they round like bf16 on the wire);
 * - q4: both 4-bit (the same deterministic quantization of the same checkpoint);
 * - mixed: a 4-bit node and a full-precision one.
 */
export const THRESHOLDS: Readonly<Record<PairClass, Thresholds>> = {
  exact: { rowRel: 3e-3, tokenDeficit: 0.01, tokenGap: 0.01, tokenLogprob: 1e-4 },
  q4: { rowRel: 3e-3, tokenDeficit: 0.01, tokenGap: 0.01, tokenLogprob: 1e-4 },
  mixed: { rowRel: 0.4, tokenDeficit: 2.5, tokenGap: 1, tokenLogprob: 2 },
};

export function pairClass(a: NodeClass, b: NodeClass): PairClass {
  const qa = a.format === 'q4';
  const qb = b.format === 'q4';
  if (qa && qb) return 'q4';
  if (qa || qb) return 'mixed';
  return 'exact';
}

export function thresholdsFor(a: NodeClass, b: NodeClass): Thresholds {
  return THRESHOLDS[pairClass(a, b)];
}

/**
 * A last hop's step against a checker's record, in units of the pair's
 * thresholds (≤ 1: they agree): the claimed token must be the one the
 * checker's logits give (its deficit, or its draw's gap when sampled), and
 * the log-probability it answered must be the checker's.
 */
export function tokenDistance(t: Thresholds, sampled: boolean, check: { deficit: number; gap: number; logprob: number }, claimedLogprob: number): number {
  const pick = sampled ? check.gap / t.tokenGap : check.deficit / t.tokenDeficit;
  const lp = Math.abs(claimedLogprob - check.logprob) / t.tokenLogprob;
  const d = Math.max(pick, lp);
  return Number.isNaN(d) ? Infinity : d;
}

/** Two checkers' records of one step, in units of the thresholds between them (≤ 1: they agree). */
export function recordsDistance(t: Thresholds, a: { sampled: number; logprob: number }, b: { sampled: number; logprob: number }): number {
  if (a.sampled !== b.sampled) return Infinity;
  const d = Math.abs(a.logprob - b.logprob) / t.tokenLogprob;
  return Number.isNaN(d) ? Infinity : d;
}
