/**
 * The registry's periodic decisions: drop nodes silent past their deadline,
 * let the placement sums follow what changed with no message (a drain past
 * its cover, a quarantine begun or ended), and rebalance — idle nodes get a
 * span, pinned ones keep theirs, and at most one serving node moves
 * (move-choice.ts), with spans in their rejoin grace held from moves
 * (rejoin-grace.ts). Only the tracker that decides (the only one, or the
 * cluster's leader) drops and moves.
 */
import { chooseSpanIn, type Coverage, type Move, type Span } from './assignment.ts';
import type { ModelSpec } from './model-registry.ts';
import { chooseMove } from './move-choice.ts';
import { budgetBytes, sameSpan, type NodeRecord } from './node-record.ts';
import type { TrackerOptions } from './options.ts';
import type { ModelPlacement } from './placement.ts';
import type { RejoinGrace } from './rejoin-grace.ts';

/** Sweeps between rebalances when nothing changed (throughput drifts: a move may pay off later). */
const REBALANCE_EVERY_SWEEPS = 6;
/** Sweeps between exact recounts of the placement sums (a minute at the 5 s sweep). */
const RECOUNT_EVERY_SWEEPS = 12;

export type SweepOptions = Pick<TrackerOptions, 'heartbeatIntervalMs' | 'deadAfterMissedHeartbeats' | 'balanceQuality' | 'now'> &
  Partial<Pick<TrackerOptions, 'rejoinGraceMs'>> & { lateMs?: () => number };

/** What the sweep reads of the registry. */
export interface SweepSource {
  readonly nodes: ReadonlyMap<string, NodeRecord>;
  readonly models: ReadonlyMap<string, ModelSpec>;
  placement(modelName: string): ModelPlacement<NodeRecord>;
  throughput(n: NodeRecord): number;
  excluded(peerId: string): boolean;
  /**
   * The latest end of any exclusion `excluded` has said yes for, ms since epoch (0: none). Past it nobody is
   * excluded, so the scan skips `excluded` for every node; and once a scan ran after it, no exclusion's end is left to find.
   */
  exclusionsEnd(): number;
}

/**
 * What `SweepHands.current` reads once per sweep instead of once per node: the time, and
 * whether any node is excluded now (false: `excluded` would say no to every
 * peer id, so its two map lookups per node can be skipped).
 */
export interface ShareCheck {
  now: number;
  anyExcluded: boolean;
}

/** How the sweep changes records: only through the registry, which keeps the sums and tells its listeners. */
export interface SweepHands {
  /** Change `n` (its share of the sums follows). */
  edit(n: NodeRecord, change: () => void): void;
  /** Remove a node gone silent (its span is held for the rejoin grace). */
  dropSilent(n: NodeRecord): void;
  /** Is `n`'s share of the sums what it would be at `at.now`? */
  current(n: NodeRecord, at: ShareCheck): boolean;
  /** The earliest time a share goes stale with no message (a drain cover it counts ends); Infinity: none. */
  nextCoverEnd(): number;
  /** A scan of every node begins: `current` notes again the drain covers still counted. */
  rescan(): void;
  assigned(n: NodeRecord): void;
  moved(n: NodeRecord, move: Move): void;
}

/** How long a draining node still counts as holding its layers for placement: as long as a silent one would stay registered. */
export function drainCoverMs(o: Pick<TrackerOptions, 'deadAfterMissedHeartbeats' | 'heartbeatIntervalMs'>): number {
  return o.deadAfterMissedHeartbeats * o.heartbeatIntervalMs;
}

export class PlacementSweep {
  private sweeps = 0;
  /** The time of the last scan of every node (-Infinity: none yet). */
  private scannedAt = -Infinity;

  constructor(
    private readonly reg: SweepSource,
    private readonly hands: SweepHands,
    private readonly grace: RejoinGrace,
    private readonly o: SweepOptions,
  ) {}

  /**
   * Drop nodes silent past their deadline, then rebalance each model whose
   * placement changed (and every few sweeps regardless: throughputs drift).
   * O(nodes) for the scan, O(layers) per model for the sums. A follower
   * (`decide` false) scans only when a share may have gone stale since its
   * last scan (a drain cover ended, an exclusion began or ended). Returns the removed ids.
   */
  sweep(decide: boolean): string[] {
    const now = this.o.now();
    const dead: NodeRecord[] = [];
    // Read once for the scan: it visits every node at every tracker of a cluster each period.
    const exclusionsEnd = this.reg.exclusionsEnd();
    // A follower's scan looks only for stale shares, and one goes stale with no message only when a drain cover it
    // counts ends or an exclusion begins or ends: with none of those since the last scan it would find nothing.
    if (decide || now < this.scannedAt || exclusionsEnd > this.scannedAt || this.hands.nextCoverEnd() <= now) {
      const late = this.o.lateMs?.() ?? 0;
      const stale: NodeRecord[] = [];
      const at: ShareCheck = { now, anyExcluded: exclusionsEnd > now };
      this.scannedAt = now;
      this.hands.rescan();
      for (const n of this.reg.nodes.values()) {
        if (decide && this.silentTooLong(n, now, late)) dead.push(n);
        else if (!this.hands.current(n, at)) stale.push(n);
      }
      for (const n of dead) this.hands.dropSilent(n);
      // A drain past its grace, a quarantine begun or ended: the sums follow.
      for (const n of stale) this.hands.edit(n, () => {});
    }
    this.sweeps++;
    // Exact sums again every few sweeps: rounding drifts slowly, and a recount walks every node's layers.
    const recount = (this.sweeps - 1) % RECOUNT_EVERY_SWEEPS === 0;
    for (const m of this.reg.models.keys()) {
      const p = this.reg.placement(m);
      if (recount) p.recount();
      const graceEnded = now >= this.grace.nextEnd(m);
      if (decide && (p.dirty || graceEnded || this.sweeps % REBALANCE_EVERY_SWEEPS === 0)) this.rebalance(m);
    }
    return dead.map((n) => n.peerId);
  }

  /**
   * True when `n` has been silent for deadAfterMissedHeartbeats of the
   * periods it was told, not counting time the tracker itself was late.
   */
  private silentTooLong(n: NodeRecord, now: number, late: number): boolean {
    const period = Math.max(n.intervalMs ?? 0, this.o.heartbeatIntervalMs);
    const silence = now - n.lastSeen - Math.max(0, late - (n.lateAtSeen ?? 0));
    return silence > this.o.deadAfterMissedHeartbeats * period;
  }

  /** Move a node where that clearly improves the worst-covered layer; moved nodes see it in their next answer. */
  rebalance(modelName: string): Move[] {
    const model = this.reg.models.get(modelName);
    if (!model) return [];
    const p = this.reg.placement(modelName);
    p.dirty = false;
    // Idle nodes (nothing fit before) get a chance whenever the picture changes.
    // A pinned node (its operator fixed the span) holds what it serves and is never moved: it would not follow.
    for (const n of p.nodes) {
      if (n.info.pinned && n.serving && !sameSpan(n.assignment, n.serving)) {
        this.hands.edit(n, () => (n.assignment = n.serving));
        this.hands.assigned(n);
      } else if (!n.assignment && !n.info.pinned) {
        const to = chooseSpanIn(model, budgetBytes(n.info), p.assigned, n.info.weight_format);
        if (to) {
          this.hands.edit(n, () => (n.assignment = to));
          this.hands.assigned(n);
        }
      }
    }
    p.dirty = false;
    // One move at a time, and none while a moved node still loads: each node switches spans when its load
    // ends, so two moves planned together (a swap) leave layers bare between the two switches, and chats
    // in that gap get 503s. A single move is judged on the placement without the mover's old span, and
    // the mover serves its old span until its new one is loaded, so it bares nothing the plan did not count.
    if (p.movers > 0) return [];
    const mv = chooseMove(model, p, this.absentSpans(modelName, p), this.o.balanceQuality, (n) => this.reg.throughput(n));
    if (!mv) return [];
    const n = this.reg.nodes.get(mv.id)!;
    this.hands.edit(n, () => (n.assignment = mv.to));
    this.hands.moved(n, mv);
    return [mv];
  }

  /**
   * The spans of nodes in their rejoin grace — dropped for silence, or
   * draining past their drain cover (a page paused or frozen for long) —
   * which moves judge as still held: moving a node that serves others onto
   * those layers costs it a download and doubles them once the absent node
   * is back, so it is the last resort, after the grace. Notes when the next
   * grace ends (a rebalance is due then). Undefined: none.
   */
  private absentSpans(modelName: string, p: ModelPlacement<NodeRecord>): Coverage | undefined {
    const now = this.o.now();
    const graceMs = this.o.rejoinGraceMs ?? 0;
    const draining: Array<{ span: Span; throughput: number; until: number }> = [];
    if (graceMs > 0) {
      for (const n of p.nodes) {
        // Still counted (a short drain), or quarantined (never reserved), or nothing assigned.
        if (!n.draining || n.drainingSince === undefined || !n.assignment || n.contribution?.assignment || this.reg.excluded(n.peerId)) continue;
        const until = n.drainingSince + drainCoverMs(this.o) + graceMs;
        if (until <= now) continue;
        draining.push({ span: n.assignment, throughput: this.reg.throughput(n), until });
      }
    }
    return this.grace.absent(modelName, p.numLayers, now, draining);
  }
}
