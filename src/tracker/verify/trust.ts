/**
 * What the tracker knows of each node's honesty (docs/verification.md):
 * BOINC's adaptive replication counters, offences and quarantine.
 *
 * - Every session of a node is checked until it has passed `newNodeChecks`
 *   (10) checks in a row; after that a session is checked with probability
 *   max(minRate, 1 / consecutive). A failed check (an offence) resets the
 *   count; an inconclusive one (no arbiter agreed with anyone) forces the
 *   node's next session to be checked, and punishes nobody.
 * - An offence quarantines the node: no new routes, no checks to run, for
 *   15 minutes doubling with each offence. Its record (and the evidence) is
 *   kept across re-registrations: a node cannot wash its past by
 *   reconnecting. A tracker restart forgets it (the counters restart at
 *   "new node": every session checked again), unless the tracker is one of a
 *   cluster: the counters then live in the node's shared document
 *   (cluster/store.ts), so a node proven on one tracker is not checked as new
 *   by the next one haproxy picks.
 * - A node that will not be checked (no attestation, a bad one) earns no
 *   pass: it stays unverified, never honest.
 */

export interface OffenceRecord {
  /** The tracker's id of this offence. */
  id: string;
  at: number;
  until: number;
  /** The node found lying, and in what role. */
  peer: string;
  /** hop: its output checked wrong; checker: its check of an honest hop; head: two disjoint audits contradict the tokens it streamed and no hop of its route lied. */
  role: 'hop' | 'checker' | 'head';
  model: string;
  start_layer: number;
  end_layer: number;
  generation: string;
  session: string;
  kind: 'rows' | 'tokens';
  rows: number;
  steps: number;
  threshold: number;
  /** The signed claim of the checked hop. */
  claim: { peer: string; attestation: string };
  checker: { peer: string; attestation: string; distance: number };
  arbiter?: { peer: string; attestation: string; distance: number };
  /** Distance between checker and arbiter (they agreed when it is under the threshold). */
  between?: number;
  /** The head that ran the check and reported it. */
  reported_by: string;
}

/** How a node's checks went, counted. */
interface CheckCounts {
  /** Checks passed in a row since the last offence. */
  consecutive: number;
  checks: number;
  passes: number;
  offences: number;
  inconclusive: number;
  /** Reports that the node would not be checked (no or a bad attestation): it stays unverified. */
  refusals: number;
}

export interface TrustRecord extends CheckCounts {
  peer: string;
  quarantinedUntil: number;
  /** The next session of this node is checked whatever the odds (after an inconclusive check). */
  forceNext: boolean;
}

/** The counters a cluster's trackers share (the node's document in NATS: docs/cluster.md). */
export interface TrustCounters extends CheckCounts {
  force_next: boolean;
}

/** What one judgement does to a node's counters; `force` checks its next session (strict mode saw its routes disagree). */
export type TrustOutcome = 'pass' | 'inconclusive' | 'refused' | 'offence' | 'force';

export const NEW_NODE: TrustCounters = { consecutive: 0, checks: 0, passes: 0, offences: 0, inconclusive: 0, refusals: 0, force_next: false };

/** The counters after `outcome`: the one rule both a tracker's own book and a cluster's shared document follow. */
export function applyOutcome(c: TrustCounters, outcome: TrustOutcome): TrustCounters {
  switch (outcome) {
    case 'pass':
      return { ...c, checks: c.checks + 1, passes: c.passes + 1, consecutive: c.consecutive + 1, force_next: false };
    case 'inconclusive':
      return { ...c, checks: c.checks + 1, inconclusive: c.inconclusive + 1, force_next: true };
    case 'refused':
      return { ...c, refusals: c.refusals + 1, force_next: true };
    case 'offence':
      return { ...c, checks: c.checks + 1, offences: c.offences + 1, consecutive: 0, force_next: true };
    case 'force':
      return { ...c, force_next: true };
  }
}

function countersOf(r: TrustRecord): TrustCounters {
  return { consecutive: r.consecutive, checks: r.checks, passes: r.passes, offences: r.offences, inconclusive: r.inconclusive, refusals: r.refusals, force_next: r.forceNext };
}

export interface TrustOptions {
  /** Smallest probability of checking a session of a proven node. @defaultValue 0.02 */
  minRate: number;
  /** Checks in a row a new node must pass before it is sampled. @defaultValue 10 */
  newNodeChecks: number;
  /** First quarantine, ms; doubled for each further offence. @defaultValue 900000 (15 min) */
  quarantineMs: number;
  /** Offences kept for the dashboard. @defaultValue 64 */
  keepOffences: number;
  /** A quarantine began or grew (the registry shares it with the cluster's other trackers). */
  onQuarantine?(peer: string, until: number): void;
  /** A judgement changed a node's counters (a cluster's store shares them): what it was, and the counters now. */
  onOutcome?(peer: string, outcome: TrustOutcome, now: TrustCounters): void;
  now(): number;
  random(): number;
}

export const TRUST_DEFAULTS: Omit<TrustOptions, 'now' | 'random'> = { minRate: 0.02, newNodeChecks: 10, quarantineMs: 15 * 60_000, keepOffences: 64 };

export class TrustBook {
  private readonly records = new Map<string, TrustRecord>();
  /** Newest last. */
  readonly offenceLog: OffenceRecord[] = [];
  private readonly o: TrustOptions;
  /** The latest end of any quarantine this book set (0: none). */
  private latestEnd = 0;

  constructor(o: Partial<TrustOptions> & Pick<TrustOptions, 'now' | 'random'>) {
    this.o = { ...TRUST_DEFAULTS, ...o };
  }

  get(peer: string): TrustRecord {
    let r = this.records.get(peer);
    if (!r) {
      r = { peer, consecutive: 0, checks: 0, passes: 0, offences: 0, inconclusive: 0, refusals: 0, quarantinedUntil: 0, forceNext: false };
      this.records.set(peer, r);
    }
    return r;
  }

  peek(peer: string): TrustRecord | undefined {
    return this.records.get(peer);
  }

  /** The probability that a new session of `peer` is checked. */
  checkProbability(peer: string): number {
    const r = this.records.get(peer);
    if (!r || r.forceNext || r.consecutive < this.o.newNodeChecks) return 1;
    return Math.max(this.o.minRate, 1 / r.consecutive);
  }

  /** Draw whether to check a session of `peer` now. */
  draw(peer: string): boolean {
    const p = this.checkProbability(peer);
    return p >= 1 || this.o.random() < p;
  }

  pass(peer: string): void {
    this.judge(peer, 'pass');
  }

  inconclusive(peer: string): void {
    this.judge(peer, 'inconclusive');
  }

  refused(peer: string): void {
    this.judge(peer, 'refused');
  }

  /** Check the node's next session whatever its odds. */
  force(peer: string): void {
    this.judge(peer, 'force');
  }

  /**
   * The counters another tracker of the cluster stored for `peer`: they count every tracker's judgements
   * (ours included, once our write is in), so they replace ours. Quarantine and offence records stay as
   * they are: the registry shares the quarantine.
   */
  adopt(peer: string, c: TrustCounters): void {
    const r = this.get(peer);
    r.consecutive = c.consecutive;
    r.checks = c.checks;
    r.passes = c.passes;
    r.offences = c.offences;
    r.inconclusive = c.inconclusive;
    r.refusals = c.refusals;
    r.forceNext = c.force_next;
  }

  private judge(peer: string, outcome: TrustOutcome): TrustRecord {
    const r = this.get(peer);
    const c = applyOutcome(countersOf(r), outcome);
    this.adopt(peer, c);
    this.o.onOutcome?.(peer, outcome, c);
    return r;
  }

  /** A proven offence: quarantine for 15 min × 2^(offences − 1); returns the record with its `until`. */
  offence(o: Omit<OffenceRecord, 'id' | 'at' | 'until'>): OffenceRecord {
    const r = this.judge(o.peer, 'offence');
    const now = this.o.now();
    const until = Math.max(r.quarantinedUntil, now + this.o.quarantineMs * 2 ** Math.min(20, r.offences - 1));
    r.quarantinedUntil = until;
    this.latestEnd = Math.max(this.latestEnd, until);
    const rec: OffenceRecord = { id: `off-${now.toString(36)}-${Math.floor(this.o.random() * 1e9).toString(36)}`, at: now, until, ...o };
    this.offenceLog.push(rec);
    if (this.offenceLog.length > this.o.keepOffences) this.offenceLog.splice(0, this.offenceLog.length - this.o.keepOffences);
    this.o.onQuarantine?.(o.peer, until);
    return rec;
  }

  /** Is any peer quarantined now? (False: `quarantined` says no to every peer; checked once by a sweep over every node.) */
  anyQuarantined(): boolean {
    return this.latestEnd > this.o.now();
  }

  /** The latest end of any quarantine this book set, ms since epoch (0: none): nobody is quarantined past it. */
  get latestQuarantineEnd(): number {
    return this.latestEnd;
  }

  quarantined(peer: string): boolean {
    const r = this.records.get(peer);
    return r !== undefined && r.quarantinedUntil > this.o.now();
  }

  /** Nodes under quarantine now, with the end of it. */
  distrusted(): Array<{ peer_id: string; until: number }> {
    const now = this.o.now();
    const out: Array<{ peer_id: string; until: number }> = [];
    for (const r of this.records.values()) if (r.quarantinedUntil > now) out.push({ peer_id: r.peer, until: r.quarantinedUntil });
    return out;
  }

  /** Offences of `peer` at or after `since` (a generation that ran through it then is tainted). */
  offencesSince(peer: string, since: number): OffenceRecord[] {
    return this.offenceLog.filter((o) => o.peer === peer && o.at >= since);
  }
}
