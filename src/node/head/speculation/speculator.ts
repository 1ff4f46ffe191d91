/**
 * One generation's speculative decoding, as the head's pipeline sees it:
 * what the next step feeds (the accepted tokens not fed yet, plus drafts),
 * which rows the hops must cut back first, and what the step's outcome
 * teaches the k policy. The pipeline stays a loop of steps; this decides
 * what a step carries.
 *
 *   step at position P: rows = [unfed accepted…, d1 … dk]   (one multi-row step)
 *   last hop: accepted a ≤ k, emits d1 … da + one token      (ids only)
 *   every hop then holds P + rows positions, of which P + unfed + a are right;
 *   the next step carries X-Meshnet-Rollback and each hop cuts back first.
 */
import { MeshError } from '../../../protocol/errors.ts';
import { MAX_DRAFT, type DraftProposal } from '../../../shard/speculative.ts';
import type { AdaptiveK, AdaptiveKStats, CarriedPolicy } from './adaptive-k.ts';
import type { Drafter, DrafterKind } from './drafter.ts';

export interface StepPlan {
  /** The rows the step feeds: the unfed accepted tokens, then the drafts. */
  tokens: number[];
  /** The drafts (absent: a plain step). */
  draft?: DraftProposal;
  /** Cut caches holding up to this position back to the step's position first (absent: nothing to cut). */
  rollbackFrom?: number;
  /** ms the drafter took. */
  draftMs: number;
}

/** The last hop's answer to a step, as the pipeline parsed it. */
export interface StepOutcome {
  /** Emitted tokens in order (accepted drafts, then the last hop's token). */
  tokens: number[];
  logprobs: number[];
  /** Drafts accepted (tokens.length − 1 for a verification step; 0 for a plain one). */
  accepted: number;
}

/** Counters a head reports (GET /info, heartbeats, the done event). */
export interface SpeculationCounters {
  /** Tokens drafted and sent for verification. */
  drafted: number;
  accepted: number;
  /** Decode trips through the mesh (plain ones included; the prompt's step is not one). */
  trips: number;
  /** Tokens those trips emitted. */
  tokens: number;
}

export function emptyCounters(): SpeculationCounters {
  return { drafted: 0, accepted: 0, trips: 0, tokens: 0 };
}

export function addCounters(into: SpeculationCounters, c: SpeculationCounters): void {
  into.drafted += c.drafted;
  into.accepted += c.accepted;
  into.trips += c.trips;
  into.tokens += c.tokens;
}

export interface SpeculatorInit {
  drafter: Drafter;
  policy: AdaptiveK;
  /** The generation's max_tokens (the prefix counts). */
  maxTokens: number;
  /** Positions the hops hold room for (prompt + max_tokens, capped by the context). */
  declared: number;
}

export class Speculator {
  readonly counters = emptyCounters();
  /** Furthest position any step wrote on the hops. */
  private written = 0;
  private last: { t0: number; prefill: boolean } | null = null;
  /** The drafter's catch-up running while a step is in flight (before a probe). */
  private preparing: Promise<void> | null = null;

  constructor(private readonly init: SpeculatorInit) {}

  get kind(): DrafterKind {
    return this.init.drafter.kind;
  }

  /**
   * What the step at `position` feeds. `accepted` is the whole accepted
   * sequence (prompt + generated), `unfed` its tail not yet in the caches,
   * `emitted` the tokens generated so far (the prefix counts).
   */
  async plan(accepted: readonly number[], unfed: readonly number[], position: number, emitted: number): Promise<StepPlan> {
    const { policy, drafter } = this.init;
    policy.setDraftCost(drafter.costPerToken());
    // Cut: the step emits at most k + 1 tokens and writes position + rows positions.
    const room = Math.min(this.init.maxTokens - emitted - 1, this.init.declared - position - unfed.length, MAX_DRAFT);
    const k = Math.max(0, Math.min(policy.next(), room));
    // A catch-up started during the last trip: let it finish (its time overlapped that trip).
    if (this.preparing) await this.preparing;
    this.preparing = null;
    const t0 = performance.now();
    let draft: DraftProposal | undefined;
    if (k > 0) {
      const d = await drafter.propose(accepted, k);
      const ids = d.ids.slice(0, k);
      if (ids.length > 0 || d.next !== undefined) {
        draft = { ids };
        // A stochastic draft cut short loses its last-row proposal with its q (they must stay in step).
        if (d.q) {
          if (d.ids.length <= k && d.next !== undefined) Object.assign(draft, { next: d.next, q: d.q.slice(0, ids.length + 1) });
          else Object.assign(draft, { q: d.q.slice(0, ids.length) });
        }
      }
    }
    const draftMs = performance.now() - t0;
    const tokens = draft ? [...unfed, ...draft.ids] : [...unfed];
    const plan: StepPlan = { tokens, draftMs };
    if (draft) plan.draft = draft;
    // A hop may hold rows past `position` from an earlier verification, or from this very step if it
    // runs again (a chain step retried as a star): both are cut, and a repeat is then idempotent.
    if (this.written > position || draft) plan.rollbackFrom = Math.max(this.written, position + tokens.length);
    this.written = Math.max(this.written, position + tokens.length);
    this.last = { t0: performance.now(), prefill: unfed.length > 1 };
    // The next trip probes a drafter that does not pay: it catches up now, while this step travels,
    // so the probe costs one drafted row, not a draft model's forward over every token since the last.
    if (k === 0 && drafter.prepare && this.init.maxTokens - emitted > 2 && policy.probeComesNext()) {
      this.preparing = drafter.prepare(accepted).catch(() => undefined);
    }
    return plan;
  }

  /** The step's answer, checked against what it drafted; feeds the counters and the k policy. */
  settle(plan: StepPlan, outcome: StepOutcome, opts: { batchFull?: boolean } = {}): void {
    const drafted = plan.draft?.ids.length ?? 0;
    if (!(Number.isInteger(outcome.accepted) && outcome.accepted >= 0 && outcome.accepted <= drafted) || outcome.tokens.length !== outcome.accepted + 1) {
      throw new MeshError('MESH_ERR_UPSTREAM', `the last hop accepted ${outcome.accepted} of ${drafted} drafted tokens and emitted ${outcome.tokens.length}: not a verification's answer`);
    }
    for (let i = 0; i < outcome.accepted; i++) {
      if (outcome.tokens[i] !== plan.draft!.ids[i]) throw new MeshError('MESH_ERR_UPSTREAM', `the last hop's accepted token ${i} is ${outcome.tokens[i]}, but the draft was ${plan.draft!.ids[i]}`);
    }
    const c = this.counters;
    c.drafted += drafted;
    c.accepted += outcome.accepted;
    // A prompt's step (several unfed rows) is no decode trip: its time would skew the per-row cost, but
    // its drafts are evidence of α like any, and it counts towards the first probe.
    const prefill = this.last?.prefill === true;
    this.init.policy.record({ drafted, accepted: outcome.accepted, tripMs: prefill ? Number.NaN : this.last ? performance.now() - this.last.t0 : 0 });
    // After the record: the trips held back are the ones after this.
    if (opts.batchFull) this.init.policy.batchFull();
    if (prefill) return;
    c.trips++;
    c.tokens += outcome.tokens.length;
  }

  policyStats(): AdaptiveKStats {
    return this.init.policy.stats();
  }

  /** What this generation's policy learnt, for the head's next generation with the same drafter (absent: nothing to carry). */
  carry(): { key: string; policy: CarriedPolicy } | undefined {
    const key = this.init.drafter.memoryKey;
    return key === undefined ? undefined : { key, policy: this.init.policy.carry() };
  }

  async release(): Promise<void> {
    if (this.preparing) await this.preparing;
    this.preparing = null;
    await this.init.drafter.release();
  }
}
