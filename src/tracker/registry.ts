/**
 * The tracker's view of the swarm: who is online, what each node was asked
 * to hold (assignment) and what it actually serves, its rolling stats, and
 * the routes through it.
 *
 * Everything here is rebuilt from register/heartbeat messages: a restarted
 * tracker answers the first heartbeat of an unknown node with 404, the node
 * registers again carrying the span it serves, and the tracker adopts that
 * span as its assignment. No state needs to survive a restart.
 *
 * This file keeps the records and their share of the placement sums (every
 * change goes through `edit`, so the sums stay exact); the jobs done over
 * them live beside it, each behind the registry's own methods: the sweep
 * and rebalance (sweep.ts), route choice (route-choice.ts), the
 * availability map (availability.ts), what is kept by peer id beyond a
 * record (peer-ledgers.ts, rejoin-grace.ts).
 */
import { MeshError } from '../protocol/errors.ts';
import type { NodeInfo, NodeMessage } from '../protocol/tracker.ts';
import { chooseSpanIn, type Move, type Span } from './assignment.ts';
import { availability, coverageOf, spanGroups } from './availability.ts';
import { sizedFor, spanBytes, type ModelSpec } from './model-registry.ts';
import { absorbStats, budgetBytes, copyRemote, NodeStatus, nodeStatus, sameData, sameSpan, setAddresses, unreachableWhy, validSpan, type NodeRecord, type RemoteRecord } from './node-record.ts';
import type { TrackerOptions } from './options.ts';
import { kvFree, kvNeed, PeerLedgers } from './peer-ledgers.ts';
import { ModelPlacement, type Contribution } from './placement.ts';
import { RejoinGrace } from './rejoin-grace.ts';
import { RouteChoice } from './route-choice.ts';
import { drainCoverMs, PlacementSweep } from './sweep.ts';
import type { RoutePlan, ServingNode } from './routing.ts';

// What a record is lives in node-record.ts; the registry's importers find it here too.
export { budgetBytes, NodeStatus, type NodeRecord, type RemoteRecord, type StatsSample } from './node-record.ts';

export type RegistryOptions = Pick<TrackerOptions, 'heartbeatIntervalMs' | 'deadAfterMissedHeartbeats' | 'defaultLayerMs' | 'hopLatencyMs' | 'routeSlack' | 'balanceQuality' | 'now' | 'random'> &
  Partial<Pick<TrackerOptions, 'rejoinGraceMs'>> & {
  /**
   * How long the tracker has been late in all, ms, a counter that only grows
   * (LoadMonitor.lateMs): a stalled loop or a backlog of unanswered
   * heartbeats. The part of a node's silence that falls in such time is not
   * counted against it. Absent: 0 (never late).
   */
  lateMs?: () => number;
};

/** Why a record changed here (not from another tracker): what a cluster store mirrors. */
export type ChangeKind = 'register' | 'heartbeat' | 'assigned' | 'moved' | 'busy' | 'quarantined';

export interface RegistryEvents {
  /** `remote`: another tracker of the cluster removed it (nothing to tell anyone). */
  onRemoved?(node: NodeRecord, reason: string, remote: boolean): void;
  onMoved?(node: NodeRecord, move: Move): void;
  /** A record changed by this tracker's own decision or a message it received (never by applyRemote). */
  onChanged?(node: NodeRecord, kind: ChangeKind): void;
}

export class NodeRegistry {
  /** Every node, by peer id. Read it; change nodes only through the registry's methods (they keep the placement sums). */
  readonly nodes: ReadonlyMap<string, NodeRecord> = new Map<string, NodeRecord>();
  readonly models: ReadonlyMap<string, ModelSpec>;
  private readonly placements = new Map<string, ModelPlacement<NodeRecord>>();
  /**
   * Nodes routing and coverage leave out while it says so (a quarantined node: docs/verification.md).
   * It stays registered and keeps its assignment; others are assigned around it (from the next sweep on;
   * routing leaves it out at once).
   */
  excluded: (peerId: string) => boolean = () => false;
  /** Failures, quarantines and KV leases by peer id, beyond the records. */
  private readonly ledgers = new PeerLedgers();
  /** Nodes this tracker removed, and the spans of the silent ones held from moves for their rejoin grace. */
  private readonly grace = new RejoinGrace();
  private readonly routing: RouteChoice;
  private readonly sweeper: PlacementSweep;

  constructor(
    models: readonly ModelSpec[],
    private readonly o: RegistryOptions,
    private readonly events: RegistryEvents = {},
  ) {
    this.models = new Map(models.map((m) => [m.name, m]));
    this.routing = new RouteChoice(this, o);
    this.sweeper = new PlacementSweep(
      this,
      {
        edit: (n, change) => this.edit(n, change),
        dropSilent: (n) => this.drop(n, 'missed heartbeats', false, true),
        current: (n) => this.contributionCurrent(n),
        assigned: (n) => this.events.onChanged?.(n, 'assigned'),
        moved: (n, mv) => {
          this.events.onMoved?.(n, mv);
          this.events.onChanged?.(n, 'moved');
        },
      },
      this.grace,
      o,
    );
  }

  private get byId(): Map<string, NodeRecord> {
    return this.nodes as Map<string, NodeRecord>;
  }

  /** A model whose checkpoint loaded after the tracker started (ModelCatalog retries). */
  addModel(spec: ModelSpec): void {
    (this.models as Map<string, ModelSpec>).set(spec.name, spec);
  }

  model(name: string): ModelSpec {
    const m = this.models.get(name);
    if (!m) throw new MeshError('MESH_ERR_NOT_FOUND', `unknown model "${name}"; this tracker serves: ${[...this.models.keys()].join(', ') || '(none)'}`, { models: [...this.models.keys()] });
    return m;
  }

  /** The placement sums of a model (created empty on first use). */
  placement(modelName: string): ModelPlacement<NodeRecord> {
    let p = this.placements.get(modelName);
    if (!p) {
      p = new ModelPlacement<NodeRecord>(this.models.get(modelName)?.numLayers ?? 0);
      this.placements.set(modelName, p);
    }
    return p;
  }

  /** Layer-steps per second the node sustains. */
  throughput(n: NodeRecord): number {
    return 1000 / this.layerMs(n);
  }

  layerMs(n: NodeRecord): number {
    const v = n.layerMsEwma;
    return v !== undefined && v > 0 ? v : this.o.defaultLayerMs;
  }

  status(n: NodeRecord): NodeStatus {
    return nodeStatus(n);
  }

  /** The cost routing ranks a node by among the nodes of its span (routing.ts hopCostMs per layer). */
  private routeCost(n: NodeRecord): number {
    return this.layerMs(n) * (1 + Math.max(0, (n.stats?.queue_depth ?? 0) + n.inFlight));
  }

  /**
   * Whether a node counts as holding its assignment for placement (new nodes' spans, rebalancing):
   * a draining node does for a while — a short freeze or pause moves nobody — and then does not, so
   * joiners and spare nodes cover the layers of a node paused for long. A quarantined one does not.
   */
  private holds(n: NodeRecord): boolean {
    return (!n.draining || n.drainingSince === undefined || this.o.now() - n.drainingSince < drainCoverMs(this.o)) && !this.excluded(n.peerId);
  }

  /**
   * The node's share of its model's sums: its assignment while it holds it
   * for placement, its served span while new sessions may be routed through
   * it (the availability map and routing's span groups count only those).
   */
  private contributionOf(n: NodeRecord): Contribution {
    const status = this.status(n);
    return {
      assignment: this.countedAssignment(n),
      serving: this.countedServing(n),
      throughput: this.throughput(n),
      cost: this.routeCost(n),
      status,
      mover: n.serving !== null && status === NodeStatus.Loading,
    };
  }

  /** Is the node's share of the sums still what it would be now (a drain's grace or a quarantine changes it with no message)? */
  private contributionCurrent(n: NodeRecord): boolean {
    const c = n.contribution;
    if (!c) return true;
    // What contributionOf would say, without making one: the sweep asks this of every node.
    return sameSpan(c.assignment, this.countedAssignment(n)) && sameSpan(c.serving, this.countedServing(n)) && c.status === this.status(n);
  }

  private countedAssignment(n: NodeRecord): Span | null {
    return this.holds(n) ? n.assignment : null;
  }

  private countedServing(n: NodeRecord): Span | null {
    return this.routable(n) ? n.serving : null;
  }

  /** A generation starts (+1) or ends (-1) on `n`: its load, so its place among the nodes of its span. */
  addInFlight(n: NodeRecord, delta: number): void {
    if (this.nodes.get(n.peerId) !== n || !n.contribution) {
      // Gone from the registry meanwhile: only the count.
      n.inFlight = Math.max(0, n.inFlight + delta);
      return;
    }
    this.edit(n, () => (n.inFlight = Math.max(0, n.inFlight + delta)));
  }

  /**
   * Change a node: take its share out of its model's sums, apply `change`,
   * put the new share in. Placement is marked for a rebalance when what it
   * decides on moved (spans, status), not on a throughput's drift.
   */
  private edit(n: NodeRecord, change: () => void): void {
    const p = this.placement(n.info.model);
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

  /** A verified register message: (re)create the record and give it an assignment. */
  register(msg: NodeMessage): NodeRecord {
    const model = this.model(msg.info.model);
    const now = this.o.now();
    const prev = this.nodes.get(msg.peer_id);
    const draining = msg.draining === true;
    const wasDropped = !prev && this.grace.wasDropped(msg.peer_id);
    const wasDraining = prev?.draining === true;
    const prevDrainingSince = prev?.drainingSince;
    if (prev && prev.info.model !== msg.info.model) {
      // Another model now: it leaves the old one's placement for good.
      this.placement(prev.info.model).forget(prev);
      this.placement(prev.info.model).dirty = true;
    } else if (prev) this.placement(prev.info.model).detach(prev);
    const keep = prev && prev.info.model === msg.info.model && prev.assignment && prev.info.memory_budget_mb === msg.info.memory_budget_mb && prev.info.weight_format === msg.info.weight_format ? prev.assignment : null;
    // The same record object when the node comes back: generations in flight hold it (inFlight).
    const rec: NodeRecord = prev ?? ({ history: [], inFlight: 0, failures: 0, busyUntil: 0, layerMsEwma: undefined, contribution: undefined } as unknown as NodeRecord);
    rec.peerId = msg.peer_id;
    rec.publicKey = msg.public_key;
    setAddresses(rec, msg);
    rec.info = msg.info;
    rec.assignment = null;
    rec.serving = validSpan(msg.serving, model);
    rec.registeredAt = now;
    rec.lastSeen = now;
    rec.lateAtSeen = this.lateMs();
    rec.intervalMs = rec.intervalMs ?? this.o.heartbeatIntervalMs;
    rec.kvHeldAtBeat = 0;
    rec.failures = this.ledgers.failuresOf(msg.peer_id);
    // A quarantine outlives the record: a node cannot wash it by registering again.
    const quarantined = this.ledgers.quarantinedUntil(msg.peer_id);
    if (quarantined > now) rec.quarantinedUntil = quarantined;
    if (msg.relay_connected !== undefined) rec.relayConnected = msg.relay_connected;
    else delete rec.relayConnected;
    delete rec.unreachable;
    rec.draining = draining;
    rec.drainingSince = draining ? (wasDraining ? prevDrainingSince : now) : undefined;
    rec.lastTimestamp = msg.timestamp;
    this.byId.set(rec.peerId, rec);
    this.grace.back(rec.peerId);
    this.absorbStats(rec, msg.stats, now);
    const p = this.placement(model.name);
    if (keep) {
      // Re-registration (reconnect): keep what it was asked to hold.
      rec.assignment = keep;
    } else if (rec.serving && (msg.info.pinned || !wasDropped)) {
      // It already serves a span (a restarted tracker, or a pinned node): adopt it, no reload.
      rec.assignment = rec.serving;
    } else if (msg.info.pinned) {
      // Pinned but not serving yet: nothing to assign; it is adopted once its heartbeat says what it serves.
      rec.assignment = null;
    } else {
      // Everyone else's holdings: the sums, this node's own share taken out above.
      // A node back after this tracker dropped it (a page frozen or asleep for long) is placed as a fresh join, keeping
      // what it serves (or, a reloaded page, what it keeps in storage) with no download unless others took those layers while some lie bare.
      const budget = budgetBytes(msg.info);
      rec.assignment = this.restorable(model, budget, msg.serving ?? msg.stored, msg.info.weight_format, p.assigned.count) ?? chooseSpanIn(model, budget, p.assigned, msg.info.weight_format);
    }
    p.attach(rec, this.contributionOf(rec));
    p.dirty = true;
    this.events.onChanged?.(rec, 'register');
    return rec;
  }

  private restorable(model: ModelSpec, budget: number, span: NodeMessage['stored'], format: NodeInfo['weight_format'], count: readonly number[]): Span | null {
    const stored = validSpan(span, model);
    if (!stored || spanBytes(sizedFor(model, format), stored.start, stored.end) > budget) return null;
    const heldElsewhere = count.slice(stored.start, stored.end).every((c) => c > 0);
    return heldElsewhere && count.some((c) => c === 0) ? null : stored;
  }

  /** A verified heartbeat; 404 for a node this tracker does not know (it must register). */
  heartbeat(msg: NodeMessage): NodeRecord {
    const rec = this.nodes.get(msg.peer_id);
    if (!rec) throw new MeshError('MESH_ERR_NOT_FOUND', `peer ${msg.peer_id} is not registered here (tracker restarted or node expired); register again`);
    // An older message than one applied (a drain beacon or a beat the browser released after the page resumed): it says nothing new.
    if (msg.timestamp < rec.lastTimestamp) return rec;
    // A new budget or weight format changes how many layers fit: size the node again.
    if (rec.info.model !== msg.info.model || rec.info.memory_budget_mb !== msg.info.memory_budget_mb || rec.info.weight_format !== msg.info.weight_format) return this.register(msg);
    const now = this.o.now();
    const model = this.model(rec.info.model);
    this.edit(rec, () => {
      // At an equal timestamp a drain holds: the page's beacon and the heartbeat it was signed beside may arrive in either order.
      const draining = msg.draining === true || (msg.timestamp === rec.lastTimestamp && rec.draining);
      if (draining !== rec.draining) {
        rec.draining = draining;
        rec.drainingSince = draining ? now : undefined;
      }
      rec.lastTimestamp = msg.timestamp;
      rec.lastSeen = now;
      rec.lateAtSeen = this.lateMs();
      // What did not change keeps its old object: a beat's parsed copies then die young instead of
      // replacing thousands of long-lived objects a second, which the GC would copy and promote.
      if (!sameData(rec.info, msg.info)) rec.info = msg.info;
      if (rec.publicKey !== msg.public_key) rec.publicKey = msg.public_key;
      setAddresses(rec, msg);
      if (msg.relay_connected !== undefined) rec.relayConnected = msg.relay_connected;
      else delete rec.relayConnected;
      // Back on its relay (it beats at once when it is): the tracker's way to it is there again.
      if (msg.relay_connected === true) delete rec.unreachable;
      if (msg.serving !== undefined) {
        const serving = validSpan(msg.serving, model);
        if (!sameSpan(rec.serving, serving)) rec.serving = serving;
      }
      if (rec.info.pinned && rec.serving) rec.assignment = rec.serving;
      this.absorbStats(rec, msg.stats, now);
    });
    this.events.onChanged?.(rec, 'heartbeat');
    return rec;
  }

  /**
   * Count a failure against `peerId` (the node that failed: a head whose stream broke, a hop a head
   * reported), whether or not it is registered now; returns its count.
   */
  countFailure(peerId: string): number {
    const n = this.ledgers.countFailure(peerId);
    const rec = this.nodes.get(peerId);
    if (rec) rec.failures = n;
    return n;
  }

  /** The tracker failed to reach the node (a head over the relay, a probe): the dashboard says so until it reaches it again. */
  markUnreachable(peerId: string, why: string): void {
    const n = this.nodes.get(peerId);
    if (n && !n.unreachable) n.unreachable = { since: this.o.now(), why };
  }

  /** The tracker reached the node (a head's stream opened, a probe answered). */
  markReachable(peerId: string): void {
    const n = this.nodes.get(peerId);
    if (n) delete n.unreachable;
  }

  /**
   * Can the tracker reach the node now, as far as it knows: a node reached
   * only over the relay is unreachable while the tracker's relay connection
   * is down (`trackerRelayUp` false), while the node says its own is, or
   * after a failed reach until a good one. A string says why it is not.
   */
  unreachableWhy(n: NodeRecord, trackerRelayUp: boolean | undefined): string | undefined {
    return unreachableWhy(n, trackerRelayUp);
  }

  /**
   * A record as another tracker of the cluster stored it: create or update
   * the local copy (placement sums follow). What only this tracker counts
   * (generations in flight, failures, the stats history) stays. Nothing is
   * decided here and no event fires: the change is not ours to announce.
   */
  applyRemote(r: RemoteRecord): NodeRecord | undefined {
    if (!this.models.has(r.info.model)) return undefined;
    let rec = this.nodes.get(r.peerId);
    if (rec && rec.info.model !== r.info.model) {
      this.placement(rec.info.model).forget(rec);
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
    if (target.contribution) this.edit(target, apply);
    else {
      apply();
      const p = this.placement(target.info.model);
      p.attach(target, this.contributionOf(target));
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
  vacateRemote(r: RemoteRecord, until: number): void {
    const rec = this.nodes.get(r.peerId);
    if (rec) this.drop(rec, 'dropped for silence by another tracker', true);
    else this.grace.noteDropped(r.peerId);
    if (until <= this.o.now() || !r.assignment || !this.models.has(r.info.model)) {
      this.grace.endVacated(r.peerId);
      return;
    }
    const layerMs = r.layerMsEwma !== undefined && r.layerMsEwma > 0 ? r.layerMsEwma : this.o.defaultLayerMs;
    this.grace.noteVacated(r.peerId, { model: r.info.model, span: r.assignment, throughput: 1000 / layerMs, until });
    this.placement(r.info.model).dirty = true;
  }

  /** When the rejoin grace of a node dropped for silence ends (ms since epoch); undefined: it has none. */
  vacatedUntil(peerId: string): number | undefined {
    return this.grace.vacatedUntil(peerId, this.o.now());
  }

  /** Another tracker of the cluster removed the node: drop the local copy (no rebalance: the remover did its own). */
  removeRemote(peerId: string, reason = 'removed by another tracker'): boolean {
    const rec = this.nodes.get(peerId);
    if (!rec) return false;
    this.drop(rec, reason, true);
    return true;
  }

  /** Another tracker heard from these nodes at `at` and told them `intervalMs` (one `seen` batch): their deadlines move as if we had. */
  touch(peerIds: readonly string[], at: number, intervalMs: number): void {
    // Once per batch, not per node: a batch names every node another tracker heard from in a second.
    const late = this.lateMs();
    const period = Math.max(this.o.heartbeatIntervalMs, intervalMs);
    for (const id of peerIds) {
      const rec = this.nodes.get(id);
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

  private absorbStats(rec: NodeRecord, stats: NodeMessage['stats'], now: number): void {
    absorbStats(rec, stats, now, this.ledgers.kvHeldOn(rec.peerId));
  }

  /** Tell the registry what heartbeat period the node was just given (its deadline counts in it). */
  toldInterval(n: NodeRecord, ms: number): void {
    n.intervalMs = ms;
  }

  remove(peerId: string, reason: string): boolean {
    const rec = this.nodes.get(peerId);
    if (!rec) return false;
    this.drop(rec, reason);
    this.rebalance(rec.info.model);
    return true;
  }

  /** `grace`: the node went silent and may come back (its span is kept from moves for the rejoin grace). */
  private drop(rec: NodeRecord, reason: string, remote = false, grace = false): void {
    const graceMs = this.o.rejoinGraceMs ?? 0;
    if (grace && rec.assignment && graceMs > 0) {
      // A node that drained first (a closed tab's beacon) stopped counting when its drain cover ended.
      const from = rec.draining && rec.drainingSince !== undefined ? Math.min(this.o.now(), rec.drainingSince + drainCoverMs(this.o)) : this.o.now();
      this.grace.noteVacated(rec.peerId, { model: rec.info.model, span: rec.assignment, throughput: this.throughput(rec), until: from + graceMs });
    }
    this.byId.delete(rec.peerId);
    this.placement(rec.info.model).forget(rec);
    this.grace.noteDropped(rec.peerId);
    this.events.onRemoved?.(rec, reason, remote);
  }

  /**
   * Drop nodes silent past their deadline, then rebalance each model whose
   * placement changed (sweep.ts). `decide` false (a cluster's follower): no
   * drop and no move, only the sums follow. Returns the removed ids.
   */
  sweep(opts: { decide?: boolean } = {}): string[] {
    return this.sweeper.sweep(opts.decide ?? true);
  }

  /** Move a node where that clearly improves the worst-covered layer; moved nodes see it in their next answer. */
  rebalance(modelName: string): Move[] {
    return this.sweeper.rebalance(modelName);
  }

  /**
   * May new chats be routed through `n` (it serves a span)? One predicate for
   * routes, replacements and admission: a node left out (draining, in
   * quarantine) is tested here.
   */
  routable(n: NodeRecord): boolean {
    return !n.draining && !this.excluded(n.peerId);
  }

  /** Nodes of `model` that serve a span now (and pass `keep`), as routing sees them. O(nodes): routing uses {@link routeCandidates}. */
  servingNodes(model: string, exclude?: ReadonlySet<string>, keep?: (n: NodeRecord) => boolean): ServingNode[] {
    return this.routing.servingNodes(model, exclude, keep);
  }

  /** Of each span of `model`, the K cheapest serving nodes that pass `keep`: all the K-best route search needs (route-choice.ts). */
  routeCandidates(model: string, exclude?: ReadonlySet<string>, keep?: (n: NodeRecord) => boolean): ServingNode[] {
    return this.routing.routeCandidates(model, exclude, keep);
  }

  // ------------------------------------------------------------ KV room (admission)

  /** KV bytes a session of `tokens` positions takes on `n`, in its blocks; 0 when the node does not report its KV. */
  kvNeed(n: NodeRecord, tokens: number): number {
    return kvNeed(n, tokens);
  }

  /** KV bytes `n` can give a new session now, as far as this tracker knows (peer-ledgers.ts kvFree). */
  kvFree(n: NodeRecord): number {
    return kvFree(n, this.ledgers.kvHeldOn(n.peerId), this.o.now());
  }

  /** KV bytes this tracker's generations hold on a node now. */
  kvHeldOn(peerId: string): number {
    return this.ledgers.kvHeldOn(peerId);
  }

  /** Add (or, negative, give back) KV bytes a generation holds on a node. */
  holdKv(peerId: string, bytes: number): void {
    this.ledgers.holdKv(peerId, bytes);
  }

  /** The node answered MESH_ERR_BUSY: route no new session to it for `ms`. */
  /**
   * A quarantine (a check proved the node wrong) until `until`: routing leaves the node out
   * (`isQuarantined`), and in a cluster every tracker learns it through the node's document.
   */
  quarantine(peerId: string, until: number): void {
    if (this.ledgers.quarantinedUntil(peerId) >= until) return;
    this.ledgers.noteQuarantine(peerId, until);
    const n = this.nodes.get(peerId);
    if (!n) return;
    n.quarantinedUntil = until;
    this.events.onChanged?.(n, 'quarantined');
  }

  /** Quarantined now, by this tracker's judgement or another's. */
  isQuarantined(peerId: string): boolean {
    return this.ledgers.quarantinedUntil(peerId) > this.o.now();
  }

  /** Nodes quarantined now, with the end of it (expired entries are forgotten). */
  quarantines(): Array<{ peer_id: string; until: number }> {
    return this.ledgers.quarantines(this.o.now());
  }

  /** The node answered MESH_ERR_BUSY: route no new session to it for `ms`. */
  markBusy(peerId: string, ms: number): void {
    const n = this.nodes.get(peerId);
    if (!n) return;
    n.busyUntil = Math.max(n.busyUntil, this.o.now() + ms);
    this.events.onChanged?.(n, 'busy');
  }

  /**
   * A route over `model` whose every node has KV room for a session of
   * `tokens` positions now; undefined when routes exist but none has room
   * (the caller waits). Throws 503 when layers are missing, and 413 when no
   * route could hold such a session even empty.
   */
  pickWithRoom(modelName: string, tokens: number, exclude?: ReadonlySet<string>): RoutePlan | undefined {
    return this.routing.pickWithRoom(modelName, tokens, exclude);
  }

  /** Routes over [from, to) of `model`, cheapest first. */
  routes(model: string, from: number, to: number, exclude?: ReadonlySet<string>): RoutePlan[] {
    return this.routing.routes(model, from, to, exclude);
  }

  /** A route for one request over [from, to), picked among the near-best; 503 naming the missing layers when none exists. */
  pick(modelName: string, exclude?: ReadonlySet<string>, from = 0, to?: number): RoutePlan {
    return this.routing.pick(modelName, exclude, from, to);
  }

  /** Per layer how many nodes serve it, and the layers none serves: O(layers). */
  coverageOf(modelName: string): { count: number[]; throughput: number[]; missing: number[]; complete: boolean } {
    return coverageOf(this, modelName);
  }

  /** Node counts of a model by status: O(1). */
  statusCounts(modelName: string): Readonly<Record<NodeStatus, number>> {
    return this.placement(modelName).statusCount;
  }

  /** The availability map of one model (availability.ts). */
  availability(modelName: string, page: { offset?: number; limit?: number; idsPerLayer?: number } = {}) {
    return availability(this, modelName, page);
  }

  /** Nodes of a model grouped by span: per span, how many serve it and how many still load it. */
  spanGroups(modelName: string): Array<{ start_layer: number; end_layer: number; serving: number; loading: number }> {
    return spanGroups(this, modelName);
  }
}

function sameContribution(a: Contribution, b: Contribution): boolean {
  return sameSpan(a.assignment, b.assignment) && sameSpan(a.serving, b.serving) && a.throughput === b.throughput && a.cost === b.cost && a.status === b.status && a.mover === b.mover;
}
