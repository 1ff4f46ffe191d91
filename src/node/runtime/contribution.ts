/**
 * What a donor has given, across restarts: tokens served, time spent
 * serving, and the layers held now. The runtime's counters start at zero
 * with every runtime; this adds their increments to a record the host keeps
 * (IndexedDB in the browser), sampled now and then and on the way out.
 */

export interface ContributionRecord {
  /** Tokens this node computed for others (a hop's rows, a head's tokens), all time. */
  tokensServed: number;
  /** Time spent serving (a span loaded, not draining), ms, all time. */
  servingMs: number;
  /** First time this node served, ms since epoch. */
  since: number | undefined;
}

export const EMPTY_CONTRIBUTION: ContributionRecord = { tokensServed: 0, servingMs: 0, since: undefined };

export class ContributionMeter {
  private rec: ContributionRecord;
  private lastTokens: number | undefined;
  private lastAt: number | undefined;
  private lastServing = false;

  constructor(
    initial: ContributionRecord | undefined,
    private readonly now: () => number = Date.now,
  ) {
    this.rec = { ...EMPTY_CONTRIBUTION, ...initial };
  }

  /**
   * A reading: the runtime's cumulative token counter (it restarts at 0 with
   * a new runtime: a drop counts from zero again) and whether it serves now.
   * The first reading is a baseline; serving time counts each interval the
   * node was serving at its start.
   */
  sample(tokensTotal: number, serving: boolean): ContributionRecord {
    const at = this.now();
    if (this.lastTokens !== undefined) {
      const delta = tokensTotal >= this.lastTokens ? tokensTotal - this.lastTokens : tokensTotal;
      this.rec.tokensServed += delta;
    }
    if (this.lastAt !== undefined && this.lastServing) this.rec.servingMs += Math.max(0, at - this.lastAt);
    if (serving && this.rec.since === undefined) this.rec.since = at;
    this.lastTokens = tokensTotal;
    this.lastAt = at;
    this.lastServing = serving;
    return this.record;
  }

  get record(): ContributionRecord {
    return { ...this.rec };
  }
}
