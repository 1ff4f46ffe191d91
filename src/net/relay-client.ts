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
 *
 * Beside it: relay-dial.ts (one socket's handshake), relay-urls.ts (which
 * relay to dial), relay-outage.ts (waiting an outage out), peer-watches.ts
 * (`peer-watch`), beat-calls.ts (`beat` messages), frame-mux.ts (the
 * registered connection).
 */
import { BEAT_BATCH_FEATURE } from '../protocol/beat-batch.ts';
import { BeatCalls, type BeatReply } from './beat-calls.ts';
import { CLUSTER_FEATURE, ONE_WAY_FEATURE, PEER_BACK_FEATURE, PEER_WATCH_FEATURE, type MeshReply, type RegisteredMsg } from '../protocol/envelopes.ts';
import { MeshError } from '../protocol/errors.ts';
import { FrameMux } from './frame-mux.ts';
import type { Identity } from './identity.ts';
import type { MeshHandler, MeshStreamReply, OutgoingRequest, RelayLogEntry, RequestOptions } from './contract.ts';
import { PeerWatches, type PeerWatchEnd } from './peer-watches.ts';
import { openRelaySocket, RelayDial } from './relay-dial.ts';
import { reconnectDelay, resolveRelayClientOptions, type RelayClientOptions } from './relay-options.ts';
import { RelayOutage } from './relay-outage.ts';
import { RelayUrls } from './relay-urls.ts';
import type { WebSocketConstructor, WebSocketLike } from './socket.ts';

// Their homes now; callers import them from here as before.
export type { PeerWatchEnd } from './peer-watches.ts';
export { relayWsUrl, relayWsUrls } from './relay-urls.ts';

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
  /** The relay holds a watch of a peer not attached to it and says when it attaches (announced `peer-back`). */
  peerBack?: boolean;
  /** The relay batches heartbeats towards trackers (announced `beat-batch`): beat(). */
  beatBatch?: boolean;
}

export class RelayClient {
  readonly options: RelayClientOptions;
  /** The relays this client may dial: the ones it was given, then the ones a relay of a cluster named. */
  private readonly urls: RelayUrls;
  private readonly WebSocketCtor: WebSocketConstructor;
  private readonly identity: Identity;
  private readonly info: Record<string, unknown>;
  private readonly onLog: (entry: RelayLogEntry) => void;
  private readonly random: () => number;
  private handler: MeshHandler | undefined;

  /** The socket while it registers. */
  private dial: RelayDial | undefined;
  /** The registered connection. */
  private mux: FrameMux | undefined;
  private stateValue: RelayClientState = RelayClientState.Idle;
  private attempt = 0;
  private reconnectTimer: ReturnType<typeof setTimeout> | undefined;
  private registration: Registration | undefined;
  private readonly stateListeners = new Set<(e: RelayStateEvent) => void>();
  private readyWaiters: Array<{ resolve: (r: Registration) => void; reject: (e: unknown) => void }> = [];
  /** From a lost registration to the next: requests made meanwhile wait for it (within the budget). */
  private readonly outage: RelayOutage;
  /** watchPeer() calls waiting; settled by the relay's notices or when the connection drops. */
  private readonly peerWatches = new PeerWatches((err) => this.log({ level: 'error', event: 'protocol', message: "a peer watch's onAttached or onAbsent threw", error: err }));
  /** beat() calls waiting for their answers on the registered connection (they fail when it drops). */
  private beatCalls = new BeatCalls();
  /** A tracker's handler for batches of beats (setBeatsHandler): the answer text, sent back at once. */
  private beatsHandler: ((msg: object) => string | undefined) | undefined;

  constructor(init: RelayClientInit) {
    this.options = resolveRelayClientOptions(init);
    this.urls = new RelayUrls(init.relayUrl);
    this.outage = new RelayOutage(this.options.outageBudgetMs);
    this.WebSocketCtor = init.WebSocket;
    this.identity = init.identity;
    this.handler = init.handler;
    this.info = { ...(init.info ?? {}), protocols: [...RELAY_CLIENT_PROTOCOLS] };
    this.onLog = init.onLog ?? (() => {});
    this.random = init.random ?? Math.random;
  }

  /** The `/ws` URL of the relay this client is registered at (or dials next). */
  get wsUrl(): string {
    return this.urls.current;
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
    return this.outage.leftMs();
  }

  /**
   * Ms left of the last outage's window (from the moment the connection was
   * lost, outageBudgetMs long), whether or not it is back: peers that lost the
   * same relay may still be reconnecting, so a "no such peer" within it is
   * worth waiting out. 0 when there was no outage or it is over.
   */
  outageWindowLeftMs(): number {
    return this.outage.windowLeftMs();
  }

  /** Resolves once registered: at once when it is, after the reconnect while an outage is waited out; rejects once the outage outlives its budget, on close(), or when `signal` aborts. */
  whenRegistered(signal?: AbortSignal): Promise<void> {
    if (this.mux !== undefined) return Promise.resolve();
    if (this.outageLeftMs() <= 0) return Promise.reject(this.notRegistered());
    return this.outage.wait(signal);
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
   * then knows its tracker takes beats on this relay. On a relay with
   * `peer-back` a peer not attached to it does not end the watch `absent`:
   * `onAbsent` is called, and `onAttached` later if it attaches there.
   */
  watchPeer(peerId: string, signal?: AbortSignal, onAttached?: () => void, onAbsent?: () => void): Promise<PeerWatchEnd> {
    const mux = this.mux;
    const reg = this.registration;
    if (mux === undefined || reg?.peerWatch !== true) return Promise.resolve('unsupported');
    // On this connection only: its watches end with it ('lost').
    const send = (text: string): void => {
      if (this.mux === mux) void mux.send(text);
    };
    return this.peerWatches.watch(peerId, send, reg.peerBack === true, signal, { ...(onAttached ? { onAttached } : {}), ...(onAbsent ? { onAbsent } : {}) });
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
    this.outage.settle(new MeshError('MESH_ERR_SHUTTING_DOWN', 'relay client closed while it was reconnecting'));
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
    const lost = this.outage.lostForMs();
    if (lost !== undefined) {
      return new MeshError('MESH_ERR_UNAVAILABLE', `relay ${this.wsUrl} unreachable for ${Math.round(lost)} ms (still reconnecting); use another path`, { reason: 'relay-unreachable' });
    }
    return new MeshError('MESH_ERR_UNAVAILABLE', `not registered with the relay (state ${this.stateValue}); await ready() or use another path`);
  }

  // ------------------------------------------------------------ connecting

  private connect(): void {
    this.reconnectTimer = undefined;
    this.setState({ state: RelayClientState.Connecting, attempt: this.attempt, peerId: this.peerId });
    const url = this.wsUrl;
    let socket: WebSocketLike;
    try {
      socket = openRelaySocket(this.WebSocketCtor, url);
    } catch (e) {
      this.log({ level: 'warn', event: 'connection', message: `cannot open ${url}: ${(e as Error).message}`, error: e });
      this.scheduleReconnect('socket constructor failed');
      return;
    }
    this.dial = new RelayDial({
      socket,
      url,
      identity: this.identity,
      info: this.info,
      registerTimeoutMs: this.options.registerTimeoutMs,
      onRegistered: (dial, msg) => this.onRegistered(dial, msg),
      onFailed: (dial, reason) => this.dialFailed(dial, reason),
      log: (entry) => this.log(entry),
    });
  }

  private onRegistered(dial: RelayDial, msg: RegisteredMsg): void {
    if (msg.peer_id !== this.peerId) {
      // The relay derived another id from our key: a protocol disagreement frames would be misrouted under.
      this.log({ level: 'error', event: 'protocol', message: `relay registered us as ${msg.peer_id}, our key gives ${this.peerId}` });
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
        if (this.mux === mux) this.peerWatches.onNotice(m);
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
    this.registration = {
      peerId: msg.peer_id,
      relayAddr: msg.relay_addr,
      oneWay: msg.features?.includes(ONE_WAY_FEATURE) === true,
      cluster: msg.features?.includes(CLUSTER_FEATURE) === true,
      peerWatch: msg.features?.includes(PEER_WATCH_FEATURE) === true,
      peerBack: msg.features?.includes(PEER_BACK_FEATURE) === true,
      beatBatch: msg.features?.includes(BEAT_BATCH_FEATURE) === true,
    };
    this.urls.learn(msg.relays);
    const outageMs = this.outage.back();
    this.setState({ state: RelayClientState.Registered, attempt: 0, peerId: msg.peer_id, relayAddr: msg.relay_addr, ...(outageMs !== undefined ? { outageMs } : {}) });
    for (const w of this.readyWaiters.splice(0)) w.resolve(this.registration);
    this.outage.settle();
  }

  /** The dial is over (registered, failed or closed): let go of it, closing its socket when `closeReason` is given. */
  private endDial(dial: RelayDial, closeReason?: string): void {
    dial.end(closeReason);
    if (this.dial === dial) this.dial = undefined;
  }

  private dialFailed(dial: RelayDial, reason: string): void {
    if (dial.done) return;
    this.endDial(dial, reason);
    if (this.stateValue === RelayClientState.Closed) return;
    this.log({ level: 'info', event: 'connection', message: `disconnected from ${this.wsUrl}: ${reason}` });
    this.urls.next();
    this.scheduleReconnect(reason);
  }

  private onMuxClosed(mux: FrameMux, reason: string): void {
    if (this.mux !== mux) return;
    this.mux = undefined;
    this.peerWatches.settle('lost');
    // A fresh set per connection: a late answer on the next one cannot settle a beat of this one.
    const calls = this.beatCalls;
    this.beatCalls = new BeatCalls();
    calls.failAll(new MeshError('MESH_ERR_PEER_GONE', `relay connection lost (${reason}) before the heartbeat's answer`));
    if (this.stateValue === RelayClientState.Closed) return;
    this.attempt = 0;
    this.outage.begin(() => {
      this.log({ level: 'warn', event: 'outage', message: `no relay reachable for ${this.options.outageBudgetMs} ms (now trying ${this.wsUrl}); requests over it fail until one is back (still reconnecting)` });
      this.outage.settle(this.notRegistered());
    });
    this.log({ level: 'warn', event: 'connection', message: `disconnected from ${this.wsUrl}: ${reason}` });
    // Another relay of the list first: the one that dropped us may be gone (with one relay, the same one again).
    this.urls.next();
    this.scheduleReconnect(reason, true);
  }

  private scheduleReconnect(reason: string, lost = false): void {
    if (this.stateValue === RelayClientState.Closed) return;
    const since = this.outage.lostForMs() ?? 0;
    const delay = reconnectDelay(this.options, this.attempt, since, this.outage.pastBudget, this.random());
    if (this.outage.active && since >= this.options.outageBudgetMs) this.outage.pastBudget++;
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
