/**
 * A frame multiplexer over one open WebSocket (docs/protocol.md §2, §4): many
 * requests in both directions at once, each on its own stream.
 *
 *   socket ──▶ REQUEST, CANCEL, relay-http-request ──▶ MuxBridge ──▶ handler
 *   socket ──▶ RESPONSE, DATA                       ──▶ MuxCaller ──▶ request() / requestStream()
 *
 * The two directions never share an id space: REQUEST/CANCEL from the far
 * side name *its* streams, RESPONSE/DATA name *ours*. Every send goes
 * through one SendGate (backpressure on bufferedAmount), and one timer per
 * connection sweeps every deadline (outgoing answers, incoming handlers).
 *
 * The socket is open and the far side known when a mux is made: the relay
 * dialer (relay-client.ts) makes one per registered connection, a direct
 * link (direct-link.ts) one per accepted and verified socket. Closing the
 * mux — or the socket closing — rejects every pending call and aborts every
 * running handler, once.
 */
import { MeshError } from '../protocol/errors.ts';
import { FRAME_HEAD_BYTES, FRAME_VERSION, FrameKind } from '../protocol/frames.ts';
import type { MeshReply } from '../protocol/envelopes.ts';
import type { MeshHandler, MeshStreamReply, OutgoingRequest, RelayLogEntry, RequestOptions } from './contract.ts';
import { MuxBridge } from './mux-bridge.ts';
import { MuxCaller } from './mux-caller.ts';
import type { MuxPort } from './mux-port.ts';
import type { MuxOptions } from './relay-options.ts';
import { SendGate, WS_OPEN, messageBytes, type SocketMessageEvent, type WebSocketLike } from './socket.ts';

export interface FrameMuxInit {
  options: MuxOptions;
  /** What the connection is, in messages ("relay connection", "link to …"). @defaultValue 'connection' */
  name?: string;
  handler?: MeshHandler;
  onLog?: (entry: RelayLogEntry) => void;
  /** Called once when the mux closes (socket gone, or close()). */
  onClose?: (reason: string) => void;
  /**
   * Every incoming REQUEST frame before it is decoded (version 1, long
   * enough to hold a peer id): may rewrite it in place, or refuse it with an
   * error that is answered on its stream. A direct link checks the target
   * is the node itself and writes in the caller's id, as a relay would.
   */
  checkRequest?: (frame: Uint8Array) => MeshError | undefined;
  /** The relay's answers about watched peers (`peer-watch`, `peer-gone`: PEER_WATCH_FEATURE), with a string peer_id. */
  onPeerNotice?: (msg: { type: 'peer-watch' | 'peer-gone'; peer_id: string; attached?: unknown }) => void;
  /** The relay's answer to one of our batched heartbeats (`beat-answer`, BEAT_BATCH_FEATURE), parsed JSON, unchecked. */
  onBeatAnswer?: (msg: object) => void;
  /** A batch of heartbeats for this peer, a tracker (`beats`, BEAT_BATCH_FEATURE), parsed JSON, unchecked. */
  onBeats?: (msg: object) => void;
}

/** Later deadlines than the armed sweep by less than this do not re-arm it. */
const SWEEP_SLACK_MS = 10;
const REQUEST_ID_RE = /"request_id"\s*:\s*"([^"\\]{1,128})"/;

export class FrameMux implements MuxPort {
  readonly options: MuxOptions;
  readonly gate: SendGate;
  closed = false;
  private readonly bridge: MuxBridge;
  private readonly caller: MuxCaller;
  private readonly onLog: (entry: RelayLogEntry) => void;
  private sweepTimer: ReturnType<typeof setTimeout> | undefined;
  /** When sweepTimer fires (ms since epoch); Infinity when not armed. */
  private sweepAt = Infinity;
  private readonly sweepOnTimer = (): void => this.sweep();

  constructor(
    readonly socket: WebSocketLike,
    private readonly init: FrameMuxInit,
  ) {
    this.options = init.options;
    this.gate = new SendGate(socket, init.options.highWaterBytes, init.options.maxSendWaitMs);
    this.onLog = init.onLog ?? (() => {});
    this.bridge = new MuxBridge(this, init.handler);
    this.caller = new MuxCaller(this);
    socket.onmessage = (ev) => this.onMessage(ev);
    socket.onclose = (ev) => this.close(`socket closed (code ${ev.code ?? '?'}${ev.reason ? `: ${ev.reason}` : ''})`);
    // An error is always followed by close; log it, let close decide.
    socket.onerror = (ev) => {
      if (!this.closed) this.log({ level: 'debug', event: 'connection', message: `socket error on the ${init.name ?? 'connection'}`, error: ev });
    };
  }

  /** Incoming requests whose handler has not finished. */
  get pendingIncoming(): number {
    return this.bridge.inFlight;
  }
  /** Outgoing requests waiting for (the rest of) an answer. */
  get pendingOutgoing(): number {
    return this.caller.size;
  }

  setHandler(handler: MeshHandler | undefined): void {
    this.bridge.handler = handler;
  }

  /** Send a request to a peer and collect its whole answer. Error answers (404, 502, 504 …) are replies, not throws. */
  request(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshReply> {
    return this.caller.request(peerId, req, opts);
  }

  /** A one-way request (see MuxCaller.push): only for a far side that announced the `one-way` feature. */
  push(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshReply> {
    return this.caller.push(peerId, req, opts);
  }

  /** Like request(), but resolves at the answer's head and yields the body as it arrives. */
  requestStream(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshStreamReply> {
    return this.caller.requestStream(peerId, req, opts);
  }

  /**
   * Close the socket (`code`, default 1000) and settle everything pending,
   * once: calls reject with `pendingError` (default MESH_ERR_PEER_GONE),
   * handlers are aborted.
   */
  close(reason: string, opts: { code?: number; pendingError?: MeshError } = {}): void {
    if (this.closed) return;
    this.closed = true;
    this.disarmSweep();
    const socket = this.socket;
    socket.onmessage = null;
    socket.onclose = null;
    socket.onerror = null;
    try {
      if (socket.readyState <= WS_OPEN) socket.close(opts.code ?? 1000, reason.slice(0, 120));
    } catch {
      // a socket that refuses close() is already going away
    }
    const err = opts.pendingError ?? new MeshError('MESH_ERR_PEER_GONE', `${this.init.name ?? 'connection'} lost (${reason}); the request may or may not have run`, { reason: 'disconnected' });
    this.gate.failAll(err);
    this.caller.failAll(err);
    // The far side answers our callers with 502; the handlers' work is moot.
    this.bridge.abandonAll(err);
    this.init.onClose?.(reason);
  }

  // ------------------------------------------------------------ MuxPort

  send(data: string | Uint8Array, streamId?: number, requestId?: string): Promise<void> | void {
    if (this.closed) {
      this.sendFailed(new MeshError('MESH_ERR_PEER_GONE', 'connection closed before the answer was ready'), streamId, requestId);
      return;
    }
    try {
      const p = this.gate.send(data);
      if (p !== undefined) return p.catch((e: unknown) => this.sendFailed(e, streamId, requestId));
    } catch (e) {
      this.sendFailed(e, streamId, requestId);
    }
  }

  log(entry: RelayLogEntry): void {
    try {
      this.onLog(entry);
    } catch {
      // a failing logger must not take the data path down with it
    }
  }

  armSweep(deadline: number): void {
    if (deadline + SWEEP_SLACK_MS >= this.sweepAt || this.closed) return;
    if (this.sweepTimer !== undefined) clearTimeout(this.sweepTimer);
    this.sweepAt = deadline;
    this.sweepTimer = setTimeout(this.sweepOnTimer, Math.max(0, deadline - Date.now()));
  }

  maybeDisarmSweep(): void {
    if (this.sweepTimer !== undefined && this.caller.size === 0 && this.bridge.size === 0) this.disarmSweep();
  }

  private disarmSweep(): void {
    if (this.sweepTimer !== undefined) clearTimeout(this.sweepTimer);
    this.sweepTimer = undefined;
    this.sweepAt = Infinity;
  }

  /** Time out what is due; re-arm for the earliest deadline left. */
  private sweep(): void {
    this.sweepTimer = undefined;
    this.sweepAt = Infinity;
    if (this.closed) return;
    const now = Date.now();
    const next = Math.min(this.caller.sweep(now), this.bridge.sweep(now));
    if (next !== Infinity) this.armSweep(next);
  }

  private sendFailed(e: unknown, streamId: number | undefined, requestId: string | undefined): void {
    this.log({ level: 'warn', event: 'send-failed', message: `answer not sent: ${(e as Error).message}`, streamId, requestId, error: e });
  }

  private ignore(reason: string, ids: { streamId?: number; requestId?: string } = {}): void {
    this.log({ level: 'warn', event: 'ignored', message: reason, ...ids });
  }

  // ------------------------------------------------------------ incoming

  private onMessage(ev: SocketMessageEvent): void {
    if (this.closed) return;
    try {
      const data = ev.data;
      if (typeof data === 'string') this.onText(data);
      else {
        const bytes = messageBytes(data);
        if (bytes === undefined) this.ignore('message of an unsupported data type');
        else this.onBinary(bytes);
      }
    } catch (e) {
      // Every path above catches its own errors; this is the last guard so a bug cannot kill the socket's event loop.
      this.log({ level: 'error', event: 'protocol', message: `message handling failed: ${(e as Error).message}`, error: e });
    }
  }

  private onText(text: string): void {
    const bridge = this.bridge;
    if (text.length > this.options.maxMessageBytes) {
      const id = REQUEST_ID_RE.exec(text.slice(0, 4096))?.[1];
      if (id !== undefined && !bridge.hasEnvelope(id)) {
        bridge.sendEnvelopeError(id, new MeshError('MESH_ERR_TOO_LARGE', `envelope of ${text.length} characters is over this node's limit of ${this.options.maxMessageBytes} bytes`));
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
    if (type === 'relay-http-request') {
      bridge.onEnvelope(msg);
      return;
    }
    if (type === 'error') {
      const m = msg as { code?: unknown; message?: unknown };
      this.log({ level: 'warn', event: 'relay-error', message: `relay says ${String(m.code)}: ${String(m.message)}` });
      return;
    }
    if (type === 'beat-answer' && this.init.onBeatAnswer) {
      this.init.onBeatAnswer(msg);
      return;
    }
    if (type === 'beats' && this.init.onBeats) {
      this.init.onBeats(msg);
      return;
    }
    if ((type === 'peer-watch' || type === 'peer-gone') && this.init.onPeerNotice && typeof (msg as { peer_id?: unknown }).peer_id === 'string') {
      this.init.onPeerNotice(msg as { type: 'peer-watch' | 'peer-gone'; peer_id: string; attached?: unknown });
      return;
    }
    // An envelope of a type we do not know, but with an id, is still a request someone waits on.
    const rid = (msg as { request_id?: unknown }).request_id;
    if (typeof rid === 'string' && rid.length > 0 && rid.length <= 128 && !bridge.hasEnvelope(rid)) {
      bridge.sendEnvelopeError(rid, new MeshError('MESH_ERR_BAD_REQUEST', `unknown message type ${JSON.stringify(type)}; expected relay-http-request`));
    } else this.ignore(`text message of unknown type ${JSON.stringify(type)}`);
  }

  private onBinary(bytes: Uint8Array): void {
    if (bytes.byteLength < FRAME_HEAD_BYTES) {
      this.ignore(`binary message of ${bytes.byteLength} bytes is shorter than a frame head`);
      return;
    }
    const kind = bytes[1]!;
    const streamId = (bytes[4]! | (bytes[5]! << 8) | (bytes[6]! << 16) | (bytes[7]! << 24)) >>> 0;
    if (kind === FrameKind.Response || kind === FrameKind.Data) {
      if (!this.caller.onFrame(streamId, bytes)) {
        this.ignore(`${kind === FrameKind.Response ? 'RESPONSE' : 'DATA'} frame for stream ${streamId}, which has no request waiting (late answer after cancel or timeout)`, { streamId });
      }
      return;
    }
    if (kind === FrameKind.Cancel && bytes[0] === FRAME_VERSION) {
      this.bridge.onCancel(streamId, bytes[2]!);
      return;
    }
    // A REQUEST, or something unknown that still names a stream: it gets a 400 unless that stream is busy.
    if (this.bridge.hasStream(streamId)) {
      this.ignore(`frame for stream ${streamId} while a request on it is in flight`, { streamId });
      return;
    }
    const check = this.init.checkRequest;
    if (check !== undefined && kind === FrameKind.Request && bytes[0] === FRAME_VERSION) {
      const refused = check(bytes);
      if (refused !== undefined) {
        this.bridge.sendFrameError(streamId, refused);
        return;
      }
    }
    this.bridge.onRequestFrame(streamId, bytes);
  }
}
