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
import { chooseSpan, coverage, rebalance, type Holder, type Move, type Span } from './assignment.ts';
import { sizedFor, spanBytes, type ModelSpec } from './model-registry.ts';
import { findRoutes, formatLayers, missingLayers, pickRoute, type RoutePlan, type ServingNode } from './routing.ts';
import type { TrackerOptions } from './options.ts';

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

export interface StatsSample {
  at: number;
  stats: NodeStats;
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
  /** Last few heartbeats' stats, oldest first (rolling view for the dashboard). */
  history: StatsSample[];
  /** Smoothed ms per layer per step (EWMA of reported layer_ms). */
  layerMsEwma: number | undefined;
  registeredAt: number;
  lastSeen: number;
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
  /** When this tracker saw it start draining, ms since epoch (tracker clock). */
  drainingSince: number | undefined;
  /** The newest message timestamp applied (the node's clock): older messages are ignored. */
  lastTimestamp: number;
}

const HISTORY = 12;
/** Peers whose failure counts are kept. */
const FAILURE_LEDGER = 10_000;
const EWMA_ALPHA = 0.3;

export type RegistryOptions = Pick<TrackerOptions, 'heartbeatIntervalMs' | 'deadAfterMissedHeartbeats' | 'defaultLayerMs' | 'hopLatencyMs' | 'routeSlack' | 'balanceQuality' | 'now' | 'random'>;

export interface RegistryEvents {
  onRemoved?(node: NodeRecord, reason: string): void;
  onMoved?(node: NodeRecord, move: Move): void;
}

export class NodeRegistry {
  readonly nodes = new Map<string, NodeRecord>();
  readonly models: ReadonlyMap<string, ModelSpec>;
  /** KV bytes held on each node by this tracker's running generations (admission leases), by peer id. */
  private readonly kvHeld = new Map<string, number>();
  /** Failures by peer id, registered or not (bounded: the oldest entries go first). */
  private readonly failureCounts = new Map<string, number>();
  /**
   * Nodes routing and coverage leave out while it says so (a quarantined node: docs/verification.md).
   * It stays registered and keeps its assignment; others are assigned around it.
   */
  excluded: (peerId: string) => boolean = () => false;
  /**
   * Nodes this tracker removed (silent, or left), by peer id: one that comes back was away, not
   * re-registering after a tracker restart, so the span it still serves is not simply adopted.
   */
  private readonly dropped = new Set<string>();

  constructor(
    models: readonly ModelSpec[],
    private readonly o: RegistryOptions,
    private readonly events: RegistryEvents = {},
  ) {
    this.models = new Map(models.map((m) => [m.name, m]));
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

  /** How long a draining node still counts as holding its layers for placement: as long as a silent one would stay registered. */
  private drainCoverMs(): number {
    return this.o.deadAfterMissedHeartbeats * this.o.heartbeatIntervalMs;
  }

  /**
   * Whether a node counts as holding its assignment for placement (new nodes' spans, rebalancing):
   * a draining node does for a while — a short freeze or pause moves nobody — and then does not, so
   * joiners and spare nodes cover the layers of a node paused for long.
   */
  private holds(n: NodeRecord): boolean {
    return !n.draining || n.drainingSince === undefined || this.o.now() - n.drainingSince < this.drainCoverMs();
  }

  private holders(model: string, except?: string): Holder[] {
    const out: Holder[] = [];
    for (const n of this.nodes.values()) {
      if (n.info.model !== model || n.peerId === except || !n.assignment || !this.holds(n) || this.excluded(n.peerId)) continue;
      out.push({ id: n.peerId, start: n.assignment.start, end: n.assignment.end, throughput: this.throughput(n) });
    }
    return out;
  }

  /** A verified register message: (re)create the record and give it an assignment. */
  register(msg: NodeMessage): NodeRecord {
    const model = this.model(msg.info.model);
    const now = this.o.now();
    const prev = this.nodes.get(msg.peer_id);
    const draining = msg.draining === true;
    const wasDropped = !prev && this.dropped.has(msg.peer_id);
    const rec: NodeRecord = {
      peerId: msg.peer_id,
      publicKey: msg.public_key,
      relayAddr: msg.relay_addr,
      endpoint: msg.endpoint,
      info: msg.info,
      assignment: null,
      serving: validSpan(msg.serving, model),
      history: prev?.history ?? [],
      layerMsEwma: prev?.layerMsEwma,
      registeredAt: now,
      lastSeen: now,
      inFlight: prev?.inFlight ?? 0,
      failures: this.failureCounts.get(msg.peer_id) ?? 0,
      kvHeldAtBeat: 0,
      busyUntil: prev?.busyUntil ?? 0,
      ...(msg.relay_connected !== undefined ? { relayConnected: msg.relay_connected } : {}),
      draining,
      drainingSince: draining ? (prev?.draining ? prev.drainingSince : now) : undefined,
      lastTimestamp: msg.timestamp,
    };
    this.nodes.set(rec.peerId, rec);
    this.dropped.delete(rec.peerId);
    this.absorbStats(rec, msg.stats, now);
    const budget = budgetBytes(msg.info);
    if (prev && prev.info.model === msg.info.model && prev.assignment && prev.info.memory_budget_mb === msg.info.memory_budget_mb && prev.info.weight_format === msg.info.weight_format) {
      // Re-registration (reconnect): keep what it was asked to hold.
      rec.assignment = prev.assignment;
    } else if (rec.serving && (msg.info.pinned || !wasDropped)) {
      // It already serves a span (a restarted tracker, or a pinned node): adopt it, no reload.
      rec.assignment = rec.serving;
    } else if (msg.info.pinned) {
      // Pinned but not serving yet: nothing to assign; it is adopted once its heartbeat says what it serves.
      rec.assignment = null;
    } else {
      const others = this.holders(model.name, rec.peerId);
      // A node back after this tracker dropped it (a page frozen or asleep for long) is placed as a fresh join, keeping
      // what it serves (or, a reloaded page, what it keeps in storage) with no download unless others took those layers while some lie bare.
      rec.assignment = this.restorable(model, budget, msg.serving ?? msg.stored, msg.info.weight_format, others) ?? chooseSpan(model, budget, others, msg.info.weight_format);
    }
    return rec;
  }

  private restorable(model: ModelSpec, budget: number, span: NodeMessage['stored'], format: NodeInfo['weight_format'], others: Holder[]): Span | null {
    const stored = validSpan(span, model);
    if (!stored || spanBytes(sizedFor(model, format), stored.start, stored.end) > budget) return null;
    const cov = coverage(model.numLayers, others).count;
    const heldElsewhere = cov.slice(stored.start, stored.end).every((c) => c > 0);
    return heldElsewhere && cov.some((c) => c === 0) ? null : stored;
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
    // At an equal timestamp a drain holds: the page's beacon and the heartbeat it was signed beside may arrive in either order.
    const draining = msg.draining === true || (msg.timestamp === rec.lastTimestamp && rec.draining);
    if (draining !== rec.draining) {
      rec.draining = draining;
      rec.drainingSince = draining ? now : undefined;
    }
    rec.lastTimestamp = msg.timestamp;
    rec.lastSeen = now;
    rec.info = msg.info;
    rec.publicKey = msg.public_key;
    rec.relayAddr = msg.relay_addr;
    rec.endpoint = msg.endpoint;
    rec.relayConnected = msg.relay_connected;
    // Back on its relay (it beats at once when it is): the tracker's way to it is there again.
    if (msg.relay_connected === true) delete rec.unreachable;
    if (msg.serving !== undefined) rec.serving = validSpan(msg.serving, this.model(rec.info.model));
    if (rec.info.pinned && rec.serving) rec.assignment = rec.serving;
    this.absorbStats(rec, msg.stats, now);
    return rec;
  }

  private absorbStats(rec: NodeRecord, stats: NodeStats | undefined, now: number): void {
    if (!stats) return;
    rec.stats = stats;
    rec.kvHeldAtBeat = this.kvHeld.get(rec.peerId) ?? 0;
    rec.history.push({ at: now, stats });
    if (rec.history.length > HISTORY) rec.history.splice(0, rec.history.length - HISTORY);
    // A node that has not run a step yet reports 0: keep the estimate until it has.
    if (stats.layer_ms > 0) rec.layerMsEwma = rec.layerMsEwma === undefined ? stats.layer_ms : rec.layerMsEwma + EWMA_ALPHA * (stats.layer_ms - rec.layerMsEwma);
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

  private forget(peerId: string): void {
    this.dropped.add(peerId);
    // Bounded: the oldest go first (a Set iterates in insertion order).
    if (this.dropped.size > 10_000) this.dropped.delete(this.dropped.values().next().value!);
  }

  remove(peerId: string, reason: string): boolean {
    const rec = this.nodes.get(peerId);
    if (!rec) return false;
    this.nodes.delete(peerId);
    this.forget(peerId);
    this.events.onRemoved?.(rec, reason);
    this.rebalance(rec.info.model);
    return true;
  }

  /** Drop nodes silent for deadAfterMissedHeartbeats × interval, then rebalance every model. Returns the removed ids. */
  sweep(): string[] {
    const cutoff = this.o.now() - this.o.deadAfterMissedHeartbeats * this.o.heartbeatIntervalMs;
    const dead = [...this.nodes.values()].filter((n) => n.lastSeen < cutoff);
    for (const n of dead) {
      this.nodes.delete(n.peerId);
      this.forget(n.peerId);
      this.events.onRemoved?.(n, 'missed heartbeats');
    }
    for (const m of this.models.keys()) this.rebalance(m);
    return dead.map((n) => n.peerId);
  }

  /** Move nodes where that clearly improves the worst-covered layer; moved nodes see it in their next answer. */
  rebalance(modelName: string): Move[] {
    const model = this.models.get(modelName);
    if (!model) return [];
    const nodes = [...this.nodes.values()].filter((n) => n.info.model === modelName);
    // Idle nodes (nothing fit before) get a chance whenever the picture changes.
    // A pinned node (its operator fixed the span) holds what it serves and is never moved: it would not follow.
    for (const n of nodes) if (n.info.pinned && n.serving) n.assignment = n.serving;
    for (const n of nodes) if (!n.assignment && !n.info.pinned) n.assignment = chooseSpan(model, budgetBytes(n.info), this.holders(modelName, n.peerId), n.info.weight_format);
    // One move at a time, and none while a moved node still loads: each node switches spans when its load
    // ends, so two moves planned together (a swap) leave layers bare between the two switches, and chats
    // in that gap get 503s. A single move is judged on the placement without the mover's old span, and
    // the mover serves its old span until its new one is loaded, so it bares nothing the plan did not count.
    if (nodes.some((n) => n.serving && this.status(n) === NodeStatus.Loading)) return [];
    const moves = rebalance(
      model,
      // A node draining for long no longer counts as covering its layers (holds()): spare nodes may move to cover them.
      nodes.filter((n) => n.assignment && this.holds(n)).map((n) => ({
        id: n.peerId,
        start: n.assignment!.start,
        end: n.assignment!.end,
        throughput: this.throughput(n),
        budgetBytes: budgetBytes(n.info),
        ...(n.info.weight_format ? { format: n.info.weight_format } : {}),
        movable: this.status(n) === NodeStatus.Serving && !n.info.pinned,
      })),
      this.o.balanceQuality,
    ).slice(0, 1);
    for (const mv of moves) {
      const n = this.nodes.get(mv.id)!;
      n.assignment = mv.to;
      this.events.onMoved?.(n, mv);
    }
    return moves;
  }

  /** Whether new sessions may be routed through a node that serves (a draining or quarantined one takes none). */
  routable(n: NodeRecord): boolean {
    return !n.draining && !this.excluded(n.peerId);
  }

  /** Nodes of `model` that serve a span now (and pass `keep`), as routing sees them. */
  servingNodes(model: string, exclude: ReadonlySet<string> = new Set(), keep?: (n: NodeRecord) => boolean): ServingNode[] {
    const out: ServingNode[] = [];
    for (const n of this.nodes.values()) {
      if (n.info.model !== model || !n.serving || exclude.has(n.peerId) || !this.routable(n)) continue;
      if (keep && !keep(n)) continue;
      out.push({ id: n.peerId, start: n.serving.start, end: n.serving.end, layerMs: this.layerMs(n), load: (n.stats?.queue_depth ?? 0) + n.inFlight });
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
  markBusy(peerId: string, ms: number): void {
    const n = this.nodes.get(peerId);
    if (n) n.busyUntil = Math.max(n.busyUntil, this.o.now() + ms);
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
    const costs = { hopLatencyMs: this.o.hopLatencyMs };
    const fit = this.servingNodes(modelName, exclude, (n) => this.kvNeed(n, tokens) <= this.kvFree(n));
    const plan = pickRoute(findRoutes(fit, 0, end, costs), this.o.routeSlack, this.o.random);
    if (plan) return plan;
    const all = this.servingNodes(modelName, exclude);
    if (findRoutes(all, 0, end, costs).length === 0) throw this.noRoute(modelName, all, 0, end);
    const ever = this.servingNodes(modelName, exclude, (n) => n.stats?.kv_budget_bytes === undefined || this.kvNeed(n, tokens) <= n.stats.kv_budget_bytes);
    if (findRoutes(ever, 0, end, costs).length === 0) {
      throw new MeshError('MESH_ERR_TOO_LARGE', `a session of ${tokens} positions (prompt + max_tokens) does not fit the KV memory of any route of "${modelName}", even idle; ask for fewer tokens`, { tokens });
    }
    return undefined;
  }

  /** Routes over [from, to) of `model`, cheapest first. */
  routes(model: string, from: number, to: number, exclude?: ReadonlySet<string>): RoutePlan[] {
    return findRoutes(this.servingNodes(model, exclude), from, to, { hopLatencyMs: this.o.hopLatencyMs });
  }

  /**
   * A route for one request over [from, to), picked among the near-best by
   * throughput; 503 naming the missing layers when none exists.
   */
  pick(modelName: string, exclude?: ReadonlySet<string>, from = 0, to?: number): RoutePlan {
    const model = this.model(modelName);
    const end = to ?? model.numLayers;
    const serving = this.servingNodes(modelName, exclude);
    const plan = pickRoute(findRoutes(serving, from, end, { hopLatencyMs: this.o.hopLatencyMs }), this.o.routeSlack, this.o.random);
    if (plan) return plan;
    throw this.noRoute(modelName, serving, from, end);
  }

  private noRoute(modelName: string, serving: readonly ServingNode[], from: number, end: number): MeshError {
    const model = this.model(modelName);
    const missing = missingLayers(serving, from, end);
    const loading = [...this.nodes.values()].filter((n) => n.info.model === modelName && this.status(n) === NodeStatus.Loading).length;
    return new MeshError(
      'MESH_ERR_UNAVAILABLE',
      `no route for model "${modelName}": layers ${formatLayers(missing)} of 0-${model.numLayers - 1} are not served by any node${loading ? ` (${loading} node(s) still loading)` : ''}; add nodes or wait for them to load`,
      { missing_layers: missing },
    );
  }

  /** The availability map of one model: per layer, who holds it. */
  availability(modelName: string) {
    const model = this.model(modelName);
    const nodes = [...this.nodes.values()].filter((n) => n.info.model === modelName);
    const serving = this.servingNodes(modelName);
    const cov = coverage(
      model.numLayers,
      serving.map((s) => ({ id: s.id, start: s.start, end: s.end, throughput: 1000 / s.layerMs })),
    );
    const missing = missingLayers(serving, 0, model.numLayers);
    return {
      model: modelName,
      num_layers: model.numLayers,
      complete: missing.length === 0,
      missing_layers: missing,
      layers: cov.count.map((count, layer) => ({
        layer,
        nodes: serving.filter((s) => s.start <= layer && layer < s.end).map((s) => s.id),
        count,
        throughput: round(cov.throughput[layer]!),
      })),
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
}

function round(x: number): number {
  return Math.round(x * 1000) / 1000;
}

export function budgetBytes(info: NodeInfo): number {
  return info.memory_budget_mb * 1024 * 1024;
}

function validSpan(s: { start_layer: number; end_layer: number } | null | undefined, model: ModelSpec): Span | null {
  if (!s || s.start_layer >= s.end_layer || s.end_layer > model.numLayers) return null;
  return { start: s.start_layer, end: s.end_layer };
}
