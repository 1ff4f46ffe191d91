/**
 * What a head's drafter is: it proposes the tokens that follow the accepted
 * sequence, and the pipeline sends them for verification in one multi-row
 * step (docs/architecture.md, "Speculative decoding").
 */
import type { SparseDist } from '../../../shard/speculative.ts';

/** Which drafter proposed (reported in /info and the bench tables). */
export type DrafterKind = 'prompt-lookup' | 'prediction' | 'model' | 'self';

/** Proposals for the positions after the accepted sequence. */
export interface Draft {
  /** The proposed tokens, in order (may be fewer than asked: nothing worth proposing). */
  ids: number[];
  /** A stochastic drafter's proposal for the last row (not fed; see src/shard/speculative.ts). */
  next?: number;
  /** A stochastic drafter (a draft model sampling at T > 0): the distribution each proposal (ids, then next) was drawn from. */
  q?: SparseDist[];
}

export interface Drafter {
  readonly kind: DrafterKind;
  /**
   * Names what this drafter's acceptance is a property of (a draft model:
   * the pair of models), so a head carries it from one generation to the
   * next (AdaptiveK's `prior`). Absent: acceptance depends on the text
   * (prompt lookup, a prediction), and each generation starts afresh.
   */
  readonly memoryKey?: string;
  /**
   * Up to `k` proposals for the tokens after `accepted` (prompt + generated
   * so far). `accepted` only ever grows by the tokens a step emitted between
   * calls of one generation; a drafter keeps whatever state it derives from it.
   */
  propose(accepted: readonly number[], k: number): Draft | Promise<Draft>;
  /**
   * Catch up on `accepted` ahead of the next `propose` (a draft model feeds
   * the tokens it has not seen): called while a step is in flight, so the
   * work overlaps the trip instead of adding to the next one. Optional.
   */
  prepare?(accepted: readonly number[]): Promise<void>;
  /** Measured cost of one proposed token, ms (0 for a lookup). */
  costPerToken(): number;
  /** The generation ended: drop per-generation state (a draft model's KV session). */
  release(): void | Promise<void>;
}
