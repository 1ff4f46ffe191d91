/**
 * Relays in a cluster (docs/protocol.md §4b): a peer attached to relay B is
 * reachable from peers of relay A, on the fast path, one-way pushes and
 * `/rpc` alike.
 *
 *   caller ─▶ relay A ══ trunk (ws, direct) ══▶ relay B ─▶ target
 *                    └─ NATS: peer.<target> ──┘           (until the trunk is up)
 *
 * - **Announcing.** The relay a peer is attached to subscribes to
 *   `peer.<peer_id>`. An empty request there is a lookup (the holder answers
 *   its relay id and URL; nobody holds it: NATS answers "no responders", so
 *   an unknown peer is a 404 at once). A registration also broadcasts a
 *   `claim`: a relay holding the same key closes its older connection, so a
 *   key has one registration in the whole cluster, as on one relay.
 * - **Carrying.** Frames cross in a *trunk* (trunks.ts), a WebSocket from
 *   relay to relay found through NATS (one extra process on the way, where
 *   NATS adds two: docs/benchmarks.md). Until a trunk is up, and with
 *   `clusterPath: 'nats'`, they cross through NATS itself: published to
 *   `peer.<target>` with the reply subject `relay.<ours>.s.<stream>`. Either way the stream table
 *   sees a link (a PeerConn with a LinkPipe) and renames stream ids as for
 *   any peer; the source peer id is written once, by the caller's relay.
 * - **Liveness.** Every relay says hello every 2 s; one silent for 6 s is
 *   gone: what was known of its peers is forgotten, its NATS streams end.
 *   Trunks ping as peer sockets do.
 *
 * Everything that comes from the cluster is checked; a malformed message is
 * counted (meshnet_relay_cluster_dropped_total) and dropped, never thrown.
 */
import type { IncomingMessage } from 'node:http';
import type { Duplex } from 'node:stream';
import type { Msg, NatsConnection, Subscription } from '@nats-io/transport-node';
import type { WebSocketServer } from 'ws';
import { z } from 'zod';
import type { NatsStatus } from '../cluster/nats.ts';
import { relaySubjects, type RelaySubjects } from '../cluster/subjects.ts';
import { MeshError } from '../protocol/errors.ts';
import { encodeErrorFrame, readFrameHead } from '../protocol/frames.ts';
import { PEER_ID_BYTES } from '../protocol/ids.ts';
import { CLOSE } from '../protocol/close-codes.ts';
import type { RelayMetrics } from './metrics.ts';
import { PeerConn, type LinkPipe, type PeerSocket, type StreamTable, type TableFederation } from './stream-table.ts';
import { Trunks } from './trunks.ts';
import type { Corker } from './ws-socket.ts';

/** How frames cross between relays: a direct trunk (found through NATS; NATS until it is up), or NATS only. */
export type ClusterPath = 'link' | 'nats';

export interface FederationLogger {
  info(obj: object, msg: string): void;
  warn(obj: object, msg: string): void;
  debug(obj: object, msg: string): void;
}

export interface FederationInit {
  nc: NatsConnection;
  natsStatus: () => NatsStatus;
  cluster: string;
  /** This relay's id in the cluster (random per process). */
  relayId: string;
  /** This relay's base URL as other relays reach it (`ws://host:port`): trunks dial `<url>/cluster`, `/rpc` proxies `<url>/rpc/<id>`. */
  publicUrl: string;
  path: ClusterPath;
  table: StreamTable;
  metrics: RelayMetrics;
  logger: FederationLogger;
  corker: Corker;
  /** Largest message on a trunk, bytes. */
  maxPayload: number;
  /** Trunk liveness ping period, ms. */
  pingIntervalMs: number;
  /** @defaultValue 2000 */
  helloIntervalMs?: number;
}

const lookupAnswerSchema = z.object({ relay_id: z.string().regex(/^[0-9a-f]{8,64}$/), url: z.string().min(1).max(500) });
const claimSchema = z.object({ peer_id: z.string().regex(/^[0-9a-f]{32}$/), relay_id: z.string().regex(/^[0-9a-f]{8,64}$/), at: z.number().int().nonnegative() });
const helloSchema = z.object({ relay_id: z.string().regex(/^[0-9a-f]{8,64}$/), url: z.string().min(1).max(500), peers: z.number().int().nonnegative(), at: z.number() });
const trunkAskSchema = z.object({ relay_id: z.string().regex(/^[0-9a-f]{8,64}$/) });

const LOOKUP_TIMEOUT_MS = 2_000;
const ZERO_ID = new Uint8Array(PEER_ID_BYTES);

/** A socket that publishes to NATS: answers to a remote caller's streams (natsIn) or nothing (natsOut's plain sends). */
class NatsSocket implements PeerSocket {
  constructor(
    private readonly fed: Federation,
    private readonly publish: ((data: Uint8Array) => void) | undefined,
  ) {}
  get isOpen(): boolean {
    return this.fed.natsConnected;
  }
  readonly bufferedAmount = 0;
  send(data: Uint8Array | string): void {
    if (typeof data === 'string' || this.publish === undefined) return;
    this.publish(data);
  }
  close(): void {}
}

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

function json(value: unknown): Uint8Array {
  return utf8.encode(JSON.stringify(value));
}

interface RelayInfo {
  url: string;
  lastSeen: number;
}

export class Federation implements TableFederation {
  readonly relayId: string;
  private readonly nc: NatsConnection;
  private readonly s: RelaySubjects;
  private readonly table: StreamTable;
  private readonly metrics: RelayMetrics;
  private readonly logger: FederationLogger;
  private readonly o: FederationInit;
  /** Where each known remote peer lives (lookups and claims). */
  private readonly peerRelay = new Map<string, string>();
  /** Relays of the cluster we heard from. */
  private readonly relays = new Map<string, RelayInfo>();
  /** Trunks to other relays (trunks.ts). */
  private readonly trunks: Trunks;
  private readonly lookups = new Map<string, Promise<{ relayId: string; url: string } | undefined>>();
  /** Per remote relay: the link its NATS-borne requests arrive on (we answer to its reply subjects). */
  private readonly natsIn = new Map<string, PeerConn>();
  /** Our NATS-borne requests: one link, its own stream ids, answers on relay.<us>.s.> */
  private readonly natsOut: PeerConn;
  private readonly peerSubs = new Map<string, Subscription>();
  private readonly subs: Subscription[] = [];
  private readonly timers: Array<ReturnType<typeof setInterval>> = [];
  private closed = false;

  constructor(init: FederationInit) {
    this.o = init;
    this.relayId = init.relayId;
    this.nc = init.nc;
    this.s = relaySubjects(init.cluster);
    this.table = init.table;
    this.metrics = init.metrics;
    this.logger = init.logger;
    this.trunks = new Trunks({
      nc: init.nc,
      subjects: this.s,
      relayId: init.relayId,
      table: init.table,
      metrics: init.metrics,
      logger: init.logger,
      corker: init.corker,
      maxPayload: init.maxPayload,
      // A grant is a NATS request as a lookup is.
      grantTimeoutMs: LOOKUP_TIMEOUT_MS,
      dropped: (kind) => this.dropped(kind),
      guard: (kind, fn) => this.guard(kind, fn),
    });
    const natsOutPipe: LinkPipe = {
      relayId: 'nats',
      sendAddressed: (target, frame) => {
        const streamId = readFrameHead(frame).streamId;
        const max = this.nc.info?.max_payload ?? 1024 * 1024;
        if (frame.byteLength > max) {
          // NATS refuses it (a prompt's activations, before a trunk is up): the caller hears at once and takes another path.
          this.table.onBinary(this.natsOut, encodeErrorFrame(streamId, new MeshError('MESH_ERR_TOO_LARGE', `a frame of ${frame.byteLength} bytes is over NATS's max_payload (${max}) and no trunk to the peer's relay is up yet; retry, or use the peer's relay_addr`)));
          return;
        }
        this.publish(this.s.peer(target), frame, this.s.relayStream(this.relayId, streamId));
      },
    };
    this.natsOut = new PeerConn(new NatsSocket(this, undefined), 'nats-out', ZERO_ID, {}, true, natsOutPipe);
  }

  get natsConnected(): boolean {
    return this.o.natsStatus() === 'connected';
  }

  /** Subscribe to what this relay answers in the cluster, and start saying hello. */
  async start(): Promise<void> {
    const nc = this.nc;
    this.subs.push(nc.subscribe(this.s.relayStreams(this.relayId), { callback: (err, msg) => this.guard('answer', () => err || this.onNatsAnswer(msg)) }));
    this.subs.push(nc.subscribe(this.s.claim, { callback: (err, msg) => this.guard('claim', () => err || this.onClaim(msg)) }));
    this.subs.push(nc.subscribe(this.s.relayHello, { callback: (err, msg) => this.guard('hello', () => err || this.onHello(msg)) }));
    this.subs.push(nc.subscribe(this.s.relayTrunk(this.relayId), { callback: (err, msg) => this.guard('trunk', () => err || this.onTrunkAsk(msg)) }));
    const hello = this.o.helloIntervalMs ?? 2_000;
    this.timers.push(setInterval(() => this.sayHello(), hello));
    this.timers.push(setInterval(() => this.sweep(hello * 3), hello));
    this.timers.push(setInterval(() => this.trunks.ping(), this.o.pingIntervalMs));
    for (const t of this.timers) t.unref?.();
    await nc.flush();
    this.sayHello();
  }

  /** Other relays heard from in the last 6 s (their base URLs), this one first. */
  relayUrls(): string[] {
    return [this.o.publicUrl, ...[...this.relays.values()].map((r) => r.url)];
  }

  status(): { relay_id: string; nats: NatsStatus; relays: number; trunks: number; path: ClusterPath } {
    return { relay_id: this.relayId, nats: this.o.natsStatus(), relays: this.relays.size, trunks: this.trunks.size, path: this.o.path };
  }

  // ------------------------------------------------------------ TableFederation

  linkFor(peerId: string): PeerConn | undefined {
    if (this.o.path === 'link') {
      const relay = this.peerRelay.get(peerId);
      if (relay !== undefined) {
        const trunk = this.trunks.open(relay);
        if (trunk !== undefined) return trunk;
        this.trunks.ensure(relay);
      } else void this.locate(peerId);
    }
    return this.natsConnected ? this.natsOut : undefined;
  }

  forget(peerId: string): void {
    this.peerRelay.delete(peerId);
  }

  peerAdded(peer: PeerConn): void {
    if (peer.link !== undefined || this.closed) return;
    const id = peer.id;
    this.peerRelay.delete(id);
    if (!this.peerSubs.has(id)) this.peerSubs.set(id, this.nc.subscribe(this.s.peer(id), { callback: (err, msg) => this.guard('peer', () => err || this.onPeerMessage(id, msg)) }));
    this.publish(this.s.claim, json({ peer_id: id, relay_id: this.relayId, at: peer.registeredAt }));
  }

  /**
   * Resolves once what was subscribed so far reached the NATS server (at most 1 s: a NATS outage must not hold
   * registrations). The registrations of one turn of the event loop share one flush, started after all of them
   * subscribed: a relay taking back 5,000 donors of a restarted one made a flush (a PING and a write) per donor.
   */
  announced(): Promise<void> {
    if (!this.natsConnected) return Promise.resolve();
    return new Promise<void>((resolve) => {
      if (this.flushWaiters !== undefined) {
        this.flushWaiters.push(resolve);
        return;
      }
      const waiters = (this.flushWaiters = [resolve]);
      setImmediate(() => {
        this.flushWaiters = undefined;
        const done = (): void => {
          clearTimeout(t);
          for (const w of waiters) w();
        };
        const t = setTimeout(done, 1_000);
        this.nc.flush().then(done, done);
      });
    });
  }

  peerRemoved(peer: PeerConn): void {
    if (peer.link !== undefined) return;
    const sub = this.peerSubs.get(peer.id);
    if (sub === undefined) return;
    this.peerSubs.delete(peer.id);
    try {
      sub.unsubscribe();
    } catch {
      // a closed connection has no subscriptions left to end
    }
  }

  // ------------------------------------------------------------ lookups

  /** Which relay holds `peerId`: a NATS request to its subject (no responders: nobody). */
  locate(peerId: string): Promise<{ relayId: string; url: string } | undefined> {
    const pending = this.lookups.get(peerId);
    if (pending) return pending;
    if (!this.natsConnected) return Promise.resolve(undefined);
    const p = (async () => {
      try {
        const msg = await this.nc.request(this.s.peer(peerId), new Uint8Array(0), { timeout: LOOKUP_TIMEOUT_MS });
        const parsed = lookupAnswerSchema.safeParse(JSON.parse(utf8d.decode(msg.data)));
        if (!parsed.success) {
          this.dropped('lookup');
          return undefined;
        }
        const { relay_id: relayId, url } = parsed.data;
        if (relayId === this.relayId) return undefined;
        this.peerRelay.set(peerId, relayId);
        this.noteRelay(relayId, url);
        if (this.o.path === 'link') this.trunks.ensure(relayId);
        return { relayId, url };
      } catch (e) {
        this.logger.debug({ peer_id: peerId, err: (e as Error).message }, 'cluster lookup found nothing');
        return undefined;
      } finally {
        this.lookups.delete(peerId);
      }
    })();
    this.lookups.set(peerId, p);
    return p;
  }

  /** The URL of the relay that holds `peerId`, for `/rpc` callers of another relay (undefined: nobody holds it). */
  async rpcUrlOf(peerId: string): Promise<string | undefined> {
    const at = await this.locate(peerId);
    return at === undefined ? undefined : `${at.url.replace(/\/+$/, '')}/rpc/${peerId}`;
  }

  // ------------------------------------------------------------ NATS messages

  /** A message on `peer.<id>` of one of our peers: a lookup (empty), or a frame from another relay. */
  private onPeerMessage(peerId: string, msg: Msg): void {
    if (msg.data.byteLength === 0) {
      if (msg.reply) msg.respond(json({ relay_id: this.relayId, url: this.o.publicUrl }));
      return;
    }
    const from = this.relayOfReply(msg.reply);
    if (from === undefined || from === this.relayId) return this.dropped('frame');
    this.table.onLinkFrame(this.natsInFor(from), peerId, msg.data);
  }

  /** An answer to one of our NATS-borne requests (or NATS's "no responders" for one). */
  private onNatsAnswer(msg: Msg): void {
    if (msg.data.byteLength === 0) {
      const streamId = Number(msg.subject.slice(msg.subject.lastIndexOf('.') + 1));
      if (msg.headers?.code === 503 && Number.isInteger(streamId) && streamId > 0 && streamId <= 0xffffffff) {
        this.table.onBinary(this.natsOut, encodeErrorFrame(streamId, new MeshError('MESH_ERR_NO_SUCH_PEER', 'the peer is not connected to any relay of this cluster')));
        return;
      }
      return this.dropped('answer');
    }
    this.table.onBinary(this.natsOut, msg.data);
  }

  private onClaim(msg: Msg): void {
    const parsed = claimSchema.safeParse(this.parseJson(msg));
    if (!parsed.success) return this.dropped('claim');
    const { peer_id: peerId, relay_id: relayId, at } = parsed.data;
    if (relayId === this.relayId) return;
    this.peerRelay.set(peerId, relayId);
    const local = this.table.peers.get(peerId);
    // One key, one registration in the cluster: the newer wins, ties by relay id, so both relays agree.
    if (local !== undefined && (local.registeredAt < at || (local.registeredAt === at && this.relayId < relayId))) {
      this.logger.info({ peer_id: peerId, relay_id: relayId }, 'peer registered again at another relay; closing the older connection here');
      local.socket.close(CLOSE.replaced, 'replaced by a newer connection with the same key at another relay of the cluster');
    }
  }

  private onHello(msg: Msg): void {
    const parsed = helloSchema.safeParse(this.parseJson(msg));
    if (!parsed.success) return this.dropped('hello');
    if (parsed.data.relay_id === this.relayId) return;
    this.noteRelay(parsed.data.relay_id, parsed.data.url);
    // Trunks to every relay heard of, before a frame needs one (a prompt is often over NATS's max_payload).
    if (this.o.path === 'link') this.trunks.ensure(parsed.data.relay_id);
  }

  private onTrunkAsk(msg: Msg): void {
    const parsed = trunkAskSchema.safeParse(this.parseJson(msg));
    if (!parsed.success || !msg.reply) return this.dropped('trunk');
    const token = this.trunks.grant(parsed.data.relay_id);
    msg.respond(json({ token, url: this.o.publicUrl }));
  }

  private natsInFor(relayId: string): PeerConn {
    let conn = this.natsIn.get(relayId);
    if (conn === undefined) {
      const socket = new NatsSocket(this, (data) => {
        if (data.byteLength < 8) return;
        this.publish(this.s.relayStream(relayId, readFrameHead(data).streamId), data);
      });
      const pipe: LinkPipe = { relayId, sendAddressed: (target, frame) => this.publish(this.s.peer(target), frame, this.s.relayStream(this.relayId, readFrameHead(frame).streamId)) };
      conn = new PeerConn(socket, `nats:${relayId}`, ZERO_ID, {}, true, pipe);
      this.natsIn.set(relayId, conn);
    }
    return conn;
  }

  /** `meshnet.<cluster>.relay.<id>.s.<stream>` → `<id>`. */
  private relayOfReply(reply: string | undefined): string | undefined {
    if (!reply || !reply.startsWith(this.s.relayPrefix)) return undefined;
    const rest = reply.slice(this.s.relayPrefix.length);
    const dot = rest.indexOf('.');
    const id = dot < 0 ? '' : rest.slice(0, dot);
    return /^[0-9a-f]{8,64}$/.test(id) ? id : undefined;
  }

  // ------------------------------------------------------------ trunks

  /** `GET /cluster` on this relay: another relay dials a trunk with a token it got from us through NATS. */
  acceptTrunk(wss: WebSocketServer, req: IncomingMessage, socket: Duplex, head: Buffer): void {
    this.trunks.accept(wss, req, socket, head);
  }

  // ------------------------------------------------------------ liveness

  private noteRelay(relayId: string, url: string): void {
    const r = this.relays.get(relayId);
    if (r) {
      r.lastSeen = Date.now();
      r.url = url;
    } else this.relays.set(relayId, { url, lastSeen: Date.now() });
  }

  private sayHello(): void {
    if (!this.natsConnected) return;
    this.publish(this.s.relayHello, json({ relay_id: this.relayId, url: this.o.publicUrl, peers: this.table.peers.size, at: Date.now() }));
  }

  private lastSweep = Date.now();
  /** Registrations waiting for the flush that starts after this turn of the event loop (announced()). */
  private flushWaiters: Array<() => void> | undefined;

  /** Forget relays silent for `silentMs` (only while we can hear: a NATS outage of ours is not their death). */
  private sweep(silentMs: number): void {
    const now = Date.now();
    this.trunks.expireTokens(now);
    const heard = this.natsConnected && now - this.lastSweep < silentMs;
    this.lastSweep = now;
    if (!heard) {
      for (const r of this.relays.values()) r.lastSeen = Math.max(r.lastSeen, now);
      return;
    }
    for (const [relayId, r] of this.relays) {
      if (now - r.lastSeen < silentMs) continue;
      this.relays.delete(relayId);
      this.logger.info({ relay_id: relayId }, 'relay silent; forgetting its peers');
      // What we sent its peers through NATS will not be answered: end it now rather than at the request timeout.
      this.table.failRemoteStreams(this.natsOut, (peer) => this.peerRelay.get(peer) === relayId, `relay ${relayId} of the cluster went silent before the peer answered`);
      for (const [peer, at] of this.peerRelay) if (at === relayId) this.peerRelay.delete(peer);
      const conn = this.natsIn.get(relayId);
      if (conn !== undefined) {
        this.natsIn.delete(relayId);
        this.table.removePeer(conn);
      }
    }
  }

  // ------------------------------------------------------------ plumbing

  private publish(subject: string, data: Uint8Array, reply?: string): void {
    try {
      this.nc.publish(subject, data, reply === undefined ? undefined : { reply });
    } catch (e) {
      // Closed or draining: the stream's own deadline answers the caller.
      this.logger.debug({ subject, err: (e as Error).message }, 'NATS publish failed');
    }
  }

  private parseJson(msg: Msg): unknown {
    return this.parseText(utf8d.decode(msg.data));
  }

  private parseText(text: string): unknown {
    try {
      return JSON.parse(text) as unknown;
    } catch {
      return undefined;
    }
  }

  private dropped(kind: string): void {
    this.metrics.clusterDropped.inc({ kind });
  }

  /** Run a handler of cluster input: a throw is a malformed message (counted, logged), never a crash. */
  private guard(kind: string, fn: () => unknown): void {
    try {
      fn();
    } catch (e) {
      this.dropped(kind);
      this.logger.warn({ kind, err: (e as Error).message }, 'cluster message dropped');
    }
  }

  /** Leave the cluster: unsubscribe, close trunks (the NATS connection is the caller's). */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    for (const t of this.timers) clearInterval(t);
    for (const sub of [...this.subs, ...this.peerSubs.values()]) {
      try {
        sub.unsubscribe();
      } catch {
        // already gone with the connection
      }
    }
    this.peerSubs.clear();
    this.trunks.close();
    for (const conn of this.natsIn.values()) this.table.removePeer(conn);
    this.table.removePeer(this.natsOut);
  }
}
