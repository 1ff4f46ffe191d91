/**
 * What the tracker tells a client about the verification of its generation
 * (docs/verification.md): for every node that computed part of it, whether
 * that node was checked clean on this generation, not checked, still being
 * checked, or found wrong — on this generation, or later (a node proven to
 * lie after the answer was sent taints what it computed before: the answer
 * cannot be unsent, but the record says so).
 *
 * One record per generation (the tracker's request id of one choice),
 * attempts included (a head failover starts a new attempt on a new route).
 * Kept for `keepMs` (default one hour, at most `max` records), answered at
 * GET /v1/verifications/<id>.
 */
import type { TrustBook } from './trust.ts';

export type HopStatus = 'clean' | 'unchecked' | 'pending' | 'wrong';

export interface HopVerification {
  peer_id: string;
  start_layer?: number;
  end_layer?: number;
  /** The head's own layers, a hop of the route, or a replacement taken in mid-generation. */
  role: 'head' | 'hop' | 'replacement';
  status: HopStatus;
  /** Why unchecked or wrong, in words. */
  detail?: string;
}

export interface VerificationView {
  id: string;
  status: HopStatus;
  hops: HopVerification[];
  /** A head audit's finding: a route sharing no node with this one re-ran it and confirmed (or contradicted) every token. */
  audit?: { status: 'clean' | 'wrong'; detail: string };
  /** Where to ask again later (a pending check resolves; a later offence taints). */
  url: string;
}

interface Span {
  peer: string;
  start?: number;
  end?: number;
  role: HopVerification['role'];
  planned: boolean;
  result?: { outcome: 'clean' | 'wrong' | 'refused' | 'inconclusive' | 'skipped'; detail?: string };
}

interface Attempt {
  generation: string;
  head: string;
  spans: Span[];
  planExpires: number;
  /** Ends the attempt at once (its head was found lying): the generation fails over to another head. */
  abort?: () => void;
  /** Peers this attempt's route runs through now. */
  active: boolean;
}

export class GenerationRecord {
  readonly attempts: Attempt[] = [];
  private waiters: Array<() => void> = [];
  private auditResult: { status: 'clean' | 'wrong'; detail: string } | undefined;

  constructor(
    readonly id: string,
    readonly model: string,
    readonly startedAt: number,
  ) {}

  attempt(generation: string, head: string, spans: ReadonlyArray<{ peer: string; start: number; end: number }>, planned: ReadonlySet<string>, planExpires: number, abort?: () => void): Attempt {
    const a: Attempt = {
      generation,
      head,
      spans: spans.map((s, i) => ({ peer: s.peer, start: s.start, end: s.end, role: i === 0 ? 'head' : 'hop', planned: planned.has(`${s.peer}:${s.start}:${s.end}`) })),
      planExpires,
      active: true,
      ...(abort ? { abort } : {}),
    };
    this.attempts.push(a);
    return a;
  }

  replacement(generation: string, peers: readonly string[]): void {
    const a = this.attempts.find((x) => x.generation === generation);
    for (const p of peers) if (a && !a.spans.some((s) => s.peer === p)) a.spans.push({ peer: p, role: 'replacement', planned: false });
  }

  /** A check of `peer`'s span is now planned for attempt `generation` (a walk after a failed audit). */
  expect(generation: string, peer: string, start: number, end: number, expires: number): void {
    const a = this.attempts.find((x) => x.generation === generation);
    const s = a?.spans.find((x) => x.peer === peer && x.start === start && x.end === end);
    if (!a || !s) return;
    s.planned = true;
    a.planExpires = Math.max(a.planExpires, expires);
  }

  /** A verdict on `peer`'s span in attempt `generation`. */
  result(generation: string, peer: string, start: number, end: number, outcome: NonNullable<Span['result']>['outcome'], detail?: string): void {
    const a = this.attempts.find((x) => x.generation === generation);
    const s = a?.spans.find((x) => x.peer === peer && x.start === start && x.end === end);
    if (!s) return;
    // A later report never turns a proven lie back into something milder.
    if (s.result?.outcome !== 'wrong') s.result = { outcome, ...(detail ? { detail } : {}) };
    this.wake();
  }

  /** A head audit's finding for the whole generation (verify/audit.ts). */
  audited(status: 'clean' | 'wrong', detail: string): void {
    this.auditResult = { status, detail };
    this.wake();
  }

  ended(generation: string): void {
    const a = this.attempts.find((x) => x.generation === generation);
    if (a) {
      a.active = false;
      delete a.abort;
    }
    this.wake();
  }

  private wake(): void {
    if (!this.settled(Date.now())) return;
    for (const w of this.waiters.splice(0)) w();
  }

  /** True when no planned check of any attempt is still awaited. */
  settled(now: number): boolean {
    return this.attempts.every((a) => a.active === false && a.spans.every((s) => !s.planned || s.result !== undefined || now > a.planExpires));
  }

  /** Resolves when every planned check reported, or after `timeoutMs`. */
  waitSettled(timeoutMs: number): Promise<void> {
    if (this.settled(Date.now())) return Promise.resolve();
    return new Promise((resolve) => {
      const done = () => {
        clearTimeout(t);
        resolve();
      };
      const t = setTimeout(() => {
        this.waiters = this.waiters.filter((w) => w !== done);
        resolve();
      }, timeoutMs);
      this.waiters.push(done);
    });
  }

  view(trust: TrustBook, now: number, urlBase: string): VerificationView {
    const hops: HopVerification[] = [];
    for (const a of this.attempts) {
      for (const s of a.spans) {
        const later = trust.offencesSince(s.peer, this.startedAt);
        let status: HopStatus;
        let detail: string | undefined;
        if (s.result?.outcome === 'wrong') {
          status = 'wrong';
          detail = s.result.detail ?? 'a check of this generation found its output wrong';
        } else if (s.result?.outcome === 'clean') status = 'clean';
        else if (later.length > 0) {
          // Not checked here, and found lying since: what it computed here is not to be trusted.
          status = 'wrong';
          detail = `found lying at ${new Date(later[0]!.at).toISOString()} (offence ${later[0]!.id}); its part of this generation was not checked`;
        } else if (s.planned && !s.result && (a.active || now <= a.planExpires)) {
          status = 'pending';
          detail = 'a check is planned';
        } else {
          status = 'unchecked';
          detail = s.result?.outcome === 'refused' ? `it would not be checked (${s.result.detail ?? 'no valid attestation'})` : s.result?.outcome === 'inconclusive' ? 'its check was inconclusive' : s.result?.outcome === 'skipped' ? `its check could not run (${s.result.detail ?? 'no checker answered'})` : s.role === 'replacement' ? 'a replacement taken in mid-generation' : s.planned ? 'the check did not happen' : 'not sampled for a check';
        }
        hops.push({ peer_id: s.peer, ...(s.start !== undefined ? { start_layer: s.start, end_layer: s.end } : {}), role: s.role, status, ...(detail ? { detail } : {}) });
      }
    }
    let status = combine(hops.map((h) => h.status));
    // An audit re-ran the whole generation on a disjoint route: its word on the tokens outranks "not checked".
    if (this.auditResult?.status === 'wrong') status = 'wrong';
    else if (this.auditResult?.status === 'clean' && status !== 'wrong') status = 'clean';
    return { id: this.id, status, hops, ...(this.auditResult ? { audit: this.auditResult } : {}), url: `${urlBase}/v1/verifications/${encodeURIComponent(this.id)}` };
  }
}

/** The generation's status from its hops': any wrong → wrong; else any pending → pending; else any unchecked → unchecked; else clean. */
export function combine(statuses: readonly HopStatus[]): HopStatus {
  if (statuses.includes('wrong')) return 'wrong';
  if (statuses.includes('pending')) return 'pending';
  if (statuses.includes('unchecked') || statuses.length === 0) return 'unchecked';
  return 'clean';
}

export class VerificationLog {
  private readonly records = new Map<string, GenerationRecord>();
  private readonly byGeneration = new Map<string, GenerationRecord>();

  constructor(private readonly o: { now(): number; keepMs?: number; max?: number }) {}

  open(id: string, model: string): GenerationRecord {
    this.prune();
    const r = new GenerationRecord(id, model, this.o.now());
    this.records.set(id, r);
    return r;
  }

  /** Index an attempt's generation id (the heads' session prefix) to its record. */
  link(generation: string, r: GenerationRecord): void {
    this.byGeneration.set(generation, r);
  }

  get(id: string): GenerationRecord | undefined {
    return this.records.get(id);
  }

  ofGeneration(generation: string): GenerationRecord | undefined {
    return this.byGeneration.get(generation);
  }

  /** Attempts still running through `peer` (head or hop). */
  activeThrough(peer: string): Array<{ record: GenerationRecord; attempt: Attempt }> {
    const out: Array<{ record: GenerationRecord; attempt: Attempt }> = [];
    for (const r of this.records.values()) for (const a of r.attempts) if (a.active && a.spans.some((s) => s.peer === peer)) out.push({ record: r, attempt: a });
    return out;
  }

  private prune(): void {
    const cutoff = this.o.now() - (this.o.keepMs ?? 3_600_000);
    const max = this.o.max ?? 10_000;
    for (const [id, r] of this.records) {
      if (r.startedAt >= cutoff && this.records.size <= max) break;
      this.records.delete(id);
      for (const a of r.attempts) this.byGeneration.delete(a.generation);
    }
  }
}
