/**
 * The tracker's view of the swarm: who is online, what each node was asked
 * to hold (assignment) and what it actually serves, its rolling stats, and
 * the routes through it.
 *
 * Everything here is rebuilt from register/heartbeat messages: a restarted
 * tracker answers the first heartbeat of an unknown node with 404, the node
 * registers again carrying the span it serves, and the tracker adopts that
 * span as its assignment. No state needs to survive a restart.
 */
import { MeshError } from '../protocol/errors.ts';
import type { NodeInfo, NodeMessage, NodeStats } from '../protocol/tracker.ts';
import { bestMove, chooseSpanIn, type Coverage, type Move, type RebalanceNode, type Span } from './assignment.ts';
import { sizedFor, spanBytes, type ModelSpec } from './model-registry.ts';
import type { TrackerOptions } from './options.ts';
import { ModelPlacement, type Contribution } from './placement.ts';
import { findRoutes, formatLayers, pickRoute, type RoutePlan, type ServingNode } from './routing.ts';

export const NodeStatus = {
  /** Told what to load; not serving it yet. */
  Loading: 'loading',
  /** Serves its assignment. */
  Serving: 'serving',
  /** Its budget holds no layer of the model. */
  Idle: 'idle',
  /** Serves, but takes no new sessions (paused, frozen, closing): routes leave it out. */
  Draining: 'draining',
} as const;
export type NodeStatus = (typeof NodeStatus)[keyof typeof NodeStatus];

/** One heartbeat's figures the dashboard draws (the rest of the stats are kept only as the latest). */
export interface StatsSample {
  at: number;
  rpm: number;
  layer_ms: number;
}

export interface NodeRecord {
  peerId: string;
  publicKey: string;
  relayAddr?: string;
  endpoint?: string;
  info: NodeInfo;
  assignment: Span | null;
  serving: Span | null;
  stats?: NodeStats;
  /** Last few heartbeats' figures, oldest first (rolling view for the dashboard). */
  history: StatsSample[];
  /** Smoothed ms per layer per step (EWMA of reported layer_ms). */
  layerMsEwma: number | undefined;
  registeredAt: number;
  lastSeen: number;
  /** The heartbeat period this tracker told the node last, ms: its deadline is counted in those. */
  intervalMs: number;
  /** The tracker's own late time (RegistryOptions.lateMs) when the node was last seen: silence while the tracker lagged is not the node's. */
  lateAtSeen: number;
  /** Generations this tracker currently runs through the node (head or hop). */
  inFlight: number;
  /**
   * Failures this tracker saw the node cause: as a head (its stream broke, not a relay outage) or as a
   * hop a head reported failed. Kept by peer id beyond the record (registry.failuresOf): a node removed
   * for missing heartbeats (a frozen page) finds its count again when it registers.
   */
  failures: number;
  /**
   * KV bytes this tracker's generations held on the node when its last
   * heartbeat arrived: what the heartbeat's use counts beyond that belongs
   * to other callers (or to sessions idling out).
   */
  kvHeldAtBeat: number;
  /** After a MESH_ERR_BUSY answer no new session is routed here before this time, ms since epoch. */
  busyUntil: number;
  /** The node's relay connection as its last message said (undefined: it did not say). */
  relayConnected?: boolean;
  /** Since when (the tracker's clock) the tracker could not reach the node, and why; cleared when it reaches it again. */
  unreachable?: { since: number; why: string };
  /** The node takes no new sessions (its last message said `draining`): no route, replacement or failover picks it. */
  draining: boolean;
  /**
   * Until when a tracker of the cluster quarantined it (a check proved it wrong), ms since epoch; absent when
   * none did. Shared through the cluster's registry, so every tracker routes around it, not only the judge.
   */
  quarantinedUntil?: number;
  /** When this tracker saw it start draining, ms since epoch (tracker clock). */
  drainingSince: number | undefined;
  /** The newest message timestamp applied (the node's clock): older messages are ignored. */
  lastTimestamp: number;
  /** What the node adds to its model's placement sums (placement.ts); the registry's own bookkeeping. */
  contribution: Contribution | undefined;
}

const HISTORY = 12;
/** Peers whose failure counts are kept. */
const FAILURE_LEDGER = 10_000;
const EWMA_ALPHA = 0.3;
/** Sweeps between rebalances when nothing changed (throughput drifts: a move may pay off later). */
const REBALANCE_EVERY_SWEEPS = 6;
/** Up to this many nodes of a model, a rebalance weighs every node's move; past it, one per span, budget and format. */
const EXACT_REBALANCE_NODES = 256;
/** Routes kept per boundary (routing.ts) and so the nodes of one span routing needs at most. */
const ROUTES_KEPT = 16;

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

/** A record as another tracker of the cluster wrote it (cluster/doc.ts reads it from the store). */
export interface RemoteRecord {
  peerId: string;
  publicKey: string;
  relayAddr?: string | undefined;
  endpoint?: string | undefined;
  info: NodeInfo;
  assignment: Span | null;
  serving: Span | null;
  stats?: NodeStats | undefined;
  layerMsEwma?: number | undefined;
  registeredAt: number;
  lastSeen: number;
  intervalMs: number;
  busyUntil: number;
  kvHeldAtBeat: number;
  draining: boolean;
  drainingSince: number | undefined;
  quarantinedUntil?: number | undefined;
}

export class NodeRegistry {
  /** Every node, by peer id. Read it; change nodes only through the registry's methods (they keep the placement sums). */
  readonly nodes: ReadonlyMap<string, NodeRecord> = new Map<string, NodeRecord>();
  readonly models: ReadonlyMap<string, ModelSpec>;
  /** KV bytes held on each node by this tracker's running generations (admission leases), by peer id. */
  private readonly kvHeld = new Map<string, number>();
  private readonly placements = new Map<string, ModelPlacement<NodeRecord>>();
  private sweeps = 0;
  /** Failures by peer id, registered or not (bounded: the oldest entries go first). */
  private readonly failureCounts = new Map<string, number>();
  /** Quarantines known here (judged here or by another tracker of the cluster): until when, by peer id, registered or not. */
  private readonly quarantineLedger = new Map<string, number>();
  /**
   * Nodes routing and coverage leave out while it says so (a quarantined node: docs/verification.md).
   * It stays registered and keeps its assignment; others are assigned around it (from the next sweep on;
   * routing leaves it out at once).
   */
  excluded: (peerId: string) => boolean = () => false;
  /**
   * Nodes this tracker removed (silent, or left), by peer id: one that comes back was away, not
   * re-registering after a tracker restart, so the span it still serves is not simply adopted.
   */
  private readonly dropped = new Set<string>();
  /**
   * Spans of nodes dropped for silence, by peer id, until their rejoin grace
   * ends: a closed tab reopened, a laptop woken, comes back with its span
   * and no download, so no serving node is moved onto those layers meanwhile
   * (new and idle nodes still take them). Only moves see them.
   */
  private readonly vacated = new Map<string, { model: string; span: Span; throughput: number; until: number }>();
  /** Per model, when the next rejoin grace ends (a rebalance is due then). */
  private readonly graceEnds = new Map<string, number>();

  constructor(
    models: readonly ModelSpec[],
    private readonly o: RegistryOptions,
    private readonly events: RegistryEvents = {},
  ) {
    this.models = new Map(models.map((m) => [m.name, m]));
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
    if (n.draining && n.serving) return NodeStatus.Draining;
    if (!n.assignment) return NodeStatus.Idle;
    if (n.serving && n.serving.start === n.assignment.start && n.serving.end === n.assignment.end) return NodeStatus.Serving;
    return NodeStatus.Loading;
  }

  /** The cost routing ranks a node by among the nodes of its span (routing.ts hopCostMs per layer). */
  private routeCost(n: NodeRecord): number {
    return this.layerMs(n) * (1 + Math.max(0, (n.stats?.queue_depth ?? 0) + n.inFlight));
  }

  /** How long a draining node still counts as holding its layers for placement: as long as a silent one would stay registered. */
  private drainCoverMs(): number {
    return this.o.deadAfterMissedHeartbeats * this.o.heartbeatIntervalMs;
  }

  /**
   * Whether a node counts as holding its assignment for placement (new nodes' spans, rebalancing):
   * a draining node does for a while — a short freeze or pause moves nobody — and then does not, so
   * joiners and spare nodes cover the layers of a node paused for long. A quarantined one does not.
   */
  private holds(n: NodeRecord): boolean {
    return (!n.draining || n.drainingSince === undefined || this.o.now() - n.drainingSince < this.drainCoverMs()) && !this.excluded(n.peerId);
  }

  /**
   * The node's share of its model's sums: its assignment while it holds it
   * for placement, its served span while new sessions may be routed through
   * it (the availability map and routing's span groups count only those).
   */
  private contributionOf(n: NodeRecord): Contribution {
    const status = this.status(n);
    return {
      assignment: this.holds(n) ? n.assignment : null,
      serving: this.routable(n) ? n.serving : null,
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
    const want = this.contributionOf(n);
    return sameSpan(c.assignment, want.assignment) && sameSpan(c.serving, want.serving) && c.status === want.status;
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
    const wasDropped = !prev && this.dropped.has(msg.peer_id);
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
    rec.failures = this.failureCounts.get(msg.peer_id) ?? 0;
    // A quarantine outlives the record: a node cannot wash it by registering again.
    const quarantined = this.quarantineLedger.get(msg.peer_id);
    if (quarantined !== undefined && quarantined > now) rec.quarantinedUntil = quarantined;
    if (msg.relay_connected !== undefined) rec.relayConnected = msg.relay_connected;
    else delete rec.relayConnected;
    delete rec.unreachable;
    rec.draining = draining;
    rec.drainingSince = draining ? (wasDraining ? prevDrainingSince : now) : undefined;
    rec.lastTimestamp = msg.timestamp;
    this.byId.set(rec.peerId, rec);
    this.dropped.delete(rec.peerId);
    this.vacated.delete(rec.peerId);
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
      if (!sameFlat(rec.info, msg.info)) rec.info = msg.info;
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
    const n = (this.failureCounts.get(peerId) ?? 0) + 1;
    this.failureCounts.delete(peerId);
    if (this.failureCounts.size >= FAILURE_LEDGER) this.failureCounts.delete(this.failureCounts.keys().next().value!);
    this.failureCounts.set(peerId, n);
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
    if (n.unreachable) return n.unreachable.why;
    if (n.endpoint) return undefined;
    if (n.relayAddr === undefined) return 'it has neither an endpoint nor a relay address';
    if (trackerRelayUp === false) return "the tracker's relay connection is down";
    if (n.relayConnected === false) return 'its relay connection is down (reconnecting)';
    return undefined;
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
    this.vacated.delete(r.peerId);
    if (!rec) {
      rec = { history: [], inFlight: 0, failures: this.failureCounts.get(r.peerId) ?? 0, contribution: undefined, lateAtSeen: this.lateMs(), draining: false, drainingSince: undefined, lastTimestamp: 0 } as unknown as NodeRecord;
      this.byId.set(r.peerId, rec);
    }
    const target = rec;
    const apply = () => {
      target.peerId = r.peerId;
      target.publicKey = r.publicKey;
      if (r.relayAddr !== undefined) target.relayAddr = r.relayAddr;
      else delete target.relayAddr;
      if (r.endpoint !== undefined) target.endpoint = r.endpoint;
      else delete target.endpoint;
      target.info = r.info;
      target.assignment = r.assignment;
      target.serving = r.serving;
      if (r.stats !== undefined) target.stats = r.stats;
      if (r.layerMsEwma !== undefined) target.layerMsEwma = r.layerMsEwma;
      target.registeredAt = r.registeredAt;
      // Seen: the later of what we heard and what the writer heard.
      if (fresh || r.lastSeen > target.lastSeen) {
        target.lastSeen = Math.max(target.lastSeen ?? 0, r.lastSeen);
        target.lateAtSeen = this.lateMs();
      }
      target.intervalMs = Math.max(target.intervalMs ?? 0, r.intervalMs);
      target.busyUntil = Math.max(target.busyUntil ?? 0, r.busyUntil);
      target.kvHeldAtBeat = r.kvHeldAtBeat;
      target.draining = r.draining;
      target.drainingSince = r.drainingSince;
      if (r.quarantinedUntil !== undefined && r.quarantinedUntil > (target.quarantinedUntil ?? 0)) {
        target.quarantinedUntil = r.quarantinedUntil;
        if (r.quarantinedUntil > (this.quarantineLedger.get(r.peerId) ?? 0)) this.noteQuarantine(r.peerId, r.quarantinedUntil);
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
    else this.noteDropped(r.peerId);
    if (until <= this.o.now() || !r.assignment || !this.models.has(r.info.model)) {
      this.vacated.delete(r.peerId);
      return;
    }
    const layerMs = r.layerMsEwma !== undefined && r.layerMsEwma > 0 ? r.layerMsEwma : this.o.defaultLayerMs;
    this.noteVacated(r.peerId, { model: r.info.model, span: r.assignment, throughput: 1000 / layerMs, until });
    this.placement(r.info.model).dirty = true;
  }

  /** When the rejoin grace of a node dropped for silence ends (ms since epoch); undefined: it has none. */
  vacatedUntil(peerId: string): number | undefined {
    const v = this.vacated.get(peerId);
    return v !== undefined && v.until > this.o.now() ? v.until : undefined;
  }

  private noteVacated(peerId: string, v: { model: string; span: Span; throughput: number; until: number }): void {
    this.vacated.delete(peerId);
    this.vacated.set(peerId, v);
    if (this.vacated.size > 10_000) this.vacated.delete(this.vacated.keys().next().value!);
  }

  private noteDropped(peerId: string): void {
    this.dropped.delete(peerId);
    this.dropped.add(peerId);
    // Bounded: the oldest go first (a Set iterates in insertion order).
    if (this.dropped.size > 10_000) this.dropped.delete(this.dropped.values().next().value!);
  }

  /** Another tracker of the cluster removed the node: drop the local copy (no rebalance: the remover did its own). */
  removeRemote(peerId: string, reason = 'removed by another tracker'): boolean {
    const rec = this.nodes.get(peerId);
    if (!rec) return false;
    this.drop(rec, reason, true);
    return true;
  }

  /** Another tracker heard from the node at `at` and told it `intervalMs`: its deadline moves as if we had. */
  touch(peerId: string, at: number, intervalMs?: number): void {
    const rec = this.nodes.get(peerId);
    if (!rec) return;
    if (at > rec.lastSeen) {
      rec.lastSeen = at;
      rec.lateAtSeen = this.lateMs();
    }
    if (intervalMs !== undefined) rec.intervalMs = Math.max(this.o.heartbeatIntervalMs, intervalMs);
  }

  private lateMs(): number {
    return this.o.lateMs?.() ?? 0;
  }

  private absorbStats(rec: NodeRecord, stats: NodeStats | undefined, now: number): void {
    if (!stats) return;
    if (!rec.stats || !sameFlat(rec.stats, stats)) rec.stats = stats;
    rec.kvHeldAtBeat = this.kvHeld.get(rec.peerId) ?? 0;
    // The oldest sample is reused once the history is full (no new long-lived object per beat).
    const sample = rec.history.length >= HISTORY ? rec.history.shift()! : ({} as StatsSample);
    sample.at = now;
    sample.rpm = stats.rpm;
    sample.layer_ms = stats.layer_ms;
    rec.history.push(sample);
    if (rec.history.length > HISTORY) rec.history.splice(0, rec.history.length - HISTORY);
    // A node that has not run a step yet reports 0: keep the estimate until it has.
    if (stats.layer_ms > 0) rec.layerMsEwma = rec.layerMsEwma === undefined ? stats.layer_ms : rec.layerMsEwma + EWMA_ALPHA * (stats.layer_ms - rec.layerMsEwma);
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
    const graceMs = this.rejoinGraceMs();
    if (grace && rec.assignment && graceMs > 0) {
      // A node that drained first (a closed tab's beacon) stopped counting when its drain cover ended.
      const from = rec.draining && rec.drainingSince !== undefined ? Math.min(this.o.now(), rec.drainingSince + this.drainCoverMs()) : this.o.now();
      this.noteVacated(rec.peerId, { model: rec.info.model, span: rec.assignment, throughput: this.throughput(rec), until: from + graceMs });
    }
    this.byId.delete(rec.peerId);
    this.placement(rec.info.model).forget(rec);
    this.noteDropped(rec.peerId);
    this.events.onRemoved?.(rec, reason, remote);
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

  /**
   * Drop nodes silent past their deadline, then rebalance each model whose
   * placement changed (and every few sweeps regardless: throughputs drift).
   * O(nodes) for the scan, O(layers) per model for the sums. Returns the removed ids.
   */
  sweep(opts: { decide?: boolean } = {}): string[] {
    const decide = opts.decide ?? true;
    const now = this.o.now();
    const late = this.lateMs();
    const dead: NodeRecord[] = [];
    // Only the tracker that decides (the only one, or the cluster's leader) removes and moves nodes.
    const stale: NodeRecord[] = [];
    for (const n of this.nodes.values()) {
      if (decide && this.silentTooLong(n, now, late)) dead.push(n);
      else if (!this.contributionCurrent(n)) stale.push(n);
    }
    for (const n of dead) this.drop(n, 'missed heartbeats', false, true);
    // A drain past its grace, a quarantine begun or ended: the sums follow.
    for (const n of stale) this.edit(n, () => {});
    this.sweeps++;
    for (const m of this.models.keys()) {
      const p = this.placement(m);
      p.recount();
      const graceEnded = now >= (this.graceEnds.get(m) ?? Infinity);
      if (decide && (p.dirty || graceEnded || this.sweeps % REBALANCE_EVERY_SWEEPS === 0)) this.rebalance(m);
    }
    return dead.map((n) => n.peerId);
  }

  /** Move a node where that clearly improves the worst-covered layer; moved nodes see it in their next answer. */
  rebalance(modelName: string): Move[] {
    const model = this.models.get(modelName);
    if (!model) return [];
    const p = this.placement(modelName);
    p.dirty = false;
    // Idle nodes (nothing fit before) get a chance whenever the picture changes.
    // A pinned node (its operator fixed the span) holds what it serves and is never moved: it would not follow.
    for (const n of p.nodes) {
      if (n.info.pinned && n.serving && !sameSpan(n.assignment, n.serving)) {
        this.edit(n, () => (n.assignment = n.serving));
        this.events.onChanged?.(n, 'assigned');
      } else if (!n.assignment && !n.info.pinned) {
        const to = chooseSpanIn(model, budgetBytes(n.info), p.assigned, n.info.weight_format);
        if (to) {
          this.edit(n, () => (n.assignment = to));
          this.events.onChanged?.(n, 'assigned');
        }
      }
    }
    p.dirty = false;
    // One move at a time, and none while a moved node still loads: each node switches spans when its load
    // ends, so two moves planned together (a swap) leave layers bare between the two switches, and chats
    // in that gap get 503s. A single move is judged on the placement without the mover's old span, and
    // the mover serves its old span until its new one is loaded, so it bares nothing the plan did not count.
    if (p.movers > 0) return [];
    // Movers only (every node's span is in the sums already). In a large swarm, nodes of one span, budget and
    // weight format differ only by speed: the fastest of each such group stands for it (its move gains most).
    const candidates = new Map<string, RebalanceNode>();
    const exact = p.size <= EXACT_REBALANCE_NODES;
    for (const n of p.nodes) {
      // Only nodes whose span the sums count (not draining for long, not quarantined): the move is judged on the sums without it.
      if (!n.assignment || !n.contribution?.assignment || n.info.pinned || this.status(n) !== NodeStatus.Serving) continue;
      const c: RebalanceNode = {
        id: n.peerId,
        start: n.assignment.start,
        end: n.assignment.end,
        throughput: n.contribution?.throughput ?? this.throughput(n),
        budgetBytes: budgetBytes(n.info),
        ...(n.info.weight_format ? { format: n.info.weight_format } : {}),
        movable: true,
      };
      const key = exact ? n.peerId : `${c.start}:${c.end}:${c.budgetBytes}:${c.format ?? ''}`;
      const had = candidates.get(key);
      if (!had || c.throughput > had.throughput) candidates.set(key, c);
    }
    // Nodes in their rejoin grace: a spare (a node none of whose layers it alone holds) may be moved onto their
    // layers at once; any other move is judged as if they were still there.
    const absent = this.absentSpans(modelName, p);
    const spares = absent ? [...candidates.values()].filter((c) => isSpare(c, p.assigned.count)) : [];
    const mv = (spares.length > 0 ? bestMove(model, p.assigned, spares, this.o.balanceQuality) : null) ?? bestMove(model, p.assigned, candidates.values(), this.o.balanceQuality, absent);
    if (!mv) return [];
    const n = this.nodes.get(mv.id)!;
    this.edit(n, () => (n.assignment = mv.to));
    this.events.onMoved?.(n, mv);
    this.events.onChanged?.(n, 'moved');
    return [mv];
  }

  private rejoinGraceMs(): number {
    return this.o.rejoinGraceMs ?? 0;
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
    const graceMs = this.rejoinGraceMs();
    const extra: Array<{ span: Span; throughput: number }> = [];
    let next = Infinity;
    for (const [id, v] of this.vacated) {
      if (v.model !== modelName) continue;
      if (v.until <= now) {
        this.vacated.delete(id);
        continue;
      }
      extra.push(v);
      next = Math.min(next, v.until);
    }
    if (graceMs > 0) {
      for (const n of p.nodes) {
        // Still counted (a short drain), or quarantined (never reserved), or nothing assigned.
        if (!n.draining || n.drainingSince === undefined || !n.assignment || n.contribution?.assignment || this.excluded(n.peerId)) continue;
        const until = n.drainingSince + this.drainCoverMs() + graceMs;
        if (until <= now) continue;
        extra.push({ span: n.assignment, throughput: this.throughput(n) });
        next = Math.min(next, until);
      }
    }
    if (next === Infinity) this.graceEnds.delete(modelName);
    else this.graceEnds.set(modelName, next);
    if (extra.length === 0) return undefined;
    const absent: Coverage = { count: new Array<number>(p.numLayers).fill(0), throughput: new Array<number>(p.numLayers).fill(0) };
    for (const x of extra) {
      for (let l = Math.max(0, x.span.start); l < Math.min(p.numLayers, x.span.end); l++) {
        absent.count[l]!++;
        absent.throughput[l]! += x.throughput;
      }
    }
    return absent;
  }

  /**
   * May new chats be routed through `n` (it serves a span)? One predicate for
   * routes, replacements and admission: a node left out (draining, in
   * quarantine) is tested here.
   */
  routable(n: NodeRecord): boolean {
    return !n.draining && !this.excluded(n.peerId);
  }

  private servingNode(n: NodeRecord): ServingNode {
    return { id: n.peerId, start: n.serving!.start, end: n.serving!.end, layerMs: this.layerMs(n), load: (n.stats?.queue_depth ?? 0) + n.inFlight };
  }

  /** Nodes of `model` that serve a span now (and pass `keep`), as routing sees them. O(nodes): routing uses {@link routeCandidates}. */
  servingNodes(model: string, exclude: ReadonlySet<string> = new Set(), keep?: (n: NodeRecord) => boolean): ServingNode[] {
    const out: ServingNode[] = [];
    for (const g of this.placement(model).groups.values()) {
      for (const n of g.nodes) {
        if (exclude.has(n.peerId) || !this.routable(n) || (keep && !keep(n))) continue;
        out.push(this.servingNode(n));
      }
    }
    return out;
  }

  /**
   * What the K-best route search needs of the serving nodes: of each span,
   * the K cheapest per layer (layer_ms × (1 + load)) that pass `keep`. A
   * route never holds two nodes of one span (the second could not start
   * where the first ends), so a node with K cheaper ones of its span is in
   * none of the K cheapest routes: the search over these finds the same
   * routes as over every node, and costs the same with 10 or 10,000 donors.
   */
  routeCandidates(model: string, exclude?: ReadonlySet<string>, keep?: (n: NodeRecord) => boolean): ServingNode[] {
    const out: ServingNode[] = [];
    for (const g of this.placement(model).groups.values()) {
      // Cheapest first: the first K that pass are the K cheapest that pass.
      let taken = 0;
      for (const n of g.nodes) {
        if (exclude?.has(n.peerId) || !this.routable(n) || (keep && !keep(n))) continue;
        out.push(this.servingNode(n));
        if (++taken === ROUTES_KEPT) break;
      }
    }
    return out;
  }

  // ------------------------------------------------------------ KV room (admission)

  /** KV bytes a session of `tokens` positions takes on `n`, in its blocks; 0 when the node does not report its KV. */
  kvNeed(n: NodeRecord, tokens: number): number {
    const st = n.stats;
    if (!st?.kv_bytes_per_token) return 0;
    const block = st.kv_block_tokens ?? 1;
    const t = Math.min(st.kv_max_tokens ?? Infinity, Math.max(block, Math.ceil(tokens / block) * block));
    return t * st.kv_bytes_per_token;
  }

  /**
   * KV bytes `n` can give a new session now, as far as this tracker knows:
   * its budget, less what other callers held at its last heartbeat, less
   * what this tracker's generations hold now. 0 while a MESH_ERR_BUSY answer
   * is fresh; Infinity for a node that does not report its KV (older nodes).
   */
  kvFree(n: NodeRecord): number {
    if (n.busyUntil > this.o.now()) return 0;
    const st = n.stats;
    if (st?.kv_budget_bytes === undefined) return Infinity;
    const usedAtBeat = st.kv_used_bytes ?? Math.max(0, st.kv_budget_bytes - st.kv_free_bytes);
    const foreign = Math.max(0, usedAtBeat - n.kvHeldAtBeat);
    return Math.max(0, st.kv_budget_bytes - foreign - (this.kvHeld.get(n.peerId) ?? 0));
  }

  /** KV bytes this tracker's generations hold on a node now. */
  kvHeldOn(peerId: string): number {
    return this.kvHeld.get(peerId) ?? 0;
  }

  /** Add (or, negative, give back) KV bytes a generation holds on a node. */
  holdKv(peerId: string, bytes: number): void {
    const v = Math.max(0, (this.kvHeld.get(peerId) ?? 0) + bytes);
    if (v === 0) this.kvHeld.delete(peerId);
    else this.kvHeld.set(peerId, v);
  }

  /** The node answered MESH_ERR_BUSY: route no new session to it for `ms`. */
  /**
   * A quarantine (a check proved the node wrong) until `until`: routing leaves the node out
   * (`isQuarantined`), and in a cluster every tracker learns it through the node's document.
   */
  quarantine(peerId: string, until: number): void {
    if ((this.quarantineLedger.get(peerId) ?? 0) >= until) return;
    this.noteQuarantine(peerId, until);
    const n = this.nodes.get(peerId);
    if (!n) return;
    n.quarantinedUntil = until;
    this.events.onChanged?.(n, 'quarantined');
  }

  /** Quarantined now, by this tracker's judgement or another's. */
  isQuarantined(peerId: string): boolean {
    return (this.quarantineLedger.get(peerId) ?? 0) > this.o.now();
  }

  /** Nodes quarantined now, with the end of it (expired entries are forgotten). */
  quarantines(): Array<{ peer_id: string; until: number }> {
    const now = this.o.now();
    const out: Array<{ peer_id: string; until: number }> = [];
    for (const [peer, until] of this.quarantineLedger) {
      if (until > now) out.push({ peer_id: peer, until });
      else this.quarantineLedger.delete(peer);
    }
    return out;
  }

  private noteQuarantine(peerId: string, until: number): void {
    this.quarantineLedger.delete(peerId);
    if (this.quarantineLedger.size >= FAILURE_LEDGER) this.quarantineLedger.delete(this.quarantineLedger.keys().next().value!);
    this.quarantineLedger.set(peerId, until);
  }

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
    const model = this.model(modelName);
    const end = model.numLayers;
    const costs = { hopLatencyMs: this.o.hopLatencyMs, keep: ROUTES_KEPT };
    const fit = this.routeCandidates(modelName, exclude, (n) => this.kvNeed(n, tokens) <= this.kvFree(n));
    const plan = pickRoute(findRoutes(fit, 0, end, costs), this.o.routeSlack, this.o.random);
    if (plan) return plan;
    const all = this.routeCandidates(modelName, exclude);
    if (findRoutes(all, 0, end, costs).length === 0) throw this.noRoute(modelName, all, 0, end);
    const ever = this.routeCandidates(modelName, exclude, (n) => n.stats?.kv_budget_bytes === undefined || this.kvNeed(n, tokens) <= n.stats.kv_budget_bytes);
    if (findRoutes(ever, 0, end, costs).length === 0) {
      throw new MeshError('MESH_ERR_TOO_LARGE', `a session of ${tokens} positions (prompt + max_tokens) does not fit the KV memory of any route of "${modelName}", even idle; ask for fewer tokens`, { tokens });
    }
    return undefined;
  }

  /** Routes over [from, to) of `model`, cheapest first. */
  routes(model: string, from: number, to: number, exclude?: ReadonlySet<string>): RoutePlan[] {
    return findRoutes(this.routeCandidates(model, exclude), from, to, { hopLatencyMs: this.o.hopLatencyMs, keep: ROUTES_KEPT });
  }

  /**
   * A route for one request over [from, to), picked among the near-best by
   * throughput; 503 naming the missing layers when none exists.
   */
  pick(modelName: string, exclude?: ReadonlySet<string>, from = 0, to?: number): RoutePlan {
    const model = this.model(modelName);
    const end = to ?? model.numLayers;
    const serving = this.routeCandidates(modelName, exclude);
    const plan = pickRoute(findRoutes(serving, from, end, { hopLatencyMs: this.o.hopLatencyMs, keep: ROUTES_KEPT }), this.o.routeSlack, this.o.random);
    if (plan) return plan;
    throw this.noRoute(modelName, serving, from, end);
  }

  private noRoute(modelName: string, serving: readonly ServingNode[], from: number, end: number): MeshError {
    const model = this.model(modelName);
    const missing = missingIn(serving, from, end);
    const loading = this.placement(modelName).statusCount.loading;
    return new MeshError(
      'MESH_ERR_UNAVAILABLE',
      `no route for model "${modelName}": layers ${formatLayers(missing)} of 0-${model.numLayers - 1} are not served by any node${loading ? ` (${loading} node(s) still loading)` : ''}; add nodes or wait for them to load`,
      { missing_layers: missing },
    );
  }

  /** Per layer how many nodes serve it, and the layers none serves: O(layers). */
  coverageOf(modelName: string): { count: number[]; throughput: number[]; missing: number[]; complete: boolean } {
    this.model(modelName);
    const p = this.placement(modelName);
    const missing = p.missing();
    return { count: [...p.serving.count], throughput: p.serving.throughput.map(round), missing, complete: missing.length === 0 };
  }

  /** Node counts of a model by status: O(1). */
  statusCounts(modelName: string): Readonly<Record<NodeStatus, number>> {
    return this.placement(modelName).statusCount;
  }

  /**
   * The availability map of one model: per layer, how many serve it and (the
   * first `idsPerLayer` of) who; the nodes, `offset`/`limit` of them.
   */
  availability(modelName: string, page: { offset?: number; limit?: number; idsPerLayer?: number } = {}) {
    const model = this.model(modelName);
    const p = this.placement(modelName);
    const cov = this.coverageOf(modelName);
    const idsPerLayer = page.idsPerLayer ?? Infinity;
    const offset = Math.max(0, page.offset ?? 0);
    const limit = Math.max(0, page.limit ?? Infinity);
    const layers = cov.count.map((count, layer) => {
      const ids: string[] = [];
      for (const g of p.groups.values()) {
        if (ids.length >= idsPerLayer) break;
        if (!(g.span.start <= layer && layer < g.span.end)) continue;
        for (const n of g.nodes) {
          if (ids.length >= idsPerLayer) break;
          ids.push(n.peerId);
        }
      }
      return { layer, nodes: ids, count, throughput: cov.throughput[layer]! };
    });
    const nodes: NodeRecord[] = [];
    let i = 0;
    for (const n of p.nodes) {
      if (nodes.length >= limit) break;
      if (i++ >= offset) nodes.push(n);
    }
    return {
      model: modelName,
      num_layers: model.numLayers,
      complete: cov.complete,
      missing_layers: cov.missing,
      nodes_total: p.size,
      layers,
      nodes: nodes.map((n) => ({
        peer_id: n.peerId,
        status: this.status(n),
        assignment: n.assignment && { start_layer: n.assignment.start, end_layer: n.assignment.end },
        serving: n.serving && { start_layer: n.serving.start, end_layer: n.serving.end },
        layer_ms: round(this.layerMs(n)),
        throughput: round(this.throughput(n)),
        backend: n.info.backend,
        host: n.info.host,
        relay: n.relayAddr !== undefined,
        direct: n.endpoint !== undefined,
        draining: n.draining,
        draining_since: n.drainingSince ?? null,
        duty_cycle: n.info.duty_cycle ?? 1,
      })),
    };
  }

  /** Nodes of a model grouped by span: per span, how many serve it and how many still load it. */
  spanGroups(modelName: string): Array<{ start_layer: number; end_layer: number; serving: number; loading: number }> {
    const bySpan = new Map<string, { start_layer: number; end_layer: number; serving: number; loading: number }>();
    for (const n of this.placement(modelName).nodes) {
      const s = n.assignment ?? n.serving;
      if (!s) continue;
      const key = `${s.start}:${s.end}`;
      let g = bySpan.get(key);
      if (!g) bySpan.set(key, (g = { start_layer: s.start, end_layer: s.end, serving: 0, loading: 0 }));
      const st = this.status(n);
      // A draining node counts as neither: it serves no new chat, and loads nothing.
      if (st === NodeStatus.Serving) g.serving++;
      else if (st === NodeStatus.Loading) g.loading++;
    }
    return [...bySpan.values()].sort((a, b) => a.start_layer - b.start_layer || a.end_layer - b.end_layer);
  }
}

function round(x: number): number {
  return Math.round(x * 1000) / 1000;
}

function sameSpan(a: Span | null | undefined, b: Span | null | undefined): boolean {
  return a === b || (!!a && !!b && a.start === b.start && a.end === b.end);
}

/** Layers of [from, to) none of `nodes` holds. */
function missingIn(nodes: readonly ServingNode[], from: number, to: number): number[] {
  const held = new Uint8Array(Math.max(0, to));
  for (const n of nodes) for (let l = Math.max(from, n.start); l < Math.min(to, n.end); l++) held[l] = 1;
  const out: number[] = [];
  for (let l = from; l < to; l++) if (!held[l]) out.push(l);
  return out;
}

function setAddresses(rec: NodeRecord, msg: NodeMessage): void {
  if (msg.relay_addr !== undefined) {
    if (rec.relayAddr !== msg.relay_addr) rec.relayAddr = msg.relay_addr;
  } else delete rec.relayAddr;
  if (msg.endpoint !== undefined) {
    if (rec.endpoint !== msg.endpoint) rec.endpoint = msg.endpoint;
  } else delete rec.endpoint;
}

/** Same keys, and each value the same primitive (an object-valued field counts as a change). */
function sameFlat(a: object, b: object): boolean {
  const ka = Object.keys(a);
  if (ka.length !== Object.keys(b).length) return false;
  for (const k of ka) {
    const x = (a as Record<string, unknown>)[k];
    if (typeof x === 'object' && x !== null) return false;
    if (x !== (b as Record<string, unknown>)[k] || !(k in b)) return false;
  }
  return true;
}

function sameContribution(a: Contribution, b: Contribution): boolean {
  return sameSpan(a.assignment, b.assignment) && sameSpan(a.serving, b.serving) && a.throughput === b.throughput && a.cost === b.cost && a.status === b.status && a.mover === b.mover;
}

export function budgetBytes(info: NodeInfo): number {
  return info.memory_budget_mb * 1024 * 1024;
}

function validSpan(s: { start_layer: number; end_layer: number } | null | undefined, model: ModelSpec): Span | null {
  if (!s || s.start_layer >= s.end_layer || s.end_layer > model.numLayers) return null;
  return { start: s.start_layer, end: s.end_layer };
}

/** A node every layer of whose span another node holds too: moving it bares nothing. */
function isSpare(n: Span, count: readonly number[]): boolean {
  for (let l = n.start; l < n.end; l++) if ((count[l] ?? 0) < 2) return false;
  return true;
}
