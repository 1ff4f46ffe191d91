/**
 * Another tracker's word on a node, in a cluster (cluster/node-docs.ts,
 * seen-batches.ts): its copy of the record, its removal or drop for silence
 * (with the rejoin grace it keeps), and its `seen` batches. The local copy
 * follows, and the placement sums with it (node-shares.ts). Nothing is
 * decided here and no event fires: the change is not ours to announce.
 */
import type { ModelSpec } from './model-registry.ts';
import { copyRemote } from './node-intake.ts';
import type { NodeRecord, RemoteRecord } from './node-record.ts';
import type { NodeShares } from './node-shares.ts';
import type { TrackerOptions } from './options.ts';
import type { PeerLedgers } from './peer-ledgers.ts';
import type { ModelPlacement } from './placement.ts';
import type { RejoinGrace } from './rejoin-grace.ts';

/** What a copy reads of the registry. */
export interface CopySource {
  readonly models: ReadonlyMap<string, ModelSpec>;
  placement(modelName: string): ModelPlacement<NodeRecord>;
}

export type CopyOptions = Pick<TrackerOptions, 'heartbeatIntervalMs' | 'defaultLayerMs' | 'now'> & { lateMs?: () => number };

export class RemoteCopies {
  constructor(
    private readonly reg: CopySource,
    /** The registry's records by peer id, which a copy new here joins. */
    private readonly byId: Map<string, NodeRecord>,
    private readonly shares: NodeShares,
    private readonly ledgers: PeerLedgers,
    private readonly grace: RejoinGrace,
    private readonly o: CopyOptions,
    /** Drop the local copy through the registry (its listeners hear that another tracker removed it). */
    private readonly drop: (rec: NodeRecord, reason: string) => void,
  ) {}

  /**
   * A record as another tracker of the cluster stored it: create or update
   * the local copy (placement sums follow). What only this tracker counts
   * (generations in flight, failures, the stats history) stays.
   */
  apply(r: RemoteRecord): NodeRecord | undefined {
    if (!this.reg.models.has(r.info.model)) return undefined;
    let rec = this.byId.get(r.peerId);
    if (rec && rec.info.model !== r.info.model) {
      this.reg.placement(rec.info.model).forget(rec);
      rec.contribution = undefined;
    }
    const fresh = !rec;
    // Alive in the store (it registered again, at another tracker): its rejoin grace is over.
    this.grace.endVacated(r.peerId);
    if (!rec) {
      rec = { history: [], inFlight: 0, failures: this.ledgers.failuresOf(r.peerId), contribution: undefined, lateAtSeen: this.lateMs(), draining: false, drainingSince: undefined, lastTimestamp: 0 } as unknown as NodeRecord;
      this.byId.set(r.peerId, rec);
    }
    const target = rec;
    const apply = () => {
      copyRemote(target, r, fresh, () => this.lateMs());
      if (r.quarantinedUntil !== undefined && r.quarantinedUntil > (target.quarantinedUntil ?? 0)) {
        target.quarantinedUntil = r.quarantinedUntil;
        if (r.quarantinedUntil > this.ledgers.quarantinedUntil(r.peerId)) this.ledgers.noteQuarantine(r.peerId, r.quarantinedUntil);
      }
    };
    if (target.contribution) this.shares.edit(target, apply);
    else {
      apply();
      const p = this.reg.placement(target.info.model);
      p.attach(target, this.shares.contributionOf(target));
      p.dirty = true;
    }
    return target;
  }

  /**
   * Another tracker of the cluster (the leader) dropped the node for silence
   * and keeps its layers from moves until `until` (its shared document says
   * so: `vacated_until`, cluster/doc.ts): drop the local copy, and hold its
   * span as absent as the dropper does, so a leader elected meanwhile keeps
   * the same rejoin grace.
   */
  vacate(r: RemoteRecord, until: number): void {
    const rec = this.byId.get(r.peerId);
    if (rec) this.drop(rec, 'dropped for silence by another tracker');
    else this.grace.noteDropped(r.peerId);
    if (until <= this.o.now() || !r.assignment || !this.reg.models.has(r.info.model)) {
      this.grace.endVacated(r.peerId);
      return;
    }
    const layerMs = r.layerMsEwma !== undefined && r.layerMsEwma > 0 ? r.layerMsEwma : this.o.defaultLayerMs;
    this.grace.noteVacated(r.peerId, { model: r.info.model, span: r.assignment, throughput: 1000 / layerMs, until });
    this.reg.placement(r.info.model).dirty = true;
  }

  /** Another tracker of the cluster removed the node: drop the local copy (no rebalance: the remover did its own). */
  remove(peerId: string, reason: string): boolean {
    const rec = this.byId.get(peerId);
    if (!rec) return false;
    this.drop(rec, reason);
    return true;
  }

  /** Another tracker heard from these nodes at `at` and told them `intervalMs` (one `seen` batch): their deadlines move as if we had. */
  touch(peerIds: readonly string[], at: number, intervalMs: number): void {
    // Once per batch, not per node: a batch names every node another tracker heard from in a second.
    const late = this.lateMs();
    const period = Math.max(this.o.heartbeatIntervalMs, intervalMs);
    for (const id of peerIds) {
      const rec = this.byId.get(id);
      if (!rec) continue;
      if (at > rec.lastSeen) {
        rec.lastSeen = at;
        rec.lateAtSeen = late;
      }
      rec.intervalMs = period;
    }
  }

  private lateMs(): number {
    return this.o.lateMs?.() ?? 0;
  }
}
