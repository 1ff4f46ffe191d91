/**
 * A tracker as one stateless replica of a cluster: the registry lives in a
 * JetStream KV bucket (cluster/doc.ts), every tracker keeps all of it in
 * memory from the bucket's watch (the NodeRegistry it routes from), and any
 * tracker answers any registration, heartbeat or chat.
 *
 *   node ── register ──▶ tracker A ── CAS create/update node.<id> ──▶ KV ──watch──▶ every tracker's registry
 *   node ── heartbeat ─▶ tracker B ── (only when routing-relevant state moved) ──▶ KV
 *                                  └─ peer id into the next `seen` batch (1/s, core NATS) ──▶ every tracker
 *   leader (KV lease) ── removes silent nodes, moves nodes (CAS) ──▶ KV
 *
 * Who writes what:
 * - A node's document is only ever written by compare-and-swap on its
 *   revision. Two trackers racing on one node (the node registering at both,
 *   or a move against a heartbeat): one write wins, the other reads the
 *   winner and merges its own fields into it (a heartbeat's fields are the
 *   node's; an assignment stays the stored one), so they cannot both win.
 * - A new node's first span is chosen by the tracker it registers with (its
 *   create either wins or adopts the stored one). Every later change of an
 *   assignment (rebalancing) and every removal is the leader's: one tracker
 *   holding `lease.leader`, renewed by CAS every `leaseMs / 3`, taken over by
 *   CAS when its revision has not moved for `leaseMs` by the taker's own clock.
 * - Heartbeats mostly write nothing: liveness travels as `seen` batches
 *   (peer ids heard in the last second), which every tracker applies, so the
 *   leader's deadlines hold whichever tracker a node beats to. A heartbeat
 *   writes the node's document only when what routing reads moved (served
 *   span, addresses, info, queue, KV room, speed) or the stored one is old.
 * - A node the leader drops for silence keeps its document through its
 *   rejoin grace, marked `vacated_until` (a tombstone): every tracker drops
 *   its copy and holds the span from moves until then, as the leader does,
 *   so a leader elected meanwhile keeps the grace. The node registering
 *   again rewrites it live; the leader deletes it when the grace ends.
 * - A chat's KV room (admission lease) is `route.<id>`, written by the
 *   tracker running it and removed when it ends; every tracker counts every
 *   route's bytes against the nodes' KV. A tracker that stops answering is
 *   declared gone by the leader after `trackerGoneMs`, with its routes.
 *
 * Failure:
 * - NATS unreachable at start: connectNats throws one line naming the URL.
 * - NATS lost: the tracker keeps answering from its copy (`/healthz` says
 *   so); nobody is removed and nothing moves while any tracker is blind or
 *   behind (the time is "late" time, excused from every deadline); writes
 *   that failed are kept and written on reconnect.
 * - The bucket lost (NATS restarted without its store): recreated, and every
 *   tracker writes back the nodes it heard from within their deadline; nodes
 *   nobody has heard from register again on their next heartbeat (404).
 * - A malformed document or batch is dropped and counted
 *   (`meshnet_tracker_cluster_dropped_total{kind}`), never applied.
 */
import { Kvm, type KV, type KvEntry } from '@nats-io/kv';
import type { Subscription } from '@nats-io/transport-node';
import type { Logger } from 'pino';
import type { NatsHandle } from '../../cluster/nats.ts';
import { trackerSubjects } from '../../cluster/subjects.ts';
import type { LeaseObserver } from '../admission.ts';
import type { TrackerMetrics } from '../metrics.ts';
import { applyOutcome, type TrustCounters, type TrustOutcome } from '../verify/trust.ts';
import type { ChangeKind, NodeRecord, NodeRegistry } from '../registry.ts';
import { keys, leaseDocSchema, nodeDocOf, nodeDocSchema, remoteOf, routeDocSchema, seenSchema, trackerDocSchema, type NodeDoc, type RouteDoc, type TrackerDoc } from './doc.ts';

export interface ClusterSelf {
  peerId: string;
  publicKey: string;
  url: string;
  /** The relay the tracker is attached to (base of its relay address), when it is. */
  relay?: string;
  cert?: TrackerDoc['cert'];
}

/** A relay address without its `/rpc/<peer id>`: which relay it is. */
export function relayBase(addr: string | undefined): string | undefined {
  if (!addr) return undefined;
  const i = addr.lastIndexOf('/rpc/');
  return i < 0 ? addr : addr.slice(0, i);
}

export interface ClusterStoreOptions {
  /** The heartbeat period the tracker is configured with, ms. */
  heartbeatIntervalMs: number;
  /** A lease not renewed for this long (by the taker's own clock) may be taken over. @defaultValue 6000 */
  leaseMs?: number;
  /** Seen batches, ms. @defaultValue 1000 */
  seenEveryMs?: number;
  /** A tracker whose batches stop for this long is late (nobody is removed meanwhile). @defaultValue 3000 */
  overdueMs?: number;
  /** ... and for this long is gone: the leader deletes its key and its routes. @defaultValue 15000 */
  trackerGoneMs?: number;
  /** A node's stored document older than this is rewritten by the tracker that hears it (the bucket's TTL is a backstop). @defaultValue 1800000 */
  docRefreshMs?: number;
  /** KV operations' timeout, ms. @defaultValue 2000 */
  opTimeoutMs?: number;
  now?: () => number;
}

export interface ClusterStoreInit {
  nats: NatsHandle;
  cluster: string;
  registry: NodeRegistry;
  self: ClusterSelf;
  options: ClusterStoreOptions;
  logger: Pick<Logger, 'info' | 'warn' | 'debug' | 'error'>;
  metrics: Pick<TrackerMetrics, 'clusterDropped' | 'clusterWrites'>;
  /** The heartbeat period this tracker hands out now, and whether it is behind (load.ts). */
  load: { intervalMs(): number; readonly current: { behind: boolean } };
}

export interface ClusterStatus {
  nats: 'connected' | 'reconnecting' | 'closed';
  leader: string | null;
  is_leader: boolean;
  bucket: 'ok' | 'lost';
  trackers: number;
  /** Writes that failed and wait for NATS. */
  pending_writes: number;
  dropped: number;
}

/** Bucket TTL: a backstop only (the leader removes what is dead); documents are rewritten well within it. */
const BUCKET_TTL_MS = 6 * 3600_000;
const WRONG_LAST_SEQUENCE = 10071;

function isConflict(e: unknown): boolean {
  return (e as { code?: number })?.code === WRONG_LAST_SEQUENCE || /wrong last sequence/i.test((e as Error)?.message ?? '');
}

function sameSpan(a: { start: number; end: number } | null | undefined, b: { start: number; end: number } | null | undefined): boolean {
  return a === b || (!!a && !!b && a.start === b.start && a.end === b.end);
}

/** Does the stored document miss something routing reads from `n` (so a heartbeat must be written)? */
export function beatNeedsWrite(n: NodeRecord, d: NodeDoc | undefined, now: number, refreshMs: number): boolean {
  if (!d) return true;
  if (!sameSpan(n.serving, d.serving) || n.publicKey !== d.public_key || n.relayAddr !== d.relay_addr || n.endpoint !== d.endpoint) return true;
  if (JSON.stringify(n.info) !== JSON.stringify(d.info) || n.draining !== (d.draining === true)) return true;
  if (now - d.last_seen > refreshMs) return true;
  const a = n.stats;
  const b = d.stats;
  if (!a !== !b) return true;
  if (a && b) {
    if (a.queue_depth !== b.queue_depth || (a.kv_sessions ?? 0) !== (b.kv_sessions ?? 0) || a.kv_budget_bytes !== b.kv_budget_bytes || a.kv_bytes_per_token !== b.kv_bytes_per_token) return true;
    const scale = Math.max(1, a.kv_budget_bytes ?? a.kv_free_bytes);
    if (Math.abs((a.kv_used_bytes ?? 0) - (b.kv_used_bytes ?? 0)) > 0.05 * scale || Math.abs(a.kv_free_bytes - b.kv_free_bytes) > 0.05 * scale) return true;
  }
  const e1 = n.layerMsEwma;
  const e2 = d.layer_ms_ewma;
  if ((e1 === undefined) !== (e2 === undefined)) return true;
  return e1 !== undefined && e2 !== undefined && Math.abs(e1 - e2) > 0.2 * e2;
}

export class ClusterStore implements LeaseObserver {
  private kv!: KV;
  private readonly subjects;
  private readonly o: Required<Omit<ClusterStoreOptions, 'now'>> & { now: () => number };
  /** Stored node documents with their revisions (what a CAS write builds on). */
  private readonly nodes = new Map<string, { doc: NodeDoc; rev: number }>();
  private readonly routes = new Map<string, { doc: RouteDoc; rev: number }>();
  private readonly trackers = new Map<string, { doc?: TrackerDoc; beaconAt: number; behind: boolean }>();
  private lease: { by: string; rev: number; seenAt: number } | undefined;
  private leaseRenewedAt = 0;
  /** Peers heard from since the last batch. */
  private seenIds = new Set<string>();
  /** Node documents to write (by peer id) and why. */
  private readonly pending = new Map<string, ChangeKind | 'remove'>();
  private readonly routeOps = new Map<string, Promise<void>>();
  private readonly trustOps = new Map<string, Promise<void>>();
  private wasConnected = true;
  private flushing = false;
  private lateTotal = 0;
  private lastLateTick = 0;
  private readonly startedAt: number;
  private bucketLost = false;
  private closed = false;
  private timers: Array<ReturnType<typeof setInterval>> = [];
  private sub: Subscription | undefined;
  private watchGen = 0;
  dropped = 0;
  private trustSink: ((peerId: string, counters: TrustCounters) => void) | undefined;

  /** Check counters stored by the cluster for a node go to `sink` (the verification service: app.ts), those read at start first. */
  set onTrust(sink: ((peerId: string, counters: TrustCounters) => void) | undefined) {
    this.trustSink = sink;
    if (sink) for (const [peer, { doc }] of this.nodes) if (doc.trust) sink(peer, doc.trust);
  }

  get onTrust(): ((peerId: string, counters: TrustCounters) => void) | undefined {
    return this.trustSink;
  }

  private constructor(private readonly init: ClusterStoreInit) {
    this.subjects = trackerSubjects(init.cluster);
    const o = init.options;
    this.o = {
      heartbeatIntervalMs: o.heartbeatIntervalMs,
      leaseMs: o.leaseMs ?? 6000,
      seenEveryMs: o.seenEveryMs ?? 1000,
      overdueMs: o.overdueMs ?? 3000,
      trackerGoneMs: o.trackerGoneMs ?? 15_000,
      docRefreshMs: o.docRefreshMs ?? 1_800_000,
      opTimeoutMs: o.opTimeoutMs ?? 2000,
      now: o.now ?? (() => Date.now()),
    };
    this.startedAt = this.o.now();
    this.lastLateTick = this.startedAt;
  }

  /** Open (or create) the bucket, load the registry from it, and start the watch, the batches and the lease. */
  static async start(init: ClusterStoreInit): Promise<ClusterStore> {
    const s = new ClusterStore(init);
    await s.openBucket();
    await s.watch();
    await s.announce();
    s.sub = init.nats.nc.subscribe(s.subjects.seen, { callback: (err, msg) => (err ? undefined : s.onSeen(msg.data)) });
    s.timers.push(setInterval(() => s.publishSeen(), s.o.seenEveryMs));
    s.timers.push(setInterval(() => void s.tickLease(), Math.max(200, Math.floor(s.o.leaseMs / 3))));
    s.timers.push(setInterval(() => s.tickLate(), 500));
    s.timers.push(setInterval(() => void s.checkBucket(), 2000));
    for (const t of s.timers) t.unref?.();
    void s.tickLease();
    return s;
  }

  private get me(): string {
    return this.init.self.peerId;
  }

  private get connected(): boolean {
    return this.init.nats.status() === 'connected';
  }

  private async openBucket(): Promise<void> {
    const kvm = new Kvm(this.init.nats.nc);
    this.kv = await kvm.create(this.subjects.registryBucket, { history: 1, ttl: BUCKET_TTL_MS, timeout: this.o.opTimeoutMs });
  }

  // ------------------------------------------------------------ reading: the watch

  private async watch(): Promise<void> {
    const gen = ++this.watchGen;
    const initial = (await this.kv.status()).values;
    const it = await this.kv.watch();
    let ready: () => void = () => {};
    const done = new Promise<void>((r) => (ready = r));
    if (initial === 0) ready();
    void (async () => {
      try {
        for await (const e of it) {
          if (gen !== this.watchGen) break;
          this.onEntry(e, !e.isUpdate);
          if ((e.delta ?? 0) === 0) ready();
        }
      } catch (err) {
        this.init.logger.warn({ err: (err as Error).message }, 'cluster: registry watch ended; restarting it');
      }
      ready();
      // An ordered consumer recovers from reconnects by itself; one that ends (the stream lost) is started again by checkBucket.
      if (gen === this.watchGen && !this.closed) this.watchGen++;
    })();
    // The first snapshot before serving: a tracker that answered from an empty copy would register known nodes afresh.
    await Promise.race([done, new Promise((r) => setTimeout(r, 10_000).unref?.())]);
  }

  private drop(kind: string, why: string): void {
    this.dropped++;
    this.init.metrics.clusterDropped.inc({ kind });
    this.init.logger.warn({ kind, why }, 'cluster: malformed message dropped');
  }

  private parse<T>(schema: { safeParse(v: unknown): { success: true; data: T } | { success: false; error: { issues: Array<{ message: string; path: PropertyKey[] }> } } }, e: KvEntry, kind: string): T | undefined {
    let raw: unknown;
    try {
      raw = e.json();
    } catch {
      this.drop(kind, `${e.key}: not JSON`);
      return undefined;
    }
    const p = schema.safeParse(raw);
    if (!p.success) {
      this.drop(kind, `${e.key}: ${p.error.issues[0]?.path.join('.')}: ${p.error.issues[0]?.message}`);
      return undefined;
    }
    return p.data;
  }

  private onEntry(e: KvEntry, snapshot: boolean): void {
    const dot = e.key.indexOf('.');
    const kind = dot < 0 ? e.key : e.key.slice(0, dot);
    const id = dot < 0 ? '' : e.key.slice(dot + 1);
    const del = e.operation !== 'PUT';
    const { registry } = this.init;
    switch (kind) {
      case 'node': {
        const had = this.nodes.get(id);
        if (had && had.rev >= e.revision) return; // our own write, already applied
        if (del) {
          this.nodes.delete(id);
          registry.removeRemote(id);
          return;
        }
        const doc = this.parse(nodeDocSchema, e, 'node');
        if (!doc || doc.peer_id !== id) {
          if (doc) this.drop('node', `${e.key}: names peer ${doc.peer_id}`);
          return;
        }
        this.nodes.set(id, { doc, rev: e.revision });
        if (doc.vacated_until !== undefined) {
          // Dropped for silence by the leader, in its rejoin grace: gone here too, its span held from moves till then.
          registry.vacateRemote(remoteOf(doc), doc.vacated_until);
          if (doc.trust) this.onTrust?.(id, doc.trust);
          return;
        }
        const r = remoteOf(doc);
        // A tracker (re)starting: everything stored counts as just seen, until the batches tell it otherwise.
        if (snapshot) r.lastSeen = Math.max(r.lastSeen, this.o.now());
        registry.applyRemote(r);
        if (doc.trust) this.onTrust?.(id, doc.trust);
        return;
      }
      case 'route': {
        const had = this.routes.get(id);
        if (had && had.rev >= e.revision) return;
        if (had && had.doc.by !== this.me) this.holdRoute(had.doc, -1);
        if (del) {
          this.routes.delete(id);
          return;
        }
        const doc = this.parse(routeDocSchema, e, 'route');
        if (!doc) return;
        this.routes.set(id, { doc, rev: e.revision });
        // Our own routes are held by our admission already.
        if (doc.by !== this.me) this.holdRoute(doc, 1);
        return;
      }
      case 'tracker': {
        if (del) {
          this.trackers.delete(id);
          if (id === this.me && !this.closed) void this.announce();
          return;
        }
        const doc = this.parse(trackerDocSchema, e, 'tracker');
        if (!doc) return;
        const t = this.trackers.get(id);
        this.trackers.set(id, { doc, beaconAt: t?.beaconAt ?? this.o.now(), behind: t?.behind ?? false });
        return;
      }
      case 'lease': {
        if (del) {
          this.lease = undefined;
          return;
        }
        const doc = this.parse(leaseDocSchema, e, 'lease');
        if (!doc) return;
        if (!this.lease || e.revision > this.lease.rev) this.lease = { by: doc.by, rev: e.revision, seenAt: this.o.now() };
        return;
      }
      default:
        this.drop('key', `unknown key ${e.key}`);
    }
  }

  private holdRoute(doc: RouteDoc, sign: 1 | -1): void {
    for (const [peer, bytes] of doc.hops) this.init.registry.holdKv(peer, sign * bytes);
  }

  // ------------------------------------------------------------ liveness batches

  /** A heartbeat arrived here: its node goes into the next batch. */
  heard(peerId: string): void {
    this.seenIds.add(peerId);
  }

  private publishSeen(): void {
    if (!this.connected) return;
    const ids = [...this.seenIds];
    this.seenIds = new Set();
    const msg = JSON.stringify({ v: 1, by: this.me, interval_ms: this.init.load.intervalMs(), behind: this.init.load.current.behind, ids });
    try {
      this.init.nats.nc.publish(this.subjects.seen, msg);
    } catch (e) {
      // The ids go into the next batch.
      for (const id of ids) this.seenIds.add(id);
      this.init.logger.debug({ err: (e as Error).message }, 'cluster: seen batch not sent');
    }
  }

  private onSeen(data: Uint8Array): void {
    let raw: unknown;
    try {
      raw = JSON.parse(new TextDecoder().decode(data));
    } catch {
      return this.drop('seen', 'not JSON');
    }
    const p = seenSchema.safeParse(raw);
    if (!p.success) return this.drop('seen', `${p.error.issues[0]?.path.join('.')}: ${p.error.issues[0]?.message}`);
    const s = p.data;
    const now = this.o.now();
    const t = this.trackers.get(s.by);
    this.trackers.set(s.by, { ...(t?.doc ? { doc: t.doc } : {}), beaconAt: now, behind: s.behind });
    if (s.by === this.me) return;
    for (const id of s.ids) this.init.registry.touch(id, now, s.interval_ms);
  }

  // ------------------------------------------------------------ late time, leadership

  /**
   * Time during which the cluster could not be sure a silent node was silent
   * (NATS lost, a tracker behind or not heard from, the first moments after
   * start): excused from every node's deadline, like the tracker's own.
   */
  lateMs(): number {
    return this.lateTotal;
  }

  private calm(now: number): boolean {
    if (!this.connected) return false;
    if (now - this.startedAt < 2 * this.o.heartbeatIntervalMs) return false;
    for (const [id, t] of this.trackers) {
      if (id === this.me) continue;
      if (now - t.beaconAt > this.o.trackerGoneMs) continue; // gone: the leader cleans it up
      if (t.behind || now - t.beaconAt > this.o.overdueMs) return false;
    }
    return true;
  }

  private tickLate(): void {
    if (this.connected && !this.wasConnected) this.reconnected();
    this.wasConnected = this.connected;
    const now = this.o.now();
    const dt = now - this.lastLateTick;
    this.lastLateTick = now;
    if (!this.calm(now)) this.lateTotal += Math.max(0, dt);
    if (this.isLeader()) {
      void this.cleanupTrackers(now);
      this.cleanupTombstones(now);
    }
  }

  /** Tombstones being deleted (by peer id): one delete each at a time. */
  private readonly burying = new Set<string>();

  /** The leader deletes the documents of nodes whose rejoin grace ended (unless rewritten since: then they are back). */
  private cleanupTombstones(now: number): void {
    for (const [id, { doc, rev }] of this.nodes) {
      if (doc.vacated_until === undefined || doc.vacated_until > now || this.burying.has(id)) continue;
      this.burying.add(id);
      void this.kv
        .delete(keys.node(id), { previousSeq: rev })
        .then(() => {
          if (this.nodes.get(id)?.rev === rev) this.nodes.delete(id);
        })
        .catch(() => undefined)
        .finally(() => this.burying.delete(id));
    }
  }

  /** This tracker holds the leader lease (and NATS): it removes and moves nodes. */
  isLeader(): boolean {
    return this.connected && this.lease?.by === this.me && this.o.now() - this.leaseRenewedAt < this.o.leaseMs;
  }

  leader(): string | null {
    return this.lease?.by ?? null;
  }

  private async tickLease(): Promise<void> {
    if (this.closed || !this.connected) return;
    const now = this.o.now();
    const body = JSON.stringify({ v: 1, by: this.me, at: now });
    const l = this.lease;
    try {
      let rev: number;
      if (!l) rev = await this.kv.create(keys.leader, body);
      else if (l.by === this.me || now - l.seenAt > this.o.leaseMs) rev = await this.kv.update(keys.leader, body, l.rev);
      else return;
      if (l?.by !== this.me) this.init.logger.info({ tracker: this.me, previous: l?.by ?? null }, 'cluster: this tracker is the leader (removes silent nodes, moves nodes)');
      this.lease = { by: this.me, rev, seenAt: this.o.now() };
      this.leaseRenewedAt = this.o.now();
    } catch (e) {
      if (isConflict(e)) {
        // Someone else renewed or took it: the watch brings the new holder.
        const cur = await this.kv.get(keys.leader).catch(() => null);
        if (cur && cur.operation === 'PUT') {
          const d = leaseDocSchema.safeParse((() => { try { return cur.json(); } catch { return undefined; } })());
          if (d.success && (!this.lease || cur.revision > this.lease.rev)) this.lease = { by: d.data.by, rev: cur.revision, seenAt: this.o.now() };
        } else this.lease = undefined;
        return;
      }
      this.init.logger.debug({ err: (e as Error).message }, 'cluster: lease not renewed');
    }
  }

  /** The leader forgets trackers gone silent, and the KV room their chats held. */
  private async cleanupTrackers(now: number): Promise<void> {
    for (const [id, t] of this.trackers) {
      if (id === this.me || now - t.beaconAt <= this.o.trackerGoneMs) continue;
      this.trackers.delete(id);
      this.init.logger.info({ tracker: id }, 'cluster: a tracker went silent; its routes in flight are released');
      await this.kv.delete(keys.tracker(id)).catch(() => undefined);
      for (const [rid, r] of this.routes) if (r.doc.by === id) await this.kv.delete(keys.route(rid)).catch(() => undefined);
    }
  }

  // ------------------------------------------------------------ writing

  /** Our own tracker document (key, certificate, URL): nodes learn the cluster's keys from it. */
  private async announce(): Promise<void> {
    const s = this.init.self;
    const doc: TrackerDoc = { v: 1, peer_id: s.peerId, public_key: s.publicKey, url: s.url, ...(s.relay ? { relay: s.relay } : {}), ...(s.cert ? { cert: s.cert } : {}), started_at: this.startedAt };
    this.trackers.set(s.peerId, { doc, beaconAt: this.o.now(), behind: false });
    await this.kv.put(keys.tracker(s.peerId), JSON.stringify(doc)).catch((e: unknown) => this.init.logger.warn({ err: (e as Error).message }, 'cluster: tracker key not announced yet'));
  }

  /** The tracker's own URL, known once it listens (announced again). */
  async setUrl(url: string): Promise<void> {
    this.init.self.url = url;
    await this.announce();
  }

  /** The relay the tracker is attached to, once registered there (announced again). */
  async setRelay(relay: string | undefined): Promise<void> {
    if (relay === this.init.self.relay) return;
    if (relay) this.init.self.relay = relay;
    else delete this.init.self.relay;
    await this.announce();
  }

  /**
   * The tracker a node should send its heartbeats to over its relay: one
   * attached to the node's own relay when the cluster has one (the beat
   * stays on that relay), spread by peer id; else this one.
   */
  beatTarget(n: NodeRecord): string {
    const base = relayBase(n.relayAddr);
    if (!base) return this.me;
    const now = this.o.now();
    const near: string[] = [];
    for (const [id, t] of this.trackers) if (t.doc?.relay === base && (id === this.me || now - t.beaconAt <= this.o.overdueMs)) near.push(id);
    if (near.length === 0) return this.me;
    near.sort();
    let h = 0;
    for (let i = 0; i < 8; i++) h = (h * 16 + parseInt(n.peerId[i]!, 16)) >>> 0;
    return near[h % near.length]!;
  }

  /** The route-signing keys of every tracker of the cluster (what nodes accept routes from). */
  trackerKeys(): Array<{ public_key: string; cert?: TrackerDoc['cert'] }> {
    const out: Array<{ public_key: string; cert?: TrackerDoc['cert'] }> = [];
    for (const t of this.trackers.values()) if (t.doc) out.push({ public_key: t.doc.public_key, ...(t.doc.cert ? { cert: t.doc.cert } : {}) });
    return out;
  }

  /**
   * Write node `peerId`'s document by compare-and-swap: `build` makes the new
   * document from the stored one (undefined when none); null writes nothing.
   * A conflict reads the winner and builds again (a few times).
   */
  private async writeNode(peerId: string, build: (stored: NodeDoc | undefined) => NodeDoc | null, kind: string): Promise<'ok' | 'none' | 'conflict' | 'failed'> {
    const key = keys.node(peerId);
    for (let attempt = 0; attempt < 4; attempt++) {
      const cur = this.nodes.get(peerId);
      const built = build(cur?.doc);
      if (!built) return 'none';
      // A quarantine stored by any tracker stays until it ends, whatever this write is about.
      const quarantined = Math.max(cur?.doc.quarantined_until ?? 0, built.quarantined_until ?? 0);
      let next = quarantined > 0 ? { ...built, quarantined_until: quarantined } : built;
      // So do the check counters: only a judgement (trustOutcome) changes them.
      if (!next.trust && cur?.doc.trust) next = { ...next, trust: cur.doc.trust };
      try {
        const body = JSON.stringify(next);
        const rev = cur ? await this.kv.update(key, body, cur.rev) : await this.kv.create(key, body);
        const now = this.nodes.get(peerId);
        if (!now || now.rev < rev) {
          this.nodes.set(peerId, { doc: next, rev });
          // What we wrote may carry another tracker's decision (a move or a quarantine we had not seen yet): our copy takes it,
          // since the watch will not bring back an older revision than ours.
          const local = this.init.registry.nodes.get(peerId);
          if (local && (!sameSpan(local.assignment, next.assignment) || (next.quarantined_until ?? 0) > (local.quarantinedUntil ?? 0))) this.init.registry.applyRemote(remoteOf(next));
          if (next.trust && next.trust !== cur?.doc.trust) this.onTrust?.(peerId, next.trust);
        }
        this.init.metrics.clusterWrites.inc({ kind, result: 'ok' });
        return 'ok';
      } catch (e) {
        if (!isConflict(e)) {
          this.init.metrics.clusterWrites.inc({ kind, result: 'failed' });
          return 'failed';
        }
        this.init.metrics.clusterWrites.inc({ kind, result: 'conflict' });
        await this.refresh(peerId);
      }
    }
    return 'conflict';
  }

  /** Read a node's stored document again (after a lost CAS) and apply it. */
  private async refresh(peerId: string): Promise<void> {
    const e = await this.kv.get(keys.node(peerId)).catch(() => null);
    if (!e || e.operation !== 'PUT') {
      this.nodes.delete(peerId);
      return;
    }
    this.onEntry(e, false);
  }

  /**
   * A registration this tracker answers: store it, and answer with what is
   * stored. When another tracker already decided this node's span (the node
   * registered there too, or it was moved), that span wins and our copy takes it.
   */
  async commitRegistration(n: NodeRecord): Promise<void> {
    if (!this.connected) {
      this.pending.set(n.peerId, 'register');
      return;
    }
    const mine = nodeDocOf(n, this.me);
    const r = await this.writeNode(
      n.peerId,
      (stored) => {
        // A tombstone's span (a node back within its rejoin grace) is not adopted: the registry placed it as a node back after a drop.
        const same = stored && stored.vacated_until === undefined && stored.info.model === n.info.model && stored.info.memory_budget_mb === n.info.memory_budget_mb && stored.info.weight_format === n.info.weight_format;
        return same && stored.assignment && !n.info.pinned ? { ...mine, assignment: stored.assignment } : mine;
      },
      'register',
    );
    if (r === 'failed') this.pending.set(n.peerId, 'register');
    const stored = this.nodes.get(n.peerId)?.doc;
    if (stored && !sameSpan(stored.assignment, n.assignment)) this.init.registry.applyRemote(remoteOf(stored));
  }

  /** A change of a record here (registry event): written when it matters to the other trackers. */
  onChanged(n: NodeRecord, kind: ChangeKind): void {
    if (kind === 'register') return; // commitRegistration, awaited by the answer
    if (kind === 'heartbeat') {
      this.heard(n.peerId);
      if (!beatNeedsWrite(n, this.nodes.get(n.peerId)?.doc, this.o.now(), this.o.docRefreshMs)) return;
    }
    this.pending.set(n.peerId, kind);
    this.scheduleFlush();
  }

  /** A node removed here (the leader's sweep): delete its document, unless it was written since (it is alive after all). */
  onRemoved(n: NodeRecord, remote: boolean): void {
    if (remote) return;
    this.pending.set(n.peerId, 'remove');
    this.scheduleFlush();
  }

  private scheduleFlush(): void {
    if (this.flushing) return;
    this.flushing = true;
    setImmediate(() => void this.flush());
  }

  private async flush(): Promise<void> {
    try {
      if (!this.connected) return;
      const batch = [...this.pending];
      this.pending.clear();
      await Promise.all(batch.map(([peer, kind]) => this.writeOne(peer, kind)));
    } finally {
      this.flushing = false;
      if (this.pending.size > 0 && this.connected) this.scheduleFlush();
    }
  }

  private async writeOne(peer: string, kind: ChangeKind | 'remove'): Promise<void> {
    const { registry } = this.init;
    if (kind === 'remove') {
      const cur = this.nodes.get(peer);
      if (!cur) return;
      // Dropped for silence with a rejoin grace: the document stays through it, as a tombstone every tracker (and
      // the next leader) reads; else it goes.
      const until = registry.nodes.has(peer) ? undefined : registry.vacatedUntil(peer);
      try {
        if (until !== undefined) {
          const doc: NodeDoc = { ...cur.doc, vacated_until: until, by: this.me };
          const rev = await this.kv.update(keys.node(peer), JSON.stringify(doc), cur.rev);
          if ((this.nodes.get(peer)?.rev ?? 0) < rev) this.nodes.set(peer, { doc, rev });
        } else {
          await this.kv.delete(keys.node(peer), { previousSeq: cur.rev });
          this.nodes.delete(peer);
        }
        this.init.metrics.clusterWrites.inc({ kind: 'remove', result: 'ok' });
      } catch (e) {
        if (!isConflict(e)) {
          this.pending.set(peer, 'remove');
          return;
        }
        // Written since we decided: it beat somewhere after all. Take the stored one back.
        this.init.metrics.clusterWrites.inc({ kind: 'remove', result: 'conflict' });
        await this.refresh(peer);
      }
      return;
    }
    const n = registry.nodes.get(peer);
    if (!n) return;
    const mine = nodeDocOf(n, this.me);
    const r = await this.writeNode(
      peer,
      (stored) => {
        if (!stored) return mine;
        switch (kind) {
          case 'moved':
          case 'assigned':
            // The leader's decision over what the node last said.
            return { ...stored, assignment: mine.assignment, by: this.me };
          case 'busy':
            return { ...stored, busy_until: Math.max(stored.busy_until, mine.busy_until), by: this.me };
          case 'quarantined':
            return { ...stored, quarantined_until: Math.max(stored.quarantined_until ?? 0, mine.quarantined_until ?? 0), by: this.me };
          default:
            // What the node says over the stored; the span it was given stays the stored one.
            return { ...mine, assignment: stored.assignment, busy_until: Math.max(stored.busy_until, mine.busy_until), last_seen: Math.max(stored.last_seen, mine.last_seen) };
        }
      },
      kind,
    );
    if (r === 'failed') this.pending.set(peer, kind);
    // A move that lost its race: our copy takes the stored span (refresh applied it); the leader decides again next sweep.
  }

  /**
   * A judgement of this tracker: applied to the counters stored for the node (every tracker's judgements
   * add up there, by compare-and-swap). `local` is our own count, the start when none is stored yet (the
   * node re-registered, or judged before the cluster stored it). Not queued while NATS is away: the
   * counters only set how often a node is checked, and the next judgement writes them again.
   */
  trustOutcome(peerId: string, outcome: TrustOutcome, local: TrustCounters): void {
    if (!this.connected) return;
    // One node's judgements in order: concurrent writes of one tracker would only lose compare-and-swaps to each other.
    const prev = this.trustOps.get(peerId) ?? Promise.resolve();
    const next = prev
      .then(() => this.writeNode(peerId, (stored) => (stored ? { ...stored, trust: stored.trust ? applyOutcome(stored.trust, outcome) : local, by: this.me } : null), 'trust'))
      .then(
        () => {},
        () => {},
      );
    this.trustOps.set(peerId, next);
    void next.then(() => {
      if (this.trustOps.get(peerId) === next) this.trustOps.delete(peerId);
    });
  }

  // ------------------------------------------------------------ routes in flight (admission leases)

  leaseOpened(id: string, model: string, held: ReadonlyMap<string, number>): void {
    this.routeOp(id, () => this.kv.put(keys.route(id), JSON.stringify({ v: 1, by: this.me, model, hops: [...held] } satisfies RouteDoc)));
  }

  leaseChanged(id: string, model: string, held: ReadonlyMap<string, number>): void {
    this.leaseOpened(id, model, held);
  }

  leaseClosed(id: string): void {
    this.routeOp(id, () => this.kv.delete(keys.route(id)), true);
  }

  /** One route's writes in order (a chat shorter than a KV round trip must not leave its route behind). */
  private routeOp(id: string, op: () => Promise<unknown>, last = false): void {
    const prev = this.routeOps.get(id) ?? Promise.resolve();
    const next = prev.then(async () => {
      if (!this.connected) return;
      await op().catch((e: unknown) => this.init.logger.debug({ err: (e as Error).message, route: id }, 'cluster: route lease not written'));
    });
    this.routeOps.set(id, next);
    if (last) void next.finally(() => this.routeOps.get(id) === next && this.routeOps.delete(id));
  }

  // ------------------------------------------------------------ the bucket lost

  private async checkBucket(): Promise<void> {
    if (this.closed || !this.connected) return;
    try {
      await this.kv.status();
      if (this.bucketLost) {
        this.bucketLost = false;
      }
    } catch (e) {
      const msg = (e as Error).message ?? '';
      if (!/stream not found|not found|jetstream is not enabled/i.test(msg)) return;
      if (!this.bucketLost) this.init.logger.warn({ err: msg }, 'cluster: the registry bucket is gone (NATS restarted without its store?); rebuilding it from what this tracker knows and from heartbeats');
      this.bucketLost = true;
      try {
        await this.rebuild();
      } catch (err) {
        this.init.logger.debug({ err: (err as Error).message }, 'cluster: rebuild not possible yet');
      }
    }
  }

  /** Recreate the bucket and write back the nodes this tracker heard from within their deadline. */
  private async rebuild(): Promise<void> {
    await this.openBucket();
    this.nodes.clear();
    for (const r of this.routes.values()) if (r.doc.by !== this.me) this.holdRoute(r.doc, -1);
    this.routes.clear();
    this.lease = undefined;
    await this.watch();
    await this.announce();
    const now = this.o.now();
    for (const n of this.init.registry.nodes.values()) {
      const deadline = 3 * Math.max(n.intervalMs, this.o.heartbeatIntervalMs);
      if (now - n.lastSeen > deadline) continue;
      const mine = nodeDocOf(n, this.me);
      await this.writeNode(n.peerId, (stored) => (stored ? null : mine), 'rebuild');
    }
    this.bucketLost = false;
    this.init.logger.info({ nodes: this.nodes.size }, 'cluster: registry bucket rebuilt');
  }

  /** NATS is back: write what waited. */
  reconnected(): void {
    if (this.pending.size > 0) this.scheduleFlush();
    void this.checkBucket();
  }

  status(): ClusterStatus {
    return {
      nats: this.init.nats.status(),
      leader: this.leader(),
      is_leader: this.isLeader(),
      bucket: this.bucketLost ? 'lost' : 'ok',
      trackers: [...this.trackers.values()].filter((t) => this.o.now() - t.beaconAt <= this.o.trackerGoneMs).length,
      pending_writes: this.pending.size,
      dropped: this.dropped,
    };
  }

  async close(): Promise<void> {
    this.closed = true;
    for (const t of this.timers) clearInterval(t);
    this.watchGen++;
    this.sub?.unsubscribe();
    if (this.connected) {
      // Leave cleanly: our key goes (nodes stop accepting our routes as their lists refresh), the lease is free at once.
      await this.kv.delete(keys.tracker(this.me)).catch(() => undefined);
      if (this.lease?.by === this.me) await this.kv.delete(keys.leader, { previousSeq: this.lease.rev }).catch(() => undefined);
      for (const [id, r] of this.routes) if (r.doc.by === this.me) await this.kv.delete(keys.route(id)).catch(() => undefined);
    }
  }
}
