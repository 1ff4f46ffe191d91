/**
 * The relay dialer: this node's persistent connection to a relay
 * (docs/protocol.md §1): connect, register, reconnect.
 *
 *   peer                                relay
 *    |  ---- open ws(s)://RELAY/ws ---->  |
 *    |  <--- {"type":"challenge"} -------  |
 *    |  ---- {"type":"register"} ------>  |   signed with the node's Ed25519 key
 *    |  <--- {"type":"registered"} -----  |
 *    |  <==> frames and envelopes          |   a FrameMux (frame-mux.ts) from here on
 *
 * Once registered, the socket belongs to a FrameMux: the node's handler
 * answers what arrives, and request()/requestStream() call other peers over
 * it. When the socket drops, the mux rejects every pending request and
 * aborts every running handler, and the dialer reconnects (at once, then
 * with backoff: reconnectDelay in relay-options.ts), registering again under
 * the same peer id. An outage shorter than `outageBudgetMs` is waited out:
 * requests made meanwhile wait for the new registration instead of failing.
 */
import { BEAT_BATCH_FEATURE } from '../protocol/beat-batch.ts';
import { BeatCalls, type BeatReply } from './beat-calls.ts';
import { CLUSTER_FEATURE, ONE_WAY_FEATURE, PEER_WATCH_FEATURE, challengeSchema, registeredSchema, type MeshReply } from '../protocol/envelopes.ts';
import { MeshError } from '../protocol/errors.ts';
import { FrameMux } from './frame-mux.ts';
import type { Identity } from './identity.ts';
import type { MeshHandler, MeshStreamReply, OutgoingRequest, RelayLogEntry, RequestOptions } from './contract.ts';
import { reconnectDelay, resolveRelayClientOptions, type RelayClientOptions } from './relay-options.ts';
import { WS_OPEN, type SocketMessageEvent, type WebSocketConstructor, type WebSocketLike } from './socket.ts';

/** The protocols this client speaks, announced in `info.protocols`. */
export const RELAY_CLIENT_PROTOCOLS = ['mesh-frames/1'] as const;

export const RelayClientState = {
  Idle: 'idle',
  Connecting: 'connecting',
  Registered: 'registered',
  Disconnected: 'disconnected',
  Closed: 'closed',
} as const;
export type RelayClientState = (typeof RelayClientState)[keyof typeof RelayClientState];

export interface RelayStateEvent {
  state: RelayClientState;
  /** Failed attempts since the last registration. */
  attempt: number;
  peerId: string;
  relayAddr?: string;
  /** Set with Disconnected when a reconnect is scheduled. */
  retryInMs?: number;
  reason?: string;
  /** Set with Registered after a lost connection: how long it was away, ms. */
  outageMs?: number;
  /** Set with Disconnected when it follows a registration: the connection was just lost (not another failed attempt). */
  lost?: boolean;
}

export interface RelayClientInit extends Partial<RelayClientOptions> {
  /**
   * `ws(s)://host:port` or the full `/ws` URL; `http(s)` is accepted and
   * mapped. Several (a list, or comma-separated): relays to fail over
   * between, each attempt after a failure or a lost connection dialling the
   * next; the identity, and so the peer id, stay the same.
   */
  relayUrl: string | readonly string[];
  WebSocket: WebSocketConstructor;
  identity: Identity;
  handler?: MeshHandler;
  /** Free-form registration info (model, layers, backend, version); `protocols` is added. */
  info?: Record<string, unknown>;
  onLog?: (entry: RelayLogEntry) => void;
  /** Jitter source in [0, 1); tests pin it. */
  random?: () => number;
}

export interface Registration {
  peerId: string;
  relayAddr: string;
  /** The far side forwards one-way requests (announced `one-way`). */
  oneWay?: boolean;
  /** The relay is in a cluster (announced `cluster`): peers of every relay of it are reachable on this connection. */
  cluster?: boolean;
  /** The relay says when a watched peer detaches (announced `peer-watch`): watchPeer(). */
  peerWatch?: boolean;
  /** The relay batches heartbeats towards trackers (announced `beat-batch`): beat(). */
  beatBatch?: boolean;
}

/**
 * How a watchPeer() ended: `gone` the relay said the peer detached; `absent`
 * it was not attached to this relay when asked; `lost` this connection to the
 * relay dropped (watches go with it); `unsupported` the relay has no
 * `peer-watch`, or this client is not registered; `cancelled` the signal.
 */
export type PeerWatchEnd = 'gone' | 'absent' | 'lost' | 'unsupported' | 'cancelled';

/** One watchPeer() call: how it ends, and whom to tell when the relay says the peer is attached. */
interface PeerWatcher {
  done: (end: PeerWatchEnd) => void;
  onAttached?: () => void;
}

/** `relayUrl` as a list of `/ws` URLs (split on commas, duplicates dropped). */
export function relayWsUrls(relayUrl: string | readonly string[]): string[] {
  const list = (typeof relayUrl === 'string' ? [relayUrl] : [...relayUrl]).flatMap((u) => u.split(',')).map((u) => u.trim()).filter((u) => u !== '');
  if (list.length === 0) throw new TypeError('no relay URL given');
  return [...new Set(list.map(relayWsUrl))];
}

/** The `/ws` endpoint for a relay base URL. */
export function relayWsUrl(relayUrl: string): string {
  const u = new URL(relayUrl);
  if (u.protocol === 'http:') u.protocol = 'ws:';
  else if (u.protocol === 'https:') u.protocol = 'wss:';
  if (u.protocol !== 'ws:' && u.protocol !== 'wss:') throw new TypeError(`relay URL must be ws(s):// or http(s)://, got ${relayUrl}`);
  if (u.pathname === '' || u.pathname === '/') u.pathname = '/ws';
  return u.toString();
}

/** One socket from open to registered (or to its end, whichever first). */
interface Dial {
  socket: WebSocketLike;
  registerTimer: ReturnType<typeof setTimeout> | undefined;
  done: boolean;
}

export class RelayClient {
  readonly options: RelayClientOptions;
  /** The relays this client may dial: the ones it was given, then the ones a relay of a cluster named. */
  private readonly wsUrls: string[];
  /** How many of `wsUrls` were given (the rest were learned). */
  private readonly givenUrls: number;
  /** Which of `wsUrls` the current (or next) attempt dials. */
  private urlIndex = 0;
  private readonly WebSocketCtor: WebSocketConstructor;
  private readonly identity: Identity;
  private readonly info: Record<string, unknown>;
  private readonly onLog: (entry: RelayLogEntry) => void;
  private readonly random: () => number;
  private handler: MeshHandler | undefined;

  /** The socket while it registers. */
  private dial: Dial | undefined;
  /** The registered connection. */
  private mux: FrameMux | undefined;
  private stateValue: RelayClientState = RelayClientState.Idle;
  private attempt = 0;
  private reconnectTimer: ReturnType<typeof setTimeout> | undefined;
  private registration: Registration | undefined;
  private readonly stateListeners = new Set<(e: RelayStateEvent) => void>();
  private readyWaiters: Array<{ resolve: (r: Registration) => void; reject: (e: unknown) => void }> = [];
  /** When (performance.now) the registered connection was last lost; kept after it is back (the outage's window). */
  private lostAt: number | undefined;
  /** True from a lost registration until the next one. */
  private inOutage = false;
  /** Reconnect attempts since the outage outlived its budget. */
  private pastBudget = 0;
  /** Fires when the outage outlives its budget: waiting requests fail then. */
  private outageTimer: ReturnType<typeof setTimeout> | undefined;
  /**
   * watchPeer() calls waiting, by the peer they watch; settled by the relay's notices or when the connection drops.
   * `attached`: the relay answered that the peer is attached to it (the watches hold until it is gone).
   */
  private readonly peerWatches = new Map<string, { watchers: Set<PeerWatcher>; attached: boolean }>();
  /** beat() calls waiting for their answers on the registered connection (they fail when it drops). */
  private beatCalls = new BeatCalls();
  /** A tracker's handler for batches of beats (setBeatsHandler): the answer text, sent back at once. */
  private beatsHandler: ((msg: object) => string | undefined) | undefined;
  /** Requests waiting for the registration while the connection is down (within the budget). */
  private readonly outageWaiters = new Set<{ resolve: () => void; reject: (e: unknown) => void }>();

  constructor(init: RelayClientInit) {
    this.options = resolveRelayClientOptions(init);
    this.wsUrls = relayWsUrls(init.relayUrl);
    this.givenUrls = this.wsUrls.length;
    this.WebSocketCtor = init.WebSocket;
    this.identity = init.identity;
    this.handler = init.handler;
    this.info = { ...(init.info ?? {}), protocols: [...RELAY_CLIENT_PROTOCOLS] };
    this.onLog = init.onLog ?? (() => {});
    this.random = init.random ?? Math.random;
  }

  /** The `/ws` URL of the relay this client is registered at (or dials next). */
  get wsUrl(): string {
    return this.wsUrls[this.urlIndex]!;
  }

  /** Base URL (`ws(s)://host:port`) of that relay. */
  get relayUrl(): string {
    const u = new URL(this.wsUrl);
    return `${u.protocol}//${u.host}`;
  }

  /** Registered at a relay of a cluster: every peer of the cluster is reachable on the fast path. */
  get cluster(): boolean {
    return this.stateValue === RelayClientState.Registered && this.registration?.cluster === true;
  }

  get state(): RelayClientState {
    return this.stateValue;
  }
  /** This node's id (known before registering: it is derived from the key). */
  get peerId(): string {
    return this.identity.peerId;
  }
  /** The address the relay gave at the last registration (`ws://RELAY/rpc/<id>`; a link's is `link:<id>`). */
  get relayAddr(): string | undefined {
    return this.registration?.relayAddr;
  }
  /** True while registered: requests go out at once. */
  get isRegistered(): boolean {
    return this.mux !== undefined;
  }
  /**
   * The registration in force (a new object at each one; undefined while not
   * registered): what the relay said on one connection (a peer not attached
   * to it) is not taken for true on the next, which may be another relay.
   */
  get currentRegistration(): Registration | undefined {
    return this.mux !== undefined ? this.registration : undefined;
  }

  /** While a lost connection is being waited out: ms until its budget runs out (0: registered, or not waiting any more). */
  outageLeftMs(): number {
    if (!this.inOutage || this.lostAt === undefined) return 0;
    return Math.max(0, this.lostAt + this.options.outageBudgetMs - performance.now());
  }

  /**
   * Ms left of the last outage's window (from the moment the connection was
   * lost, outageBudgetMs long), whether or not it is back: peers that lost the
   * same relay may still be reconnecting, so a "no such peer" within it is
   * worth waiting out. 0 when there was no outage or it is over.
   */
  outageWindowLeftMs(): number {
    if (this.lostAt === undefined) return 0;
    return Math.max(0, this.lostAt + this.options.outageBudgetMs - performance.now());
  }

  /** Resolves once registered: at once when it is, after the reconnect while an outage is waited out; rejects once the outage outlives its budget, on close(), or when `signal` aborts. */
  whenRegistered(signal?: AbortSignal): Promise<void> {
    if (this.mux !== undefined) return Promise.resolve();
    if (this.outageLeftMs() <= 0) return Promise.reject(this.notRegistered());
    if (signal?.aborted) return Promise.reject(new MeshError('MESH_ERR_CANCELLED', 'cancelled while the relay was reconnecting'));
    return new Promise<void>((resolve, reject) => {
      const onAbort = (): void => {
        this.outageWaiters.delete(w);
        reject(new MeshError('MESH_ERR_CANCELLED', 'cancelled while the relay was reconnecting'));
      };
      const w = {
        resolve: () => {
          signal?.removeEventListener('abort', onAbort);
          resolve();
        },
        reject: (e: unknown) => {
          signal?.removeEventListener('abort', onAbort);
          reject(e);
        },
      };
      this.outageWaiters.add(w);
      signal?.addEventListener('abort', onAbort, { once: true });
    });
  }

  /** Incoming requests whose handler has not finished. */
  get pendingIncoming(): number {
    return this.mux?.pendingIncoming ?? 0;
  }
  /** Outgoing requests waiting for (the rest of) an answer. */
  get pendingOutgoing(): number {
    return this.mux?.pendingOutgoing ?? 0;
  }

  /**
   * Resolves when the relay says `peerId` detached from it (`gone`), or why
   * no such news will come on this watch (PeerWatchEnd). A node watches its
   * tracker this way instead of holding an HTTP stream to it. `onAttached`
   * is called when the relay answers that the peer is attached to it (at
   * once when an earlier watch of the same peer was answered so): the node
   * then knows its tracker takes beats on this relay.
   */
  watchPeer(peerId: string, signal?: AbortSignal, onAttached?: () => void): Promise<PeerWatchEnd> {
    const mux = this.mux;
    if (mux === undefined || this.registration?.peerWatch !== true) return Promise.resolve('unsupported');
    if (signal?.aborted) return Promise.resolve('cancelled');
    return new Promise<PeerWatchEnd>((resolve) => {
      let entry = this.peerWatches.get(peerId);
      const first = entry === undefined;
      if (entry === undefined) this.peerWatches.set(peerId, (entry = { watchers: new Set(), attached: false }));
      const watcher: PeerWatcher = {
        done: (end: PeerWatchEnd): void => {
          signal?.removeEventListener('abort', onAbort);
          resolve(end);
        },
        ...(onAttached ? { onAttached } : {}),
      };
      const onAbort = (): void => {
        const e = this.peerWatches.get(peerId);
        e?.watchers.delete(watcher);
        if (e?.watchers.size === 0) {
          this.peerWatches.delete(peerId);
          if (this.mux === mux) void mux.send(JSON.stringify({ type: 'unwatch-peer', peer_id: peerId }));
        }
        watcher.done('cancelled');
      };
      entry.watchers.add(watcher);
      signal?.addEventListener('abort', onAbort, { once: true });
      if (first) void mux.send(JSON.stringify({ type: 'watch-peer', peer_id: peerId }));
      else if (entry.attached) this.tellAttached(watcher);
    });
  }

  /** The relay's `peer-watch` / `peer-gone`: settle the watches of that peer (a peer attached here stays watched until gone). */
  private onPeerNotice(msg: { type: 'peer-watch' | 'peer-gone'; peer_id: string; attached?: unknown }): void {
    if (msg.type === 'peer-watch' && msg.attached !== false) {
      const entry = this.peerWatches.get(msg.peer_id);
      if (entry === undefined || entry.attached) return;
      entry.attached = true;
      for (const w of entry.watchers) this.tellAttached(w);
      return;
    }
    this.settlePeerWatches(msg.type === 'peer-gone' ? 'gone' : 'absent', msg.peer_id);
  }

  private tellAttached(w: PeerWatcher): void {
    try {
      w.onAttached?.();
    } catch (err) {
      this.log({ level: 'error', event: 'protocol', message: 'a peer watch\'s onAttached threw', error: err });
    }
  }

  private settlePeerWatches(end: PeerWatchEnd, peerId?: string): void {
    const ids = peerId === undefined ? [...this.peerWatches.keys()] : [peerId];
    for (const id of ids) {
      const entry = this.peerWatches.get(id);
      this.peerWatches.delete(id);
      for (const w of entry?.watchers ?? []) w.done(end);
    }
  }

  /**
   * A heartbeat to tracker `peerId` as a `beat` message (docs/protocol.md
   * §9.1): the relay batches it with others' and answers it alone. Undefined
   * when this relay does not batch (an older one) or we are not registered:
   * then the beat goes as a request. Rejects on timeout or when the
   * connection drops; relay errors (tracker not here, backpressure) are replies.
   */
  beat(peerId: string, body: unknown, timeoutMs: number): Promise<BeatReply> | undefined {
    const mux = this.mux;
    if (mux === undefined || this.registration?.beatBatch !== true) return undefined;
    return this.beatCalls.call((text) => void mux.send(text), peerId, body, timeoutMs);
  }

  /**
   * A tracker takes batches of beats (`beats` messages): `handler` answers one
   * batch with the text of its `beats-answer`, synchronously. Declare
   * BEAT_BATCH_FEATURE in `info.features` too, or no relay sends any.
   */
  setBeatsHandler(handler: ((msg: object) => string | undefined) | undefined): void {
    this.beatsHandler = handler;
  }

  setHandler(handler: MeshHandler | undefined): void {
    this.handler = handler;
    this.mux?.setHandler(handler);
  }

  /** Subscribe to state changes; returns the unsubscribe function. */
  on(_event: 'state', listener: (e: RelayStateEvent) => void): () => void {
    this.stateListeners.add(listener);
    return () => this.stateListeners.delete(listener);
  }

  /** Connect and keep reconnecting until close(). */
  start(): void {
    if (this.stateValue !== RelayClientState.Idle) return;
    this.connect();
  }

  /** Resolves at the next (or current) registration; rejects on close() or after `timeoutMs`. */
  ready(timeoutMs = 0): Promise<Registration> {
    if (this.stateValue === RelayClientState.Registered && this.registration) return Promise.resolve(this.registration);
    if (this.stateValue === RelayClientState.Closed) return Promise.reject(new MeshError('MESH_ERR_SHUTTING_DOWN', 'relay client is closed'));
    return new Promise<Registration>((resolve, reject) => {
      const waiter = { resolve, reject };
      this.readyWaiters.push(waiter);
      if (timeoutMs > 0) {
        const t = setTimeout(() => {
          this.readyWaiters = this.readyWaiters.filter((w) => w !== waiter);
          reject(new MeshError('MESH_ERR_TIMEOUT', `not registered with ${this.wsUrl} within ${timeoutMs} ms (state ${this.stateValue})`));
        }, timeoutMs);
        waiter.resolve = (r) => {
          clearTimeout(t);
          resolve(r);
        };
        waiter.reject = (e) => {
          clearTimeout(t);
          reject(e);
        };
      }
    });
  }

  /** Stop reconnecting, close the socket, settle everything pending. */
  close(): void {
    if (this.stateValue === RelayClientState.Closed) return;
    if (this.reconnectTimer !== undefined) clearTimeout(this.reconnectTimer);
    this.reconnectTimer = undefined;
    this.endOutage(new MeshError('MESH_ERR_SHUTTING_DOWN', 'relay client closed while it was reconnecting'));
    this.stateValue = RelayClientState.Closed;
    if (this.dial) this.endDial(this.dial, 'closed by this node');
    this.mux?.close('closed by this node', { pendingError: new MeshError('MESH_ERR_SHUTTING_DOWN', 'relay client closed while the request was in flight') });
    this.emitState({ state: RelayClientState.Closed, attempt: this.attempt, peerId: this.peerId, reason: 'closed by this node' });
    for (const w of this.readyWaiters.splice(0)) w.reject(new MeshError('MESH_ERR_SHUTTING_DOWN', 'relay client closed before it registered'));
  }

  /**
   * Send a request to another peer over the fast path and collect its whole
   * answer. Relay errors (404, 502, 504 …) are replies, not throws. While a
   * lost connection is waited out, it is sent once the client registered
   * again (opts.timeoutMs counts from then).
   */
  request(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshReply> {
    const mux = this.mux;
    if (mux === undefined) return this.whenRegistered(opts?.signal).then(() => this.request(peerId, req, opts));
    return mux.request(peerId, req, opts);
  }

  /**
   * A one-way request (FLAG_ONE_WAY, see MuxCaller.push), or undefined when
   * the relay (or the link's node) did not announce the `one-way` feature in
   * its `registered` message, or we are not registered: then the caller
   * sends an ordinary request.
   */
  push(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshReply> | undefined {
    const mux = this.mux;
    if (mux === undefined) {
      if (this.outageLeftMs() <= 0) return undefined;
      // Held until the connection is back: then one-way if the relay still allows it, else an ordinary request.
      return this.whenRegistered(opts?.signal).then(() => this.push(peerId, req, opts) ?? this.request(peerId, req, opts));
    }
    if (this.registration?.oneWay !== true) return undefined;
    return mux.push(peerId, req, opts);
  }

  /** Like request(), but resolves at the answer's head and yields the body as it arrives. */
  requestStream(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshStreamReply> {
    const mux = this.mux;
    if (mux === undefined) return this.whenRegistered(opts?.signal).then(() => this.requestStream(peerId, req, opts));
    return mux.requestStream(peerId, req, opts);
  }

  private notRegistered(): MeshError {
    if (this.lostAt !== undefined && this.inOutage) {
      return new MeshError('MESH_ERR_UNAVAILABLE', `relay ${this.wsUrl} unreachable for ${Math.round(performance.now() - this.lostAt)} ms (still reconnecting); use another path`, { reason: 'relay-unreachable' });
    }
    return new MeshError('MESH_ERR_UNAVAILABLE', `not registered with the relay (state ${this.stateValue}); await ready() or use another path`);
  }

  /** The connection is back, closed, or the outage outlived its budget: settle the requests waiting for it. */
  private endOutage(err?: unknown): void {
    if (this.outageTimer !== undefined) clearTimeout(this.outageTimer);
    this.outageTimer = undefined;
    const waiters = [...this.outageWaiters];
    this.outageWaiters.clear();
    for (const w of waiters) {
      if (err === undefined) w.resolve();
      else w.reject(err);
    }
  }

  // ------------------------------------------------------------ connecting

  private connect(): void {
    this.reconnectTimer = undefined;
    this.setState({ state: RelayClientState.Connecting, attempt: this.attempt, peerId: this.peerId });
    let socket: WebSocketLike;
    try {
      socket = new this.WebSocketCtor(this.wsUrl);
      // Node's `ws` can hand us its Buffer as is ('nodebuffer'); a browser ignores
      // that value, and then 'arraybuffer' it is. Saves a copy of every frame.
      socket.binaryType = 'nodebuffer';
      if (socket.binaryType !== 'nodebuffer') socket.binaryType = 'arraybuffer';
    } catch (e) {
      this.log({ level: 'warn', event: 'connection', message: `cannot open ${this.wsUrl}: ${(e as Error).message}`, error: e });
      this.scheduleReconnect('socket constructor failed');
      return;
    }
    const dial: Dial = { socket, registerTimer: undefined, done: false };
    this.dial = dial;
    dial.registerTimer = setTimeout(() => this.dialFailed(dial, `not registered within ${this.options.registerTimeoutMs} ms`), this.options.registerTimeoutMs);
    socket.onmessage = (ev) => this.onHandshakeMessage(dial, ev);
    socket.onclose = (ev) => this.dialFailed(dial, `socket closed (code ${ev.code ?? '?'}${ev.reason ? `: ${ev.reason}` : ''})`);
    // An error is always followed by close; log it, let close decide.
    socket.onerror = (ev) => {
      if (!dial.done) this.log({ level: 'debug', event: 'connection', message: `socket error on ${this.wsUrl}`, error: ev });
    };
  }

  /** Before registration only the handshake is read; frames and envelopes are not ours to answer yet. */
  private onHandshakeMessage(dial: Dial, ev: SocketMessageEvent): void {
    if (dial.done) return;
    if (typeof ev.data !== 'string') {
      this.ignore('binary frame before registration');
      return;
    }
    let msg: unknown;
    try {
      msg = JSON.parse(ev.data);
    } catch {
      this.ignore('text message is not JSON');
      return;
    }
    const type = (msg as { type?: unknown } | null)?.type;
    if (type === 'challenge') this.onChallenge(dial, msg);
    else if (type === 'registered') this.onRegistered(dial, msg);
    else if (type === 'error') {
      const m = msg as { code?: unknown; message?: unknown };
      this.log({ level: 'warn', event: 'relay-error', message: `relay says ${String(m.code)}: ${String(m.message)}` });
    } else this.ignore(`${JSON.stringify(type)} message before registration`);
  }

  private onChallenge(dial: Dial, msg: unknown): void {
    const parsed = challengeSchema.safeParse(msg);
    if (!parsed.success) {
      this.dialFailed(dial, 'relay sent a malformed challenge');
      return;
    }
    this.identity.registerMessage(parsed.data.nonce, this.info).then(
      (reg) => {
        if (dial.done) return;
        try {
          dial.socket.send(JSON.stringify(reg));
        } catch (e) {
          this.dialFailed(dial, `cannot send register: ${(e as Error).message}`);
        }
      },
      (e: unknown) => this.dialFailed(dial, `cannot sign the challenge: ${(e as Error).message}`),
    );
  }

  private onRegistered(dial: Dial, msg: unknown): void {
    const parsed = registeredSchema.safeParse(msg);
    if (!parsed.success) {
      this.ignore('malformed registered message');
      return;
    }
    if (parsed.data.peer_id !== this.peerId) {
      // The relay derived another id from our key: a protocol disagreement frames would be misrouted under.
      this.log({ level: 'error', event: 'protocol', message: `relay registered us as ${parsed.data.peer_id}, our key gives ${this.peerId}` });
    }
    this.endDial(dial);
    // From here on the socket is the mux's.
    const mux = new FrameMux(dial.socket, {
      options: this.options,
      name: `relay connection to ${this.wsUrl}`,
      ...(this.handler ? { handler: this.handler } : {}),
      onLog: this.onLog,
      onClose: (reason) => this.onMuxClosed(mux, reason),
      onPeerNotice: (m) => {
        if (this.mux === mux) this.onPeerNotice(m);
      },
      onBeatAnswer: (m) => {
        if (this.mux === mux && !this.beatCalls.onAnswer(m)) this.ignore('beat-answer that answers no beat waiting (late or malformed)');
      },
      onBeats: (m) => {
        const text = this.mux === mux ? this.beatsHandler?.(m) : undefined;
        if (text !== undefined) void mux.send(text);
      },
    });
    this.mux = mux;
    this.attempt = 0;
    this.pastBudget = 0;
    this.registration = {
      peerId: parsed.data.peer_id,
      relayAddr: parsed.data.relay_addr,
      oneWay: parsed.data.features?.includes(ONE_WAY_FEATURE) === true,
      cluster: parsed.data.features?.includes(CLUSTER_FEATURE) === true,
      peerWatch: parsed.data.features?.includes(PEER_WATCH_FEATURE) === true,
      beatBatch: parsed.data.features?.includes(BEAT_BATCH_FEATURE) === true,
    };
    this.learnRelays(parsed.data.relays);
    const outageMs = this.inOutage && this.lostAt !== undefined ? Math.round(performance.now() - this.lostAt) : undefined;
    this.inOutage = false;
    this.setState({ state: RelayClientState.Registered, attempt: 0, peerId: parsed.data.peer_id, relayAddr: parsed.data.relay_addr, ...(outageMs !== undefined ? { outageMs } : {}) });
    for (const w of this.readyWaiters.splice(0)) w.resolve(this.registration);
    this.endOutage();
  }

  /**
   * A relay of a cluster names its relays at registration: they join the
   * list after the given ones, so a node given one URL can fail over too
   * (at most 16 learned; a URL that is not ws(s) is ignored).
   */
  private learnRelays(relays: readonly string[] | undefined): void {
    if (!relays) return;
    for (const r of relays) {
      let ws: string;
      try {
        ws = relayWsUrl(r);
      } catch {
        continue;
      }
      if (this.wsUrls.includes(ws)) continue;
      if (this.wsUrls.length - this.givenUrls >= 16) break;
      this.wsUrls.push(ws);
    }
  }

  /** The next attempt dials the next relay of the list (with one relay: the same one). */
  private nextRelay(): void {
    this.urlIndex = (this.urlIndex + 1) % this.wsUrls.length;
  }

  /** The dial is over (registered, failed or closed): stop its timer and let go of its socket. */
  private endDial(dial: Dial, closeReason?: string): void {
    dial.done = true;
    if (dial.registerTimer !== undefined) clearTimeout(dial.registerTimer);
    dial.registerTimer = undefined;
    if (this.dial === dial) this.dial = undefined;
    const socket = dial.socket;
    socket.onmessage = null;
    socket.onclose = null;
    // Not null: `ws` reports a close() before the handshake ended as an 'error' event, and one with
    // no listener is an uncaught exception (a LinkPool closed while a link was still dialling).
    socket.onerror = ignoreError;
    if (closeReason === undefined) return;
    try {
      if (socket.readyState <= WS_OPEN) socket.close(1000, closeReason.slice(0, 120));
    } catch {
      // a socket that refuses close() is already going away
    }
  }

  private dialFailed(dial: Dial, reason: string): void {
    if (dial.done) return;
    this.endDial(dial, reason);
    if (this.stateValue === RelayClientState.Closed) return;
    this.log({ level: 'info', event: 'connection', message: `disconnected from ${this.wsUrl}: ${reason}` });
    this.nextRelay();
    this.scheduleReconnect(reason);
  }

  private onMuxClosed(mux: FrameMux, reason: string): void {
    if (this.mux !== mux) return;
    this.mux = undefined;
    this.settlePeerWatches('lost');
    // A fresh set per connection: a late answer on the next one cannot settle a beat of this one.
    const calls = this.beatCalls;
    this.beatCalls = new BeatCalls();
    calls.failAll(new MeshError('MESH_ERR_PEER_GONE', `relay connection lost (${reason}) before the heartbeat's answer`));
    if (this.stateValue === RelayClientState.Closed) return;
    this.attempt = 0;
    this.lostAt = performance.now();
    this.inOutage = true;
    if (this.options.outageBudgetMs > 0) {
      this.outageTimer = setTimeout(() => {
        this.outageTimer = undefined;
        this.log({ level: 'warn', event: 'outage', message: `no relay reachable for ${this.options.outageBudgetMs} ms (now trying ${this.wsUrl}); requests over it fail until one is back (still reconnecting)` });
        this.endOutage(this.notRegistered());
      }, this.options.outageBudgetMs);
    }
    this.log({ level: 'warn', event: 'connection', message: `disconnected from ${this.wsUrl}: ${reason}` });
    // Another relay of the list first: the one that dropped us may be gone (with one relay, the same one again).
    this.nextRelay();
    this.scheduleReconnect(reason, true);
  }

  private scheduleReconnect(reason: string, lost = false): void {
    if (this.stateValue === RelayClientState.Closed) return;
    const since = this.inOutage && this.lostAt !== undefined ? performance.now() - this.lostAt : 0;
    const delay = reconnectDelay(this.options, this.attempt, since, this.pastBudget, this.random());
    if (this.inOutage && since >= this.options.outageBudgetMs) this.pastBudget++;
    this.attempt++;
    this.setState({ state: RelayClientState.Disconnected, attempt: this.attempt, peerId: this.peerId, retryInMs: delay, reason, ...(lost ? { lost } : {}) });
    this.reconnectTimer = setTimeout(() => this.connect(), delay);
  }

  private setState(e: RelayStateEvent): void {
    this.stateValue = e.state;
    this.emitState(e);
  }

  private emitState(e: RelayStateEvent): void {
    for (const l of this.stateListeners) {
      try {
        l(e);
      } catch (err) {
        this.log({ level: 'error', event: 'protocol', message: 'a state listener threw', error: err });
      }
    }
  }

  private ignore(reason: string): void {
    this.log({ level: 'warn', event: 'ignored', message: reason });
  }

  private log(entry: RelayLogEntry): void {
    try {
      this.onLog(entry);
    } catch {
      // a failing logger must not take the data path down with it
    }
  }
}

function ignoreError(): void {}
