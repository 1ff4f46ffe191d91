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
 *
 * This file holds the bucket, its watch and late time; the `seen` batches are seen-batches.ts,
 * the nodes' documents and their writes are node-docs.ts, the other
 * trackers tracker-peers.ts, the lease leader-lease.ts, the chats' KV room
 * route-leases.ts.
 */
import { Kvm, type KV, type KvEntry } from '@nats-io/kv';
import type { Subscription } from '@nats-io/transport-node';
import type { Logger } from 'pino';
import type { NatsHandle } from '../../cluster/nats.ts';
import { trackerSubjects } from '../../cluster/subjects.ts';
import type { LeaseObserver } from '../admission.ts';
import type { TrackerMetrics } from '../metrics.ts';
import type { ChangeKind, NodeRecord, NodeRegistry } from '../registry.ts';
import { Ticker } from '../ticker.ts';
import type { TrustCounters, TrustOutcome } from '../verify/trust.ts';
import { keys, leaseDocSchema, nodeDocSchema, routeDocSchema, trackerDocSchema, type TrackerDoc } from './doc.ts';
import { LeaderLease } from './leader-lease.ts';
import { NodeDocs } from './node-docs.ts';
import { RouteLeases } from './route-leases.ts';
import { SeenBatches } from './seen-batches.ts';
import { TrackerPeers, type ClusterSelf } from './tracker-peers.ts';

// Who the tracker is, and which relay an address names, live with the cluster's trackers; importers find them here too.
export { relayBase, type ClusterSelf } from './tracker-peers.ts';

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
  /** The tracker's shared clock (ticker.ts) the store's periodic jobs run on; absent: a clock of the store's own. */
  ticker?: Ticker;
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
export class ClusterStore implements LeaseObserver {
  private kv!: KV;
  private readonly subjects;
  private readonly o: Required<Omit<ClusterStoreOptions, 'now'>> & { now: () => number };
  private readonly docs: NodeDocs;
  private readonly peers: TrackerPeers;
  private readonly leaderLease: LeaderLease;
  private readonly routeLeases: RouteLeases;
  private readonly seen: SeenBatches;
  private wasConnected = true;
  private lateTotal = 0;
  private lastLateTick = 0;
  private readonly startedAt: number;
  private bucketLost = false;
  private closed = false;
  /** What stops each periodic job. */
  private timers: Array<() => void> = [];
  private sub: Subscription | undefined;
  private watchGen = 0;
  dropped = 0;

  /** Check counters stored by the cluster for a node go to `sink` (the verification service: app.ts), those read at start first. */
  set onTrust(sink: ((peerId: string, counters: TrustCounters) => void) | undefined) {
    this.docs.onTrust = sink;
  }

  get onTrust(): ((peerId: string, counters: TrustCounters) => void) | undefined {
    return this.docs.onTrust;
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
    const kv = () => this.kv;
    const connected = () => this.connected;
    const { logger } = init;
    this.peers = new TrackerPeers({ kv, self: init.self, startedAt: this.startedAt, overdueMs: this.o.overdueMs, trackerGoneMs: this.o.trackerGoneMs, now: () => this.o.now(), logger });
    this.leaderLease = new LeaderLease({ kv, me: init.self.peerId, connected, leaseMs: this.o.leaseMs, now: () => this.o.now(), logger });
    this.routeLeases = new RouteLeases({ kv, me: init.self.peerId, connected, registry: init.registry, logger });
    this.seen = new SeenBatches({
      nats: init.nats,
      subject: this.subjects.seen,
      me: init.self.peerId,
      registry: init.registry,
      load: init.load,
      connected,
      now: () => this.o.now(),
      beacon: (by, behind, now) => this.peers.beacon(by, behind, now),
      dropped: (kind, why) => this.drop(kind, why),
      logger,
    });
    this.docs = new NodeDocs({
      kv,
      me: init.self.peerId,
      connected,
      registry: init.registry,
      writes: init.metrics.clusterWrites,
      heartbeatIntervalMs: this.o.heartbeatIntervalMs,
      docRefreshMs: this.o.docRefreshMs,
      now: () => this.o.now(),
      parse: (e) => this.parse(nodeDocSchema, e, 'node'),
      dropped: (kind, why) => this.drop(kind, why),
      heard: (peerId) => this.seen.heard(peerId),
    });
  }

  /** Open (or create) the bucket, load the registry from it, and start the watch, the batches and the lease. */
  static async start(init: ClusterStoreInit): Promise<ClusterStore> {
    const s = new ClusterStore(init);
    await s.openBucket();
    await s.watch();
    await s.announce();
    s.sub = init.nats.nc.subscribe(s.subjects.seen, { callback: (err, msg) => (err ? undefined : s.seen.received(msg.data)) });
    // On the tracker's one clock (500 ms beats by default): at the defaults all four wake the process together.
    const ticker = init.ticker ?? new Ticker();
    s.timers.push(ticker.every(500, () => s.tickLate()));
    s.timers.push(ticker.every(s.o.seenEveryMs, () => s.seen.publish()));
    s.timers.push(ticker.every(Math.max(200, Math.floor(s.o.leaseMs / 3)), () => void s.tickLease()));
    s.timers.push(ticker.every(2000, () => void s.checkBucket()));
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
    switch (kind) {
      case 'node':
        this.docs.entry(e, id, snapshot);
        return;
      case 'route':
        this.routeLeases.stored(id, e.revision, del, () => this.parse(routeDocSchema, e, 'route'));
        return;
      case 'tracker': {
        if (del) {
          this.peers.deleted(id);
          if (id === this.me && !this.closed) void this.announce();
          return;
        }
        const doc = this.parse(trackerDocSchema, e, 'tracker');
        if (doc) this.peers.stored(id, doc);
        return;
      }
      case 'lease': {
        if (del) {
          this.leaderLease.seen(undefined, e.revision);
          return;
        }
        const doc = this.parse(leaseDocSchema, e, 'lease');
        if (doc) this.leaderLease.seen(doc.by, e.revision);
        return;
      }
      default:
        this.drop('key', `unknown key ${e.key}`);
    }
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
    return this.peers.allHeard(now);
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
      this.docs.buryTombstones(now);
    }
  }

  /** This tracker holds the leader lease (and NATS): it removes and moves nodes. */
  isLeader(): boolean {
    return this.leaderLease.holds();
  }

  leader(): string | null {
    return this.leaderLease.holder();
  }

  private async tickLease(): Promise<void> {
    if (this.closed || !this.connected) return;
    await this.leaderLease.tick();
  }

  /** The leader forgets trackers gone silent, and the KV room their chats held. */
  private async cleanupTrackers(now: number): Promise<void> {
    await this.peers.forgetGone(now, (id) => this.routeLeases.deleteBy(id));
  }

  // ------------------------------------------------------------ writing

  /** Our own tracker document (key, certificate, URL): nodes learn the cluster's keys from it. */
  private async announce(): Promise<void> {
    await this.peers.announce();
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
    return this.peers.beatTarget(n);
  }

  /** The route-signing keys of every tracker of the cluster (what nodes accept routes from). */
  trackerKeys(): Array<{ public_key: string; cert?: TrackerDoc['cert'] }> {
    return this.peers.trackerKeys();
  }

  /**
   * A registration this tracker answers: store it, and answer with what is
   * stored (another tracker's decision on its span wins: node-docs.ts).
   */
  async commitRegistration(n: NodeRecord): Promise<void> {
    await this.docs.commitRegistration(n);
  }

  /** A change of a record here (registry event): written when it matters to the other trackers. */
  onChanged(n: NodeRecord, kind: ChangeKind): void {
    this.docs.onChanged(n, kind);
  }

  /** A node removed here (the leader's sweep): delete its document, unless it was written since (it is alive after all). */
  onRemoved(n: NodeRecord, remote: boolean): void {
    this.docs.onRemoved(n, remote);
  }

  /** A judgement of this tracker, added to the check counters stored for the node (node-docs.ts). */
  trustOutcome(peerId: string, outcome: TrustOutcome, local: TrustCounters): void {
    this.docs.trustOutcome(peerId, outcome, local);
  }

  // ------------------------------------------------------------ routes in flight (admission leases)

  leaseOpened(id: string, model: string, held: ReadonlyMap<string, number>): void {
    this.routeLeases.opened(id, model, held);
  }

  leaseChanged(id: string, model: string, held: ReadonlyMap<string, number>): void {
    this.routeLeases.opened(id, model, held);
  }

  leaseClosed(id: string): void {
    this.routeLeases.closed(id);
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
    this.docs.forget();
    this.routeLeases.releaseAll();
    this.leaderLease.forget();
    await this.watch();
    await this.announce();
    await this.docs.rebuild();
    this.bucketLost = false;
    this.init.logger.info({ nodes: this.docs.size }, 'cluster: registry bucket rebuilt');
  }

  /** NATS is back: write what waited. */
  reconnected(): void {
    this.docs.flushPending();
    void this.checkBucket();
  }

  status(): ClusterStatus {
    return {
      nats: this.init.nats.status(),
      leader: this.leader(),
      is_leader: this.isLeader(),
      bucket: this.bucketLost ? 'lost' : 'ok',
      trackers: this.peers.live(this.o.now()),
      pending_writes: this.docs.pendingWrites,
      dropped: this.dropped,
    };
  }

  async close(): Promise<void> {
    this.closed = true;
    for (const stop of this.timers) stop();
    this.watchGen++;
    this.sub?.unsubscribe();
    if (this.connected) {
      // Leave cleanly: our key goes (nodes stop accepting our routes as their lists refresh), the lease is free at once.
      await this.kv.delete(keys.tracker(this.me)).catch(() => undefined);
      await this.leaderLease.release();
      await this.routeLeases.deleteBy(this.me);
    }
  }
}
