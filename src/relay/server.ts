/**
 * The relay: a WebSocket hub that NAT'd peers connect out to, and the data
 * path of every pipeline hop.
 *
 *   caller ──/ws──▶ relay ──/ws──▶ target        fast path (binary frames, PROTOCOL §4)
 *   caller ──/rpc/<id>──▶ relay ──/ws──▶ target  ADR-0014 path (JSON/base64, §3)
 *
 * On the fast path the relay reads an 8-byte head and a 16-byte peer id,
 * rewrites both in place and sends the same buffer on: no body copy, no
 * parse. Streams are renamed towards the target (each target connection has
 * its own id space) and restored on the way back, so callers can never
 * collide or see each other's answers.
 */
import { createHash, createPublicKey, randomBytes, verify as verifySignature } from 'node:crypto';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { Duplex } from 'node:stream';
import pino, { type Logger } from 'pino';
import { WebSocket, WebSocketServer, type RawData } from 'ws';
import {
  FLAG_END,
  FrameKind,
  MeshError,
  PEER_ID_BYTES,
  bodyFieldsFor,
  decodeFrame,
  encodeErrorFrame,
  encodeResponseFrame,
  encodeCancelFrame,
  envelopeBody,
  errorBody,
  normalizeHeaders,
  readFrameHead,
  parseRegister,
  registrationMessage,
  relayHttpResponseSchema,
  requestBodyBytes,
  rpcRequestSchema,
  writeRequestPeerId,
  writeStreamId,
  type MeshErrorCode,
  type RelayHttpResponse,
} from '../protocol/index.ts';
import { createRelayMetrics, type RelayMetrics } from './metrics.ts';
import { resolveRelayOptions, type RelayOptions } from './options.ts';
import { CLOSE } from '../protocol/close-codes.ts';

export { CLOSE } from '../protocol/close-codes.ts';

/** The capability a peer announces in `info.protocols` to receive binary frames. */
export const FAST_PATH_PROTOCOL = 'mesh-frames/1';

type Caller = PeerConn | RpcCaller;

/** One request in flight through the relay. */
interface Stream {
  caller: Caller;
  /** The caller's own id (fast path: stream id; `/rpc`: request_id). */
  callerId: number | string;
  target: PeerConn;
  /** The relay's id towards the target. */
  relayStreamId: number;
  /** `/rpc` or legacy-target streams travel as JSON envelopes with this id. */
  relayRequestId: string | null;
  deadline: number;
  startedAt: number;
  path: 'fast' | 'rpc' | 'envelope';
}

class PeerConn {
  readonly kind = 'peer' as const;
  /** Streams this peer called, by its own stream id. */
  readonly outgoing = new Map<number, Stream>();
  /** Streams addressed to this peer, by the relay's stream id. */
  readonly incoming = new Map<number, Stream>();
  nextStreamId = 1;
  alive = true;
  constructor(
    readonly ws: WebSocket,
    readonly id: string,
    readonly idBytes: Uint8Array,
    readonly info: Record<string, unknown>,
    readonly fastPath: boolean,
  ) {}

  allocStreamId(): number {
    // Skip ids still in use after a wrap-around (2^32 requests on one socket).
    do {
      this.nextStreamId = this.nextStreamId >= 0xffffffff ? 1 : this.nextStreamId + 1;
    } while (this.incoming.has(this.nextStreamId));
    return this.nextStreamId;
  }
}

class RpcCaller {
  readonly kind = 'rpc' as const;
  readonly pending = new Map<string, Stream>();
  alive = true;
  constructor(
    readonly ws: WebSocket,
    readonly targetId: string,
  ) {}
}

export interface Relay {
  readonly url: string;
  readonly port: number;
  readonly metrics: RelayMetrics;
  readonly logger: Logger;
  /** Registered peer ids with their `info`. */
  peers(): Array<{ peer_id: string; info: Record<string, unknown>; fast_path: boolean }>;
  /** Answer what is in flight (within the grace period), then close every socket. */
  close(): Promise<void>;
}

const utf8 = new TextEncoder();

export async function startRelay(partial: Partial<RelayOptions> = {}): Promise<Relay> {
  const opts = resolveRelayOptions(partial);
  const logger = pino({ name: 'relay', level: opts.logLevel });
  const metrics = createRelayMetrics();
  const hot = metrics.hot;
  hot.inFlight = () => streams.size;
  // Label lookups hash their label object on every call; bind the histogram's once.
  const latencyBy = { fast: metrics.latency.labels('fast'), rpc: metrics.latency.labels('rpc'), envelope: metrics.latency.labels('envelope') };
  const peers = new Map<string, PeerConn>();
  const streams = new Set<Stream>();
  const jsonPending = new Map<string, Stream>();
  const allSockets = new Set<WebSocket>();
  let closing = false;
  let publicUrl = opts.publicUrl ?? '';

  // Frames carry at most maxBodyBytes of body plus a meta block (≤ 64 KiB);
  // /rpc JSON carries base64 (4/3). Anything larger is cut off by ws itself.
  const maxFrameBytes = opts.maxBodyBytes + 128 * 1024;
  const maxJsonBytes = Math.ceil((opts.maxBodyBytes * 4) / 3) + 128 * 1024;
  const wssPeers = new WebSocketServer({ noServer: true, maxPayload: maxFrameBytes * 2, perMessageDeflate: false });
  const wssRpc = new WebSocketServer({ noServer: true, maxPayload: maxJsonBytes * 2, perMessageDeflate: false });

  // ------------------------------------------------------------ answering

  // One read from a peer often carries many frames (64 requests in flight
  // arrive in a few reads). Each ws.send() would be its own write(2); instead
  // the first send to a socket in this tick corks it and the tick's end
  // uncorks it, so everything the relay forwards to one peer while handling
  // one read leaves in one writev. Nothing waits longer than the current tick.
  let corked: Duplex[] = [];
  const flushCorked = (): void => {
    const sockets = corked;
    corked = [];
    for (const socket of sockets) socket.uncork();
  };
  function send(ws: WebSocket, data: Uint8Array | string): void {
    const socket = (ws as unknown as { _socket?: Duplex | null })._socket;
    if (socket && socket.writableCorked === 0) {
      socket.cork();
      if (corked.push(socket) === 1) process.nextTick(flushCorked);
    }
    ws.send(data);
  }

  function sendTo(ws: WebSocket, data: Uint8Array | string): void {
    if (ws.readyState !== WebSocket.OPEN) return;
    if (ws.bufferedAmount > opts.maxBufferedBytes) {
      // The reader is not reading: dropping it is the only bounded choice.
      logger.warn({ buffered: ws.bufferedAmount }, 'slow consumer disconnected');
      ws.close(CLOSE.slowConsumer, 'slow consumer: too much unread data');
      return;
    }
    send(ws, data);
  }

  function rpcAnswer(caller: RpcCaller, requestId: string | null, status: number, headers: Record<string, string>, fields: { body_base64?: string; body?: string }): void {
    sendTo(caller.ws, JSON.stringify({ request_id: requestId, status, headers, ...fields }));
  }

  function rpcError(caller: RpcCaller, requestId: string | null, code: MeshErrorCode, message: string): void {
    const e = new MeshError(code, message);
    metrics.errors.inc({ code });
    rpcAnswer(caller, requestId, e.status, { 'content-type': 'application/json' }, { body: JSON.stringify(e.toBody()) });
  }

  function frameError(ws: WebSocket, streamId: number, code: MeshErrorCode, message: string): void {
    metrics.errors.inc({ code });
    sendTo(ws, encodeErrorFrame(streamId, new MeshError(code, message)));
  }

  /** Finish a stream with an error produced by the relay (peer gone, timeout, shutdown). */
  function failStream(s: Stream, code: MeshErrorCode, message: string, notifyTarget: boolean): void {
    if (!dropStream(s)) return;
    if (notifyTarget && s.target.ws.readyState === WebSocket.OPEN && s.path !== 'rpc' && s.relayRequestId === null) {
      send(s.target.ws, encodeCancelFrame(s.relayStreamId));
    }
    if (s.caller.kind === 'rpc') rpcError(s.caller, s.callerId as string, code, message);
    else frameError(s.caller.ws, s.callerId as number, code, message);
  }

  /** Forget a stream everywhere; false when it was already gone. */
  function dropStream(s: Stream): boolean {
    if (!streams.delete(s)) return false;
    s.target.incoming.delete(s.relayStreamId);
    if (s.relayRequestId !== null) jsonPending.delete(s.relayRequestId);
    if (s.caller.kind === 'rpc') s.caller.pending.delete(s.callerId as string);
    else s.caller.outgoing.delete(s.callerId as number);
    return true;
  }

  function completeStream(s: Stream): void {
    if (!dropStream(s)) return;
    latencyBy[s.path].observe((performance.now() - s.startedAt) / 1000);
    if (closing && streams.size === 0) drained?.();
  }

  /** Why a new request to `target` cannot be taken now, if it cannot. */
  function admission(target: PeerConn): [MeshErrorCode, string] | null {
    if (closing) return ['MESH_ERR_SHUTTING_DOWN', 'relay is shutting down; retry on another relay'];
    if (target.incoming.size >= opts.maxInFlightPerPeer) return ['MESH_ERR_BACKPRESSURE', `peer ${target.id} has ${target.incoming.size} requests in flight (limit ${opts.maxInFlightPerPeer})`];
    if (target.ws.bufferedAmount > opts.highWaterBytes) return ['MESH_ERR_BACKPRESSURE', `peer ${target.id} is not keeping up (${target.ws.bufferedAmount} bytes queued)`];
    return null;
  }

  function openStream(caller: Caller, callerId: number | string, target: PeerConn, path: Stream['path'], json: boolean): Stream {
    const now = performance.now();
    const s: Stream = {
      caller,
      callerId,
      target,
      relayStreamId: target.allocStreamId(),
      relayRequestId: json ? randomBytes(12).toString('hex') : null,
      deadline: now + opts.requestTimeoutMs,
      startedAt: now,
      path,
    };
    streams.add(s);
    target.incoming.set(s.relayStreamId, s);
    if (s.relayRequestId !== null) jsonPending.set(s.relayRequestId, s);
    if (caller.kind === 'rpc') caller.pending.set(callerId as string, s);
    else caller.outgoing.set(callerId as number, s);
    hot.hops[path]++;
    return s;
  }

  // ------------------------------------------------------------ fast path

  function peerOnBinary(peer: PeerConn, data: Buffer): void {
    hot.bytesIn += data.byteLength;
    if (data.byteLength < 8) {
      peer.ws.close(CLOSE.protocolError, 'frame shorter than its 8-byte head');
      return;
    }
    const head = readFrameHead(data);
    if (head.version !== 1) return frameError(peer.ws, head.streamId, 'MESH_ERR_BAD_FRAME', `unsupported frame version ${head.version}; this relay speaks 1`);
    switch (head.kind) {
      case FrameKind.Request:
        return peerOnRequestFrame(peer, data, head.streamId);
      case FrameKind.Response:
      case FrameKind.Data: {
        const s = peer.incoming.get(head.streamId);
        if (s === undefined) return; // late answer to a stream that timed out or was cancelled
        s.deadline = performance.now() + opts.requestTimeoutMs;
        if (s.relayRequestId !== null) return; // JSON-bound streams take JSON answers only
        const end = (head.flags & FLAG_END) !== 0;
        if (end) completeStream(s);
        writeStreamId(data, s.callerId as number);
        hot.bytesOut += data.byteLength;
        sendTo(s.caller.ws, data);
        return;
      }
      case FrameKind.Cancel: {
        const s = peer.outgoing.get(head.streamId);
        if (s === undefined) return;
        dropStream(s);
        if (s.relayRequestId === null) sendTo(s.target.ws, encodeCancelFrame(s.relayStreamId));
        return;
      }
      default:
        return frameError(peer.ws, head.streamId, 'MESH_ERR_BAD_FRAME', `unknown frame kind ${head.kind}`);
    }
  }

  function peerOnRequestFrame(peer: PeerConn, data: Buffer, streamId: number): void {
    if (data.byteLength < 26) return frameError(peer.ws, streamId, 'MESH_ERR_BAD_FRAME', 'request frame shorter than its 26-byte head');
    const metaLen = data[24]! | (data[25]! << 8);
    if (26 + metaLen > data.byteLength) return frameError(peer.ws, streamId, 'MESH_ERR_BAD_FRAME', 'request meta runs past the frame');
    if (peer.outgoing.has(streamId)) return frameError(peer.ws, streamId, 'MESH_ERR_BAD_FRAME', `stream ${streamId} is already in flight on this connection`);
    const targetId = data.toString('hex', 8, 8 + PEER_ID_BYTES);
    const target = peers.get(targetId);
    if (target === undefined) return frameError(peer.ws, streamId, 'MESH_ERR_NO_SUCH_PEER', `peer ${targetId} is not connected to this relay`);
    if (requestBodyBytes(data) > opts.maxBodyBytes) return frameError(peer.ws, streamId, 'MESH_ERR_TOO_LARGE', `body of ${requestBodyBytes(data)} bytes is over this relay's limit of ${opts.maxBodyBytes}`);
    const refused = admission(target);
    if (refused) return frameError(peer.ws, streamId, refused[0], refused[1]);
    if (!target.fastPath) return forwardFrameAsEnvelope(peer, data, streamId, target);
    const s = openStream(peer, streamId, target, 'fast', false);
    writeRequestPeerId(data, peer.idBytes);
    writeStreamId(data, s.relayStreamId);
    hot.bytesOut += data.byteLength;
    send(target.ws, data);
  }

  /** An ADR-era target only reads JSON envelopes: translate this one request. */
  function forwardFrameAsEnvelope(peer: PeerConn, data: Buffer, streamId: number, target: PeerConn): void {
    let f;
    try {
      f = decodeFrame(data);
    } catch (e) {
      return frameError(peer.ws, streamId, 'MESH_ERR_BAD_FRAME', (e as Error).message);
    }
    if (f.kind !== FrameKind.Request) return;
    const s = openStream(peer, streamId, target, 'envelope', true);
    sendTo(target.ws, JSON.stringify({ type: 'relay-http-request', request_id: s.relayRequestId, method: f.method, path: f.path, headers: f.headers, ...bodyFieldsFor(f.body, f.headers) }));
  }

  // ------------------------------------------------------------ JSON on /ws

  function peerOnText(peer: PeerConn, text: string): void {
    let msg: unknown;
    try {
      msg = JSON.parse(text);
    } catch {
      sendTo(peer.ws, JSON.stringify({ type: 'error', code: 'MESH_ERR_BAD_REQUEST', message: 'message is not JSON' }));
      return;
    }
    const type = (msg as { type?: unknown } | null)?.type;
    if (type !== 'relay-http-response') {
      sendTo(peer.ws, JSON.stringify({ type: 'error', code: 'MESH_ERR_BAD_REQUEST', message: `unexpected message type ${JSON.stringify(type)} on a registered connection` }));
      return;
    }
    const parsed = relayHttpResponseSchema.safeParse(msg);
    if (!parsed.success) {
      sendTo(peer.ws, JSON.stringify({ type: 'error', code: 'MESH_ERR_BAD_REQUEST', message: `malformed relay-http-response: ${parsed.error.issues[0]?.message ?? ''}` }));
      return;
    }
    const s = jsonPending.get(parsed.data.request_id);
    if (s === undefined || s.target !== peer) return; // late, or not this peer's to answer
    completeStream(s);
    deliverEnvelopeAnswer(s, parsed.data);
  }

  function deliverEnvelopeAnswer(s: Stream, r: RelayHttpResponse): void {
    if (s.caller.kind === 'rpc') {
      const fields = r.body_base64 !== undefined ? { body_base64: r.body_base64 } : r.body !== undefined ? { body: r.body } : {};
      rpcAnswer(s.caller, s.callerId as string, r.status, normalizeHeaders(r.headers), fields);
      return;
    }
    let body: Uint8Array;
    try {
      body = envelopeBody(r);
    } catch {
      return frameError(s.caller.ws, s.callerId as number, 'MESH_ERR_UPSTREAM', 'peer answered with invalid base64');
    }
    sendTo(s.caller.ws, encodeResponseFrame({ streamId: s.callerId as number, status: r.status, headers: normalizeHeaders(r.headers), body }));
  }

  // ------------------------------------------------------------ /rpc

  function rpcOnMessage(caller: RpcCaller, raw: RawData, isBinary: boolean): void {
    const text = isBinary ? null : raw.toString();
    let msg: unknown;
    try {
      msg = text === null ? undefined : JSON.parse(text);
    } catch {
      msg = undefined;
    }
    const idGuess = typeof (msg as { request_id?: unknown } | undefined)?.request_id === 'string' ? (msg as { request_id: string }).request_id : null;
    if (msg === undefined) return rpcError(caller, null, 'MESH_ERR_BAD_REQUEST', 'request is not a JSON text message');
    const parsed = rpcRequestSchema.safeParse(msg);
    if (!parsed.success) {
      const issue = parsed.error.issues[0];
      return rpcError(caller, idGuess, 'MESH_ERR_BAD_REQUEST', `malformed request: ${issue ? `${issue.path.join('.') || 'request'}: ${issue.message}` : 'invalid'}`);
    }
    const req = parsed.data;
    if (caller.pending.has(req.request_id)) return rpcError(caller, req.request_id, 'MESH_ERR_BAD_REQUEST', `request_id ${req.request_id} is already in flight on this socket`);
    const bodyBytes = req.body_base64 !== undefined ? Math.floor((req.body_base64.length * 3) / 4) : req.body !== undefined ? utf8.encode(req.body).byteLength : 0;
    if (bodyBytes > opts.maxBodyBytes) return rpcError(caller, req.request_id, 'MESH_ERR_TOO_LARGE', `body of ~${bodyBytes} bytes is over this relay's limit of ${opts.maxBodyBytes}`);
    if (req.body_base64 !== undefined && !/^[A-Za-z0-9+/_-]*={0,2}$/.test(req.body_base64)) return rpcError(caller, req.request_id, 'MESH_ERR_BAD_REQUEST', 'body_base64 is not valid base64');
    const target = peers.get(caller.targetId);
    if (target === undefined) return rpcError(caller, req.request_id, 'MESH_ERR_NO_SUCH_PEER', `peer ${caller.targetId} is not connected to this relay`);
    const refused = admission(target);
    if (refused) return rpcError(caller, req.request_id, refused[0], refused[1]);
    const s = openStream(caller, req.request_id, target, 'rpc', true);
    const fields = req.body_base64 !== undefined ? { body_base64: req.body_base64 } : req.body !== undefined ? { body: req.body } : {};
    sendTo(target.ws, JSON.stringify({ type: 'relay-http-request', request_id: s.relayRequestId, method: req.method.toUpperCase(), path: req.path, headers: req.headers, ...fields }));
  }

  // ------------------------------------------------------------ registration

  function onPeerSocket(ws: WebSocket): void {
    allSockets.add(ws);
    const nonce = randomBytes(16).toString('hex');
    let peer: PeerConn | null = null;
    let alive = true;
    ws.on('pong', () => {
      alive = true;
      if (peer) peer.alive = true;
    });
    (ws as WebSocket & { meshAlive?: () => boolean; meshMark?: () => void }).meshAlive = () => alive;
    (ws as WebSocket & { meshMark?: () => void }).meshMark = () => {
      alive = false;
    };
    const registerTimer = setTimeout(() => {
      if (!peer) ws.close(CLOSE.registerTimeout, 'no registration within the time limit');
    }, opts.registerTimeoutMs);
    ws.send(JSON.stringify({ type: 'challenge', nonce }));

    ws.on('message', (raw: RawData, isBinary: boolean) => {
      try {
        if (peer) {
          if (isBinary) peerOnBinary(peer, raw as Buffer);
          else peerOnText(peer, raw.toString());
          return;
        }
        if (isBinary) {
          ws.close(CLOSE.policy, 'register before sending frames');
          return;
        }
        peer = register(ws, raw.toString(), nonce);
        if (peer) clearTimeout(registerTimer);
      } catch (e) {
        // A bug here must not take the relay down: log it and drop this socket only.
        logger.error({ err: e }, 'peer message handler failed');
        ws.close(CLOSE.protocolError, 'internal error handling a message');
      }
    });
    ws.on('close', () => {
      clearTimeout(registerTimer);
      allSockets.delete(ws);
      if (peer) peerOnClose(peer);
    });
    ws.on('error', (err) => logger.debug({ err }, 'peer socket error'));
  }

  function register(ws: WebSocket, text: string, nonce: string): PeerConn | null {
    const refuse = (code: number, reason: string) => {
      ws.send(JSON.stringify({ type: 'error', code: 'MESH_ERR_UNAUTHORIZED', message: reason }));
      ws.close(code, reason.slice(0, 120));
      return null;
    };
    const cred = parseRegister(text);
    if (!cred.ok) return refuse(CLOSE[cred.close], cred.reason);
    const { publicKey: key, signature: sig } = cred;
    let ok: boolean;
    try {
      const pub = createPublicKey({ key: { kty: 'OKP', crv: 'Ed25519', x: Buffer.from(key).toString('base64url') }, format: 'jwk' });
      ok = verifySignature(null, registrationMessage(nonce), pub, sig);
    } catch {
      ok = false;
    }
    if (!ok) return refuse(CLOSE.badSignature, 'bad signature: sign "meshnet-register:" + this connection\'s nonce');
    if (closing) return refuse(CLOSE.tryAgainLater, 'relay is shutting down');
    const idBytes = createHash('sha256').update(key).digest().subarray(0, PEER_ID_BYTES);
    const id = Buffer.from(idBytes).toString('hex');
    const old = peers.get(id);
    if (old === undefined && peers.size >= opts.maxPeers) return refuse(CLOSE.tryAgainLater, `relay full (${opts.maxPeers} peers)`);
    const info = cred.info;
    const protocols = Array.isArray(info.protocols) ? info.protocols : [];
    const peer = new PeerConn(ws, id, new Uint8Array(idBytes), info, protocols.includes(FAST_PATH_PROTOCOL));
    if (old) {
      // Same key, newer connection: the old one is stale (a reload, a reconnect).
      peers.delete(id);
      peerOnClose(old);
      old.ws.close(CLOSE.replaced, 'replaced by a newer connection with the same key');
    }
    peers.set(id, peer);
    metrics.peers.set(peers.size);
    ws.send(JSON.stringify({ type: 'registered', peer_id: id, relay_addr: `${publicUrl}/rpc/${id}` }));
    logger.info({ peer_id: id, fast_path: peer.fastPath }, 'peer registered');
    return peer;
  }

  function peerOnClose(peer: PeerConn): void {
    if (peers.get(peer.id) === peer) {
      peers.delete(peer.id);
      metrics.peers.set(peers.size);
      logger.info({ peer_id: peer.id }, 'peer left');
    }
    for (const s of [...peer.incoming.values()]) failStream(s, 'MESH_ERR_PEER_GONE', `peer ${peer.id} went away before answering`, false);
    for (const s of [...peer.outgoing.values()]) failStream(s, 'MESH_ERR_CANCELLED', 'caller went away', true);
  }

  function onRpcSocket(ws: WebSocket, targetId: string): void {
    allSockets.add(ws);
    const caller = new RpcCaller(ws, targetId);
    ws.on('pong', () => {
      caller.alive = true;
    });
    (ws as WebSocket & { meshAlive?: () => boolean }).meshAlive = () => caller.alive;
    (ws as WebSocket & { meshMark?: () => void }).meshMark = () => {
      caller.alive = false;
    };
    ws.on('message', (raw: RawData, isBinary: boolean) => {
      try {
        rpcOnMessage(caller, raw, isBinary);
      } catch (e) {
        logger.error({ err: e }, 'rpc message handler failed');
        rpcError(caller, null, 'MESH_ERR_INTERNAL', 'internal relay error');
      }
    });
    ws.on('close', () => {
      allSockets.delete(ws);
      for (const s of [...caller.pending.values()]) dropStream(s);
    });
    ws.on('error', (err) => logger.debug({ err }, 'rpc socket error'));
  }

  // ------------------------------------------------------------ HTTP

  function onHttp(req: IncomingMessage, res: ServerResponse): void {
    const path = (req.url ?? '/').split('?')[0];
    const json = (status: number, value: unknown) => {
      res.writeHead(status, { 'content-type': 'application/json', 'access-control-allow-origin': '*' });
      res.end(JSON.stringify(value));
    };
    if (path === '/healthz') return json(closing ? 503 : 200, { status: closing ? 'shutting-down' : 'ok', peers: peers.size, in_flight: streams.size });
    if (path === '/peers') return json(200, { peers: relay.peers() });
    if (path === '/metrics') {
      metrics.registry
        .metrics()
        .then((text) => {
          res.writeHead(200, { 'content-type': metrics.registry.contentType });
          res.end(text);
        })
        .catch(() => json(500, errorBody('MESH_ERR_INTERNAL', 'metrics unavailable')));
      return;
    }
    json(404, errorBody('MESH_ERR_NOT_FOUND', `no route ${path}; try /ws, /rpc/<peer_id>, /healthz, /metrics, /peers`));
  }

  function rejectUpgrade(socket: Duplex, status: number, code: string, message: string): void {
    const body = JSON.stringify(errorBody(code, message));
    const reason = status === 404 ? 'Not Found' : status === 503 ? 'Service Unavailable' : 'Bad Request';
    socket.end(`HTTP/1.1 ${status} ${reason}\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`);
  }

  function onUpgrade(req: IncomingMessage, socket: Duplex, head: Buffer): void {
    socket.on('error', () => socket.destroy());
    const path = (req.url ?? '/').split('?')[0] ?? '/';
    if (closing) return rejectUpgrade(socket, 503, 'MESH_ERR_SHUTTING_DOWN', 'relay is shutting down');
    if (path === '/ws') {
      wssPeers.handleUpgrade(req, socket, head, (ws) => onPeerSocket(ws));
      return;
    }
    const m = /^\/rpc\/([^/]+)$/.exec(path);
    if (m) {
      const id = decodeURIComponent(m[1]!).toLowerCase();
      if (!peers.has(id)) return rejectUpgrade(socket, 404, 'MESH_ERR_NO_SUCH_PEER', `peer ${id} is not connected to this relay`);
      wssRpc.handleUpgrade(req, socket, head, (ws) => onRpcSocket(ws, id));
      return;
    }
    rejectUpgrade(socket, 404, 'MESH_ERR_NOT_FOUND', `no WebSocket route ${path}; use /ws or /rpc/<peer_id>`);
  }

  // ------------------------------------------------------------ timers

  const sweepTimer = setInterval(() => {
    const now = performance.now();
    for (const s of streams) {
      if (s.deadline <= now) failStream(s, 'MESH_ERR_TIMEOUT', `peer ${s.target.id} did not answer within ${opts.requestTimeoutMs} ms`, true);
    }
  }, Math.max(10, Math.min(250, opts.requestTimeoutMs / 4)));
  sweepTimer.unref?.();

  const pingTimer = setInterval(() => {
    for (const ws of allSockets) {
      const w = ws as WebSocket & { meshAlive?: () => boolean; meshMark?: () => void };
      if (w.meshAlive && !w.meshAlive()) {
        ws.terminate();
        continue;
      }
      w.meshMark?.();
      if (ws.readyState === WebSocket.OPEN) ws.ping();
    }
  }, opts.pingIntervalMs);
  pingTimer.unref?.();

  // ------------------------------------------------------------ lifecycle

  const server: Server = createServer(onHttp);
  server.on('upgrade', onUpgrade);
  server.on('clientError', (_err, socket) => socket.destroy());
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(opts.port, opts.host, () => resolve());
  });
  const addr = server.address();
  const port = typeof addr === 'object' && addr ? addr.port : opts.port;
  const hostForUrl = opts.host.includes(':') ? `[${opts.host}]` : opts.host === '0.0.0.0' ? '127.0.0.1' : opts.host;
  const url = `ws://${hostForUrl}:${port}`;
  if (!publicUrl) publicUrl = url;
  logger.info({ url, maxBodyBytes: opts.maxBodyBytes }, 'relay listening');

  let drained: (() => void) | null = null;

  const relay: Relay = {
    url,
    port,
    metrics,
    logger,
    peers: () => [...peers.values()].map((p) => ({ peer_id: p.id, info: p.info, fast_path: p.fastPath })),
    async close() {
      if (closing) return;
      closing = true;
      if (streams.size > 0) {
        await new Promise<void>((resolve) => {
          drained = resolve;
          setTimeout(resolve, opts.shutdownGraceMs).unref?.();
        });
      }
      for (const s of [...streams]) failStream(s, 'MESH_ERR_SHUTTING_DOWN', 'relay shut down before the peer answered', true);
      clearInterval(sweepTimer);
      clearInterval(pingTimer);
      for (const ws of allSockets) ws.close(CLOSE.goingAway, 'relay shutting down');
      await new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections?.();
        setTimeout(() => {
          for (const ws of allSockets) ws.terminate();
          resolve();
        }, 1000).unref?.();
      });
      logger.info('relay closed');
    },
  };
  return relay;
}

