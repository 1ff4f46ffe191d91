/**
 * The relay dialer: this node's persistent connection to a relay
 * (PROTOCOL.md §1): connect, register, reconnect.
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
 * aborts every running handler, and the dialer reconnects with exponential
 * backoff and full jitter, registering again under the same peer id.
 */
import { ONE_WAY_FEATURE, challengeSchema, registeredSchema, type MeshReply } from '../protocol/envelopes.ts';
import { MeshError } from '../protocol/errors.ts';
import { FrameMux } from './frame-mux.ts';
import type { Identity } from './identity.ts';
import type { MeshHandler, MeshStreamReply, OutgoingRequest, RelayLogEntry, RequestOptions } from './contract.ts';
import { resolveRelayClientOptions, type RelayClientOptions } from './relay-options.ts';
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
}

export interface RelayClientInit extends Partial<RelayClientOptions> {
  /** `ws(s)://host:port` or the full `/ws` URL; `http(s)` is accepted and mapped. */
  relayUrl: string;
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
  private readonly wsUrl: string;
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

  constructor(init: RelayClientInit) {
    this.options = resolveRelayClientOptions(init);
    this.wsUrl = relayWsUrl(init.relayUrl);
    this.WebSocketCtor = init.WebSocket;
    this.identity = init.identity;
    this.handler = init.handler;
    this.info = { ...(init.info ?? {}), protocols: [...RELAY_CLIENT_PROTOCOLS] };
    this.onLog = init.onLog ?? (() => {});
    this.random = init.random ?? Math.random;
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
  /** Incoming requests whose handler has not finished. */
  get pendingIncoming(): number {
    return this.mux?.pendingIncoming ?? 0;
  }
  /** Outgoing requests waiting for (the rest of) an answer. */
  get pendingOutgoing(): number {
    return this.mux?.pendingOutgoing ?? 0;
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
    this.stateValue = RelayClientState.Closed;
    if (this.dial) this.endDial(this.dial, 'closed by this node');
    this.mux?.close('closed by this node', { pendingError: new MeshError('MESH_ERR_SHUTTING_DOWN', 'relay client closed while the request was in flight') });
    this.emitState({ state: RelayClientState.Closed, attempt: this.attempt, peerId: this.peerId, reason: 'closed by this node' });
    for (const w of this.readyWaiters.splice(0)) w.reject(new MeshError('MESH_ERR_SHUTTING_DOWN', 'relay client closed before it registered'));
  }

  /** Send a request to another peer over the fast path and collect its whole answer. Relay errors (404, 502, 504 …) are replies, not throws. */
  request(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshReply> {
    const mux = this.mux;
    if (mux === undefined) return Promise.reject(this.notRegistered());
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
    if (mux === undefined || this.registration?.oneWay !== true) return undefined;
    return mux.push(peerId, req, opts);
  }

  /** Like request(), but resolves at the answer's head and yields the body as it arrives. */
  requestStream(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshStreamReply> {
    const mux = this.mux;
    if (mux === undefined) return Promise.reject(this.notRegistered());
    return mux.requestStream(peerId, req, opts);
  }

  private notRegistered(): MeshError {
    return new MeshError('MESH_ERR_UNAVAILABLE', `not registered with the relay (state ${this.stateValue}); await ready() or use another path`);
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
      // The relay wrote each request's sender after checking its key at registration.
      sourceVouched: true,
      ...(this.handler ? { handler: this.handler } : {}),
      onLog: this.onLog,
      onClose: (reason) => this.onMuxClosed(mux, reason),
    });
    this.mux = mux;
    this.attempt = 0;
    this.registration = { peerId: parsed.data.peer_id, relayAddr: parsed.data.relay_addr, oneWay: parsed.data.features?.includes(ONE_WAY_FEATURE) === true };
    this.setState({ state: RelayClientState.Registered, attempt: 0, peerId: parsed.data.peer_id, relayAddr: parsed.data.relay_addr });
    for (const w of this.readyWaiters.splice(0)) w.resolve(this.registration);
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
    // Not null: closing a socket still connecting makes Node's `ws` emit an error, which kills the process when nobody listens.
    socket.onerror = () => {};
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
    this.scheduleReconnect(reason);
  }

  private onMuxClosed(mux: FrameMux, reason: string): void {
    if (this.mux !== mux) return;
    this.mux = undefined;
    if (this.stateValue === RelayClientState.Closed) return;
    this.attempt = 0;
    this.log({ level: 'warn', event: 'connection', message: `disconnected from ${this.wsUrl}: ${reason}` });
    this.scheduleReconnect(reason);
  }

  private scheduleReconnect(reason: string): void {
    if (this.stateValue === RelayClientState.Closed) return;
    const ceiling = Math.min(this.options.maxBackoffMs, this.options.minBackoffMs * 2 ** Math.min(this.attempt, 30));
    const delay = Math.floor(this.random() * ceiling);
    this.attempt++;
    this.setState({ state: RelayClientState.Disconnected, attempt: this.attempt, peerId: this.peerId, retryInMs: delay, reason });
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
