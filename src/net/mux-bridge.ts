/**
 * The bridge half of a frame multiplexer: incoming REQUEST frames and
 * `relay-http-request` envelopes go to the local handler and get exactly one
 * answer each (a RESPONSE frame, DATA frames for a streamed body, or an
 * envelope), within the concurrency limit and the handler's deadline. A
 * CANCEL, a timeout or the connection dropping aborts the handler's signal.
 */
import { bodyFieldsFor, collectBody, meshRequestFromEnvelope, relayHttpRequestSchema, type MeshRequest, type MeshResponse } from '../protocol/envelopes.ts';
import { MeshError } from '../protocol/errors.ts';
import { FLAG_CALLER_GONE, FLAG_END, FLAG_ONE_WAY, FrameError, FrameKind, decodeFrame, encodeDataFrame, encodeErrorFrame, encodeResponseFrame, encodeStreamErrorFrame, type RequestFrame } from '../protocol/frames.ts';
import { normalizeHeaders, type HeaderMap } from '../protocol/headers.ts';
import { bytesToHex } from '../protocol/ids.ts';
import type { MeshHandler } from './contract.ts';
import type { MuxPort } from './mux-port.ts';
import { trace } from '../protocol/trace.ts';

const EMPTY = new Uint8Array(0);

class InboundCall {
  /** Set once the answer (or the decision not to answer) is taken: guards exactly-once. */
  settled = false;
  /** Set once the call stops counting against maxConcurrentRequests. */
  released = true;
  /** When the handler's time is up (ms since epoch); 0: no limit. */
  deadline = 0;
  /** Made on first use: most handlers never look at their signal, and an AbortController per hop showed in profiles. */
  private controller: AbortController | undefined;
  private abortReason: unknown;
  aborted = false;
  /** A one-way request (FLAG_ONE_WAY): the handler runs, nothing is answered. */
  oneWay = false;
  constructor(
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
  readonly #from: Uint8Array | undefined;
  #fromHex: string | undefined;
  constructor(
    public method: string,
    public path: string,
    public headers: HeaderMap,
    public body: Uint8Array,
    call: InboundCall,
    from?: Uint8Array,
  ) {
    this.#call = call;
    this.#from = from;
  }
  get signal(): AbortSignal {
    return this.#call.signal;
  }
  /** Hex only when a handler asks (signalling does; a forward step does not). */
  get from(): string | undefined {
    if (this.#from === undefined) return undefined;
    return (this.#fromHex ??= bytesToHex(this.#from));
  }
}

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

function asMeshError(e: unknown): MeshError | undefined {
  return e instanceof MeshError ? e : undefined;
}

/** Validate what a handler returned; a bad answer is the handler's bug, so the caller gets 500, not garbage. */
function checkResponse(res: unknown): MeshResponse {
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

export class MuxBridge {
  /** Incoming requests by the far side's stream id. */
  private readonly frames = new Map<number, InboundCall>();
  /** Incoming envelopes by request id. */
  private readonly envelopes = new Map<string, InboundCall>();
  /** Handlers running now (admitted, not yet released). */
  inFlight = 0;

  constructor(
    private readonly port: MuxPort,
    public handler: MeshHandler | undefined,
  ) {}

  /** Calls that still owe an answer or a cleanup. */
  get size(): number {
    return this.frames.size + this.envelopes.size;
  }

  /** True when a request with this stream id is running (a second REQUEST on it is not answered). */
  hasStream(streamId: number): boolean {
    return this.frames.has(streamId);
  }

  hasEnvelope(requestId: string): boolean {
    return this.envelopes.has(requestId);
  }

  // ------------------------------------------------------------ in

  onEnvelope(msg: unknown): void {
    const rawId = (msg as { request_id?: unknown }).request_id;
    const readableId = typeof rawId === 'string' && rawId.length > 0 && rawId.length <= 128 ? rawId : undefined;
    if (readableId !== undefined && this.envelopes.has(readableId)) {
      // Answering the duplicate would give the first request a second, wrong answer.
      this.port.log({ level: 'warn', event: 'ignored', message: 'duplicate request_id while the first is in flight', requestId: readableId });
      return;
    }
    const parsed = relayHttpRequestSchema.safeParse(msg);
    if (!parsed.success) {
      if (readableId === undefined) this.port.log({ level: 'warn', event: 'ignored', message: 'malformed relay-http-request without a readable request_id' });
      else this.sendEnvelopeError(readableId, new MeshError('MESH_ERR_BAD_REQUEST', `malformed relay-http-request: ${parsed.error.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; ')}`));
      return;
    }
    let req: MeshRequest;
    try {
      req = meshRequestFromEnvelope(parsed.data);
    } catch (e) {
      this.sendEnvelopeError(parsed.data.request_id, asMeshError(e) ?? new MeshError('MESH_ERR_BAD_REQUEST', 'undecodable request body'));
      return;
    }
    const call = new InboundCall(-1, parsed.data.request_id);
    if (!this.admit(call)) return;
    this.envelopes.set(parsed.data.request_id, call);
    this.run(call, new InboundRequest(req.method, req.path, req.headers, req.body, call));
  }

  /** A REQUEST frame (or an unknown kind naming a free stream): decoded, admitted, handed to the handler. */
  onRequestFrame(streamId: number, bytes: Uint8Array): void {
    if (bytes.byteLength > this.port.options.maxMessageBytes) {
      this.sendFrameError(streamId, new MeshError('MESH_ERR_TOO_LARGE', `frame of ${bytes.byteLength} bytes is over this node's limit of ${this.port.options.maxMessageBytes}`));
      return;
    }
    let frame: RequestFrame;
    try {
      const f = decodeFrame(bytes);
      if (f.kind !== FrameKind.Request) throw new FrameError(`unexpected frame kind ${f.kind}`, streamId);
      frame = f;
    } catch (e) {
      const err = e instanceof FrameError ? e : new MeshError('MESH_ERR_BAD_FRAME', `undecodable frame: ${(e as Error).message}`);
      this.sendFrameError(streamId, err);
      return;
    }
    trace?.(`in:${frame.path}`, frame.headers['x-meshnet-session'], frame.headers['x-meshnet-position']);
    if ((frame.flags & FLAG_END) === 0) {
      this.sendFrameError(streamId, new MeshError('MESH_ERR_BAD_REQUEST', 'streamed request bodies are not supported: send the whole body in the REQUEST frame with END set'));
      return;
    }
    const call = new InboundCall(streamId, undefined);
    if (!this.admit(call)) return;
    // One-way: not kept by stream id (the relay keeps no stream for it either, and a CANCEL cannot name it); its answer is dropped.
    if ((frame.flags & FLAG_ONE_WAY) !== 0) call.oneWay = true;
    else this.frames.set(streamId, call);
    this.run(call, new InboundRequest(frame.method, frame.path, frame.headers, frame.body, call, frame.peerId));
  }

  onCancel(streamId: number, flags = 0): void {
    const call = this.frames.get(streamId);
    if (call === undefined) {
      this.port.log({ level: 'warn', event: 'ignored', message: `CANCEL for stream ${streamId}, which is not running (already answered?)`, streamId });
      return;
    }
    // The far side has forgotten the stream: no answer may follow, or it could land on a reused id.
    this.frames.delete(streamId);
    // A relay's CANCEL for a caller whose connection dropped reads like our own connection dropping: the caller may come back.
    const gone = (flags & FLAG_CALLER_GONE) !== 0;
    this.abandon(call, gone ? new MeshError('MESH_ERR_CANCELLED', "the caller's connection to the relay dropped", { reason: 'disconnected' }) : new MeshError('MESH_ERR_CANCELLED', 'the caller cancelled the request'));
  }

  /** Abort every running handler; their answers are dropped (the connection is gone). */
  abandonAll(err: MeshError): void {
    for (const call of this.frames.values()) this.abandon(call, err);
    for (const call of this.envelopes.values()) this.abandon(call, err);
    this.frames.clear();
    this.envelopes.clear();
  }

  /** Time out handlers past their deadline; returns the earliest deadline left (Infinity: none). */
  sweep(now: number): number {
    return this.sweepMap(this.envelopes, now, this.sweepMap(this.frames, now, Infinity));
  }

  private sweepMap(calls: Map<unknown, InboundCall>, now: number, next: number): number {
    for (const call of calls.values()) {
      if (call.settled || call.deadline === 0) continue;
      if (call.deadline <= now) {
        const err = new MeshError('MESH_ERR_TIMEOUT', `the handler did not answer within ${this.port.options.handlerTimeoutMs} ms`);
        call.abort(err);
        this.answerError(call, err);
      } else if (call.deadline < next) next = call.deadline;
    }
    return next;
  }

  private admit(call: InboundCall): boolean {
    if (this.handler === undefined) {
      this.answerError(call, new MeshError('MESH_ERR_UNAVAILABLE', 'this node serves no requests yet (no handler set); retry later'));
      return false;
    }
    if (this.inFlight >= this.port.options.maxConcurrentRequests) {
      this.answerError(call, new MeshError('MESH_ERR_TOO_MANY_REQUESTS', `this node already runs ${this.inFlight} requests; retry later`));
      return false;
    }
    return true;
  }

  private run(call: InboundCall, req: InboundRequest): void {
    const handler = this.handler!;
    this.inFlight++;
    call.released = false;
    const timeoutMs = this.port.options.handlerTimeoutMs;
    if (timeoutMs > 0) {
      call.deadline = Date.now() + timeoutMs;
      this.port.armSweep(call.deadline);
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
      this.port.log({ level: 'error', event: 'send-failed', message: `answering failed: ${(e as Error).message}`, streamId: call.streamId, requestId: call.requestId, error: e });
    } finally {
      this.forget(call);
    }
  }

  private onHandlerError(call: InboundCall, e: unknown): void {
    if (call.settled) return;
    const err = asMeshError(e);
    if (err === undefined) this.port.log({ level: 'error', event: 'handler-error', message: `handler threw: ${(e as Error)?.message ?? String(e)}`, streamId: call.streamId, requestId: call.requestId, error: e });
    this.answerError(call, err ?? new MeshError('MESH_ERR_INTERNAL', 'the node failed to handle the request; see its log'));
  }

  /** The call no longer owes an answer: free its id and its concurrency slot (a handler that ignores its abort signal cannot hold a slot forever). */
  private forget(call: InboundCall): void {
    if (!call.released) {
      call.released = true;
      this.inFlight--;
    }
    if (call.requestId !== undefined) {
      if (this.envelopes.get(call.requestId) === call) this.envelopes.delete(call.requestId);
    } else if (this.frames.get(call.streamId) === call) this.frames.delete(call.streamId);
    this.port.maybeDisarmSweep();
  }

  private abandon(call: InboundCall, reason: MeshError): void {
    // Mid-stream, the answer loop sees the abort and stops; before the answer, the answer is dropped.
    call.settled = true;
    call.abort(reason);
    this.forget(call);
  }

  // ------------------------------------------------------------ out

  /** Send the handler's answer; synchronous (no promise) for a bytes body that the send gate lets through at once, the common case. */
  private answer(call: InboundCall, raw: MeshResponse): Promise<void> | void {
    if (call.settled) {
      // Timed out or cancelled already: release a stream the handler may have opened.
      const body = (raw as MeshResponse | undefined)?.body;
      if (body && !(body instanceof Uint8Array)) void body[Symbol.asyncIterator]().return?.()?.catch?.(() => {});
      return;
    }
    if (call.oneWay) {
      call.settled = true;
      const body = (raw as MeshResponse | undefined)?.body;
      if (body && !(body instanceof Uint8Array)) void body[Symbol.asyncIterator]().return?.()?.catch?.(() => {});
      return;
    }
    let res: MeshResponse;
    try {
      res = checkResponse(raw);
    } catch (e) {
      this.answerError(call, e as MeshError);
      return;
    }
    call.settled = true;
    if (call.requestId !== undefined) return this.answerEnvelope(call, call.requestId, res);
    if (res.body instanceof Uint8Array) return this.answerBytes(call.streamId, res.status, res.headers, res.body);
    return this.answerStream(call, res.status, res.headers, res.body);
  }

  private async answerEnvelope(call: InboundCall, requestId: string, res: MeshResponse): Promise<void> {
    let body: Uint8Array;
    try {
      body = await collectBody(res.body);
    } catch (e) {
      const err = asMeshError(e) ?? new MeshError('MESH_ERR_INTERNAL', 'the response body failed while it was read; see the node log');
      if (!asMeshError(e)) this.port.log({ level: 'error', event: 'handler-error', message: `response body threw: ${(e as Error)?.message}`, requestId, error: e });
      this.sendEnvelope({ type: 'relay-http-response', request_id: requestId, status: err.status, headers: { 'content-type': 'application/json' }, body: JSON.stringify(err.toBody()) }, requestId);
      return;
    }
    if (call.aborted) return;
    this.sendEnvelope({ type: 'relay-http-response', request_id: requestId, status: res.status, headers: res.headers, ...bodyFieldsFor(body, res.headers) }, requestId);
  }

  private answerBytes(streamId: number, status: number, headers: HeaderMap, body: Uint8Array): Promise<void> | void {
    let frame: Uint8Array;
    try {
      frame = encodeResponseFrame({ streamId, status, headers, body });
    } catch (e) {
      frame = encodeErrorFrame(streamId, asMeshError(e) ?? new MeshError('MESH_ERR_INTERNAL', 'the response could not be encoded'));
    }
    return this.port.send(frame, streamId);
  }

  private async answerStream(call: InboundCall, status: number, headers: HeaderMap, body: AsyncIterable<Uint8Array>): Promise<void> {
    const streamId = call.streamId;
    const port = this.port;
    const iterator = body[Symbol.asyncIterator]();
    try {
      await port.send(encodeResponseFrame({ streamId, status, headers, end: false }), streamId);
      while (!call.aborted) {
        const step = await iterator.next();
        if (call.aborted) break;
        if (step.done) {
          await port.send(encodeDataFrame(streamId, EMPTY, true), streamId);
          return;
        }
        if (!(step.value instanceof Uint8Array)) throw new MeshError('MESH_ERR_INTERNAL', 'the response stream yielded something other than bytes');
        await port.send(encodeDataFrame(streamId, step.value, false), streamId);
      }
      await iterator.return?.();
    } catch (e) {
      if (call.aborted || port.closed) {
        void Promise.resolve(iterator.return?.()).catch(() => {});
        return;
      }
      const err = asMeshError(e) ?? new MeshError('MESH_ERR_INTERNAL', 'the response stream failed midway; see the node log');
      if (!asMeshError(e)) port.log({ level: 'error', event: 'handler-error', message: `response stream threw: ${(e as Error)?.message}`, streamId, error: e });
      void Promise.resolve(iterator.return?.()).catch(() => {});
      await port.send(encodeStreamErrorFrame(streamId, err), streamId);
    }
  }

  private answerError(call: InboundCall, err: MeshError): void {
    if (call.settled) return;
    call.settled = true;
    if (call.oneWay) {
      this.port.log({ level: 'info', event: 'answered-error', message: `one-way request failed (not answered): ${err.status} ${err.code}: ${err.message}`, streamId: call.streamId });
      this.forget(call);
      return;
    }
    if (call.requestId !== undefined) this.sendEnvelopeError(call.requestId, err);
    else this.sendFrameError(call.streamId, err);
    // The id is free for the far side to reuse once our last frame is out, even if the handler still runs.
    this.forget(call);
  }

  sendFrameError(streamId: number, err: MeshError): void {
    this.port.log({ level: 'info', event: 'answered-error', message: `${err.status} ${err.code}: ${err.message}`, streamId });
    void this.port.send(encodeErrorFrame(streamId, err), streamId);
  }

  sendEnvelopeError(requestId: string, err: MeshError): void {
    this.port.log({ level: 'info', event: 'answered-error', message: `${err.status} ${err.code}: ${err.message}`, requestId });
    this.sendEnvelope({ type: 'relay-http-response', request_id: requestId, status: err.status, headers: { 'content-type': 'application/json' }, body: JSON.stringify(err.toBody()) }, requestId);
  }

  private sendEnvelope(msg: Record<string, unknown>, requestId: string): void {
    void this.port.send(JSON.stringify(msg), undefined, requestId);
  }
}
