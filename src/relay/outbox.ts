/**
 * What the relay itself puts on a socket: every send goes through the one
 * slow-consumer rule here, and the answers the relay produces on its own
 * (error frames, `/rpc` answers, CANCEL towards a target) are shaped here,
 * so that the stream table keeps to routing.
 */
import { MeshError, encodeCancelFrame, encodeErrorFrame, type MeshErrorCode } from '../protocol/index.ts';
import { CLOSE } from '../protocol/close-codes.ts';
import type { RelayMetrics } from './metrics.ts';
import type { PeerSocket, RpcCaller, Stream } from './peer-conn.ts';

export class Outbox {
  constructor(
    /** A reader with more than this unread is disconnected (RelayOptions.maxBufferedBytes). */
    private readonly maxBufferedBytes: number,
    private readonly metrics: RelayMetrics,
    private readonly logger: { warn(obj: object, msg: string): void },
  ) {}

  /** Send unless the reader has stopped reading: then it is dropped, the only bounded choice. */
  sendTo(socket: PeerSocket, data: Uint8Array | string): void {
    if (!socket.isOpen) return;
    if (socket.bufferedAmount > this.maxBufferedBytes) {
      this.logger.warn({ buffered: socket.bufferedAmount }, 'slow consumer disconnected');
      socket.close(CLOSE.slowConsumer, 'slow consumer: too much unread data');
      return;
    }
    this.metrics.hot.messages++;
    socket.send(data);
  }

  frameError(socket: PeerSocket, streamId: number, code: MeshErrorCode, message: string): void {
    this.metrics.errors.inc({ code });
    this.sendTo(socket, encodeErrorFrame(streamId, new MeshError(code, message)));
  }

  rpcAnswer(caller: RpcCaller, requestId: string | null, status: number, headers: Record<string, string>, fields: { body_base64?: string; body?: string }): void {
    this.sendTo(caller.socket, JSON.stringify({ request_id: requestId, status, headers, ...fields }));
  }

  /** Answer an `/rpc` caller with an error the relay produced. */
  rpcError(caller: RpcCaller, requestId: string | null, code: MeshErrorCode, message: string): void {
    const e = new MeshError(code, message);
    this.metrics.errors.inc({ code });
    this.rpcAnswer(caller, requestId, e.status, { 'content-type': 'application/json' }, { body: JSON.stringify(e.toBody()) });
  }

  /** A JSON `error` message on a registered connection (bad or unexpected text). */
  textError(socket: PeerSocket, code: MeshErrorCode, message: string): void {
    this.sendTo(socket, JSON.stringify({ type: 'error', code, message }));
  }

  /** CANCEL towards a stream's target (addressed when the target is a link). */
  sendCancel(s: Stream, callerGone = false): void {
    const frame = encodeCancelFrame(s.relayStreamId, callerGone);
    if (s.target.link !== undefined) {
      if (s.target.socket.isOpen) s.target.link.sendAddressed(s.remotePeer!, frame);
    } else this.sendTo(s.target.socket, frame);
  }
}
