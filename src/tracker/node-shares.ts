/**
 * A node's share of its model's placement sums (placement.ts), and the one
 * way a record changes: `edit` takes the share out, applies the change and
 * puts the new share in, so the sums stay exact without a recount. The
 * registry owns the records and the sums; every change it, the sweep or a
 * copy from another tracker makes to a record goes through here.
 *
 * A share counts a node's assignment only while it holds it for placement
 * and its served span only while new chats may be routed through it: a
 * drain past its cover or a quarantine changes the share with no message,
 * which the sweep finds with `current`.
 */
import type { Span } from './assignment.ts';
import { NodeStatus, nodeStatus, sameSpan, type NodeRecord } from './node-record.ts';
import type { TrackerOptions } from './options.ts';
import type { Contribution, ModelPlacement } from './placement.ts';
import { perLayerMs } from './routing.ts';
import { drainCoverMs, type ShareCheck } from './sweep.ts';

/** What a node's share reads of the registry. */
export interface ShareSource {
  placement(modelName: string): ModelPlacement<NodeRecord>;
  throughput(n: NodeRecord): number;
  layerMs(n: NodeRecord): number;
  routable(n: NodeRecord): boolean;
  excluded(peerId: string): boolean;
}

export type ShareOptions = Pick<TrackerOptions, 'heartbeatIntervalMs' | 'deadAfterMissedHeartbeats' | 'now'>;

export class NodeShares {
  /**
   * When a share may next go stale with no change to its record: the earliest end of a drain cover among
   * the shares that count a draining node's assignment (Infinity: none does). Every share made notes its
   * own; {@link rescan} starts it again for a scan of every node, whose `current` notes those still counted.
   */
  private coverEnds = Infinity;

  constructor(
    private readonly reg: ShareSource,
    private readonly o: ShareOptions,
  ) {}

  /**
   * Change a node: take its share out of its model's sums, apply `change`,
   * put the new share in. Placement is marked for a rebalance when what it
   * decides on moved (spans, status), not on a throughput's drift.
   */
  edit(n: NodeRecord, change: () => void): void {
    const p = this.reg.placement(n.info.model);
    const before = n.contribution;
    // The sums hold `before` (not the record's fields), so the change can be made first: most heartbeats
    // change nothing the sums count, and then the record stays where it is (no re-sort, no new share kept).
    change();
    const after = this.contributionOf(n);
    if (before && sameContribution(before, after) && p.nodes.has(n)) return;
    p.detach(n);
    p.attach(n, after);
    if (!before || !sameSpan(before.assignment, after.assignment) || !sameSpan(before.serving, after.serving) || before.status !== after.status) p.dirty = true;
  }

  /**
   * The node's share of its model's sums: its assignment while it holds it
   * for placement, its served span while new sessions may be routed through
   * it (the availability map and routing's span groups count only those).
   */
  contributionOf(n: NodeRecord): Contribution {
    const status = nodeStatus(n);
    const assignment = this.countedAssignment(n);
    if (assignment && n.draining) this.noteCover(n);
    return {
      assignment,
      serving: this.countedServing(n),
      throughput: this.reg.throughput(n),
      cost: this.routeCost(n),
      status,
      mover: n.serving !== null && status === NodeStatus.Loading,
    };
  }

  /**
   * Is the node's share of the sums still what it would be now (a drain's grace or a quarantine changes it with no message)?
   * `at`: the sweep's time and whether anyone is excluded, read once for all its nodes.
   */
  current(n: NodeRecord, at: ShareCheck): boolean {
    const c = n.contribution;
    if (!c) return true;
    // What contributionOf would say, without making one: the sweep asks this of every node. A node neither draining
    // nor (nobody is) excluded counts its assignment and its served span as they are: no clock, no quarantine lookups
    // (at 10,000 nodes those were most of each sweep, every 5 s at every tracker of a cluster).
    if (!at.anyExcluded && !n.draining) return sameSpan(c.assignment, n.assignment) && sameSpan(c.serving, n.serving) && c.status === nodeStatus(n);
    if (c.assignment && n.draining) this.noteCover(n, at.now);
    return sameSpan(c.assignment, this.countedAssignment(n, at.now)) && sameSpan(c.serving, this.countedServing(n)) && c.status === nodeStatus(n);
  }

  /**
   * Until when every share stays current if no record changes and no exclusion begins or ends: the earliest
   * end of a drain cover a share still counts (Infinity: no share counts a draining node's assignment).
   */
  nextCoverEnd(): number {
    return this.coverEnds;
  }

  /** A scan asks `current` of every node now: the covers still counted are noted again as it goes (ended ones drop out). */
  rescan(): void {
    this.coverEnds = Infinity;
  }

  /** `n` is draining and its share counts its assignment: that stops when its cover ends. Past ends (at `now`) are not kept. */
  private noteCover(n: NodeRecord, now?: number): void {
    if (n.drainingSince === undefined) return;
    const end = n.drainingSince + drainCoverMs(this.o);
    if (end > (now ?? -Infinity) && end < this.coverEnds) this.coverEnds = end;
  }

  private countedAssignment(n: NodeRecord, now?: number): Span | null {
    return this.holds(n, now) ? n.assignment : null;
  }

  private countedServing(n: NodeRecord): Span | null {
    return this.reg.routable(n) ? n.serving : null;
  }

  /**
   * Whether a node counts as holding its assignment for placement (new nodes' spans, rebalancing):
   * a draining node does for a while — a short freeze or pause moves nobody — and then does not, so
   * joiners and spare nodes cover the layers of a node paused for long. A quarantined one does not.
   */
  private holds(n: NodeRecord, now?: number): boolean {
    return (!n.draining || n.drainingSince === undefined || (now ?? this.o.now()) - n.drainingSince < drainCoverMs(this.o)) && !this.reg.excluded(n.peerId);
  }

  /** The cost routing ranks a node by among the nodes of its span, and reads off the group in a pick (routing.ts perLayerMs). */
  private routeCost(n: NodeRecord): number {
    return perLayerMs(this.reg.layerMs(n), (n.stats?.queue_depth ?? 0) + n.inFlight);
  }
}

function sameContribution(a: Contribution, b: Contribution): boolean {
  return sameSpan(a.assignment, b.assignment) && sameSpan(a.serving, b.serving) && a.throughput === b.throughput && a.cost === b.cost && a.status === b.status && a.mover === b.mover;
}
