/**
 * The node's persistent connection to a relay (PROTOCOL.md §1, §2, §4).
 *
 *   peer                                relay
 *    |  ---- open ws(s)://RELAY/ws ---->  |
 *    |  <--- {"type":"challenge"} -------  |
 *    |  ---- {"type":"register"} ------>  |   signed with the node's Ed25519 key
 *    |  <--- {"type":"registered"} -----  |
 *    |  <==> REQUEST/RESPONSE/DATA/CANCEL frames, relay-http-request/-response envelopes
 *
 * One socket carries both directions. Incoming REQUEST frames and
 * `relay-http-request` envelopes go to the local handler (the bridge) and get
 * exactly one answer each; outgoing requests (this node calling another peer)
 * are REQUEST frames on stream ids this side picks. The two directions never
 * share an id space: REQUEST/CANCEL from the relay name *its* streams,
 * RESPONSE/DATA name *ours*.
 *
 * When the socket drops, every pending outgoing request rejects, every running
 * handler is aborted, and the client reconnects with exponential backoff and
 * full jitter, registering again under the same peer id.
 */
import { collectBody, bodyFieldsFor, meshRequestFromEnvelope, relayHttpRequestSchema, challengeSchema, registeredSchema, type MeshReply, type MeshRequest, type MeshResponse } from '../protocol/envelopes.ts';
import { MeshError, ERROR_STATUS, type MeshErrorCode } from '../protocol/errors.ts';
import {
  FLAG_END,
  FLAG_ERROR,
  FRAME_HEAD_BYTES,
  FRAME_VERSION,
  FrameError,
  FrameKind,
  decodeFrame,
  encodeCancelFrame,
  encodeDataFrame,
  encodeErrorFrame,
  encodeRequestFrame,
  encodeResponseFrame,
  encodeStreamErrorFrame,
  type RequestFrame,
} from '../protocol/frames.ts';
import { normalizeHeaders, type HeaderMap } from '../protocol/headers.ts';
import { hexToBytes, isPeerId } from '../protocol/ids.ts';
import { concatBytes } from '../protocol/bytes.ts';
import type { Identity } from './identity.ts';
import { resolveRelayClientOptions, type RelayClientOptions } from './relay-options.ts';
import { SendGate, WS_OPEN, messageBytes, type SocketCloseEvent, type SocketMessageEvent, type WebSocketConstructor, type WebSocketLike } from './socket.ts';

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

/** `event` is stable for filtering; `ignored` entries are inputs that got no answer, `reason` says why. */
export interface RelayLogEntry {
  level: 'debug' | 'info' | 'warn' | 'error';
  event: 'ignored' | 'answered-error' | 'handler-error' | 'send-failed' | 'relay-error' | 'connection' | 'protocol';
  message: string;
  streamId?: number;
  requestId?: string;
  error?: unknown;
}

/** The local side of the bridge: the node's HTTP surface, host-neutral. */
export type MeshHandler = (req: MeshRequest) => Promise<MeshResponse>;

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

export interface OutgoingRequest {
  method: string;
  path: string;
  headers?: HeaderMap;
  body?: Uint8Array;
}

export interface RequestOptions {
  /** Longest wait for the next frame of the answer (for a one-frame answer: the whole answer). 0 disables. Default: the client's requestTimeoutMs. */
  timeoutMs?: number;
  /** Aborting sends CANCEL and rejects with MESH_ERR_CANCELLED. */
  signal?: AbortSignal;
}

/** A streamed answer: the head now, the body chunk by chunk. Leaving the loop early cancels the stream. */
export interface MeshStreamReply {
  status: number;
  headers: HeaderMap;
  body: AsyncIterableIterator<Uint8Array>;
}

export interface Registration {
  peerId: string;
  relayAddr: string;
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

const EMPTY = new Uint8Array(0);
const utf8d = new TextDecoder();
const REQUEST_ID_RE = /"request_id"\s*:\s*"([^"\\]{1,128})"/;

// ---------------------------------------------------------------- per-connection state

class Connection {
  registered = false;
  closed = false;
  registerTimer: ReturnType<typeof setTimeout> | undefined;
  readonly gate: SendGate;
  /** Incoming requests by the relay's stream id. */
  readonly inboundFrames = new Map<number, InboundCall>();
  /** Incoming envelopes by request id. */
  readonly inboundEnvelopes = new Map<string, InboundCall>();
  /** Our requests by our stream id. */
  readonly outbound = new Map<number, OutboundCall>();
  /**
   * One timer for every deadline on this connection (outgoing answers,
   * incoming handlers) instead of a timer per request: it is due at the
   * earliest deadline known when it was armed, and each sweep re-arms it at
   * the next one. Cleared when nothing is pending.
   */
  sweepTimer: ReturnType<typeof setTimeout> | undefined;
  /** When sweepTimer fires (ms since epoch); Infinity when not armed. */
  sweepAt = Infinity;
  constructor(
    readonly socket: WebSocketLike,
    options: RelayClientOptions,
  ) {
    this.gate = new SendGate(socket, options.highWaterBytes, options.maxSendWaitMs);
  }
}

class InboundCall {
  /** Set once the answer (or the decision not to answer) is taken: guards exactly-once. */
  settled = false;
  /** Set once the call stops counting against maxConcurrentRequests. */
  released = false;
  /** When the handler's time is up (ms since epoch); 0: no limit. */
  deadline = 0;
  /** Made on first use: most handlers never look at their signal, and an AbortController per hop showed in profiles. */
  private controller: AbortController | undefined;
  private abortReason: unknown;
  aborted = false;
  constructor(
    readonly conn: Connection,
    readonly streamId: number,
    readonly requestId: string | undefined,
  ) {}

  get signal(): AbortSignal {
    if (this.controller === undefined) {
      this.controller = new AbortController();
      if (this.aborted) this.controller.abort(this.abortReason);
    }
    return this.controller.signal;
  }

  abort(reason: unknown): void {
    if (this.aborted) return;
    this.aborted = true;
    this.abortReason = reason;
    this.controller?.abort(reason);
  }
}

/**
 * What a handler receives: its `signal` is a getter, made on first read. A
 * class (not a plain object with a property defined per request, which sent
 * every request object into dictionary mode) keeps the shape fixed.
 */
class InboundRequest implements MeshRequest {
  readonly #call: InboundCall;
  constructor(
    public method: string,
    public path: string,
    public headers: HeaderMap,
    public body: Uint8Array,
    call: InboundCall,
  ) {
    this.#call = call;
  }
  get signal(): AbortSignal {
    return this.#call.signal;
  }
}

const enum CallPhase {
  AwaitingHead,
  Streaming,
  Done,
}

/**
 * One outgoing request. Collect mode (request()) gathers the body; stream
 * mode (requestStream()) resolves at the head and hands chunks to a pull
 * iterator. Either way it settles exactly once: answered, failed, timed out,
 * cancelled or disconnected.
 */
class OutboundCall {
  phase = CallPhase.AwaitingHead;
  status = 0;
  headers: HeaderMap = {};
  parts: Uint8Array[] = [];
  lastFrameAt = Date.now();
  // stream mode
  chunkWaiter: { resolve: (r: IteratorResult<Uint8Array>) => void; reject: (e: unknown) => void } | undefined;
  failure: unknown;
  ended = false;
  abortCleanup: (() => void) | undefined;

  constructor(
    readonly streamId: number,
    readonly conn: Connection,
    readonly streaming: boolean,
    readonly timeoutMs: number,
    readonly resolveReply: (r: MeshReply) => void,
    readonly resolveHead: (r: MeshStreamReply) => void,
    readonly reject: (e: unknown) => void,
  ) {}
}

/** Later deadlines than the armed sweep by less than this do not re-arm it. */
const SWEEP_SLACK_MS = 10;
const NOOP = (): void => {};
const NO_OPTIONS: RequestOptions = {};

/** Headers a handler returned, as is when they already are what normalizeHeaders would make (lowercase names, string values): the common case copies nothing. */
function normalHeaders(headers: Record<string, unknown> | undefined): HeaderMap {
  if (headers === undefined || headers === null) return {};
  const proto = Object.getPrototypeOf(headers);
  if (proto !== Object.prototype && proto !== null) return normalizeHeaders(headers);
  for (const name in headers) {
    if (typeof headers[name] !== 'string') return normalizeHeaders(headers);
    for (let i = 0; i < name.length; i++) {
      const c = name.charCodeAt(i);
      if ((c >= 0x41 && c <= 0x5a) || c > 0x7f) return normalizeHeaders(headers);
    }
  }
  return headers as HeaderMap;
}

function concat(parts: Uint8Array[]): Uint8Array {
  return parts.length === 0 ? EMPTY : concatBytes(parts);
}

function asMeshError(e: unknown): MeshError | undefined {
  return e instanceof MeshError ? e : undefined;
}

/** A remote error body as a MeshError, keeping its code when we know it. */
function meshErrorFromBody(body: Uint8Array, fallback: string): MeshError {
  try {
    const v = JSON.parse(utf8d.decode(body)) as { error?: { code?: unknown; message?: unknown } };
    const code = v.error?.code;
    const message = typeof v.error?.message === 'string' ? v.error.message : fallback;
    if (typeof code === 'string' && code in ERROR_STATUS) return new MeshError(code as MeshErrorCode, message);
    return new MeshError('MESH_ERR_UPSTREAM', message, { remoteCode: code });
  } catch {
    return new MeshError('MESH_ERR_UPSTREAM', fallback);
  }
}

// ---------------------------------------------------------------- the client

export class RelayClient {
  readonly options: RelayClientOptions;
  private readonly wsUrl: string;
  private readonly WebSocketCtor: WebSocketConstructor;
  private readonly identity: Identity;
  private readonly info: Record<string, unknown>;
  private readonly onLog: (entry: RelayLogEntry) => void;
  private readonly random: () => number;
  private handler: MeshHandler | undefined;

  private conn: Connection | undefined;
  private stateValue: RelayClientState = RelayClientState.Idle;
  private attempt = 0;
  private reconnectTimer: ReturnType<typeof setTimeout> | undefined;
  private registration: Registration | undefined;
  private readonly stateListeners = new Set<(e: RelayStateEvent) => void>();
  private readyWaiters: Array<{ resolve: (r: Registration) => void; reject: (e: unknown) => void }> = [];
  private nextStreamId = 0;
  private inFlight = 0;
  private readonly peerIdBytes = new Map<string, Uint8Array>();
  private readonly sweepOnTimer = (conn: Connection): void => this.sweep(conn);

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
  /** The `/rpc` address the relay gave at the last registration. */
  get relayAddr(): string | undefined {
    return this.registration?.relayAddr;
  }
  /** Incoming requests whose handler has not finished. */
  get pendingIncoming(): number {
    return this.inFlight;
  }
  /** Outgoing requests waiting for (the rest of) an answer. */
  get pendingOutgoing(): number {
    return this.conn?.outbound.size ?? 0;
  }

  setHandler(handler: MeshHandler | undefined): void {
    this.handler = handler;
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
    const conn = this.conn;
    this.stateValue = RelayClientState.Closed;
    if (conn) this.dropConnection(conn, 'closed by this node', new MeshError('MESH_ERR_SHUTTING_DOWN', 'relay client closed while the request was in flight'));
    this.emitState({ state: RelayClientState.Closed, attempt: this.attempt, peerId: this.peerId, reason: 'closed by this node' });
    for (const w of this.readyWaiters.splice(0)) w.reject(new MeshError('MESH_ERR_SHUTTING_DOWN', 'relay client closed before it registered'));
  }

  // ------------------------------------------------------------ connection lifecycle

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
    const conn = new Connection(socket, this.options);
    this.conn = conn;
    conn.registerTimer = setTimeout(() => {
      if (!conn.registered) this.dropConnection(conn, `not registered within ${this.options.registerTimeoutMs} ms`);
    }, this.options.registerTimeoutMs);
    socket.onmessage = (ev) => this.socketOnMessage(conn, ev);
    socket.onclose = (ev) => this.socketOnClose(conn, ev);
    // An error is always followed by close; log it, let close decide.
    socket.onerror = (ev) => {
      if (!conn.closed) this.log({ level: 'debug', event: 'connection', message: `socket error on ${this.wsUrl}`, error: ev });
    };
  }

  private socketOnClose(conn: Connection, ev: SocketCloseEvent): void {
    this.dropConnection(conn, `socket closed (code ${ev.code ?? '?'}${ev.reason ? `: ${ev.reason}` : ''})`);
  }

  /** Tear down one connection exactly once; schedule the next unless the client is closed. */
  private dropConnection(conn: Connection, reason: string, pendingError?: MeshError): void {
    if (conn.closed) return;
    conn.closed = true;
    if (conn.registerTimer !== undefined) clearTimeout(conn.registerTimer);
    this.disarmSweep(conn);
    conn.socket.onmessage = null;
    conn.socket.onclose = null;
    conn.socket.onerror = null;
    try {
      if (conn.socket.readyState <= WS_OPEN) conn.socket.close(1000, reason.slice(0, 120));
    } catch {
      // a socket that refuses close() is already going away
    }
    const err = pendingError ?? new MeshError('MESH_ERR_PEER_GONE', `relay connection lost (${reason}); the request may or may not have run`, { reason: 'relay-disconnected' });
    conn.gate.failAll(err);
    for (const call of conn.outbound.values()) this.failCall(call, err, false);
    conn.outbound.clear();
    // The relay answers our callers with 502; the handlers' work is moot.
    for (const call of conn.inboundFrames.values()) this.abandonInbound(call, err);
    for (const call of conn.inboundEnvelopes.values()) this.abandonInbound(call, err);
    conn.inboundFrames.clear();
    conn.inboundEnvelopes.clear();
    if (this.conn !== conn) return;
    this.conn = undefined;
    const wasRegistered = conn.registered;
    this.registration = wasRegistered ? this.registration : undefined;
    if (this.stateValue === RelayClientState.Closed) return;
    if (wasRegistered) this.attempt = 0;
    this.log({ level: wasRegistered ? 'warn' : 'info', event: 'connection', message: `disconnected from ${this.wsUrl}: ${reason}` });
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

  private log(entry: RelayLogEntry): void {
    try {
      this.onLog(entry);
    } catch {
      // a failing logger must not take the data path down with it
    }
  }

  // ------------------------------------------------------------ incoming

  private socketOnMessage(conn: Connection, ev: SocketMessageEvent): void {
    if (conn.closed) return;
    try {
      const data = ev.data;
      if (typeof data === 'string') this.onText(conn, data);
      else {
        const bytes = messageBytes(data);
        if (bytes === undefined) this.ignore('message of an unsupported data type');
        else this.onBinary(conn, bytes);
      }
    } catch (e) {
      // Every path above catches its own errors; this is the last guard so a bug cannot kill the socket's event loop.
      this.log({ level: 'error', event: 'protocol', message: `message handling failed: ${(e as Error).message}`, error: e });
    }
  }

  private ignore(reason: string, ids: { streamId?: number; requestId?: string } = {}): void {
    this.log({ level: 'warn', event: 'ignored', message: reason, ...ids });
  }

  private onText(conn: Connection, text: string): void {
    if (text.length > this.options.maxMessageBytes) {
      const id = REQUEST_ID_RE.exec(text.slice(0, 4096))?.[1];
      if (id !== undefined && conn.registered && !conn.inboundEnvelopes.has(id)) {
        this.sendEnvelopeError(conn, id, new MeshError('MESH_ERR_TOO_LARGE', `envelope of ${text.length} characters is over this node's limit of ${this.options.maxMessageBytes} bytes`));
      } else this.ignore(`text message of ${text.length} characters is over the limit and has no readable request_id`);
      return;
    }
    let msg: unknown;
    try {
      msg = JSON.parse(text);
    } catch {
      this.ignore('text message is not JSON');
      return;
    }
    if (typeof msg !== 'object' || msg === null || Array.isArray(msg)) {
      this.ignore('text message is not a JSON object');
      return;
    }
    const type = (msg as { type?: unknown }).type;
    switch (type) {
      case 'challenge':
        this.onChallenge(conn, msg);
        return;
      case 'registered':
        this.onRegistered(conn, msg);
        return;
      case 'relay-http-request':
        this.onEnvelope(conn, msg);
        return;
      case 'error': {
        const m = msg as { code?: unknown; message?: unknown };
        this.log({ level: 'warn', event: 'relay-error', message: `relay says ${String(m.code)}: ${String(m.message)}` });
        return;
      }
      default: {
        // An envelope of a type we do not know, but with an id, is still a request someone waits on.
        const rid = (msg as { request_id?: unknown }).request_id;
        if (conn.registered && typeof rid === 'string' && rid.length > 0 && rid.length <= 128 && !conn.inboundEnvelopes.has(rid)) {
          this.sendEnvelopeError(conn, rid, new MeshError('MESH_ERR_BAD_REQUEST', `unknown message type ${JSON.stringify(type)}; expected relay-http-request`));
        } else this.ignore(`text message of unknown type ${JSON.stringify(type)}`);
      }
    }
  }

  private onChallenge(conn: Connection, msg: unknown): void {
    if (conn.registered) {
      this.ignore('challenge after registration');
      return;
    }
    const parsed = challengeSchema.safeParse(msg);
    if (!parsed.success) {
      this.dropConnection(conn, 'relay sent a malformed challenge');
      return;
    }
    this.identity.registerMessage(parsed.data.nonce, this.info).then(
      (reg) => {
        if (conn.closed) return;
        try {
          conn.socket.send(JSON.stringify(reg));
        } catch (e) {
          this.dropConnection(conn, `cannot send register: ${(e as Error).message}`);
        }
      },
      (e: unknown) => this.dropConnection(conn, `cannot sign the challenge: ${(e as Error).message}`),
    );
  }

  private onRegistered(conn: Connection, msg: unknown): void {
    const parsed = registeredSchema.safeParse(msg);
    if (!parsed.success || conn.registered) {
      this.ignore(conn.registered ? 'second registered message' : 'malformed registered message');
      return;
    }
    if (parsed.data.peer_id !== this.peerId) {
      // The relay derived another id from our key: a protocol disagreement frames would be misrouted under.
      this.log({ level: 'error', event: 'protocol', message: `relay registered us as ${parsed.data.peer_id}, our key gives ${this.peerId}` });
    }
    conn.registered = true;
    if (conn.registerTimer !== undefined) clearTimeout(conn.registerTimer);
    conn.registerTimer = undefined;
    this.attempt = 0;
    this.registration = { peerId: parsed.data.peer_id, relayAddr: parsed.data.relay_addr };
    this.setState({ state: RelayClientState.Registered, attempt: 0, peerId: parsed.data.peer_id, relayAddr: parsed.data.relay_addr });
    for (const w of this.readyWaiters.splice(0)) w.resolve(this.registration);
  }

  private onEnvelope(conn: Connection, msg: unknown): void {
    const rawId = (msg as { request_id?: unknown }).request_id;
    const readableId = typeof rawId === 'string' && rawId.length > 0 && rawId.length <= 128 ? rawId : undefined;
    if (!conn.registered) {
      this.ignore('relay-http-request before registration', { requestId: readableId });
      return;
    }
    if (readableId !== undefined && conn.inboundEnvelopes.has(readableId)) {
      // Answering the duplicate would give the first request a second, wrong answer.
      this.ignore('duplicate request_id while the first is in flight', { requestId: readableId });
      return;
    }
    const parsed = relayHttpRequestSchema.safeParse(msg);
    if (!parsed.success) {
      if (readableId === undefined) this.ignore('malformed relay-http-request without a readable request_id');
      else this.sendEnvelopeError(conn, readableId, new MeshError('MESH_ERR_BAD_REQUEST', `malformed relay-http-request: ${parsed.error.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; ')}`));
      return;
    }
    let req: MeshRequest;
    try {
      req = meshRequestFromEnvelope(parsed.data);
    } catch (e) {
      this.sendEnvelopeError(conn, parsed.data.request_id, asMeshError(e) ?? new MeshError('MESH_ERR_BAD_REQUEST', 'undecodable request body'));
      return;
    }
    const call = new InboundCall(conn, -1, parsed.data.request_id);
    call.released = true; // not counted until admitted
    if (!this.admit(call)) return;
    conn.inboundEnvelopes.set(parsed.data.request_id, call);
    this.runHandler(call, new InboundRequest(req.method, req.path, req.headers, req.body, call));
  }

  private onBinary(conn: Connection, bytes: Uint8Array): void {
    if (!conn.registered) {
      this.ignore('binary frame before registration');
      return;
    }
    if (bytes.byteLength < FRAME_HEAD_BYTES) {
      this.ignore(`binary message of ${bytes.byteLength} bytes is shorter than a frame head`);
      return;
    }
    const kind = bytes[1]!;
    const streamId = (bytes[4]! | (bytes[5]! << 8) | (bytes[6]! << 16) | (bytes[7]! << 24)) >>> 0;
    const answerDirection = kind === FrameKind.Response || kind === FrameKind.Data;
    if (answerDirection) {
      const call = conn.outbound.get(streamId);
      if (call === undefined) {
        this.ignore(`${kind === FrameKind.Response ? 'RESPONSE' : 'DATA'} frame for stream ${streamId}, which has no request waiting (late answer after cancel or timeout)`, { streamId });
        return;
      }
      this.onAnswerFrame(call, bytes);
      return;
    }
    if (kind === FrameKind.Cancel && bytes[0] === FRAME_VERSION) {
      this.onCancel(conn, streamId);
      return;
    }
    // A REQUEST, or something unknown that still names a stream: it gets a 400 unless that stream is busy.
    if (conn.inboundFrames.has(streamId)) {
      this.ignore(`frame for stream ${streamId} while a request on it is in flight`, { streamId });
      return;
    }
    if (bytes.byteLength > this.options.maxMessageBytes) {
      this.sendFrameError(conn, streamId, new MeshError('MESH_ERR_TOO_LARGE', `frame of ${bytes.byteLength} bytes is over this node's limit of ${this.options.maxMessageBytes}`));
      return;
    }
    let frame: RequestFrame;
    try {
      const f = decodeFrame(bytes);
      if (f.kind !== FrameKind.Request) throw new FrameError(`unexpected frame kind ${f.kind}`, streamId);
      frame = f;
    } catch (e) {
      const err = e instanceof FrameError ? e : new MeshError('MESH_ERR_BAD_FRAME', `undecodable frame: ${(e as Error).message}`);
      this.sendFrameError(conn, streamId, err);
      return;
    }
    if ((frame.flags & FLAG_END) === 0) {
      this.sendFrameError(conn, streamId, new MeshError('MESH_ERR_BAD_REQUEST', 'streamed request bodies are not supported: send the whole body in the REQUEST frame with END set'));
      return;
    }
    const call = new InboundCall(conn, streamId, undefined);
    call.released = true; // not counted until admitted
    if (!this.admit(call)) return;
    conn.inboundFrames.set(streamId, call);
    this.runHandler(call, new InboundRequest(frame.method, frame.path, frame.headers, frame.body, call));
  }

  private onCancel(conn: Connection, streamId: number): void {
    const call = conn.inboundFrames.get(streamId);
    if (call === undefined) {
      this.ignore(`CANCEL for stream ${streamId}, which is not running (already answered?)`, { streamId });
      return;
    }
    // The relay has forgotten the stream: no answer may follow, or it could land on a reused id.
    conn.inboundFrames.delete(streamId);
    this.abandonInbound(call, new MeshError('MESH_ERR_CANCELLED', 'the caller cancelled the request'));
  }

  private admit(call: InboundCall): boolean {
    if (this.handler === undefined) {
      this.answerError(call, new MeshError('MESH_ERR_UNAVAILABLE', 'this node serves no requests yet (no handler set); retry later'));
      return false;
    }
    if (this.inFlight >= this.options.maxConcurrentRequests) {
      this.answerError(call, new MeshError('MESH_ERR_TOO_MANY_REQUESTS', `this node already runs ${this.inFlight} requests; retry later`));
      return false;
    }
    return true;
  }

  private runHandler(call: InboundCall, req: InboundRequest): void {
    const handler = this.handler!;
    this.inFlight++;
    call.released = false;
    if (this.options.handlerTimeoutMs > 0) {
      call.deadline = Date.now() + this.options.handlerTimeoutMs;
      this.armSweep(call.conn, call.deadline);
    }
    let pending: Promise<MeshResponse>;
    try {
      pending = handler(req);
    } catch (e) {
      pending = Promise.reject(e);
    }
    void this.awaitHandler(call, pending);
  }

  /** Answer once the handler settles. An async method, not a then-chain: no closures or extra promises per request. */
  private async awaitHandler(call: InboundCall, pending: Promise<MeshResponse>): Promise<void> {
    try {
      let res: MeshResponse;
      try {
        res = await pending;
      } catch (e) {
        this.onHandlerError(call, e);
        return;
      }
      const answered = this.answer(call, res);
      if (answered !== undefined) await answered;
    } catch (e) {
      this.log({ level: 'error', event: 'send-failed', message: `answering failed: ${(e as Error).message}`, streamId: call.streamId, requestId: call.requestId, error: e });
    } finally {
      this.forgetInbound(call);
    }
  }

  private onHandlerError(call: InboundCall, e: unknown): void {
    if (call.settled) return;
    const err = asMeshError(e);
    if (err === undefined) this.log({ level: 'error', event: 'handler-error', message: `handler threw: ${(e as Error)?.message ?? String(e)}`, streamId: call.streamId, requestId: call.requestId, error: e });
    this.answerError(call, err ?? new MeshError('MESH_ERR_INTERNAL', 'the node failed to handle the request; see its log'));
  }

  /** The call no longer owes an answer: free its id and its concurrency slot (a handler that ignores its abort signal cannot hold a slot forever). */
  private forgetInbound(call: InboundCall): void {
    if (!call.released) {
      call.released = true;
      this.inFlight--;
    }
    const conn = call.conn;
    if (call.requestId !== undefined) {
      if (conn.inboundEnvelopes.get(call.requestId) === call) conn.inboundEnvelopes.delete(call.requestId);
    } else if (conn.inboundFrames.get(call.streamId) === call) conn.inboundFrames.delete(call.streamId);
    this.maybeDisarmSweep(conn);
  }

  private abandonInbound(call: InboundCall, reason: MeshError): void {
    // Mid-stream, the answer loop sees the abort and stops; before the answer, the answer is dropped.
    call.settled = true;
    call.abort(reason);
    this.forgetInbound(call);
  }

  // ------------------------------------------------------------ deadlines

  /** Make sure a sweep runs by `deadline` (give or take SWEEP_SLACK_MS). */
  private armSweep(conn: Connection, deadline: number): void {
    if (deadline + SWEEP_SLACK_MS >= conn.sweepAt || conn.closed) return;
    if (conn.sweepTimer !== undefined) clearTimeout(conn.sweepTimer);
    conn.sweepAt = deadline;
    conn.sweepTimer = setTimeout(this.sweepOnTimer, Math.max(0, deadline - Date.now()), conn);
  }

  private disarmSweep(conn: Connection): void {
    if (conn.sweepTimer !== undefined) clearTimeout(conn.sweepTimer);
    conn.sweepTimer = undefined;
    conn.sweepAt = Infinity;
  }

  /** Nothing pending: drop the timer, so an idle client holds no timer (and does not keep a process alive). */
  private maybeDisarmSweep(conn: Connection): void {
    if (conn.sweepTimer !== undefined && conn.outbound.size === 0 && conn.inboundFrames.size === 0 && conn.inboundEnvelopes.size === 0) this.disarmSweep(conn);
  }

  /** Time out what is due; re-arm for the earliest deadline left. */
  private sweep(conn: Connection): void {
    conn.sweepTimer = undefined;
    conn.sweepAt = Infinity;
    if (conn.closed) return;
    const now = Date.now();
    let next = Infinity;
    for (const call of conn.outbound.values()) {
      if (call.timeoutMs <= 0 || call.phase === CallPhase.Done) continue;
      // Idle time: every answer frame moves the deadline (onAnswerFrame sets lastFrameAt).
      const deadline = call.lastFrameAt + call.timeoutMs;
      if (deadline <= now) this.cancelCall(call, new MeshError('MESH_ERR_TIMEOUT', `no answer frame from the peer within ${call.timeoutMs} ms`, { streamId: call.streamId }));
      else if (deadline < next) next = deadline;
    }
    next = this.sweepInbound(conn.inboundFrames, now, next);
    next = this.sweepInbound(conn.inboundEnvelopes, now, next);
    if (next !== Infinity) this.armSweep(conn, next);
  }

  private sweepInbound(calls: Map<unknown, InboundCall>, now: number, next: number): number {
    for (const call of calls.values()) {
      if (call.settled || call.deadline === 0) continue;
      if (call.deadline <= now) {
        const err = new MeshError('MESH_ERR_TIMEOUT', `the handler did not answer within ${this.options.handlerTimeoutMs} ms`);
        call.abort(err);
        this.answerError(call, err);
      } else if (call.deadline < next) next = call.deadline;
    }
    return next;
  }

  /** Validate what a handler returned; a bad answer is the handler's bug, so the caller gets 500, not garbage. */
  private static checkResponse(res: unknown): MeshResponse {
    const r = res as MeshResponse | undefined;
    if (typeof r !== 'object' || r === null || !Number.isInteger(r.status) || r.status < 100 || r.status > 599) {
      throw new MeshError('MESH_ERR_INTERNAL', 'the handler returned no valid response (status must be an integer 100..599)');
    }
    const body = r.body ?? EMPTY;
    if (!(body instanceof Uint8Array) && typeof (body as AsyncIterable<Uint8Array>)[Symbol.asyncIterator] !== 'function') {
      throw new MeshError('MESH_ERR_INTERNAL', 'the handler returned a body that is neither bytes nor an async iterable');
    }
    return { status: r.status, headers: normalHeaders(r.headers), body };
  }

  /** Send the handler's answer; synchronous (no promise) for a bytes body that the send gate lets through at once, the common case. */
  private answer(call: InboundCall, raw: MeshResponse): Promise<void> | void {
    if (call.settled) {
      // Timed out or cancelled already: release a stream the handler may have opened.
      const body = (raw as MeshResponse | undefined)?.body;
      if (body && !(body instanceof Uint8Array)) void body[Symbol.asyncIterator]().return?.()?.catch?.(() => {});
      return;
    }
    let res: MeshResponse;
    try {
      res = RelayClient.checkResponse(raw);
    } catch (e) {
      this.answerError(call, e as MeshError);
      return;
    }
    call.settled = true;
    if (call.requestId !== undefined) return this.answerEnvelope(call, res);
    if (res.body instanceof Uint8Array) return this.answerBytes(call, res.status, res.headers, res.body);
    return this.answerStream(call, res.status, res.headers, res.body);
  }

  private async answerEnvelope(call: InboundCall, res: MeshResponse): Promise<void> {
    let body: Uint8Array;
    try {
      body = await collectBody(res.body);
    } catch (e) {
      const err = asMeshError(e) ?? new MeshError('MESH_ERR_INTERNAL', 'the response body failed while it was read; see the node log');
      if (!asMeshError(e)) this.log({ level: 'error', event: 'handler-error', message: `response body threw: ${(e as Error)?.message}`, requestId: call.requestId, error: e });
      this.sendEnvelope(call.conn, { type: 'relay-http-response', request_id: call.requestId, status: err.status, headers: { 'content-type': 'application/json' }, body: JSON.stringify(err.toBody()) }, call.requestId);
      return;
    }
    if (call.aborted) return;
    this.sendEnvelope(call.conn, { type: 'relay-http-response', request_id: call.requestId, status: res.status, headers: res.headers, ...bodyFieldsFor(body, res.headers) }, call.requestId);
  }

  private answerBytes(call: InboundCall, status: number, headers: HeaderMap, body: Uint8Array): Promise<void> | void {
    const streamId = call.streamId;
    let frame: Uint8Array;
    try {
      frame = encodeResponseFrame({ streamId, status, headers, body });
    } catch (e) {
      frame = encodeErrorFrame(streamId, asMeshError(e) ?? new MeshError('MESH_ERR_INTERNAL', 'the response could not be encoded'));
    }
    return this.sendFrame(call.conn, frame, streamId);
  }

  private async answerStream(call: InboundCall, status: number, headers: HeaderMap, body: AsyncIterable<Uint8Array>): Promise<void> {
    const { conn, streamId } = call;
    const iterator = body[Symbol.asyncIterator]();
    try {
      await this.sendFrame(conn, encodeResponseFrame({ streamId, status, headers, end: false }), streamId);
      while (!call.aborted) {
        const step = await iterator.next();
        if (call.aborted) break;
        if (step.done) {
          await this.sendFrame(conn, encodeDataFrame(streamId, EMPTY, true), streamId);
          return;
        }
        if (!(step.value instanceof Uint8Array)) throw new MeshError('MESH_ERR_INTERNAL', 'the response stream yielded something other than bytes');
        await this.sendFrame(conn, encodeDataFrame(streamId, step.value, false), streamId);
      }
      await iterator.return?.();
    } catch (e) {
      if (call.aborted || conn.closed) {
        void Promise.resolve(iterator.return?.()).catch(() => {});
        return;
      }
      const err = asMeshError(e) ?? new MeshError('MESH_ERR_INTERNAL', 'the response stream failed midway; see the node log');
      if (!asMeshError(e)) this.log({ level: 'error', event: 'handler-error', message: `response stream threw: ${(e as Error)?.message}`, streamId, error: e });
      void Promise.resolve(iterator.return?.()).catch(() => {});
      await this.sendFrame(conn, encodeStreamErrorFrame(streamId, err), streamId);
    }
  }

  private answerError(call: InboundCall, err: MeshError): void {
    if (call.settled) return;
    call.settled = true;
    if (call.requestId !== undefined) this.sendEnvelopeError(call.conn, call.requestId, err);
    else this.sendFrameError(call.conn, call.streamId, err);
    // The id is free for the relay to reuse once our last frame is out, even if the handler still runs.
    this.forgetInbound(call);
  }

  private sendFrameError(conn: Connection, streamId: number, err: MeshError): void {
    this.log({ level: 'info', event: 'answered-error', message: `${err.status} ${err.code}: ${err.message}`, streamId });
    void this.sendFrame(conn, encodeErrorFrame(streamId, err), streamId);
  }

  private sendEnvelopeError(conn: Connection, requestId: string, err: MeshError): void {
    this.log({ level: 'info', event: 'answered-error', message: `${err.status} ${err.code}: ${err.message}`, requestId });
    this.sendEnvelope(conn, { type: 'relay-http-response', request_id: requestId, status: err.status, headers: { 'content-type': 'application/json' }, body: JSON.stringify(err.toBody()) }, requestId);
  }

  private sendEnvelope(conn: Connection, msg: Record<string, unknown>, requestId: string | undefined): void {
    void this.sendFrame(conn, JSON.stringify(msg), undefined, requestId);
  }

  /** Send on one connection; never throws: a lost answer is logged (the relay answers the caller 502). */
  private sendFrame(conn: Connection, data: string | Uint8Array, streamId?: number, requestId?: string): Promise<void> | void {
    if (conn.closed) {
      this.sendFailed(new MeshError('MESH_ERR_PEER_GONE', 'connection closed before the answer was ready'), streamId, requestId);
      return;
    }
    try {
      const p = conn.gate.send(data);
      if (p !== undefined) return p.catch((e: unknown) => this.sendFailed(e, streamId, requestId));
    } catch (e) {
      this.sendFailed(e, streamId, requestId);
    }
  }

  private sendFailed(e: unknown, streamId: number | undefined, requestId: string | undefined): void {
    this.log({ level: 'warn', event: 'send-failed', message: `answer not sent: ${(e as Error).message}`, streamId, requestId, error: e });
  }

  // ------------------------------------------------------------ outgoing

  /** Send a request to another peer over the fast path and collect its whole answer. Relay errors (404, 502, 504 …) are replies, not throws. */
  request(peerId: string, req: OutgoingRequest, opts: RequestOptions = NO_OPTIONS): Promise<MeshReply> {
    return new Promise<MeshReply>((resolve, reject) => {
      this.startCall(peerId, req, opts, false, resolve, NOOP, reject);
    });
  }

  /** Like request(), but resolves at the answer's head and yields the body as it arrives. */
  requestStream(peerId: string, req: OutgoingRequest, opts: RequestOptions = NO_OPTIONS): Promise<MeshStreamReply> {
    return new Promise<MeshStreamReply>((resolve, reject) => {
      this.startCall(peerId, req, opts, true, NOOP, resolve, reject);
    });
  }

  private startCall(peerId: string, req: OutgoingRequest, opts: RequestOptions, streaming: boolean, resolveReply: (r: MeshReply) => void, resolveHead: (r: MeshStreamReply) => void, reject: (e: unknown) => void): void {
    const conn = this.conn;
    if (conn === undefined || !conn.registered || conn.closed) {
      reject(new MeshError('MESH_ERR_UNAVAILABLE', `not registered with the relay (state ${this.stateValue}); await ready() or use another path`));
      return;
    }
    const signal = opts.signal;
    if (signal?.aborted) {
      reject(new MeshError('MESH_ERR_CANCELLED', 'the request was cancelled before it was sent', { reason: String(signal.reason) }));
      return;
    }
    let target = this.peerIdBytes.get(peerId);
    if (target === undefined) {
      if (!isPeerId(peerId)) {
        reject(new MeshError('MESH_ERR_BAD_REQUEST', `"${peerId}" is not a peer id (32 lowercase hex digits)`));
        return;
      }
      target = hexToBytes(peerId);
      if (this.peerIdBytes.size >= 4096) this.peerIdBytes.clear();
      this.peerIdBytes.set(peerId, target);
    }
    const streamId = this.allocStreamId(conn);
    let frame: Uint8Array;
    try {
      frame = encodeRequestFrame({ streamId, peerId: target, method: req.method, path: req.path, headers: req.headers, body: req.body });
    } catch (e) {
      reject(e);
      return;
    }
    const timeoutMs = opts.timeoutMs ?? this.options.requestTimeoutMs;
    const call = new OutboundCall(streamId, conn, streaming, timeoutMs, resolveReply, resolveHead, reject);
    conn.outbound.set(streamId, call);
    if (timeoutMs > 0) this.armSweep(conn, call.lastFrameAt + timeoutMs);
    if (signal) {
      const onAbort = (): void => this.cancelCall(call, new MeshError('MESH_ERR_CANCELLED', 'the request was cancelled', { reason: String(signal.reason) }));
      signal.addEventListener('abort', onAbort, { once: true });
      call.abortCleanup = () => signal.removeEventListener('abort', onAbort);
    }
    try {
      const p = conn.gate.send(frame);
      if (p !== undefined) p.catch((e: unknown) => this.failCall(call, asMeshError(e) ?? new MeshError('MESH_ERR_PEER_GONE', (e as Error).message), true));
    } catch (e) {
      this.failCall(call, asMeshError(e) ?? new MeshError('MESH_ERR_PEER_GONE', (e as Error).message), true);
    }
  }

  private allocStreamId(conn: Connection): number {
    // Monotonic over 2^32 so a late answer to a cancelled stream cannot land on a new request.
    for (;;) {
      this.nextStreamId = (this.nextStreamId + 1) >>> 0;
      if (this.nextStreamId !== 0 && !conn.outbound.has(this.nextStreamId)) return this.nextStreamId;
    }
  }

  /** Give up on a call and tell the far side to stop (CANCEL). */
  private cancelCall(call: OutboundCall, err: MeshError): void {
    if (call.phase === CallPhase.Done) return;
    if (!call.conn.closed) void this.sendFrame(call.conn, encodeCancelFrame(call.streamId), call.streamId);
    this.failCall(call, err, true);
  }

  private failCall(call: OutboundCall, err: unknown, removeFromMap: boolean): void {
    if (call.phase === CallPhase.Done) return;
    const wasStreaming = call.phase === CallPhase.Streaming;
    this.finishCall(call, removeFromMap);
    if (call.streaming && wasStreaming) {
      call.failure = err;
      const w = call.chunkWaiter;
      call.chunkWaiter = undefined;
      w?.reject(err);
    } else call.reject(err);
  }

  private finishCall(call: OutboundCall, removeFromMap: boolean): void {
    call.phase = CallPhase.Done;
    call.abortCleanup?.();
    call.abortCleanup = undefined;
    if (removeFromMap && call.conn.outbound.get(call.streamId) === call) {
      call.conn.outbound.delete(call.streamId);
      this.maybeDisarmSweep(call.conn);
    }
  }

  private onAnswerFrame(call: OutboundCall, bytes: Uint8Array): void {
    call.lastFrameAt = Date.now();
    if (bytes[0] !== FRAME_VERSION) {
      this.cancelCall(call, new MeshError('MESH_ERR_BAD_FRAME', `answer frame of version ${bytes[0]} (this peer speaks ${FRAME_VERSION})`));
      return;
    }
    const flags = bytes[2]!;
    const end = (flags & FLAG_END) !== 0;
    if (bytes[1] === FrameKind.Response) {
      if (call.phase !== CallPhase.AwaitingHead) {
        this.cancelCall(call, new MeshError('MESH_ERR_BAD_FRAME', 'a second RESPONSE frame on one stream'));
        return;
      }
      let frame;
      try {
        frame = decodeFrame(bytes);
      } catch (e) {
        this.cancelCall(call, asMeshError(e) ?? new MeshError('MESH_ERR_BAD_FRAME', 'undecodable RESPONSE frame'));
        return;
      }
      if (frame.kind !== FrameKind.Response) return;
      call.status = frame.status;
      call.headers = frame.headers;
      if (end) {
        this.finishCall(call, true);
        if (call.streaming) {
          call.ended = true;
          if (frame.body.byteLength > 0) call.parts.push(frame.body);
          call.resolveHead({ status: frame.status, headers: frame.headers, body: this.bodyIterator(call) });
        } else call.resolveReply({ status: frame.status, headers: frame.headers, body: frame.body });
        return;
      }
      call.phase = CallPhase.Streaming;
      if (frame.body.byteLength > 0) call.parts.push(frame.body);
      if (call.streaming) call.resolveHead({ status: frame.status, headers: frame.headers, body: this.bodyIterator(call) });
      return;
    }
    // DATA
    if (call.phase !== CallPhase.Streaming) {
      this.cancelCall(call, new MeshError('MESH_ERR_BAD_FRAME', 'DATA frame before the RESPONSE head'));
      return;
    }
    const body = bytes.subarray(FRAME_HEAD_BYTES);
    if ((flags & FLAG_ERROR) !== 0) {
      this.failCall(call, meshErrorFromBody(body, 'the peer failed midway through a streamed answer'), true);
      return;
    }
    if (!call.streaming) {
      if (body.byteLength > 0) call.parts.push(body);
      if (end) {
        this.finishCall(call, true);
        call.resolveReply({ status: call.status, headers: call.headers, body: concat(call.parts) });
        call.parts = [];
      }
      return;
    }
    if (body.byteLength > 0) call.parts.push(body);
    if (end) {
      this.finishCall(call, true);
      call.ended = true;
    }
    const w = call.chunkWaiter;
    if (w === undefined) return;
    if (call.parts.length > 0) {
      call.chunkWaiter = undefined;
      w.resolve({ value: call.parts.shift()!, done: false });
    } else if (call.ended) {
      call.chunkWaiter = undefined;
      w.resolve({ value: undefined, done: true });
    }
  }

  /** Pull iterator over a streamed answer; return() before the end sends CANCEL. */
  private bodyIterator(call: OutboundCall): AsyncIterableIterator<Uint8Array> {
    const iterator: AsyncIterableIterator<Uint8Array> = {
      next: (): Promise<IteratorResult<Uint8Array>> => {
        if (call.parts.length > 0) return Promise.resolve({ value: call.parts.shift()!, done: false });
        if (call.failure !== undefined) return Promise.reject(call.failure);
        if (call.ended) return Promise.resolve({ value: undefined, done: true });
        if (call.chunkWaiter !== undefined) return Promise.reject(new TypeError('next() called again before the previous chunk arrived'));
        return new Promise((resolve, reject) => {
          call.chunkWaiter = { resolve, reject };
        });
      },
      return: (): Promise<IteratorResult<Uint8Array>> => {
        if (call.phase !== CallPhase.Done) this.cancelCall(call, new MeshError('MESH_ERR_CANCELLED', 'the consumer stopped reading the stream'));
        call.parts = [];
        call.ended = true;
        call.failure = undefined;
        return Promise.resolve({ value: undefined, done: true });
      },
      [Symbol.asyncIterator]() {
        return iterator;
      },
    };
    return iterator;
  }
}
