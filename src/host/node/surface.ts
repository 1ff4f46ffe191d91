/**
 * How requests reach a Node.js node: its HTTP server (POST /forward,
 * POST /generate, GET /health, GET /info, DELETE /sessions/<id>) and direct
 * links on `GET /link` (the fast path's frames, src/net/direct-link.ts),
 * both into the runtime's handler for that surface.
 */
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import { once } from 'node:events';
import type { AddressInfo } from 'node:net';
import { WebSocketServer } from 'ws';
import type { MeshRequest } from '../../protocol/envelopes.ts';
import { MeshError } from '../../protocol/errors.ts';
import { normalizeHeaders } from '../../protocol/headers.ts';
import { LINK_PATH, acceptLink, type AcceptedLink } from '../../net/direct-link.ts';
import type { Identity } from '../../net/identity.ts';
import type { MeshHandler } from '../../net/contract.ts';
import type { LogLevel } from '../../node/runtime/host.ts';
import type { MuxOptions } from '../../net/relay-options.ts';

export interface SurfaceOptions {
  port: number;
  host: string;
  /** Host name put in the advertised endpoint (default: the bound host). */
  publicHost?: string;
  /** Largest request body, bytes (413 above). */
  maxBodyBytes: number;
  /** Accept direct links on GET /link. */
  links: boolean;
  /** Limits of each accepted link (maxMessageBytes defaults to the body limit + 64 KiB of frame). */
  linkOptions?: Partial<MuxOptions>;
  /** Time a link's caller has to register. @defaultValue 10000 */
  linkRegisterTimeoutMs?: number;
  identity: Identity;
  http: MeshHandler;
  link: MeshHandler;
  onLinkOpen(callerId: string): void;
  log(level: LogLevel, message: string): void;
}

export interface Surface {
  port: number;
  /** `http://host:port`: where hops and heads reach this node directly. */
  endpoint: string;
  /** Links open now. */
  readonly links: ReadonlySet<AcceptedLink>;
  close(): Promise<void>;
}

/** An error answer on node:http, closing the connection (its request body may still be arriving). */
function writeError(res: ServerResponse, err: MeshError): void {
  res.writeHead(err.status, { 'content-type': 'application/json', connection: 'close' });
  res.end(JSON.stringify(err.toBody()));
}

export async function openSurface(o: SurfaceOptions): Promise<Surface> {
  const server: Server = createServer({ noDelay: true, keepAliveTimeout: 30_000 }, (req, res) => {
    serveHttp(req, res).catch((e: unknown) => {
      o.log('error', `http ${req.method} ${req.url}: ${(e as Error).stack ?? String(e)}`);
      if (!res.headersSent) res.writeHead(500, { 'content-type': 'application/json' });
      res.end();
    });
  });

  async function serveHttp(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const declared = Number(req.headers['content-length'] ?? '0');
    if (declared > o.maxBodyBytes) {
      writeError(res, new MeshError('MESH_ERR_TOO_LARGE', `body of ${declared} bytes is over ${o.maxBodyBytes}`));
      req.destroy();
      return;
    }
    // Plain 'data' events: cheaper per request than async iteration, and this runs once per hop per token.
    const buf = await new Promise<Buffer | null>((resolve, reject) => {
      const chunks: Buffer[] = [];
      let n = 0;
      req.on('data', (c: Buffer) => {
        n += c.byteLength;
        if (n > o.maxBodyBytes) {
          writeError(res, new MeshError('MESH_ERR_TOO_LARGE', `body is over ${o.maxBodyBytes} bytes`));
          req.destroy();
          resolve(null);
          return;
        }
        chunks.push(c);
      });
      req.on('end', () => resolve(chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks, n)));
      req.on('error', reject);
    });
    if (buf === null) return;
    const ac = new AbortController();
    res.on('close', () => {
      if (!res.writableFinished) ac.abort(new Error('client went away'));
    });
    const mreq: MeshRequest = {
      method: req.method ?? 'GET',
      path: req.url ?? '/',
      headers: normalizeHeaders(req.headers as Record<string, unknown>),
      body: new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength),
      signal: ac.signal,
    };
    const r = await o.http(mreq);
    if (r.body instanceof Uint8Array) {
      res.writeHead(r.status, { ...r.headers, 'content-length': String(r.body.byteLength) });
      res.end(r.body);
      return;
    }
    res.writeHead(r.status, r.headers);
    for await (const chunk of r.body) {
      if (ac.signal.aborted) break;
      if (!res.write(chunk)) await Promise.race([once(res, 'drain'), once(res, 'close')]);
    }
    res.end();
  }

  // Direct links: the fast path's frames from callers that can reach this endpoint.
  const linkServer = new WebSocketServer({ noServer: true, maxPayload: o.maxBodyBytes + 64 * 1024, perMessageDeflate: false });
  const accepted = new Set<AcceptedLink>();
  server.on('upgrade', (req, socket, head) => {
    if (!o.links || (req.url ?? '').split('?')[0] !== LINK_PATH) {
      socket.end('HTTP/1.1 404 Not Found\r\nconnection: close\r\ncontent-length: 0\r\n\r\n');
      return;
    }
    linkServer.handleUpgrade(req, socket, head, (ws) => {
      const link = acceptLink(ws as unknown as Parameters<typeof acceptLink>[0], {
        identity: o.identity,
        handler: o.link,
        onOpen: o.onLinkOpen,
        options: { maxMessageBytes: o.maxBodyBytes + 64 * 1024, ...o.linkOptions },
        ...(o.linkRegisterTimeoutMs !== undefined ? { registerTimeoutMs: o.linkRegisterTimeoutMs } : {}),
        onLog: (e) => {
          if (e.level === 'warn' || e.level === 'error') o.log(e.level, `link: ${e.event}: ${e.message}`);
        },
      });
      accepted.add(link);
      void link.closed.then(() => accepted.delete(link));
    });
  });
  server.listen(o.port, o.host);
  await once(server, 'listening');
  const port = (server.address() as AddressInfo).port;
  const endpoint = `http://${o.publicHost ?? (o.host === '0.0.0.0' || o.host === '::' ? '127.0.0.1' : o.host)}:${port}`;
  return {
    port,
    endpoint,
    links: accepted,
    async close() {
      for (const l of accepted) l.close();
      linkServer.close();
      server.closeAllConnections();
      await new Promise<void>((r) => server.close(() => r()));
    },
  };
}
