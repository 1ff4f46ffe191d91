/**
 * One generation's state as its steps share it, and the shapes a step hands
 * between the driver (pipeline.ts, which plans steps and emits tokens) and
 * the hops (hop-steps.ts, which carries a step's rows down the route). Apart
 * so that both can name them without importing each other.
 */
import { MeshError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import type { GenerateEvent } from '../../protocol/tracker.ts';
import { encodeDraft } from '../../protocol/draft.ts';
import type { SamplingParams } from '../../shard/sampling.ts';
import { MAX_DRAFT, type DraftProposal } from '../../shard/speculative.ts';
import type { GenerationTrace } from '../verify/head-verify.ts';
import type { ChainState } from './chain-driver.ts';
import type { Chunk, HopState } from './hop-failover.ts';
import type { TokenAnswer } from './pipeline-parts.ts';
import type { StepOutcome, StepPlan } from './speculation/speculator.ts';

/** One generation's state, shared by its steps. */
export interface Generation {
  headPeerId: string;
  /** The KV session id on every hop. */
  session: string;
  /** Positions the session reaches at most (sessionTokens, X-Meshnet-Session-Tokens). */
  declared: number;
  /** The head runs layers [0, localEnd) itself. */
  localEnd: number;
  /** The downstream hops, replacements spliced in. */
  hops: HopState[];
  /** X-Meshnet-Sampling for the last hop. */
  sampling: string;
  /** The same, for a head that runs the last layer itself. */
  localSampling: SamplingParams;
  chain: ChainState;
  /** Events to yield after the current step (recoveries). */
  pending: GenerateEvent[];
  /** Replacements so far (up to maxRecoveries). */
  recoveries: number;
  /** Resumes on a failed hop the tracker found answering again (up to MAX_SAME_NODE_RESUMES, hop-failover.ts). */
  sameNode: number;
  /** Tokens every hop's cache holds before the current step. */
  position: number;
  /** How each step was computed (start, rows fed): a replay resends the history in these same chunks. */
  steps: Chunk[];
  signal: AbortSignal | undefined;
  /** What the spot-checks need of this generation (attestations, steps, tokens); absent: no checks. */
  checks: GenerationTrace | undefined;
  /** Rows were cut back after a speculative step (the next step started before the previous one ended). */
  cut?: boolean;
}

/** What a step emits. */
export interface StepAnswer extends StepOutcome {
  /** A hop said its batches run full. */
  batchFull: boolean;
}

/** A step's speculative-decoding headers: the drafts (to the hop with the LM head) and the rollback bound (to every hop). */
export interface SpecHeaders {
  draft?: DraftProposal | undefined;
  rollbackFrom?: number | undefined;
}

export function specHeaders(sp: StepPlan): SpecHeaders {
  return { ...(sp.draft ? { draft: sp.draft } : {}), ...(sp.rollbackFrom !== undefined ? { rollbackFrom: sp.rollbackFrom } : {}) };
}

export function specHeaderMap(s: SpecHeaders): Record<string, string> {
  const out: Record<string, string> = {};
  if (s.draft) out[H.draft] = encodeDraft(s.draft);
  if (s.rollbackFrom !== undefined) out[H.rollback] = String(s.rollbackFrom);
  return out;
}

/** Steps after the prompt with at most a verification's rows are timed as decode steps. */
export function isDecodeStep(position: number, seq: number): boolean {
  return seq === 1 || (position > 0 && seq <= MAX_DRAFT + 1);
}

/** The last hop's token JSON as what the step emits: its accepted drafts, then its token. */
export function stepAnswer(ans: TokenAnswer, spec: SpecHeaders, batchFull: boolean): StepAnswer {
  const accepted = ans.accepted ?? 0;
  const ids = spec.draft?.ids ?? [];
  if (accepted > ids.length) throw new MeshError('MESH_ERR_UPSTREAM', `the last hop accepted ${accepted} drafted tokens of ${ids.length}`);
  const tokens = [...ids.slice(0, accepted), ans.token_id];
  const logprobs = ans.logprobs && ans.logprobs.length === tokens.length ? ans.logprobs : [...new Array<number>(accepted).fill(0), ans.logprob];
  return { tokens, logprobs, accepted, batchFull };
}
