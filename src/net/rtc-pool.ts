/**
 * Page-to-page data channels (docs/protocol.md §12): one WebRTC data
 * channel per peer, carrying the relay fast path's frames (§4) straight
 * between two nodes, with the relay as the signalling channel.
 *
 *   A (sends first to B)                   relay                     B
 *    |  POST /rtc/signal {offer, proof} ───▶ │ ─── (names A to B) ───▶ |  proof: a route the tracker signed,
 *    |  POST /rtc/signal {candidate}… ─────▶ │ ──────────────────────▶ |  A and B both on it; else 403
 *    |  ◀── POST /rtc/signal {answer}, {candidate}… ──────────────────  |
 *    |  ════════ data channel: REQUEST → RESPONSE/DATA, one-way pushes, both ways ════════  |
 *
 * Requests never wait for a channel: `requester()` answers the open one, or
 * undefined (and starts dialling in the background when it was handed a
 * proof); the hop transport goes by the relay meanwhile, and whenever a
 * channel fails, closes or is refused. A peer whose channel did not open
 * (ICE failed, no answer within `openTimeoutMs`) is left on the relay for
 * `retryMs`, doubling to `maxRetryMs`; a peer that does not know
 * `/rtc/signal` (a Node.js node, an older page) for `unsupportedMs`.
 *
 * Either end may send requests over a channel once it is open; REQUEST
 * frames must name this node and are rewritten to name the far side, as a
 * direct link's are (direct-link.ts). Host-free: the host gives the peer
 * connections (rtc-peer.ts), the runtime the relay and the route check.
 */
import { errorReply, type MeshReply, type MeshRequest, type MeshResponse } from '../protocol/envelopes.ts';
import { MeshError, remoteError } from '../protocol/errors.ts';
import { FRAME_HEAD_BYTES } from '../protocol/frames.ts';
import { PEER_ID_BYTES, hexToBytes, randomHex } from '../protocol/ids.ts';
import type { MeshHandler, PeerRequester, RelayLogEntry } from './contract.ts';
import { FrameMux } from './frame-mux.ts';
import { resolveRelayClientOptions, type MuxOptions } from './relay-options.ts';
import type { DataChannelLike, IceServer, RtcFactory, RtcPeerHandle, RtcSignal } from './rtc-peer.ts';
import { MAX_SIGNAL_BYTES, signalMessageSchema, type RouteProof, type SignalMessage } from './rtc-signal.ts';
import { ChannelSocket, type ChannelSocketOptions } from './rtc-socket.ts';

/** What /info says of the channel to one peer. */
export type RtcState = 'open' | 'connecting' | 'failed' | 'unsupported' | 'none';

export interface RtcPoolInit {
  /** This node's peer id: REQUEST frames on a channel must name it. */
  selfId: string;
  factory: RtcFactory;
  /** A signal to a peer over the relay (the relay names this node to it); resolves with its answer. */
  sendSignal(peerId: string, msg: SignalMessage, timeoutMs: number): Promise<MeshReply>;
  /** Resolves when `callerId` may open a channel to this node on `proof`; rejects with a MeshError (403) when not. */
  authorize(callerId: string, proof: RouteProof): Promise<void>;
  /** Serves the requests that arrive over channels. */
  handler: MeshHandler;
  iceServers?: readonly IceServer[];
  /** 'relay': ICE through the TURN servers only (RTCIceTransportPolicy). */
  icePolicy?: 'relay';
  /** Limits of each channel's multiplexer (as a direct link's). */
  options?: Partial<MuxOptions>;
  socket?: ChannelSocketOptions;
  /** A channel not open this long after the dial is given up. @defaultValue 10000 */
  openTimeoutMs?: number;
  /** A peer whose channel failed stays on the relay this long, doubling per failure. @defaultValue 30000 */
  retryMs?: number;
  /** @defaultValue 300000 */
  maxRetryMs?: number;
  /** A peer that answered 404 to an offer (no WebRTC) stays on the relay this long. @defaultValue 600000 */
  unsupportedMs?: number;
  /** A channel unused this long is closed. @defaultValue 300000 */
  idleMs?: number;
  /** Channels open or opening at most (both directions); beyond it the least recently used is closed for a dial, and an offer is refused. @defaultValue 32 */
  maxChannels?: number;
  onLog?(level: 'debug' | 'info' | 'warn', message: string): void;
  /** Something /info shows changed (a channel opened, closed or failed). */
  onChange?(): void;
  now?: () => number;
}

interface Conn {
  readonly id: string;
  readonly peer: string;
  readonly initiator: boolean;
  state: 'verifying' | 'connecting' | 'open' | 'closed';
  handle: RtcPeerHandle | undefined;
  mux: FrameMux | undefined;
  request: PeerRequester | undefined;
  /** Candidates that came before the offer was checked. */
  queued: RtcSignal[];
  timer: ReturnType<typeof setTimeout> | undefined;
  lastUsed: number;
  startedAt: number;
  /** ms from the dial (or the offer) to the channel's open event. */
  openMs: number | undefined;
}

/** Candidates queued per connection at most before its offer is checked. */
const MAX_QUEUED = 64;
/** After an open channel closed, this long before the same peer is dialled again (a page that left answers 404 anyway). */
const REDIAL_AFTER_CLOSE_MS = 1_000;
const SIGNAL_TIMEOUT_MS = 10_000;
/** Connections to or from one peer at most (two when both ends dialled at once). */
const MAX_PER_PEER = 2;

export class RtcPool {
  private readonly conns = new Map<string, Conn>();
  private readonly failures = new Map<string, { until: number; delay: number; reason: string }>();
  private readonly unsupported = new Map<string, number>();
  private readonly options: MuxOptions;
  private readonly now: () => number;
  private readonly selfIdBytes: Uint8Array;
  private sweepTimer: ReturnType<typeof setInterval> | undefined;
  private closedPool = false;
  /** Channels that opened / failed to open / closed after opening, since start. */
  readonly counts = { opened: 0, failed: 0, closed: 0, refused: 0 };

  constructor(private readonly init: RtcPoolInit) {
    this.options = resolveRelayClientOptions(init.options ?? {});
    this.now = init.now ?? Date.now;
    this.selfIdBytes = hexToBytes(init.selfId);
  }

  /**
   * The open channel's request function for `peerId`, or undefined. With a
   * `proof`, a peer with no channel (and none failed lately) is dialled in
   * the background.
   */
  requester(peerId: string, proof?: RouteProof): PeerRequester | undefined {
    let dialling = false;
    for (const c of this.conns.values()) {
      if (c.peer !== peerId) continue;
      if (c.state === 'open' && c.request) {
        c.lastUsed = this.now();
        return c.request;
      }
      dialling = true;
    }
    if (!dialling && proof !== undefined && !this.closedPool && this.mayDial(peerId)) this.dial(peerId, proof);
    return undefined;
  }

  /** The channel to `peerId` as /info shows it. */
  state(peerId: string): RtcState {
    let connecting = false;
    for (const c of this.conns.values()) {
      if (c.peer !== peerId) continue;
      if (c.state === 'open') return 'open';
      connecting = true;
    }
    if (connecting) return 'connecting';
    const t = this.now();
    if ((this.unsupported.get(peerId) ?? 0) > t) return 'unsupported';
    if ((this.failures.get(peerId)?.until ?? 0) > t) return 'failed';
    return 'none';
  }

  /** Every peer the pool knows of, with its state and (open channels) the time it took to open. */
  snapshot(): Array<{ peer_id: string; state: RtcState; open_ms?: number; failure?: string }> {
    const peers = new Set<string>([...[...this.conns.values()].map((c) => c.peer), ...this.failures.keys(), ...this.unsupported.keys()]);
    return [...peers].map((p) => {
      const open = [...this.conns.values()].find((c) => c.peer === p && c.state === 'open');
      const st = this.state(p);
      const f = this.failures.get(p);
      return { peer_id: p, state: st, ...(open?.openMs !== undefined ? { open_ms: Math.round(open.openMs) } : {}), ...(st === 'failed' && f ? { failure: f.reason } : {}) };
    });
  }

  /** Channels open now. */
  get openCount(): number {
    let n = 0;
    for (const c of this.conns.values()) if (c.state === 'open') n++;
    return n;
  }

  /** The `/rtc/signal` handler: `callerId` is the peer the relay names as the sender. */
  async onSignal(callerId: string, req: MeshRequest): Promise<MeshResponse> {
    try {
      if (req.method !== 'POST') throw new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', `${req.method} ${req.path}: signalling takes POST`);
      if (req.body.byteLength > MAX_SIGNAL_BYTES) throw new MeshError('MESH_ERR_TOO_LARGE', `a signalling message of ${req.body.byteLength} bytes is over ${MAX_SIGNAL_BYTES}`);
      let raw: unknown;
      try {
        raw = JSON.parse(new TextDecoder().decode(req.body));
      } catch {
        throw new MeshError('MESH_ERR_BAD_REQUEST', 'a signalling message must be JSON');
      }
      const p = signalMessageSchema.safeParse(raw);
      if (!p.success) throw new MeshError('MESH_ERR_BAD_REQUEST', `not a signalling message: ${p.error.issues[0]!.path.join('.')}: ${p.error.issues[0]!.message}`);
      const msg = p.data;
      if (this.closedPool) throw new MeshError('MESH_ERR_UNAVAILABLE', 'this node is shutting its data channels');
      if (msg.signal.type === 'offer') await this.onOffer(callerId, msg);
      else this.onOther(callerId, msg);
      return { status: 204, headers: {}, body: new Uint8Array(0) };
    } catch (e) {
      const err = e instanceof MeshError ? e : new MeshError('MESH_ERR_INTERNAL', `signalling failed: ${(e as Error).message}`);
      if (err.status === 403) {
        this.counts.refused++;
        this.init.onLog?.('warn', `data channel: refused a signal from ${callerId}: ${err.message}`);
      }
      return errorReply(err);
    }
  }

  /** Close every channel; the pool dials no more. */
  close(): void {
    this.closedPool = true;
    if (this.sweepTimer !== undefined) clearInterval(this.sweepTimer);
    this.sweepTimer = undefined;
    for (const c of [...this.conns.values()]) this.drop(c, 'the node is closing', { tell: true });
  }

  /** Close the channels to `peerId` (tests, a peer that misbehaved); it may be dialled again. */
  closePeer(peerId: string, reason = 'closed by this node'): void {
    for (const c of [...this.conns.values()]) if (c.peer === peerId) this.drop(c, reason, { tell: true });
  }

  // ------------------------------------------------------------ dialling

  private mayDial(peer: string): boolean {
    const t = this.now();
    const unsupportedUntil = this.unsupported.get(peer);
    if (unsupportedUntil !== undefined) {
      if (unsupportedUntil > t) return false;
      this.unsupported.delete(peer);
    }
    const f = this.failures.get(peer);
    return f === undefined || f.until <= t;
  }

  private dial(peer: string, proof: RouteProof): void {
    if (!this.makeRoom(true)) return;
    const conn = this.newConn(randomHex(12), peer, true);
    this.init.onLog?.('debug', `data channel: dialling ${peer}`);
    this.start(conn, proof);
  }

  private newConn(id: string, peer: string, initiator: boolean): Conn {
    const t = this.now();
    const conn: Conn = { id, peer, initiator, state: initiator ? 'connecting' : 'verifying', handle: undefined, mux: undefined, request: undefined, queued: [], timer: undefined, lastUsed: t, startedAt: t, openMs: undefined };
    this.conns.set(id, conn);
    this.armSweep();
    return conn;
  }

  /** Create the peer connection; its channel is wrapped once the host hands it over. */
  private start(conn: Conn, proof?: RouteProof): void {
    conn.state = 'connecting';
    const timeout = this.init.openTimeoutMs ?? 10_000;
    conn.timer = setTimeout(() => this.fail(conn, `the channel did not open within ${timeout} ms (ICE found no path?)`), timeout);
    let handle: RtcPeerHandle;
    try {
      handle = this.init.factory.create({
        initiator: conn.initiator,
        iceServers: this.init.iceServers ?? [],
        ...(this.init.icePolicy ? { icePolicy: this.init.icePolicy } : {}),
        onSignal: (s) => this.send(conn, s, s.type === 'offer' ? proof : undefined),
        onFailed: (reason) => this.fail(conn, reason),
      });
    } catch (e) {
      this.fail(conn, `the host could not make a peer connection: ${(e as Error).message}`);
      return;
    }
    conn.handle = handle;
    handle.channel.then(
      (ch) => this.attach(conn, ch),
      (e: unknown) => this.fail(conn, (e as Error)?.message ?? String(e)),
    );
  }

  private send(conn: Conn, signal: RtcSignal, proof: RouteProof | undefined): void {
    if (conn.state === 'closed' && signal.type !== 'close') return;
    const msg: SignalMessage = { conn: conn.id, signal, ...(proof ? { proof } : {}) };
    this.init.sendSignal(conn.peer, msg, SIGNAL_TIMEOUT_MS).then(
      (reply) => {
        if (reply.status < 300 || signal.type === 'close') return;
        const err = remoteError(reply.status, reply.body);
        // A node that does not know the path has no WebRTC (a Node.js node, an older page).
        if (signal.type === 'offer' && reply.status === 404 && err.code !== 'MESH_ERR_NO_SUCH_PEER') {
          this.unsupported.set(conn.peer, this.now() + (this.init.unsupportedMs ?? 600_000));
          this.drop(conn, `${conn.peer} has no data channels (${err.message})`, { tell: false });
          return;
        }
        this.fail(conn, `the far side refused the ${signal.type}: ${err.code}: ${err.message}`, { tell: false });
      },
      (e: unknown) => {
        if (signal.type !== 'close') this.fail(conn, `signalling ${signal.type} to ${conn.peer} failed: ${(e as Error).message}`, { tell: false });
      },
    );
  }

  private attach(conn: Conn, channel: DataChannelLike): void {
    if (conn.state === 'closed') {
      try {
        channel.close();
      } catch {
        // already closed
      }
      return;
    }
    const socket = new ChannelSocket(channel, this.init.socket);
    const peerBytes = hexToBytes(conn.peer);
    // Handler in place before anything can arrive (Chromium may deliver messages before the channel's open event).
    conn.mux = new FrameMux(socket, {
      options: this.options,
      name: `data channel with ${conn.peer}`,
      handler: this.init.handler,
      onLog: (e: RelayLogEntry) => {
        if (e.level === 'warn' || e.level === 'error') this.init.onLog?.('warn', `data channel with ${conn.peer}: ${e.event}: ${e.message}`);
      },
      onClose: (reason) => this.closed(conn, reason),
      checkRequest: (frame) => {
        if (frame.byteLength < FRAME_HEAD_BYTES + PEER_ID_BYTES) return undefined;
        const target = frame.subarray(FRAME_HEAD_BYTES, FRAME_HEAD_BYTES + PEER_ID_BYTES);
        if (!sameBytes(target, this.selfIdBytes)) return new MeshError('MESH_ERR_NO_SUCH_PEER', `this data channel ends at ${this.init.selfId}; the frame names another peer`);
        conn.lastUsed = this.now();
        target.set(peerBytes);
        return undefined;
      },
    });
    if (socket.readyState === 1) this.opened(conn);
    else socket.onopen = () => this.opened(conn);
  }

  private opened(conn: Conn): void {
    if (conn.state !== 'connecting' || !conn.mux) return;
    clearTimeout(conn.timer);
    conn.timer = undefined;
    conn.state = 'open';
    conn.openMs = this.now() - conn.startedAt;
    const mux = conn.mux;
    const request: PeerRequester = (peerId, req, opts) => {
      conn.lastUsed = this.now();
      return mux.request(peerId, req, opts);
    };
    request.push = (peerId, req, opts) => {
      conn.lastUsed = this.now();
      return mux.push(peerId, req, opts);
    };
    conn.request = request;
    this.failures.delete(conn.peer);
    this.counts.opened++;
    this.init.onLog?.('info', `data channel with ${conn.peer} open (${conn.initiator ? 'dialled' : 'answered'}, ${Math.round(conn.openMs)} ms)`);
    this.init.onChange?.();
  }

  /** The channel's multiplexer closed (the channel closed, or drop()). */
  private closed(conn: Conn, reason: string): void {
    if (conn.state === 'closed') return;
    const wasOpen = conn.state === 'open';
    this.forget(conn);
    if (wasOpen) {
      this.counts.closed++;
      // Not a failure of the path, but do not dial again in the same breath.
      this.failures.set(conn.peer, { until: this.now() + REDIAL_AFTER_CLOSE_MS, delay: 0, reason: `closed: ${reason}` });
      this.init.onLog?.('info', `data channel with ${conn.peer} closed (${reason}); its requests go by the relay`);
    }
    this.init.onChange?.();
  }

  /** The dial (or answer) failed: that peer goes by the relay, and is dialled again only after the backoff. */
  private fail(conn: Conn, reason: string, opts: { tell?: boolean } = {}): void {
    if (conn.state === 'closed') return;
    const wasOpen = conn.state === 'open';
    this.drop(conn, reason, { tell: opts.tell ?? true });
    if (wasOpen) return;
    this.counts.failed++;
    const prev = this.failures.get(conn.peer);
    const base = this.init.retryMs ?? 30_000;
    const delay = prev && prev.delay > 0 ? Math.min(prev.delay * 2, this.init.maxRetryMs ?? 300_000) : base;
    this.failures.set(conn.peer, { until: this.now() + delay, delay, reason });
    this.init.onLog?.('warn', `data channel with ${conn.peer}: ${reason}; its requests go by the relay (next try in ${Math.round(delay / 1000)} s)`);
    this.init.onChange?.();
  }

  private drop(conn: Conn, reason: string, opts: { tell: boolean }): void {
    if (conn.state === 'closed') return;
    const hadHandle = conn.handle !== undefined;
    const mux = conn.mux;
    this.forget(conn);
    if (opts.tell && hadHandle) this.send(conn, { type: 'close', reason: reason.slice(0, 200) }, undefined);
    mux?.close(reason);
  }

  private forget(conn: Conn): void {
    conn.state = 'closed';
    clearTimeout(conn.timer);
    conn.timer = undefined;
    conn.request = undefined;
    this.conns.delete(conn.id);
    try {
      conn.handle?.close();
    } catch {
      // the host's connection is gone already
    }
  }

  // ------------------------------------------------------------ answering

  private async onOffer(callerId: string, msg: SignalMessage): Promise<void> {
    if (!msg.proof) throw new MeshError('MESH_ERR_FORBIDDEN', 'an offer must carry the route the tracker signed (proof): nodes connect only to peers on a route with them');
    if (this.conns.has(msg.conn)) throw new MeshError('MESH_ERR_BAD_REQUEST', `connection ${msg.conn} exists already`);
    let perPeer = 0;
    for (const c of this.conns.values()) if (c.peer === callerId) perPeer++;
    if (perPeer >= MAX_PER_PEER) throw new MeshError('MESH_ERR_TOO_MANY_REQUESTS', `${perPeer} data channels with ${callerId} already`);
    if (!this.makeRoom(false)) throw new MeshError('MESH_ERR_UNAVAILABLE', `this node has ${this.conns.size} data channels, its most`);
    const conn = this.newConn(msg.conn, callerId, false);
    try {
      await this.init.authorize(callerId, msg.proof);
    } catch (e) {
      this.forget(conn);
      throw e instanceof MeshError ? e : new MeshError('MESH_ERR_FORBIDDEN', (e as Error).message);
    }
    if (conn.state === 'closed') throw new MeshError('MESH_ERR_NOT_FOUND', `connection ${msg.conn} was closed meanwhile`);
    this.start(conn);
    try {
      await conn.handle?.signal(msg.signal);
      for (const s of conn.queued.splice(0)) await conn.handle?.signal(s);
    } catch (e) {
      this.fail(conn, `the offer was refused by the peer connection: ${(e as Error).message}`, { tell: false });
      throw new MeshError('MESH_ERR_BAD_REQUEST', `the offer was refused: ${(e as Error).message}`);
    }
  }

  private onOther(callerId: string, msg: SignalMessage): void {
    const conn = this.conns.get(msg.conn);
    if (!conn) {
      if (msg.signal.type === 'close') return;
      throw new MeshError('MESH_ERR_NOT_FOUND', `no data channel ${msg.conn} here (closed, or never offered)`);
    }
    if (conn.peer !== callerId) throw new MeshError('MESH_ERR_FORBIDDEN', `connection ${msg.conn} is not with ${callerId}`);
    const s = msg.signal;
    if (s.type === 'close') {
      if (conn.state === 'open') conn.mux?.close(`the far side closed it${s.reason ? `: ${s.reason}` : ''}`);
      else this.drop(conn, `the far side gave up${s.reason ? `: ${s.reason}` : ''}`, { tell: false });
      return;
    }
    if (s.type === 'answer' && !conn.initiator) throw new MeshError('MESH_ERR_BAD_REQUEST', 'an answer to a connection this node did not offer');
    if (conn.state === 'verifying' || conn.handle === undefined) {
      if (conn.queued.length >= MAX_QUEUED) throw new MeshError('MESH_ERR_TOO_MANY_REQUESTS', `more than ${MAX_QUEUED} signals before the offer was checked`);
      conn.queued.push(s);
      return;
    }
    conn.handle.signal(s).catch((e: unknown) => {
      if (s.type === 'answer') this.fail(conn, `the answer was refused by the peer connection: ${(e as Error).message}`);
      else this.init.onLog?.('debug', `data channel with ${conn.peer}: a candidate was refused: ${(e as Error).message}`);
    });
  }

  // ------------------------------------------------------------ housekeeping

  /** Room for one more connection: closes idle ones, and (for a dial) the least recently used. */
  private makeRoom(evict: boolean): boolean {
    this.sweep();
    const max = this.init.maxChannels ?? 32;
    if (this.conns.size < max) return true;
    if (!evict) return false;
    let lru: Conn | undefined;
    for (const c of this.conns.values()) if (c.state === 'open' && (lru === undefined || c.lastUsed < lru.lastUsed)) lru = c;
    if (lru === undefined) return false;
    this.drop(lru, 'making room for another channel', { tell: true });
    return true;
  }

  private sweep(): void {
    const idle = this.init.idleMs ?? 300_000;
    const t = this.now();
    for (const c of [...this.conns.values()]) if (c.state === 'open' && t - c.lastUsed > idle) this.drop(c, `unused for ${Math.round(idle / 1000)} s`, { tell: true });
    if (this.conns.size === 0 && this.sweepTimer !== undefined) {
      clearInterval(this.sweepTimer);
      this.sweepTimer = undefined;
    }
  }

  private armSweep(): void {
    if (this.sweepTimer !== undefined) return;
    const every = Math.max(1_000, Math.floor((this.init.idleMs ?? 300_000) / 4));
    this.sweepTimer = setInterval(() => this.sweep(), every);
  }
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.byteLength !== b.byteLength) return false;
  for (let i = 0; i < a.byteLength; i++) if (a[i] !== b[i]) return false;
  return true;
}
