/**
 * The caller half of a frame multiplexer: this node's requests to other
 * peers, as REQUEST frames on stream ids this side picks, and their answers
 * (RESPONSE, then DATA frames) matched back by id. Collect mode (request())
 * gathers the body; stream mode (requestStream()) resolves at the head and
 * hands chunks to a pull iterator. Either way a call settles exactly once:
 * answered, failed, timed out, cancelled or disconnected.
 */
import type { MeshReply } from '../protocol/envelopes.ts';
import { MeshError, remoteError } from '../protocol/errors.ts';
import { FLAG_END, FLAG_ERROR, FLAG_ONE_WAY, FRAME_HEAD_BYTES, FRAME_VERSION, FrameKind, decodeFrame, encodeCancelFrame, encodeRequestFrame } from '../protocol/frames.ts';
import type { HeaderMap } from '../protocol/headers.ts';
import { hexToBytes, isPeerId } from '../protocol/ids.ts';
import { concatBytes } from '../protocol/bytes.ts';
import type { MeshStreamReply, OutgoingRequest, RequestOptions } from './contract.ts';
import type { MuxPort } from './frame-mux.ts';

const EMPTY = new Uint8Array(0);
const NOOP = (): void => {};
const NO_OPTIONS: RequestOptions = {};

/** What a one-way request resolves with when no error came back within its window: 202, "accepted as far as anyone knows". */
export const NO_NEWS: MeshReply = Object.freeze({ status: 202, headers: Object.freeze({}) as HeaderMap, body: EMPTY });

const enum CallPhase {
  AwaitingHead,
  Streaming,
  Done,
}

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
  /** A one-way request: its "timeout" is the window in which an error may still come back; past it, no news is good news. */
  oneWay = false;

  constructor(
    readonly streamId: number,
    readonly streaming: boolean,
    readonly timeoutMs: number,
    readonly resolveReply: (r: MeshReply) => void,
    readonly resolveHead: (r: MeshStreamReply) => void,
    readonly reject: (e: unknown) => void,
  ) {}
}

/** Peer ids as bytes, parsed once: the same few peers are called for every hop of every token. */
const peerIdBytes = new Map<string, Uint8Array>();

function targetBytes(peerId: string): Uint8Array | undefined {
  let target = peerIdBytes.get(peerId);
  if (target === undefined) {
    if (!isPeerId(peerId)) return undefined;
    target = hexToBytes(peerId);
    if (peerIdBytes.size >= 4096) peerIdBytes.clear();
    peerIdBytes.set(peerId, target);
  }
  return target;
}

function asMeshError(e: unknown): MeshError | undefined {
  return e instanceof MeshError ? e : undefined;
}

export class MuxCaller {
  /** Our requests by our stream id. */
  private readonly calls = new Map<number, OutboundCall>();
  private nextStreamId = 0;

  constructor(private readonly port: MuxPort) {}

  /** Requests waiting for (the rest of) an answer. */
  get size(): number {
    return this.calls.size;
  }

  request(peerId: string, req: OutgoingRequest, opts: RequestOptions = NO_OPTIONS): Promise<MeshReply> {
    return new Promise<MeshReply>((resolve, reject) => {
      this.start(peerId, req, opts, false, resolve, NOOP, reject);
    });
  }

  requestStream(peerId: string, req: OutgoingRequest, opts: RequestOptions = NO_OPTIONS): Promise<MeshStreamReply> {
    return new Promise<MeshStreamReply>((resolve, reject) => {
      this.start(peerId, req, opts, true, NOOP, resolve, reject);
    });
  }

  /**
   * A one-way request (FLAG_ONE_WAY): resolves with {@link NO_NEWS} once
   * `opts.timeoutMs` passed without an answer frame (the receiver answers
   * none), or with the error a relay or a link's far side sent back within
   * that window (no such peer, too large, back-pressure …). Only for a far
   * side that announced the `one-way` feature.
   */
  push(peerId: string, req: OutgoingRequest, opts: RequestOptions = NO_OPTIONS): Promise<MeshReply> {
    return new Promise<MeshReply>((resolve, reject) => {
      this.start(peerId, req, opts, false, resolve, NOOP, reject, true);
    });
  }

  private start(peerId: string, req: OutgoingRequest, opts: RequestOptions, streaming: boolean, resolveReply: (r: MeshReply) => void, resolveHead: (r: MeshStreamReply) => void, reject: (e: unknown) => void, oneWay = false): void {
    const port = this.port;
    if (port.closed) {
      reject(new MeshError('MESH_ERR_UNAVAILABLE', 'the connection is closed; use another path'));
      return;
    }
    const signal = opts.signal;
    if (signal?.aborted) {
      reject(new MeshError('MESH_ERR_CANCELLED', 'the request was cancelled before it was sent', { reason: String(signal.reason) }));
      return;
    }
    const target = targetBytes(peerId);
    if (target === undefined) {
      reject(new MeshError('MESH_ERR_BAD_REQUEST', `"${peerId}" is not a peer id (32 lowercase hex digits)`));
      return;
    }
    const streamId = this.allocStreamId();
    let frame: Uint8Array;
    try {
      frame = encodeRequestFrame({ streamId, peerId: target, method: req.method, path: req.path, headers: req.headers, body: req.body, ...(oneWay ? { flags: FLAG_END | FLAG_ONE_WAY } : {}) });
    } catch (e) {
      reject(e);
      return;
    }
    const timeoutMs = opts.timeoutMs ?? port.options.requestTimeoutMs;
    const call = new OutboundCall(streamId, streaming, timeoutMs, resolveReply, resolveHead, reject);
    call.oneWay = oneWay;
    this.calls.set(streamId, call);
    if (timeoutMs > 0) port.armSweep(call.lastFrameAt + timeoutMs);
    // A one-way request is out once sent (nothing to stop at the far side), and its call lives on for its window:
    // a listener per push on a generation's signal would pile up (~2 s of steps each) for nothing.
    if (signal && !oneWay) {
      const onAbort = (): void => this.cancel(call, new MeshError('MESH_ERR_CANCELLED', 'the request was cancelled', { reason: String(signal.reason) }));
      signal.addEventListener('abort', onAbort, { once: true });
      call.abortCleanup = () => signal.removeEventListener('abort', onAbort);
    }
    try {
      const p = port.gate.send(frame);
      if (p !== undefined) p.catch((e: unknown) => this.fail(call, asMeshError(e) ?? new MeshError('MESH_ERR_PEER_GONE', (e as Error).message), true));
    } catch (e) {
      this.fail(call, asMeshError(e) ?? new MeshError('MESH_ERR_PEER_GONE', (e as Error).message), true);
    }
  }

  private allocStreamId(): number {
    // Monotonic over 2^32 so a late answer to a cancelled stream cannot land on a new request.
    for (;;) {
      this.nextStreamId = (this.nextStreamId + 1) >>> 0;
      if (this.nextStreamId !== 0 && !this.calls.has(this.nextStreamId)) return this.nextStreamId;
    }
  }

  /** A RESPONSE or DATA frame for stream `streamId`; false when no request waits on it. */
  onFrame(streamId: number, bytes: Uint8Array): boolean {
    const call = this.calls.get(streamId);
    if (call === undefined) return false;
    this.onAnswerFrame(call, bytes);
    return true;
  }

  /** Time out what is due; returns the earliest deadline left (Infinity: none). */
  sweep(now: number): number {
    let next = Infinity;
    for (const call of this.calls.values()) {
      if (call.timeoutMs <= 0 || call.phase === CallPhase.Done) continue;
      // Idle time: every answer frame moves the deadline (onAnswerFrame sets lastFrameAt).
      const deadline = call.lastFrameAt + call.timeoutMs;
      if (deadline <= now && call.oneWay) {
        // Nothing came back: the request went out, and the far side answers none.
        this.finish(call, true);
        call.resolveReply(NO_NEWS);
      } else if (deadline <= now) this.cancel(call, new MeshError('MESH_ERR_TIMEOUT', `no answer frame from the peer within ${call.timeoutMs} ms`, { streamId: call.streamId }));
      else if (deadline < next) next = deadline;
    }
    return next;
  }

  /** The connection is gone: every pending call rejects with `err`. */
  failAll(err: MeshError): void {
    for (const call of this.calls.values()) this.fail(call, err, false);
    this.calls.clear();
  }

  /** Give up on a call and tell the far side to stop (CANCEL). */
  private cancel(call: OutboundCall, err: MeshError): void {
    if (call.phase === CallPhase.Done) return;
    if (!this.port.closed) void this.port.send(encodeCancelFrame(call.streamId), call.streamId);
    this.fail(call, err, true);
  }

  private fail(call: OutboundCall, err: unknown, removeFromMap: boolean): void {
    if (call.phase === CallPhase.Done) return;
    const wasStreaming = call.phase === CallPhase.Streaming;
    this.finish(call, removeFromMap);
    if (call.streaming && wasStreaming) {
      call.failure = err;
      const w = call.chunkWaiter;
      call.chunkWaiter = undefined;
      w?.reject(err);
    } else call.reject(err);
  }

  private finish(call: OutboundCall, removeFromMap: boolean): void {
    call.phase = CallPhase.Done;
    call.abortCleanup?.();
    call.abortCleanup = undefined;
    if (removeFromMap && this.calls.get(call.streamId) === call) {
      this.calls.delete(call.streamId);
      this.port.maybeDisarmSweep();
    }
  }

  private onAnswerFrame(call: OutboundCall, bytes: Uint8Array): void {
    call.lastFrameAt = Date.now();
    if (bytes[0] !== FRAME_VERSION) {
      this.cancel(call, new MeshError('MESH_ERR_BAD_FRAME', `answer frame of version ${bytes[0]} (this peer speaks ${FRAME_VERSION})`));
      return;
    }
    const flags = bytes[2]!;
    const end = (flags & FLAG_END) !== 0;
    if (bytes[1] === FrameKind.Response) {
      this.onResponseFrame(call, bytes, end);
      return;
    }
    // DATA
    if (call.phase !== CallPhase.Streaming) {
      this.cancel(call, new MeshError('MESH_ERR_BAD_FRAME', 'DATA frame before the RESPONSE head'));
      return;
    }
    const body = bytes.subarray(FRAME_HEAD_BYTES);
    if ((flags & FLAG_ERROR) !== 0) {
      this.fail(call, remoteError(undefined, body, 'the peer failed midway through a streamed answer'), true);
      return;
    }
    if (!call.streaming) {
      if (body.byteLength > 0) call.parts.push(body);
      if (end) {
        this.finish(call, true);
        call.resolveReply({ status: call.status, headers: call.headers, body: call.parts.length === 0 ? EMPTY : concatBytes(call.parts) });
        call.parts = [];
      }
      return;
    }
    if (body.byteLength > 0) call.parts.push(body);
    if (end) {
      this.finish(call, true);
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

  private onResponseFrame(call: OutboundCall, bytes: Uint8Array, end: boolean): void {
    if (call.phase !== CallPhase.AwaitingHead) {
      this.cancel(call, new MeshError('MESH_ERR_BAD_FRAME', 'a second RESPONSE frame on one stream'));
      return;
    }
    let frame;
    try {
      frame = decodeFrame(bytes);
    } catch (e) {
      this.cancel(call, asMeshError(e) ?? new MeshError('MESH_ERR_BAD_FRAME', 'undecodable RESPONSE frame'));
      return;
    }
    if (frame.kind !== FrameKind.Response) return;
    call.status = frame.status;
    call.headers = frame.headers;
    if (end) {
      this.finish(call, true);
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
        if (call.phase !== CallPhase.Done) this.cancel(call, new MeshError('MESH_ERR_CANCELLED', 'the consumer stopped reading the stream'));
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
