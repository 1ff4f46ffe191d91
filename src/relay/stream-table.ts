/**
 * The relay's routing, without sockets: registered peers, the streams in
 * flight between them, and what each incoming message turns into.
 *
 *   caller ──REQUEST(stream s, target t)──▶ table ──REQUEST(stream r, source c)──▶ t
 *   caller ◀──RESPONSE/DATA(stream s)────── table ◀──RESPONSE/DATA(stream r)────── t
 *
 * On the fast path a REQUEST is rewritten in place (target → source, the
 * caller's stream id → the relay's id on the target connection) and the
 * same buffer sent on: no body copy, no parse. Each target connection has
 * its own id space, so callers never collide or see each other's answers,
 * and a late answer to a forgotten stream is dropped. `/rpc` callers and
 * ADR-era targets travel as JSON envelopes under a relay-chosen request id.
 *
 * The server (server.ts) feeds it what its sockets receive and gives it a
 * PeerSocket per connection; tests drive it the same way with in-memory
 * sockets and a clock of their own.
 *
 * What is not routing lives beside it: the connection shapes (peer-conn.ts),
 * the streams' indexes (stream-book.ts), what the relay sends of its own and
 * the slow-consumer rule (outbox.ts), who watches whom (peer-watch.ts), and
 * heartbeats batched per tracker (beat-batcher.ts).
 */
import {
  FLAG_END,
  FLAG_ONE_WAY,
  FrameKind,
  MeshError,
  PEER_ID_BYTES,
  bodyFieldsFor,
  decodeFrame,
  encodeResponseFrame,
  encodeStreamErrorFrame,
  envelopeBody,
  normalizeHeaders,
  readFrameHead,
  relayHttpResponseSchema,
  requestBodyBytes,
  rpcRequestSchema,
  writeRequestPeerId,
  writeStreamId,
  type MeshErrorCode,
  type RelayHttpResponse,
} from '../protocol/index.ts';
import { CLOSE } from '../protocol/close-codes.ts';
import { BeatBatcher } from './beat-batcher.ts';
import type { RelayMetrics } from './metrics.ts';
import { RELAY_DEFAULTS, type RelayOptions } from './options.ts';
import { Outbox } from './outbox.ts';
import { FAST_PATH_PROTOCOL, PeerConn, type PeerSocket, type RpcCaller, type Stream } from './peer-conn.ts';
import { PeerWatch } from './peer-watch.ts';
import { StreamBook } from './stream-book.ts';

// The connection shapes live in peer-conn.ts; server.ts, federation.ts, trunks.ts and the tests import them from here.
export { FAST_PATH_PROTOCOL, PeerConn, RpcCaller, type LinkPipe, type PeerSocket, type StreamPath } from './peer-conn.ts';

/** The few pino methods the table logs through. */
export interface TableLogger {
  info(obj: object, msg: string): void;
  warn(obj: object, msg: string): void;
}

/**
 * How long the relay remembers a one-way request: a target that leaves
 * within it is reported to the caller (MESH_ERR_PEER_GONE), as for any
 * stream. Callers watch for errors at least this long (chain pushes: 2 s).
 */
export const ONE_WAY_WINDOW_MS = 2_000;

/** First byte of a trunk message that carries a frame addressed to a peer: `0xF1 | peer id (16 B) | frame`. Never a frame version. */
export const ADDRESSED_FRAME = 0xf1;

/**
 * What the relay needs of its cluster (src/relay/federation.ts): where a
 * peer that is not attached here lives, and to hear of local peers coming
 * and going. Absent: a relay on its own, exactly as before.
 */
export interface TableFederation {
  /** A link towards the relay that holds `peerId`, or undefined when no relay of the cluster has it (as far as is known now). */
  linkFor(peerId: string): PeerConn | undefined;
  /** A link's answer to one of our requests was 404: what we knew of `peerId` is stale. */
  forget(peerId: string): void;
  peerAdded(peer: PeerConn): void;
  peerRemoved(peer: PeerConn): void;
}

export interface StreamTableInit {
  options: Pick<RelayOptions, 'maxBodyBytes' | 'maxInFlightPerPeer' | 'requestTimeoutMs' | 'maxPeers' | 'highWaterBytes' | 'maxBufferedBytes'> & Partial<Pick<RelayOptions, 'beatBatchMs' | 'beatBatchFill'>>;
  metrics: RelayMetrics;
  logger: TableLogger;
  /** ms, monotonic. @defaultValue performance.now */
  now?: () => number;
}

const utf8 = new TextEncoder();

/** `n` bytes at `offset` as lowercase hex; a Buffer (what ws delivers) converts natively. */
function hexAt(data: Uint8Array, offset: number, n: number): string {
  if (data instanceof Buffer) return data.toString('hex', offset, offset + n);
  return Buffer.from(data.buffer, data.byteOffset + offset, n).toString('hex');
}

export class StreamTable {
  readonly peers = new Map<string, PeerConn>();
  /** New requests are refused (503) and registrations too (1013). */
  closing = false;
  /** Called when the last stream finishes while closing. */
  onDrained: (() => void) | undefined;
  /** The cluster, when this relay is in one. */
  federation: TableFederation | undefined;
  private readonly o: StreamTableInit['options'];
  private readonly metrics: RelayMetrics;
  private readonly logger: TableLogger;
  private readonly now: () => number;
  private readonly book: StreamBook;
  private readonly out: Outbox;
  private readonly watch: PeerWatch;
  /** Heartbeats batched towards trackers (beat-batch); undefined when batching is off (beatBatchMs 0). */
  readonly beats: BeatBatcher | undefined;

  constructor(init: StreamTableInit) {
    this.o = init.options;
    this.metrics = init.metrics;
    this.logger = init.logger;
    this.now = init.now ?? (() => performance.now());
    const m = init.metrics;
    this.book = new StreamBook(this.o.requestTimeoutMs, m, this.now);
    this.out = new Outbox(this.o.maxBufferedBytes, m, this.logger);
    this.watch = new PeerWatch(this.peers, this.out, m);
    const beatBatchMs = this.o.beatBatchMs ?? 0;
    if (beatBatchMs > 0) {
      // eslint-disable-next-line @typescript-eslint/no-this-alias -- the getter below reads the table's flag as it is then
      const table = this;
      const host = { peers: this.peers, now: this.now, sendTo: (socket: PeerSocket, text: string) => this.out.sendTo(socket, text), get closing() { return table.closing; } };
      this.beats = new BeatBatcher(host, { beatBatchMs, beatBatchFill: this.o.beatBatchFill ?? RELAY_DEFAULTS.beatBatchFill, requestTimeoutMs: this.o.requestTimeoutMs, highWaterBytes: this.o.highWaterBytes }, m);
    }
  }

  /** Requests waiting for their final answer frame. */
  get inFlight(): number {
    return this.book.size;
  }

  // ------------------------------------------------------------ peers

  /**
   * A peer proved its key: register it, replacing an older connection with
   * the same key (closed with 4002, its streams answered). Returns the
   * refusal (close code and reason) when the relay is full or closing.
   */
  addPeer(socket: PeerSocket, id: string, info: Record<string, unknown>): PeerConn | { close: number; reason: string } {
    if (this.closing) return { close: CLOSE.tryAgainLater, reason: 'relay is shutting down' };
    const old = this.peers.get(id);
    if (old === undefined && this.peers.size >= this.o.maxPeers) return { close: CLOSE.tryAgainLater, reason: `relay full (${this.o.maxPeers} peers)` };
    const protocols = Array.isArray(info.protocols) ? info.protocols : [];
    const idBytes = new Uint8Array(Buffer.from(id, 'hex'));
    const peer = new PeerConn(socket, id, idBytes, info, protocols.includes(FAST_PATH_PROTOCOL));
    if (old) {
      // Same key, newer connection: the old one is stale (a reload, a reconnect).
      this.peers.delete(id);
      this.removePeer(old);
      old.socket.close(CLOSE.replaced, 'replaced by a newer connection with the same key');
    }
    this.peers.set(id, peer);
    this.metrics.peers.set(this.peers.size);
    this.logger.info({ peer_id: id, fast_path: peer.fastPath }, 'peer registered');
    this.federation?.peerAdded(peer);
    return peer;
  }

  /**
   * The peer was told it is registered (`registered` sent; in a cluster once
   * NATS has it): those that watched it while it was not attached hear that
   * it is (PEER_BACK_FEATURE), and the beats batched for it meanwhile leave.
   * Not at addPeer: a peer sent anything before its own `registered`
   * ignores it (relay-dial.ts), so a batch sent then was never answered and
   * its beats failed after the request timeout.
   */
  announced(peer: PeerConn): void {
    peer.announced = true;
    this.beats?.announced(peer);
    if (this.peers.get(peer.id) === peer) this.watch.attached(peer.id);
  }

  /** The peer's socket closed (or a link to another relay): its streams end (502 to its callers, CANCEL to its targets). */
  removePeer(peer: PeerConn): void {
    if (this.peers.get(peer.id) === peer) {
      this.peers.delete(peer.id);
      this.metrics.peers.set(this.peers.size);
      this.logger.info({ peer_id: peer.id }, 'peer left');
      this.federation?.peerRemoved(peer);
      // Only a peer really gone reaches here: one replaced by a newer connection of its key left the map first
      // (addPeer), so its watchers hear nothing.
      this.watch.detached(peer.id);
    }
    this.beats?.peerGone(peer);
    this.watch.watcherGone(peer);
    for (const s of [...peer.incoming.values()]) this.failStream(s, 'MESH_ERR_PEER_GONE', peer.link ? `the link to relay ${peer.link.relayId} (peer ${s.remotePeer}) was lost before the answer` : `peer ${peer.id} went away before answering`, false);
    // The targets learn the caller did not ask to stop (it may reconnect and ask again): FLAG_CALLER_GONE.
    for (const s of [...peer.outgoing.values()]) this.failStream(s, 'MESH_ERR_CANCELLED', 'caller went away', true, true);
  }

  /** An `/rpc` socket closed: forget its streams (late answers are dropped). */
  removeRpcCaller(caller: RpcCaller): void {
    for (const s of [...caller.pending.values()]) this.book.drop(s);
  }

  // ------------------------------------------------------------ fast path

  /** A binary message from a registered peer. */
  onBinary(peer: PeerConn, data: Uint8Array): void {
    const hot = this.metrics.hot;
    hot.bytesIn += data.byteLength;
    if (peer.link !== undefined && data[0] === ADDRESSED_FRAME) {
      if (data.byteLength < 1 + PEER_ID_BYTES + 8) return this.dropLinkMessage(peer, 'addressed frame too short');
      return this.onLinkFrame(peer, hexAt(data, 1, PEER_ID_BYTES), data.subarray(1 + PEER_ID_BYTES));
    }
    if (data.byteLength < 8) {
      if (peer.link !== undefined) return this.dropLinkMessage(peer, 'frame shorter than its 8-byte head');
      peer.socket.close(CLOSE.protocolError, 'frame shorter than its 8-byte head');
      return;
    }
    const head = readFrameHead(data);
    if (head.version !== 1) return this.out.frameError(peer.socket, head.streamId, 'MESH_ERR_BAD_FRAME', `unsupported frame version ${head.version}; this relay speaks 1`);
    switch (head.kind) {
      case FrameKind.Request:
        return this.onRequestFrame(peer, data, head.streamId, head.flags);
      case FrameKind.Response:
      case FrameKind.Data: {
        const s = peer.incoming.get(head.streamId);
        if (s === undefined) return; // late answer to a stream that timed out or was cancelled
        s.deadline = this.now() + this.o.requestTimeoutMs;
        if (s.relayRequestId !== null) return; // JSON-bound streams take JSON answers only
        if (head.kind === FrameKind.Response) {
          // One head per stream: a second one would break the caller's stream (it may only end it).
          if (s.answered) return this.failStream(s, 'MESH_ERR_BAD_FRAME', `peer ${s.target.id} sent a second RESPONSE on one stream`, true);
          s.answered = true;
        }
        // The relay over there does not have the peer (any more): what we knew of where it lives is stale.
        if (s.remotePeer !== undefined && head.kind === FrameKind.Response && data.byteLength >= 10 && (data[8]! | (data[9]! << 8)) === 404) this.federation?.forget(s.remotePeer);
        if ((head.flags & FLAG_END) !== 0) this.completeStream(s);
        writeStreamId(data, s.callerId as number);
        hot.bytesOut += data.byteLength;
        this.out.sendTo(s.caller.socket, data);
        return;
      }
      case FrameKind.Cancel: {
        const s = peer.outgoing.get(head.streamId);
        if (s === undefined) return;
        this.book.drop(s);
        if (s.relayRequestId === null) this.out.sendCancel(s);
        return;
      }
      default:
        return this.out.frameError(peer.socket, head.streamId, 'MESH_ERR_BAD_FRAME', `unknown frame kind ${head.kind}`);
    }
  }

  /**
   * A REQUEST from a peer (target in the frame's peer id field), or from a
   * link (`linkTarget`: the frame's peer id field already holds the source,
   * written by the relay the caller is attached to).
   */
  private onRequestFrame(peer: PeerConn, data: Uint8Array, streamId: number, flags: number, linkTarget?: string): void {
    if (data.byteLength < 26) return this.out.frameError(peer.socket, streamId, 'MESH_ERR_BAD_FRAME', 'request frame shorter than its 26-byte head');
    const metaLen = data[24]! | (data[25]! << 8);
    if (26 + metaLen > data.byteLength) return this.out.frameError(peer.socket, streamId, 'MESH_ERR_BAD_FRAME', 'request meta runs past the frame');
    if (peer.outgoing.has(streamId)) return this.out.frameError(peer.socket, streamId, 'MESH_ERR_BAD_FRAME', `stream ${streamId} is already in flight on this connection`);
    const targetId = linkTarget ?? hexAt(data, 8, PEER_ID_BYTES);
    const target = this.peers.get(targetId);
    if (target === undefined) {
      // Not attached here: another relay of the cluster may hold it (never passed on twice: a link's requests are for our own peers).
      if (linkTarget === undefined && this.federation !== undefined) return this.forwardToLink(peer, data, streamId, flags, targetId);
      return this.out.frameError(peer.socket, streamId, 'MESH_ERR_NO_SUCH_PEER', `peer ${targetId} is not connected to this relay${this.federation ? ' or any relay of its cluster' : ''}`);
    }
    if (requestBodyBytes(data) > this.o.maxBodyBytes) return this.out.frameError(peer.socket, streamId, 'MESH_ERR_TOO_LARGE', `body of ${requestBodyBytes(data)} bytes is over this relay's limit of ${this.o.maxBodyBytes}`);
    const oneWay = (flags & FLAG_ONE_WAY) !== 0 && target.fastPath;
    const refused = this.admission(target, oneWay);
    if (refused) return this.out.frameError(peer.socket, streamId, refused[0], refused[1]);
    if (!target.fastPath) return this.forwardFrameAsEnvelope(peer, data, streamId, target);
    if (oneWay && target.oneWayIn >= this.o.maxInFlightPerPeer) {
      // So many one-way requests in their window: this one goes on without one (no report if the target leaves now).
      if (linkTarget === undefined) writeRequestPeerId(data, peer.idBytes);
      writeStreamId(data, target.allocStreamId());
      this.metrics.hot.hops.fast++;
      this.metrics.hot.oneWay++;
      this.metrics.hot.bytesOut += data.byteLength;
      this.metrics.hot.messages++;
      target.socket.send(data);
      return;
    }
    const s = this.book.open(peer, streamId, target, 'fast', false);
    if (oneWay) {
      // One-way (a chained hop's push): no answer comes. The stream is kept only for a short window, so
      // that the caller still hears PEER_GONE when the target leaves just after taking it; then it is
      // forgotten without a word (a 504 would be a message nobody waits for).
      s.oneWay = true;
      target.oneWayIn++;
      s.deadline = s.startedAt + ONE_WAY_WINDOW_MS;
      this.metrics.hot.oneWay++;
    }
    if (linkTarget === undefined) writeRequestPeerId(data, peer.idBytes);
    writeStreamId(data, s.relayStreamId);
    this.metrics.hot.bytesOut += data.byteLength;
    this.metrics.hot.messages++;
    target.socket.send(data);
  }

  /** A request for a peer attached to another relay of the cluster: over the link towards it, stream ids renamed as for a local target. */
  private forwardToLink(peer: PeerConn, data: Uint8Array, streamId: number, flags: number, targetId: string): void {
    const link = this.federation!.linkFor(targetId);
    if (link === undefined) return this.out.frameError(peer.socket, streamId, 'MESH_ERR_NO_SUCH_PEER', `peer ${targetId} is not connected to this relay or any relay of its cluster`);
    if (requestBodyBytes(data) > this.o.maxBodyBytes) return this.out.frameError(peer.socket, streamId, 'MESH_ERR_TOO_LARGE', `body of ${requestBodyBytes(data)} bytes is over this relay's limit of ${this.o.maxBodyBytes}`);
    if (this.closing) return this.out.frameError(peer.socket, streamId, 'MESH_ERR_SHUTTING_DOWN', 'relay is shutting down; retry on another relay');
    // The far relay admits per peer; here only the link itself can be full.
    if (link.socket.bufferedAmount > this.o.highWaterBytes) return this.out.frameError(peer.socket, streamId, 'MESH_ERR_BACKPRESSURE', `the link to relay ${link.link!.relayId} is not keeping up (${link.socket.bufferedAmount} bytes queued)`);
    const s = this.book.open(peer, streamId, link, 'fast', false);
    s.remotePeer = targetId;
    if ((flags & FLAG_ONE_WAY) !== 0) {
      // The far relay keeps its own window and reports the target leaving within it; ours only has to outlast it.
      s.oneWay = true;
      link.oneWayIn++;
      s.deadline = s.startedAt + ONE_WAY_WINDOW_MS + 1_000;
      this.metrics.hot.oneWay++;
    }
    writeRequestPeerId(data, peer.idBytes);
    writeStreamId(data, s.relayStreamId);
    this.metrics.hot.bytesOut += data.byteLength;
    this.metrics.hot.messages++;
    this.metrics.hot.cluster.out++;
    link.link!.sendAddressed(targetId, data);
  }

  /** A REQUEST or CANCEL that came over a link, for `targetId` (one of ours). */
  onLinkFrame(link: PeerConn, targetId: string, frame: Uint8Array): void {
    if (frame.byteLength < 8) return this.dropLinkMessage(link, 'frame shorter than its 8-byte head');
    const head = readFrameHead(frame);
    if (head.version !== 1) return this.out.frameError(link.socket, head.streamId, 'MESH_ERR_BAD_FRAME', `unsupported frame version ${head.version}; this relay speaks 1`);
    if (head.kind === FrameKind.Request) {
      this.metrics.hot.cluster.in++;
      return this.onRequestFrame(link, frame, head.streamId, head.flags, targetId);
    }
    if (head.kind === FrameKind.Cancel) return this.onBinary(link, frame);
    this.dropLinkMessage(link, `addressed frame of kind ${head.kind}`);
  }

  /** A link sent something that is no frame we can route: counted and dropped (the link stays). */
  private dropLinkMessage(link: PeerConn, why: string): void {
    this.metrics.clusterDropped.inc({ kind: 'frame' });
    this.logger.warn({ relay_id: link.link?.relayId, why }, 'malformed message from another relay dropped');
  }

  /** An ADR-era target only reads JSON envelopes: translate this one request. */
  private forwardFrameAsEnvelope(peer: PeerConn, data: Uint8Array, streamId: number, target: PeerConn): void {
    let f;
    try {
      f = decodeFrame(data);
    } catch (e) {
      return this.out.frameError(peer.socket, streamId, 'MESH_ERR_BAD_FRAME', (e as Error).message);
    }
    if (f.kind !== FrameKind.Request) return;
    const s = this.book.open(peer, streamId, target, 'envelope', true);
    this.out.sendTo(target.socket, JSON.stringify({ type: 'relay-http-request', request_id: s.relayRequestId, method: f.method, path: f.path, headers: f.headers, ...bodyFieldsFor(f.body, f.headers) }));
  }

  // ------------------------------------------------------------ JSON on /ws

  /** A text message from a registered peer: relay-http-response envelopes, watch-peer / unwatch-peer (PEER_WATCH_FEATURE), beat / beats-answer (BEAT_BATCH_FEATURE). */
  onText(peer: PeerConn, text: string): void {
    let msg: unknown;
    try {
      msg = JSON.parse(text);
    } catch {
      this.out.textError(peer.socket, 'MESH_ERR_BAD_REQUEST', 'message is not JSON');
      return;
    }
    const type = (msg as { type?: unknown } | null)?.type;
    if (type === 'beat' && this.beats) return this.beats.onBeat(peer, msg, text.length);
    if (type === 'beats-answer' && this.beats) return this.beats.onAnswer(peer, msg);
    if (type === 'watch-peer' || type === 'unwatch-peer') return this.watch.onMessage(peer, type, (msg as { peer_id?: unknown }).peer_id);
    if (type !== 'relay-http-response') {
      this.out.textError(peer.socket, 'MESH_ERR_BAD_REQUEST', `unexpected message type ${JSON.stringify(type)} on a registered connection`);
      return;
    }
    const parsed = relayHttpResponseSchema.safeParse(msg);
    if (!parsed.success) {
      this.out.textError(peer.socket, 'MESH_ERR_BAD_REQUEST', `malformed relay-http-response: ${parsed.error.issues[0]?.message ?? ''}`);
      return;
    }
    const s = this.book.byRequestId(parsed.data.request_id);
    if (s === undefined || s.target !== peer) return; // late, or not this peer's to answer
    this.completeStream(s);
    this.deliverEnvelopeAnswer(s, parsed.data);
  }

  private deliverEnvelopeAnswer(s: Stream, r: RelayHttpResponse): void {
    if (s.caller.kind === 'rpc') {
      const fields = r.body_base64 !== undefined ? { body_base64: r.body_base64 } : r.body !== undefined ? { body: r.body } : {};
      this.out.rpcAnswer(s.caller, s.callerId as string, r.status, normalizeHeaders(r.headers), fields);
      return;
    }
    let body: Uint8Array;
    try {
      body = envelopeBody(r);
    } catch {
      return this.out.frameError(s.caller.socket, s.callerId as number, 'MESH_ERR_UPSTREAM', 'peer answered with invalid base64');
    }
    this.out.sendTo(s.caller.socket, encodeResponseFrame({ streamId: s.callerId as number, status: r.status, headers: normalizeHeaders(r.headers), body }));
  }

  // ------------------------------------------------------------ /rpc

  /** A message on an `/rpc/<peer_id>` socket: `text` null for a binary one. */
  onRpcMessage(caller: RpcCaller, text: string | null): void {
    let msg: unknown;
    try {
      msg = text === null ? undefined : JSON.parse(text);
    } catch {
      msg = undefined;
    }
    const idGuess = typeof (msg as { request_id?: unknown } | undefined)?.request_id === 'string' ? (msg as { request_id: string }).request_id : null;
    if (msg === undefined) return this.rpcError(caller, null, 'MESH_ERR_BAD_REQUEST', 'request is not a JSON text message');
    const parsed = rpcRequestSchema.safeParse(msg);
    if (!parsed.success) {
      const issue = parsed.error.issues[0];
      return this.rpcError(caller, idGuess, 'MESH_ERR_BAD_REQUEST', `malformed request: ${issue ? `${issue.path.join('.') || 'request'}: ${issue.message}` : 'invalid'}`);
    }
    const req = parsed.data;
    if (caller.pending.has(req.request_id)) return this.rpcError(caller, req.request_id, 'MESH_ERR_BAD_REQUEST', `request_id ${req.request_id} is already in flight on this socket`);
    const bodyBytes = req.body_base64 !== undefined ? Math.floor((req.body_base64.length * 3) / 4) : req.body !== undefined ? utf8.encode(req.body).byteLength : 0;
    if (bodyBytes > this.o.maxBodyBytes) return this.rpcError(caller, req.request_id, 'MESH_ERR_TOO_LARGE', `body of ~${bodyBytes} bytes is over this relay's limit of ${this.o.maxBodyBytes}`);
    if (req.body_base64 !== undefined && !/^[A-Za-z0-9+/_-]*={0,2}$/.test(req.body_base64)) return this.rpcError(caller, req.request_id, 'MESH_ERR_BAD_REQUEST', 'body_base64 is not valid base64');
    const target = this.peers.get(caller.targetId);
    if (target === undefined) return this.rpcError(caller, req.request_id, 'MESH_ERR_NO_SUCH_PEER', `peer ${caller.targetId} is not connected to this relay`);
    const refused = this.admission(target);
    if (refused) return this.rpcError(caller, req.request_id, refused[0], refused[1]);
    const s = this.book.open(caller, req.request_id, target, 'rpc', true);
    const fields = req.body_base64 !== undefined ? { body_base64: req.body_base64 } : req.body !== undefined ? { body: req.body } : {};
    this.out.sendTo(target.socket, JSON.stringify({ type: 'relay-http-request', request_id: s.relayRequestId, method: req.method.toUpperCase(), path: req.path, headers: req.headers, ...fields }));
  }

  /** Answer an `/rpc` caller with an error the relay produced. */
  rpcError(caller: RpcCaller, requestId: string | null, code: MeshErrorCode, message: string): void {
    this.out.rpcError(caller, requestId, code, message);
  }

  // ------------------------------------------------------------ deadlines, shutdown

  /** Answer 504 to every stream past its deadline. */
  sweep(): void {
    this.beats?.sweep();
    const now = this.now();
    for (const s of this.book.all) {
      if (s.deadline <= now && s.oneWay) this.book.drop(s);
      else if (s.deadline <= now) this.failStream(s, 'MESH_ERR_TIMEOUT', `peer ${s.target.id} did not answer within ${this.o.requestTimeoutMs} ms`, true);
    }
  }

  /** End the streams sent over `link` to peers `gone(peer)` says are lost (their relay went silent): 502 to each caller. */
  failRemoteStreams(link: PeerConn, gone: (peerId: string) => boolean, message: string): void {
    for (const s of [...link.incoming.values()]) if (s.remotePeer !== undefined && gone(s.remotePeer)) this.failStream(s, 'MESH_ERR_PEER_GONE', message, false);
  }

  /** Answer every stream still in flight with `code` (the grace period is over). */
  failAll(code: MeshErrorCode, message: string): void {
    this.beats?.failAll(code, message);
    for (const s of [...this.book.all]) this.failStream(s, code, message, true);
  }

  // ------------------------------------------------------------ streams

  /** Finish a stream with an error produced by the relay (peer gone, timeout, shutdown). */
  private failStream(s: Stream, code: MeshErrorCode, message: string, notifyTarget: boolean, callerGone = false): void {
    if (!this.book.drop(s)) return;
    if (notifyTarget && !s.oneWay && s.target.socket.isOpen && s.path !== 'rpc' && s.relayRequestId === null) this.out.sendCancel(s, callerGone);
    if (s.caller.kind === 'rpc') this.out.rpcError(s.caller, s.callerId as string, code, message);
    else if (s.answered) {
      // The caller already has this stream's RESPONSE head: the error ends the body instead.
      this.metrics.errors.inc({ code });
      this.out.sendTo(s.caller.socket, encodeStreamErrorFrame(s.callerId as number, new MeshError(code, message)));
    } else this.out.frameError(s.caller.socket, s.callerId as number, code, message);
  }

  /** The stream got its final answer; the last one while closing calls onDrained. */
  private completeStream(s: Stream): void {
    if (!this.book.complete(s)) return;
    if (this.closing && this.book.size === 0) this.onDrained?.();
  }

  /** Why a new request to `target` cannot be taken now, if it cannot. */
  private admission(target: PeerConn, oneWay = false): [MeshErrorCode, string] | null {
    if (this.closing) return ['MESH_ERR_SHUTTING_DOWN', 'relay is shutting down; retry on another relay'];
    // One-way requests in their window answer nothing and hold no handler: they do not count against the limit (their own cap is below).
    if (!oneWay && target.incoming.size - target.oneWayIn >= this.o.maxInFlightPerPeer) return ['MESH_ERR_BACKPRESSURE', `peer ${target.id} has ${target.incoming.size - target.oneWayIn} requests in flight (limit ${this.o.maxInFlightPerPeer})`];
    if (target.socket.bufferedAmount > this.o.highWaterBytes) return ['MESH_ERR_BACKPRESSURE', `peer ${target.id} is not keeping up (${target.socket.bufferedAmount} bytes queued)`];
    return null;
  }
}
