/**
 * Trunks between the relays of a cluster (docs/protocol.md §4b): one
 * WebSocket from relay to relay that carries both relays' frames. The
 * dialling relay asks the far one over NATS for a token (`relay.<id>.trunk`),
 * dials `<url>/cluster` and says hello with it; the far relay answers
 * `trunk-ok`. Both ends then bind the socket as a link of the stream table,
 * and ping it as peer sockets are pinged. A failed dial leaves that relay's
 * frames to NATS for a while before the next try.
 */
import { randomBytes } from 'node:crypto';
import type { IncomingMessage } from 'node:http';
import type { Duplex } from 'node:stream';
import type { NatsConnection } from '@nats-io/transport-node';
import { WebSocket, type RawData, type WebSocketServer } from 'ws';
import { z } from 'zod';
import type { RelaySubjects } from '../cluster/subjects.ts';
import { PEER_ID_BYTES } from '../protocol/ids.ts';
import { CLOSE } from '../protocol/close-codes.ts';
import type { RelayMetrics } from './metrics.ts';
import { ADDRESSED_FRAME, PeerConn, type LinkPipe, type StreamTable } from './stream-table.ts';
import { WsPeerSocket, type Corker } from './ws-socket.ts';

const trunkGrantSchema = z.object({ token: z.string().regex(/^[0-9a-f]{32}$/), url: z.string().min(1).max(500) });
const trunkHelloSchema = z.object({ type: z.literal('trunk'), relay_id: z.string().regex(/^[0-9a-f]{8,64}$/), token: z.string().regex(/^[0-9a-f]{32}$/) });
const trunkOkSchema = z.object({ type: z.literal('trunk-ok'), relay_id: z.string().regex(/^[0-9a-f]{8,64}$/) });

const TOKEN_TTL_MS = 10_000;
const TRUNK_HANDSHAKE_MS = 5_000;
/** After a failed trunk dial, NATS carries that relay's frames for this long before the next try. */
const TRUNK_RETRY_MS = 5_000;
const ZERO_ID = new Uint8Array(PEER_ID_BYTES);

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

export interface TrunksInit {
  nc: NatsConnection;
  subjects: RelaySubjects;
  relayId: string;
  table: StreamTable;
  metrics: RelayMetrics;
  logger: { info(obj: object, msg: string): void; warn(obj: object, msg: string): void; debug(obj: object, msg: string): void };
  corker: Corker;
  /** Largest message on a trunk, bytes. */
  maxPayload: number;
  /** How long the far relay has to grant a token, ms. */
  grantTimeoutMs: number;
  /** Counts a malformed message from the cluster. */
  dropped(kind: string): void;
  /** Runs a handler of cluster input: a throw is a malformed message, never a crash. */
  guard(kind: string, fn: () => unknown): void;
}

export class Trunks {
  /** Open trunks by the far relay's id. */
  private readonly trunks = new Map<string, PeerConn>();
  private readonly sockets = new Set<WsPeerSocket>();
  private readonly dialing = new Set<string>();
  private readonly dialFailedAt = new Map<string, number>();
  private readonly tokens = new Map<string, { relayId: string; expires: number }>();
  private closed = false;

  constructor(private readonly o: TrunksInit) {}

  get size(): number {
    return this.trunks.size;
  }

  /** The trunk to `relayId` when one is up and open. */
  open(relayId: string): PeerConn | undefined {
    const trunk = this.trunks.get(relayId);
    return trunk !== undefined && trunk.socket.isOpen ? trunk : undefined;
  }

  /** Dial a trunk to `relayId` unless one is up, being dialled, or failed a moment ago. */
  ensure(relayId: string): void {
    if (this.closed || this.dialing.has(relayId) || this.trunks.has(relayId)) return;
    const failed = this.dialFailedAt.get(relayId);
    if (failed !== undefined && Date.now() - failed < TRUNK_RETRY_MS) return;
    this.dialing.add(relayId);
    this.dial(relayId)
      .catch((e: unknown) => {
        this.dialFailedAt.set(relayId, Date.now());
        this.o.logger.warn({ relay_id: relayId, err: (e as Error).message }, 'cannot open a trunk to that relay; its frames go through NATS meanwhile');
      })
      .finally(() => this.dialing.delete(relayId));
  }

  /** A token `relayId` may dial a trunk to us with, for a while. */
  grant(relayId: string): string {
    const token = randomBytes(16).toString('hex');
    this.tokens.set(token, { relayId, expires: Date.now() + TOKEN_TTL_MS });
    return token;
  }

  /** Forget tokens nobody used in time. */
  expireTokens(now: number): void {
    for (const [token, t] of this.tokens) if (t.expires < now) this.tokens.delete(token);
  }

  private async dial(relayId: string): Promise<void> {
    const grantMsg = await this.o.nc.request(this.o.subjects.relayTrunk(relayId), utf8.encode(JSON.stringify({ relay_id: this.o.relayId })), { timeout: this.o.grantTimeoutMs });
    const grant = trunkGrantSchema.safeParse(parseText(utf8d.decode(grantMsg.data)));
    if (!grant.success) {
      this.o.dropped('trunk');
      throw new Error('malformed trunk grant');
    }
    const url = `${grant.data.url.replace(/\/+$/, '')}/cluster`;
    const ws = new WebSocket(url, { perMessageDeflate: false, maxPayload: this.o.maxPayload, generateMask: (mask: Buffer) => void mask.fill(0) });
    await new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => {
        ws.terminate();
        reject(new Error(`trunk handshake with ${url} took over ${TRUNK_HANDSHAKE_MS} ms`));
      }, TRUNK_HANDSHAKE_MS);
      ws.once('open', () => ws.send(JSON.stringify({ type: 'trunk', relay_id: this.o.relayId, token: grant.data.token })));
      ws.once('message', (data: RawData, isBinary: boolean) => {
        clearTimeout(timer);
        const ok = isBinary ? undefined : trunkOkSchema.safeParse(parseText(data.toString()));
        if (!ok?.success || ok.data.relay_id !== relayId) {
          ws.close(CLOSE.policy, 'unexpected trunk answer');
          return reject(new Error('the relay refused the trunk'));
        }
        resolve();
      });
      ws.once('error', (e) => {
        clearTimeout(timer);
        reject(e);
      });
      ws.once('close', (code) => {
        clearTimeout(timer);
        reject(new Error(`trunk closed during its handshake (${code})`));
      });
    });
    for (const ev of ['open', 'message', 'error', 'close'] as const) ws.removeAllListeners(ev);
    const raw = (ws as unknown as { _socket: Duplex })._socket;
    this.bind(ws, raw, relayId);
  }

  /** `GET /cluster` on this relay: another relay dials a trunk with a token it got from us through NATS. */
  accept(wss: WebSocketServer, req: IncomingMessage, socket: Duplex, head: Buffer): void {
    wss.handleUpgrade(req, socket, head, (ws) => {
      const timer = setTimeout(() => ws.close(CLOSE.registerTimeout, 'no trunk hello in time'), TRUNK_HANDSHAKE_MS);
      ws.once('message', (data: RawData, isBinary: boolean) => {
        clearTimeout(timer);
        const hello = isBinary ? undefined : trunkHelloSchema.safeParse(parseText(data.toString()));
        const grant = hello?.success ? this.tokens.get(hello.data.token) : undefined;
        if (!hello?.success || grant === undefined || grant.relayId !== hello.data.relay_id || grant.expires < Date.now()) {
          this.o.dropped('trunk');
          ws.close(CLOSE.badSignature, 'unknown or expired trunk token');
          return;
        }
        this.tokens.delete(hello.data.token);
        ws.send(JSON.stringify({ type: 'trunk-ok', relay_id: this.o.relayId }));
        this.bind(ws, socket, hello.data.relay_id);
      });
    });
  }

  /** A trunk is up (dialled or accepted): it becomes a link of the stream table. */
  private bind(ws: WebSocket, raw: Duplex, relayId: string): void {
    if (this.closed) {
      ws.close(CLOSE.goingAway, 'relay shutting down');
      return;
    }
    const { table, metrics, logger } = this.o;
    const socket = new WsPeerSocket(ws, raw, this.o.corker);
    const pipe: LinkPipe = {
      relayId,
      sendAddressed(target, frame) {
        const buf = Buffer.allocUnsafe(1 + PEER_ID_BYTES + frame.byteLength);
        buf[0] = ADDRESSED_FRAME;
        buf.write(target, 1, PEER_ID_BYTES, 'hex');
        buf.set(frame, 1 + PEER_ID_BYTES);
        socket.send(buf);
      },
    };
    const conn = new PeerConn(socket, `relay:${relayId}`, ZERO_ID, {}, true, pipe);
    this.sockets.add(socket);
    // Both relays may have dialled at once: keep the first for new requests; the other still answers what arrives on it.
    if (!this.trunks.has(relayId)) this.trunks.set(relayId, conn);
    this.dialFailedAt.delete(relayId);
    metrics.clusterLinks.set(this.trunks.size);
    logger.info({ relay_id: relayId }, 'trunk to another relay up');
    ws.on('message', (data: RawData, isBinary: boolean) => {
      if (!isBinary) return this.o.dropped('frame');
      this.o.guard('frame', () => table.onBinary(conn, data as Buffer));
    });
    ws.on('close', () => {
      this.sockets.delete(socket);
      if (this.trunks.get(relayId) === conn) this.trunks.delete(relayId);
      metrics.clusterLinks.set(this.trunks.size);
      table.removePeer(conn);
      if (!this.closed) logger.info({ relay_id: relayId }, 'trunk to another relay closed');
    });
    ws.on('error', (err) => logger.debug({ err }, 'trunk socket error'));
  }

  /** Terminate a trunk that did not answer the last ping; ping the others. */
  ping(): void {
    for (const socket of this.sockets) {
      if (!socket.alive) {
        socket.ws.terminate();
        continue;
      }
      socket.alive = false;
      if (socket.isOpen) socket.ws.ping();
    }
  }

  /** Close every trunk (the relay is leaving the cluster); none is bound after this. */
  close(): void {
    this.closed = true;
    for (const socket of this.sockets) socket.ws.close(CLOSE.goingAway, 'relay shutting down');
  }
}

function parseText(text: string): unknown {
  try {
    return JSON.parse(text) as unknown;
  } catch {
    return undefined;
  }
}
