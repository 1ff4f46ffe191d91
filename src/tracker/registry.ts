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
 * This file keeps the records and the placement sums, and decides what a
 * register or heartbeat does: which record, which span. The jobs done over
 * them live beside it, each behind the registry's own methods: what a
 * message writes into a record (node-intake.ts), each node's share of the
 * sums, which every change goes through (node-shares.ts), another
 * tracker's copy (remote-copies.ts), the sweep and rebalance (sweep.ts),
 * route choice (route-choice.ts), the availability map (availability.ts),
 * what is kept by peer id beyond a record (peer-ledgers.ts, rejoin-grace.ts).
 */
import { MeshError } from '../protocol/errors.ts';
import type { NodeInfo, NodeMessage } from '../protocol/tracker.ts';
import { chooseSpanIn, type Move, type Span } from './assignment.ts';
import { availability, coverageOf, spanGroups } from './availability.ts';
import { sizedFor, spanBytes, type ModelSpec } from './model-registry.ts';
import { absorbStats, beatInto, registerInto, sameSizing } from './node-intake.ts';
import { budgetBytes, nodeStatus, unreachableWhy, validSpan, type NodeRecord, type NodeStatus, type RemoteRecord } from './node-record.ts';
import { NodeShares } from './node-shares.ts';
import type { TrackerOptions } from './options.ts';
import { kvFree, kvNeed, PeerLedgers } from './peer-ledgers.ts';
import { ModelPlacement } from './placement.ts';
import { RejoinGrace } from './rejoin-grace.ts';
import { RemoteCopies } from './remote-copies.ts';
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
  /**
   * The latest end of any exclusion `excluded` has said or will say yes for, ms since epoch (0: none ever): past
   * it, `excluded` says no to every peer id, so the sweep skips asking it per node, and a follower's sweep skips
   * its scan once it has scanned after that end. Whoever sets `excluded` sets this too (the default, like
   * `excluded`'s, excludes nobody).
   */
  exclusionsEnd: () => number = () => 0;
  /** Failures, quarantines and KV leases by peer id, beyond the records. */
  private readonly ledgers = new PeerLedgers();
  /** Nodes this tracker removed, and the spans of the silent ones held from moves for their rejoin grace. */
  private readonly grace = new RejoinGrace();
  /** Every change to a record goes through its `edit`, so the sums stay exact. */
  private readonly shares: NodeShares;
  private readonly remote: RemoteCopies;
  private readonly routing: RouteChoice;
  private readonly sweeper: PlacementSweep;

  constructor(
    models: readonly ModelSpec[],
    private readonly o: RegistryOptions,
    private readonly events: RegistryEvents = {},
  ) {
    this.models = new Map(models.map((m) => [m.name, m]));
    this.shares = new NodeShares(this, o);
    this.remote = new RemoteCopies(this, this.byId, this.shares, this.ledgers, this.grace, o, (n, reason) => this.drop(n, reason, true));
    this.routing = new RouteChoice(this, o);
    this.sweeper = new PlacementSweep(
      this,
      {
        edit: (n, change) => this.shares.edit(n, change),
        dropSilent: (n) => this.drop(n, 'missed heartbeats', false, true),
        current: (n, at) => this.shares.current(n, at),
        nextCoverEnd: () => this.shares.nextCoverEnd(),
        rescan: () => this.shares.rescan(),
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

  /** May `excluded` say yes to anyone now? False: it says no to every peer id. */
  anyExcluded(): boolean {
    return this.exclusionsEnd() > this.o.now();
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

  /** A generation starts (+1) or ends (-1) on `n`: its load, so its place among the nodes of its span. */
  addInFlight(n: NodeRecord, delta: number): void {
    if (this.nodes.get(n.peerId) !== n || !n.contribution) {
      // Gone from the registry meanwhile: only the count.
      n.inFlight = Math.max(0, n.inFlight + delta);
      return;
    }
    this.shares.edit(n, () => (n.inFlight = Math.max(0, n.inFlight + delta)));
  }

  /** A verified register message: (re)create the record and give it an assignment. */
  register(msg: NodeMessage): NodeRecord {
    const model = this.model(msg.info.model);
    const now = this.o.now();
    const prev = this.nodes.get(msg.peer_id);
    const wasDropped = !prev && this.grace.wasDropped(msg.peer_id);
    if (prev && prev.info.model !== msg.info.model) {
      // Another model now: it leaves the old one's placement for good.
      this.placement(prev.info.model).forget(prev);
      this.placement(prev.info.model).dirty = true;
    } else if (prev) this.placement(prev.info.model).detach(prev);
    const keep = prev && prev.assignment && sameSizing(prev.info, msg.info) ? prev.assignment : null;
    const rec = registerInto(prev, msg, model, now, this.lateMs(), this.o.heartbeatIntervalMs, this.ledgers);
    this.byId.set(rec.peerId, rec);
    this.grace.back(rec.peerId);
    absorbStats(rec, msg.stats, now, this.ledgers.kvHeldOn(rec.peerId));
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
    p.attach(rec, this.shares.contributionOf(rec));
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
    if (!sameSizing(rec.info, msg.info)) return this.register(msg);
    const now = this.o.now();
    const model = this.model(rec.info.model);
    this.shares.edit(rec, () => beatInto(rec, msg, model, now, this.lateMs(), this.ledgers.kvHeldOn(rec.peerId)));
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

  /** A record as another tracker of the cluster stored it: create or update the local copy (remote-copies.ts). */
  applyRemote(r: RemoteRecord): NodeRecord | undefined {
    return this.remote.apply(r);
  }

  /** Another tracker (the leader) dropped the node for silence and keeps its layers from moves until `until`: so do we. */
  vacateRemote(r: RemoteRecord, until: number): void {
    this.remote.vacate(r, until);
  }

  /** When the rejoin grace of a node dropped for silence ends (ms since epoch); undefined: it has none. */
  vacatedUntil(peerId: string): number | undefined {
    return this.grace.vacatedUntil(peerId, this.o.now());
  }

  /** Another tracker of the cluster removed the node: drop the local copy (no rebalance: the remover did its own). */
  removeRemote(peerId: string, reason = 'removed by another tracker'): boolean {
    return this.remote.remove(peerId, reason);
  }

  /** Another tracker heard from these nodes at `at` and told them `intervalMs` (one `seen` batch): their deadlines move as if we had. */
  touch(peerIds: readonly string[], at: number, intervalMs: number): void {
    this.remote.touch(peerIds, at, intervalMs);
  }

  private lateMs(): number {
    return this.o.lateMs?.() ?? 0;
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

  /** {@link routable} for one pick's nodes: with no exclusion in force, no lookup per node. */
  routableNow(): (n: NodeRecord) => boolean {
    return this.anyExcluded() ? (n) => this.routable(n) : (n) => !n.draining;
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

  /** Is any node (registered or not) quarantined now, by this tracker's judgement or another's? */
  anyQuarantined(): boolean {
    return this.ledgers.latestQuarantineEnd > this.o.now();
  }

  /** The latest end of any quarantine noted here (this tracker's or another's), ms since epoch; 0: none. */
  latestQuarantineEnd(): number {
    return this.ledgers.latestQuarantineEnd;
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
