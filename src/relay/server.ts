/**
 * The relay: a WebSocket hub that NAT'd peers connect out to, and the data
 * path of every pipeline hop.
 *
 *   caller ──/ws──▶ relay ──/ws──▶ target        fast path (binary frames, PROTOCOL §4)
 *   caller ──/rpc/<id>──▶ relay ──/ws──▶ target  ADR-0014 path (JSON/base64, §3)
 *
 * This file is the sockets: HTTP and upgrades, the registration handshake,
 * liveness pings, the sweep timer and shutdown. What a message means — which
 * stream it belongs to, where it goes, what error it earns — is the stream
 * table's (stream-table.ts), which never sees a socket.
 */
import { createHash, createPublicKey, randomBytes, verify as verifySignature } from 'node:crypto';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { Duplex } from 'node:stream';
import pino, { type Logger } from 'pino';
import { WebSocket, WebSocketServer, type RawData } from 'ws';
import { connectNats, type NatsHandle, type NatsStatus } from '../cluster/nats.ts';
import { Federation } from './federation.ts';
import { BEAT_BATCH_FEATURE, CLUSTER_FEATURE, MeshError, ONE_WAY_FEATURE, PEER_BACK_FEATURE, PEER_ID_BYTES, PEER_WATCH_FEATURE, parseRegister, registrationMessage } from '../protocol/index.ts';
import { createRelayMetrics, type RelayMetrics } from './metrics.ts';
import { resolveRelayOptions, type RelayOptions } from './options.ts';
import { CLOSE } from '../protocol/close-codes.ts';
import { trace } from '../protocol/trace.ts';
import { StreamTable, type PeerConn, RpcCaller } from './stream-table.ts';
import { Corker, WsPeerSocket } from './ws-socket.ts';
import { PingSweep } from './ping-sweep.ts';

export { CLOSE } from '../protocol/close-codes.ts';
export { FAST_PATH_PROTOCOL } from './stream-table.ts';

/** A register message checked against this connection's nonce: the peer id its key gives, or why it is refused (close code of §8). */
function verifyRegistration(text: string, nonce: string): { ok: true; id: string; info: Record<string, unknown> } | { ok: false; close: number; reason: string } {
  const cred = parseRegister(text);
  if (!cred.ok) return { ok: false, close: CLOSE[cred.close], reason: cred.reason };
  let ok: boolean;
  try {
    const pub = createPublicKey({ key: { kty: 'OKP', crv: 'Ed25519', x: Buffer.from(cred.publicKey).toString('base64url') }, format: 'jwk' });
    ok = verifySignature(null, registrationMessage(nonce), pub, cred.signature);
  } catch {
    ok = false;
  }
  if (!ok) return { ok: false, close: CLOSE.badSignature, reason: 'bad signature: sign "meshnet-register:" + this connection\'s nonce' };
  const id = createHash('sha256').update(cred.publicKey).digest().subarray(0, PEER_ID_BYTES).toString('hex');
  return { ok: true, id, info: cred.info };
}

export interface Relay {
  readonly url: string;
  readonly port: number;
  readonly metrics: RelayMetrics;
  readonly logger: Logger;
  /** Registered peer ids with their `info`. */
  peers(): Array<{ peer_id: string; info: Record<string, unknown>; fast_path: boolean }>;
  /** This relay's place in its cluster (absent without `nats`). */
  readonly cluster?: { relayId: string; status(): ReturnType<Federation['status']>; relayUrls(): string[] };
  /** Answer what is in flight (within the grace period), then close every socket. */
  close(): Promise<void>;
}

export async function startRelay(partial: Partial<RelayOptions> = {}): Promise<Relay> {
  const opts = resolveRelayOptions(partial);
  const logger = pino({ name: 'relay', level: opts.logLevel });
  // In a cluster, NATS first: a relay that cannot reach it never takes a peer (NatsUnreachableError: one line naming the URL).
  const relayId = randomBytes(8).toString('hex');
  let natsStatus: NatsStatus = 'connected';
  const nats: NatsHandle | undefined = opts.nats ? await connectNats({ servers: opts.nats, name: `relay-${relayId}`, logger, onStatus: (st) => (natsStatus = st) }) : undefined;
  const metrics = createRelayMetrics();
  const table = new StreamTable({ options: opts, metrics, logger });
  const corker = new Corker();
  const allSockets = new Set<WsPeerSocket>();
  const pings = new PingSweep<WsPeerSocket>(opts.pingIntervalMs);
  let publicUrl = opts.publicUrl ?? '';

  // Frames carry at most maxBodyBytes of body plus a meta block (≤ 64 KiB);
  // /rpc JSON carries base64 (4/3). Anything larger is cut off by ws itself.
  const maxFrameBytes = opts.maxBodyBytes + 128 * 1024;
  const maxJsonBytes = Math.ceil((opts.maxBodyBytes * 4) / 3) + 128 * 1024;
  const wssPeers = new WebSocketServer({ noServer: true, maxPayload: maxFrameBytes * 2, perMessageDeflate: false });
  const wssRpc = new WebSocketServer({ noServer: true, maxPayload: maxJsonBytes * 2, perMessageDeflate: false });
  const wssTrunk = new WebSocketServer({ noServer: true, maxPayload: maxFrameBytes * 2, perMessageDeflate: false });
  let federation: Federation | undefined;

  // ------------------------------------------------------------ sockets

  function onPeerSocket(ws: WebSocket, raw: Duplex): void {
    const socket = new WsPeerSocket(ws, raw, corker);
    allSockets.add(socket);
    pings.add(socket);
    const nonce = randomBytes(16).toString('hex');
    let peer: PeerConn | null = null;
    const registerTimer = setTimeout(() => {
      if (!peer) ws.close(CLOSE.registerTimeout, 'no registration within the time limit');
    }, opts.registerTimeoutMs);
    ws.send(JSON.stringify({ type: 'challenge', nonce }));

    ws.on('message', (data: RawData, isBinary: boolean) => {
      try {
        if (peer) {
          if (isBinary) {
            trace?.('relay-in');
            table.onBinary(peer, data as Buffer);
          } else table.onText(peer, data.toString());
          return;
        }
        if (isBinary) {
          ws.close(CLOSE.policy, 'register before sending frames');
          return;
        }
        peer = register(socket, data.toString(), nonce);
        if (peer) clearTimeout(registerTimer);
      } catch (e) {
        // A bug here must not take the relay down: log it and drop this socket only.
        logger.error({ err: e }, 'peer message handler failed');
        ws.close(CLOSE.protocolError, 'internal error handling a message');
      }
    });
    ws.on('close', () => {
      clearTimeout(registerTimer);
      allSockets.delete(socket);
      pings.delete(socket);
      if (peer) table.removePeer(peer);
    });
    ws.on('error', (err) => logger.debug({ err }, 'peer socket error'));
  }

  function register(socket: WsPeerSocket, text: string, nonce: string): PeerConn | null {
    const refuse = (code: number, reason: string) => {
      socket.ws.send(JSON.stringify({ type: 'error', code: 'MESH_ERR_UNAUTHORIZED', message: reason }));
      socket.ws.close(code, reason.slice(0, 120));
      return null;
    };
    const v = verifyRegistration(text, nonce);
    if (!v.ok) return refuse(v.close, v.reason);
    const peer = table.addPeer(socket, v.id, v.info);
    if (!('id' in peer)) return refuse(peer.close, peer.reason);
    // `features`: what this relay forwards beyond docs/protocol.md §4 (peers of older relays see none and never send one-way frames).
    // `cluster`: peers on every relay of the cluster are reachable on this connection's fast path.
    // `peer-watch`: the relay says when a watched peer detaches (a node watching its tracker).
    // `beat-batch`: a node may send its heartbeat as a `beat` message; the relay batches them per tracker (docs/protocol.md §9.1).
    // `peer-back`: it holds a watch of a peer not attached to it, and says when that peer attaches.
    const features = [ONE_WAY_FEATURE, PEER_WATCH_FEATURE, PEER_BACK_FEATURE, ...(table.beats ? [BEAT_BATCH_FEATURE] : []), ...(federation ? [CLUSTER_FEATURE] : [])];
    const registered = () => {
      if (!socket.isOpen) return;
      socket.ws.send(JSON.stringify({ type: 'registered', peer_id: v.id, relay_addr: `${publicUrl}/rpc/${v.id}`, features, ...(federation ? { relays: federation.relayUrls().slice(0, 64) } : {}) }));
      try {
        table.announced(peer);
      } catch (e) {
        // Run from a promise in a cluster: a bug here is logged, never an unhandled rejection.
        logger.error({ err: e }, 'telling the watchers of a peer that it attached failed');
      }
    };
    // In a cluster, `registered` once NATS has the peer's subscription: from then on every relay finds it.
    if (federation) void federation.announced().then(registered);
    else registered();
    return peer;
  }

  function onRpcSocket(ws: WebSocket, raw: Duplex, targetId: string): void {
    const socket = new WsPeerSocket(ws, raw, corker);
    allSockets.add(socket);
    pings.add(socket);
    const caller = new RpcCaller(socket, targetId);
    ws.on('message', (data: RawData, isBinary: boolean) => {
      try {
        table.onRpcMessage(caller, isBinary ? null : data.toString());
      } catch (e) {
        logger.error({ err: e }, 'rpc message handler failed');
        table.rpcError(caller, null, 'MESH_ERR_INTERNAL', 'internal relay error');
      }
    });
    ws.on('close', () => {
      allSockets.delete(socket);
      pings.delete(socket);
      table.removeRpcCaller(caller);
    });
    ws.on('error', (err) => logger.debug({ err }, 'rpc socket error'));
  }

  /**
   * An `/rpc` caller of a peer attached to another relay: its messages go to
   * that relay's `/rpc/<id>` and back unchanged. Requests sent before (or
   * when) that socket cannot open are answered 502 with their own ids.
   */
  function proxyRpc(ws: WebSocket, url: string): void {
    const upstream = new WebSocket(url, { perMessageDeflate: false, maxPayload: maxJsonBytes * 2 });
    let queued: string[] | undefined = [];
    const fail = (text: string) => {
      let id: unknown;
      try {
        id = (JSON.parse(text) as { request_id?: unknown }).request_id;
      } catch {
        id = undefined;
      }
      const e = new MeshError('MESH_ERR_PEER_GONE', `cannot reach the relay that holds this peer (${url})`);
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ request_id: typeof id === 'string' ? id : null, status: e.status, headers: { 'content-type': 'application/json' }, body: JSON.stringify(e.toBody()) }));
    };
    ws.on('message', (data: RawData, isBinary: boolean) => {
      const text = isBinary ? null : data.toString();
      if (text === null) {
        const e = new MeshError('MESH_ERR_BAD_REQUEST', 'request is not a JSON text message');
        ws.send(JSON.stringify({ request_id: null, status: e.status, headers: { 'content-type': 'application/json' }, body: JSON.stringify(e.toBody()) }));
        return;
      }
      if (queued !== undefined) queued.push(text);
      else if (upstream.readyState === WebSocket.OPEN) upstream.send(text);
      else fail(text);
    });
    upstream.once('open', () => {
      for (const text of queued ?? []) upstream.send(text);
      queued = undefined;
    });
    upstream.on('message', (data: RawData, isBinary: boolean) => {
      if (!isBinary && ws.readyState === WebSocket.OPEN) ws.send(data.toString());
    });
    const end = () => {
      for (const text of queued ?? []) fail(text);
      queued = undefined;
      if (ws.readyState === WebSocket.OPEN) ws.close(CLOSE.goingAway, 'the relay that holds this peer closed the connection');
    };
    upstream.on('close', end);
    upstream.on('error', (err) => logger.debug({ err }, 'rpc proxy upstream error'));
    ws.on('close', () => upstream.readyState === WebSocket.CONNECTING ? upstream.terminate() : upstream.close());
    ws.on('error', (err) => logger.debug({ err }, 'rpc proxy socket error'));
  }

  // ------------------------------------------------------------ HTTP

  function onHttp(req: IncomingMessage, res: ServerResponse): void {
    const path = (req.url ?? '/').split('?')[0];
    const json = (status: number, value: unknown) => {
      res.writeHead(status, { 'content-type': 'application/json', 'access-control-allow-origin': '*' });
      res.end(JSON.stringify(value));
    };
    const jsonError = (err: MeshError) => json(err.status, err.toBody());
    if (path === '/healthz') return json(table.closing ? 503 : 200, { status: table.closing ? 'shutting-down' : 'ok', peers: table.peers.size, in_flight: table.inFlight, ...(federation ? { cluster: federation.status() } : {}) });
    if (path === '/peers') return json(200, { peers: relay.peers() });
    if (path === '/metrics') {
      metrics.registry
        .metrics()
        .then((text) => {
          res.writeHead(200, { 'content-type': metrics.registry.contentType });
          res.end(text);
        })
        .catch(() => jsonError(new MeshError('MESH_ERR_INTERNAL', 'metrics unavailable')));
      return;
    }
    jsonError(new MeshError('MESH_ERR_NOT_FOUND', `no route ${path}; try /ws, /rpc/<peer_id>, /healthz, /metrics, /peers`));
  }

  function rejectUpgrade(socket: Duplex, err: MeshError): void {
    const body = JSON.stringify(err.toBody());
    const status = err.status;
    const reason = status === 404 ? 'Not Found' : status === 503 ? 'Service Unavailable' : 'Bad Request';
    socket.end(`HTTP/1.1 ${status} ${reason}\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`);
  }

  function onUpgrade(req: IncomingMessage, socket: Duplex, head: Buffer): void {
    socket.on('error', () => socket.destroy());
    const path = (req.url ?? '/').split('?')[0] ?? '/';
    if (table.closing) return rejectUpgrade(socket, new MeshError('MESH_ERR_SHUTTING_DOWN', 'relay is shutting down'));
    if (path === '/ws') {
      wssPeers.handleUpgrade(req, socket, head, (ws) => onPeerSocket(ws, socket));
      return;
    }
    if (path === '/cluster' && federation) {
      federation.acceptTrunk(wssTrunk, req, socket, head);
      return;
    }
    const m = /^\/rpc\/([^/]+)$/.exec(path);
    if (m) {
      let id: string;
      try {
        id = decodeURIComponent(m[1]!).toLowerCase();
      } catch {
        return rejectUpgrade(socket, new MeshError('MESH_ERR_BAD_REQUEST', 'peer id is not valid percent-encoding'));
      }
      if (table.peers.has(id)) {
        wssRpc.handleUpgrade(req, socket, head, (ws) => onRpcSocket(ws, socket, id));
        return;
      }
      if (!federation || !/^[0-9a-f]{32}$/.test(id)) return rejectUpgrade(socket, new MeshError('MESH_ERR_NO_SUCH_PEER', `peer ${id} is not connected to this relay`));
      // Attached to another relay of the cluster: this socket is passed through to that relay's /rpc (JSON unchanged).
      void federation.rpcUrlOf(id).then((url) => {
        if (socket.destroyed) return;
        if (url === undefined) return rejectUpgrade(socket, new MeshError('MESH_ERR_NO_SUCH_PEER', `peer ${id} is not connected to this relay or any relay of its cluster`));
        wssRpc.handleUpgrade(req, socket, head, (ws) => proxyRpc(ws, url));
      });
      return;
    }
    rejectUpgrade(socket, new MeshError('MESH_ERR_NOT_FOUND', `no WebSocket route ${path}; use /ws or /rpc/<peer_id>`));
  }

  // ------------------------------------------------------------ timers

  const sweepTimer = setInterval(() => table.sweep(), Math.max(10, Math.min(250, opts.requestTimeoutMs / 4)));
  sweepTimer.unref?.();


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
  if (nats) {
    federation = new Federation({
      nc: nats.nc,
      natsStatus: () => natsStatus,
      cluster: opts.cluster,
      relayId,
      publicUrl,
      path: opts.clusterPath,
      table,
      metrics,
      logger,
      corker,
      maxPayload: maxFrameBytes * 2,
      pingIntervalMs: Math.min(opts.pingIntervalMs, 5_000),
    });
    table.federation = federation;
    await federation.start();
  }
  logger.info({ url, maxBodyBytes: opts.maxBodyBytes, ...(federation ? { cluster: opts.cluster, relay_id: relayId, cluster_path: opts.clusterPath } : {}) }, 'relay listening');

  const relay: Relay = {
    url,
    port,
    metrics,
    logger,
    peers: () => [...table.peers.values()].map((p) => ({ peer_id: p.id, info: p.info, fast_path: p.fastPath })),
    ...(federation ? { cluster: { relayId, status: () => federation!.status(), relayUrls: () => federation!.relayUrls() } } : {}),
    async close() {
      if (table.closing) return;
      table.closing = true;
      if (table.inFlight > 0) {
        await new Promise<void>((resolve) => {
          table.onDrained = resolve;
          setTimeout(resolve, opts.shutdownGraceMs).unref?.();
        });
      }
      table.failAll('MESH_ERR_SHUTTING_DOWN', 'relay shut down before the peer answered');
      federation?.close();
      await nats?.close();
      clearInterval(sweepTimer);
      pings.stop();
      for (const socket of allSockets) socket.ws.close(CLOSE.goingAway, 'relay shutting down');
      await new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections?.();
        setTimeout(() => {
          for (const socket of allSockets) socket.ws.terminate();
          resolve();
        }, 1000).unref?.();
      });
      logger.info('relay closed');
    },
  };
  return relay;
}

