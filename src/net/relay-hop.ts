/**
 * The ADR-0014 path (PROTOCOL.md §3): a caller opens `ws(s)://RELAY/rpc/<peer_id>`
 * and exchanges JSON `{request_id, method, path, headers, body_base64|body}`
 * messages. It works with any ADR-era relay; the fast path of RelayClient is
 * preferred when both ends speak it.
 *
 * `relayHop` is the ADR's Option A: one socket per hop. `RpcConnection` keeps
 * the socket open for many requests, matched by `request_id`, which saves the
 * 50–150 ms handshake per token that the ADR accepted "for prototype".
 */
import { bodyFieldsFor, envelopeBody, errorReply, rpcResponseSchema, type MeshReply } from '../protocol/envelopes.ts';
import { MeshError, codeForStatus, type MeshErrorCode } from '../protocol/errors.ts';
import { normalizeHeaders } from '../protocol/headers.ts';
import { randomHex } from '../protocol/ids.ts';
import type { OutgoingRequest, RelayLogEntry, RequestOptions } from './contract.ts';
import { RPC_DEFAULTS, type RpcOptions } from './relay-options.ts';
import { SendGate, WS_OPEN, type WebSocketConstructor, type WebSocketLike } from './socket.ts';

/**
 * Reports the HTTP status of a refused handshake, for hosts that can see it.
 * A browser WebSocket cannot (it only fires error + close 1006); `ws` can, see
 * {@link watchWsHandshake}. The hook must call `onRejected` at most once.
 */
export type HandshakeWatcher = (socket: WebSocketLike, onRejected: (status: number) => void) => void;

export interface RpcConnectionInit extends Partial<RpcOptions> {
  WebSocket: WebSocketConstructor;
  watchHandshake?: HandshakeWatcher;
  onLog?: (entry: RelayLogEntry) => void;
}

/** What the `ws` package's socket offers beyond the browser API (typed here so src/node never imports `ws`). */
interface WsHandshakeEmitter {
  once(event: 'unexpected-response', listener: (req: unknown, res: { statusCode?: number; resume?: () => void }) => void): unknown;
}

/** HandshakeWatcher for sockets of the `ws` package: the Node.js host passes it, the browser host passes nothing. */
export const watchWsHandshake: HandshakeWatcher = (socket, onRejected) => {
  (socket as unknown as WsHandshakeEmitter).once('unexpected-response', (_req, res) => {
    onRejected(res.statusCode ?? 0);
    res.resume?.();
    // With a listener attached `ws` leaves the handshake to us; close() aborts it and emits close.
    socket.close();
  });
};

/** The code of a refused `/rpc` handshake: a browser sees no body, only (through the host) the status; on `/rpc/<id>` a 404 means that peer is not connected. */
function handshakeCode(status: number): MeshErrorCode {
  return status === 404 ? 'MESH_ERR_NO_SUCH_PEER' : codeForStatus(status);
}

/** A refused handshake as the reply the relay would have sent on an open socket (the code's status, as every error answer). */
function handshakeReply(status: number, addr: string): MeshReply {
  return errorReply(new MeshError(handshakeCode(status), status === 404 ? `the relay has no peer connected at ${addr}` : `the relay refused ${addr} with HTTP ${status}`));
}

class HandshakeRejected extends MeshError {
  constructor(
    readonly handshakeStatus: number,
    addr: string,
  ) {
    super(handshakeCode(handshakeStatus), `the relay refused ${addr} with HTTP ${handshakeStatus}`, { handshakeStatus });
  }
}

interface PendingRpc {
  resolve: (r: MeshReply) => void;
  reject: (e: unknown) => void;
  timer: ReturnType<typeof setTimeout> | undefined;
  abortCleanup: (() => void) | undefined;
}

/** One `/rpc/<peer_id>` socket carrying many requests. Reopens on the next request after it closes. */
export class RpcConnection {
  readonly options: RpcOptions;
  private readonly WebSocketCtor: WebSocketConstructor;
  private readonly watchHandshake: HandshakeWatcher | undefined;
  private readonly onLog: (entry: RelayLogEntry) => void;
  private socket: WebSocketLike | undefined;
  private gate: SendGate | undefined;
  private opening: Promise<void> | undefined;
  private readonly pending = new Map<string, PendingRpc>();
  private readonly idPrefix = randomHex(4);
  private nextId = 0;
  private closedByUs = false;

  constructor(
    readonly relayAddr: string,
    init: RpcConnectionInit,
  ) {
    this.options = { ...RPC_DEFAULTS };
    for (const k of Object.keys(RPC_DEFAULTS) as Array<keyof RpcOptions>) if (init[k] !== undefined) this.options[k] = init[k];
    this.WebSocketCtor = init.WebSocket;
    this.watchHandshake = init.watchHandshake;
    this.onLog = init.onLog ?? (() => {});
  }

  get isOpen(): boolean {
    return this.socket !== undefined && this.socket.readyState === WS_OPEN;
  }
  get pendingRequests(): number {
    return this.pending.size;
  }

  /** Open the socket (idempotent). Rejects with HTTP status details when the host can see them. */
  open(): Promise<void> {
    if (this.isOpen) return Promise.resolve();
    if (this.opening) return this.opening;
    this.closedByUs = false;
    const opening = new Promise<void>((resolve, reject) => {
      let socket: WebSocketLike;
      try {
        socket = new this.WebSocketCtor(this.relayAddr);
        socket.binaryType = 'arraybuffer';
      } catch (e) {
        reject(new MeshError('MESH_ERR_UNAVAILABLE', `cannot open ${this.relayAddr}: ${(e as Error).message}`));
        return;
      }
      let settled = false;
      const settle = (err?: MeshError): void => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        if (err === undefined) resolve();
        else {
          this.detach(socket);
          reject(err);
        }
      };
      const timer = setTimeout(() => {
        settle(new MeshError('MESH_ERR_TIMEOUT', `${this.relayAddr} did not open within ${this.options.openTimeoutMs} ms`));
        try {
          socket.close();
        } catch {
          // closing a socket that never opened may throw in some hosts; it is abandoned either way
        }
      }, this.options.openTimeoutMs);
      this.watchHandshake?.(socket, (status) => settle(new HandshakeRejected(status, this.relayAddr)));
      this.socket = socket;
      this.gate = new SendGate(socket, this.options.highWaterBytes, this.options.maxSendWaitMs);
      socket.onopen = () => settle();
      socket.onmessage = (ev) => this.socketOnMessage(socket, ev.data);
      socket.onerror = () => {
        // The browser hides why (404 handshake, refused TCP …); close follows with 1006.
      };
      socket.onclose = (ev) => {
        settle(
          new MeshError('MESH_ERR_UNAVAILABLE', `could not open ${this.relayAddr} (close code ${ev.code ?? '?'}): the peer is not connected to the relay, or the relay is unreachable`),
        );
        this.socketOnClose(socket, ev.code);
      };
    });
    this.opening = opening;
    const clear = (): void => {
      if (this.opening === opening) this.opening = undefined;
    };
    opening.then(clear, clear);
    return opening;
  }

  /** One request; the relay's error answers (404, 502, 504 …) are replies. Throws MeshError only for timeout, cancel, or a lost/unopenable socket. */
  async request(req: OutgoingRequest, opts: RequestOptions = {}): Promise<MeshReply> {
    if (opts.signal?.aborted) throw new MeshError('MESH_ERR_CANCELLED', 'the request was cancelled before it was sent');
    try {
      await this.open();
    } catch (e) {
      if (e instanceof HandshakeRejected) return handshakeReply(e.handshakeStatus, this.relayAddr);
      throw e;
    }
    const socket = this.socket!;
    const gate = this.gate!;
    const requestId = `${this.idPrefix}${(this.nextId++).toString(16)}`;
    const headers = normalizeHeaders(req.headers);
    const body = req.body ?? new Uint8Array(0);
    const text = JSON.stringify({ request_id: requestId, method: req.method.toUpperCase(), path: req.path, headers, ...bodyFieldsFor(body, headers) });
    const timeoutMs = opts.timeoutMs ?? this.options.requestTimeoutMs;
    return new Promise<MeshReply>((resolve, reject) => {
      const entry: PendingRpc = { resolve, reject, timer: undefined, abortCleanup: undefined };
      this.pending.set(requestId, entry);
      if (timeoutMs > 0) {
        entry.timer = setTimeout(() => this.fail(requestId, new MeshError('MESH_ERR_TIMEOUT', `no answer from ${this.relayAddr} within ${timeoutMs} ms`)), timeoutMs);
      }
      const signal = opts.signal;
      if (signal) {
        // The ADR path has no cancel message: forgetting the id is all a caller can do.
        const onAbort = (): void => this.fail(requestId, new MeshError('MESH_ERR_CANCELLED', 'the request was cancelled', { reason: String(signal.reason) }));
        signal.addEventListener('abort', onAbort, { once: true });
        entry.abortCleanup = () => signal.removeEventListener('abort', onAbort);
      }
      try {
        if (this.socket !== socket) throw new MeshError('MESH_ERR_PEER_GONE', `${this.relayAddr} closed before the request was sent`);
        const p = gate.send(text);
        if (p !== undefined) p.catch((e: unknown) => this.fail(requestId, e));
      } catch (e) {
        this.fail(requestId, e);
      }
    });
  }

  /** Close the socket; pending requests reject with MESH_ERR_PEER_GONE. */
  close(): void {
    this.closedByUs = true;
    const socket = this.socket;
    if (socket) {
      this.detach(socket);
      try {
        socket.close(1000, 'done');
      } catch {
        // already closing
      }
    }
  }

  private fail(requestId: string, err: unknown): void {
    const entry = this.pending.get(requestId);
    if (entry === undefined) return;
    this.pending.delete(requestId);
    if (entry.timer !== undefined) clearTimeout(entry.timer);
    entry.abortCleanup?.();
    entry.reject(err);
  }

  private socketOnMessage(socket: WebSocketLike, data: unknown): void {
    if (socket !== this.socket) return;
    if (typeof data !== 'string') {
      this.onLog({ level: 'warn', event: 'ignored', message: `binary message on ${this.relayAddr}; the /rpc path speaks JSON text` });
      return;
    }
    let parsed;
    try {
      parsed = rpcResponseSchema.safeParse(JSON.parse(data));
    } catch {
      this.onLog({ level: 'warn', event: 'ignored', message: `non-JSON message on ${this.relayAddr}` });
      return;
    }
    if (!parsed.success) {
      this.onLog({ level: 'warn', event: 'ignored', message: `malformed /rpc answer: ${parsed.error.issues[0]?.message ?? ''}` });
      return;
    }
    const msg = parsed.data;
    let requestId = msg.request_id;
    // The relay answers a request whose id it could not read with request_id null: only attributable when one is pending.
    if (requestId === null) {
      if (this.pending.size !== 1) {
        this.onLog({ level: 'warn', event: 'ignored', message: `answer without request_id while ${this.pending.size} requests are pending` });
        return;
      }
      requestId = this.pending.keys().next().value!;
    }
    const entry = this.pending.get(requestId);
    if (entry === undefined) {
      this.onLog({ level: 'debug', event: 'ignored', message: `answer for ${requestId}, which no longer waits (timed out or cancelled)`, requestId });
      return;
    }
    let body: Uint8Array;
    try {
      body = envelopeBody(msg);
    } catch {
      this.fail(requestId, new MeshError('MESH_ERR_UPSTREAM', `answer for ${requestId} has a body_base64 that is not base64`));
      return;
    }
    this.pending.delete(requestId);
    if (entry.timer !== undefined) clearTimeout(entry.timer);
    entry.abortCleanup?.();
    entry.resolve({ status: msg.status, headers: normalizeHeaders(msg.headers), body });
  }

  private socketOnClose(socket: WebSocketLike, code: number | undefined): void {
    if (socket !== this.socket) return;
    this.detach(socket);
    if (!this.closedByUs && this.pending.size > 0) this.onLog({ level: 'warn', event: 'connection', message: `${this.relayAddr} closed (code ${code ?? '?'}) with ${this.pending.size} requests pending` });
  }

  /** Forget a socket and fail everything that waited on it. */
  private detach(socket: WebSocketLike): void {
    if (socket !== this.socket) return;
    this.socket = undefined;
    const gate = this.gate;
    this.gate = undefined;
    socket.onmessage = null;
    socket.onclose = null;
    socket.onopen = null;
    const err = new MeshError('MESH_ERR_PEER_GONE', `${this.relayAddr} closed before answering; the request may or may not have run`);
    gate?.failAll(err);
    for (const id of [...this.pending.keys()]) this.fail(id, err);
  }
}

export interface RelayHopOptions extends Partial<RpcOptions> {
  WebSocket: WebSocketConstructor;
  /** Time for open + answer. @defaultValue 30000 */
  timeoutMs?: number;
  signal?: AbortSignal;
  watchHandshake?: HandshakeWatcher;
}

/** ADR-0014 Option A: one `/rpc` socket for one request, closed afterwards. */
export async function relayHop(relayAddr: string, req: OutgoingRequest, opts: RelayHopOptions): Promise<MeshReply> {
  const timeoutMs = opts.timeoutMs ?? RPC_DEFAULTS.requestTimeoutMs;
  const conn = new RpcConnection(relayAddr, { ...opts, openTimeoutMs: opts.openTimeoutMs ?? (timeoutMs > 0 ? timeoutMs : RPC_DEFAULTS.openTimeoutMs) });
  const started = Date.now();
  try {
    try {
      await conn.open();
    } catch (e) {
      if (e instanceof HandshakeRejected) return handshakeReply(e.handshakeStatus, relayAddr);
      throw e;
    }
    const left = timeoutMs > 0 ? Math.max(1, timeoutMs - (Date.now() - started)) : 0;
    return await conn.request(req, { timeoutMs: left, signal: opts.signal });
  } finally {
    conn.close();
  }
}
