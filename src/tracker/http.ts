/**
 * A small fetch-style app: `app.fetch(Request) → Response`, so tests call the
 * tracker without a socket (`app.request('/v1/models')`, as in Hono) and the
 * same app serves Node's http server (serveApp), or requests arriving over
 * the relay. Errors thrown by handlers become JSON error bodies; the process
 * keeps serving.
 */
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { MeshError } from '../protocol/errors.ts';

export interface RouteContext {
  req: Request;
  url: URL;
  params: Record<string, string>;
}

export type Handler = (ctx: RouteContext) => Response | Promise<Response>;

/** An error that already knows its HTTP answer (OpenAI-shaped or mesh-shaped). */
export class HttpError extends Error {
  constructor(
    readonly status: number,
    readonly body: unknown,
    /** Extra response headers (Retry-After on a 429). */
    readonly headers: Record<string, string> = {},
  ) {
    super(typeof body === 'object' && body !== null && 'error' in body ? String((body as { error: { message?: unknown } }).error.message) : `HTTP ${status}`);
  }
}

export function json(status: number, body: unknown, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'content-type': 'application/json', ...headers } });
}

const SOURCE = Symbol('meshnet.bodySource');

/**
 * A streamed answer whose chunks come from `source` (SSE). To app.fetch's
 * callers it is an ordinary Response with a ReadableStream body; the hosts
 * in this process (serveApp, the relay bridge) take the chunks from the
 * source itself (bodySource): one await per chunk instead of a web stream's
 * pull, enqueue and read, which at many chats the tracker pays per token per
 * chat. Read one way or the other, never both; the stream's highWaterMark 0
 * keeps it from pulling before it is read. `onCancel`: what a cancelled
 * stream must stop at once (the hosts stop the producer through the
 * request's signal).
 */
export function streamResponse(source: AsyncGenerator<Uint8Array>, init: ResponseInit, onCancel?: () => void): Response {
  const body = new ReadableStream<Uint8Array>(
    {
      async pull(controller) {
        const r = await source.next();
        if (r.done) controller.close();
        else controller.enqueue(r.value);
      },
      async cancel() {
        // At once: return() waits for a next() in progress (the next token, or a silent head's timeout).
        onCancel?.();
        await source.return(undefined);
      },
    },
    { highWaterMark: 0 },
  );
  return Object.assign(new Response(body, init), { [SOURCE]: source });
}

/** The chunk source of a streamResponse answer; undefined for any other Response. */
export function bodySource(res: Response): AsyncGenerator<Uint8Array> | undefined {
  return (res as Response & { [SOURCE]?: AsyncGenerator<Uint8Array> })[SOURCE];
}

/** A mesh error as its JSON answer; one that says when to come back (`retry_after_ms`) also says it in Retry-After. */
export function meshErrorResponse(e: MeshError): Response {
  const retry = e.details.retry_after_ms;
  const headers: Record<string, string> = typeof retry === 'number' && retry >= 0 ? { 'retry-after': String(Math.max(1, Math.ceil(retry / 1000))), 'retry-after-ms': String(Math.round(retry)) } : {};
  return json(e.status, e.toBody(), headers);
}

interface Route {
  method: string;
  parts: string[];
  handler: Handler;
}

export class App {
  private readonly routes: Route[] = [];
  onError: (err: unknown, req: Request) => Response = (err) => {
    if (err instanceof HttpError) return json(err.status, err.body, err.headers);
    if (err instanceof MeshError) return meshErrorResponse(err);
    return meshErrorResponse(new MeshError('MESH_ERR_INTERNAL', 'internal error; the tracker keeps serving'));
  };

  on(method: string, path: string, handler: Handler): this {
    this.routes.push({ method, parts: path.split('/').filter(Boolean), handler });
    return this;
  }
  get(path: string, handler: Handler): this {
    return this.on('GET', path, handler);
  }
  post(path: string, handler: Handler): this {
    return this.on('POST', path, handler);
  }

  readonly fetch = async (req: Request): Promise<Response> => {
    const url = new URL(req.url);
    const parts = url.pathname.split('/').filter(Boolean);
    let pathMatched = false;
    for (const r of this.routes) {
      const params = match(r.parts, parts);
      if (!params) continue;
      pathMatched = true;
      if (r.method !== req.method && !(r.method === 'GET' && req.method === 'HEAD')) continue;
      try {
        return await r.handler({ req, url, params });
      } catch (err) {
        return this.onError(err, req);
      }
    }
    if (pathMatched) return meshErrorResponse(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', `${req.method} is not allowed on ${url.pathname}`));
    return meshErrorResponse(new MeshError('MESH_ERR_NOT_FOUND', `no route ${req.method} ${url.pathname}`));
  };

  /** Test helper: `app.request('/path', init)`. */
  request(path: string, init?: RequestInit): Promise<Response> {
    return this.fetch(new Request(new URL(path, 'http://tracker.local'), init));
  }
}

function match(pattern: string[], parts: string[]): Record<string, string> | null {
  if (pattern.length !== parts.length) return null;
  const params: Record<string, string> = {};
  for (let i = 0; i < pattern.length; i++) {
    const p = pattern[i]!;
    if (p.startsWith(':')) params[p.slice(1)] = decodeURIComponent(parts[i]!);
    else if (p !== parts[i]) return null;
  }
  return params;
}

/** Read a JSON body, bounded. Throws MeshError 400/413. */
export async function readJson(req: Request, maxBytes: number): Promise<unknown> {
  const len = Number(req.headers.get('content-length') ?? '0');
  if (len > maxBytes) throw new MeshError('MESH_ERR_TOO_LARGE', `body is ${len} bytes, the limit is ${maxBytes}`);
  const buf = new Uint8Array(await req.arrayBuffer());
  if (buf.byteLength > maxBytes) throw new MeshError('MESH_ERR_TOO_LARGE', `body is ${buf.byteLength} bytes, the limit is ${maxBytes}`);
  try {
    return JSON.parse(new TextDecoder().decode(buf));
  } catch (e) {
    throw new MeshError('MESH_ERR_BAD_REQUEST', `body is not valid JSON (${(e as Error).message})`);
  }
}

// ---------------------------------------------------------------- Node http host

export interface ServedApp {
  server: Server;
  port: number;
  url: string;
  close(): Promise<void>;
}

/**
 * Requests answered on Node's own objects, skipping the web Request and
 * Response (by `METHOD /path`, the query ignored): for the few routes held
 * open by every node, where those objects are most of what a connection
 * costs (watch-hub.ts).
 */
export type NativeRoutes = Record<string, (req: IncomingMessage, res: ServerResponse) => void>;

/** Serve `fetchFn` on Node's http server; a client going away aborts the Request's signal (and so the generation). */
export async function serveApp(fetchFn: (req: Request) => Promise<Response>, port: number, host: string, maxBodyBytes: number, native: NativeRoutes = {}): Promise<ServedApp> {
  // Idle connections are kept past the longest heartbeat period handed out (60 s): clients honour the
  // server's Keep-Alive hint, so a node's next heartbeat reuses its connection instead of opening one
  // (with the default 5 s, equal to the heartbeat period, every beat was a new TCP connection).
  const server = createServer({ keepAliveTimeout: 65_000, headersTimeout: 70_000 }, (req, res) => {
    const own = native[`${req.method} ${(req.url ?? '/').split('?')[0]}`];
    if (own) own(req, res);
    else void handleNode(fetchFn, req, res, host, maxBodyBytes);
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host, () => resolve());
  });
  const addr = server.address() as AddressInfo;
  const shownHost = host === '0.0.0.0' || host === '::' ? '127.0.0.1' : host.includes(':') ? `[${host}]` : host;
  return {
    server,
    port: addr.port,
    url: `http://${shownHost}:${addr.port}`,
    close: () =>
      new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      }),
  };
}

const CORS_HEADERS = {
  'access-control-allow-origin': '*',
  'access-control-allow-methods': 'GET, POST, OPTIONS',
  'access-control-allow-headers': 'content-type, authorization',
};

async function handleNode(fetchFn: (req: Request) => Promise<Response>, req: IncomingMessage, res: ServerResponse, host: string, maxBodyBytes: number): Promise<void> {
  const abort = new AbortController();
  res.on('close', () => {
    if (!res.writableFinished) abort.abort();
  });
  try {
    const chunks: Buffer[] = [];
    let size = 0;
    let tooLarge = false;
    for await (const c of req as AsyncIterable<Buffer>) {
      size += c.length;
      if (size > maxBodyBytes * 2) {
        tooLarge = true;
        break;
      }
      chunks.push(c);
    }
    if (tooLarge) {
      const err = new MeshError('MESH_ERR_TOO_LARGE', `body over ${maxBodyBytes} bytes`);
      res.writeHead(err.status, { 'content-type': 'application/json', connection: 'close' });
      res.end(JSON.stringify(err.toBody()));
      return;
    }
    // Browser nodes (another origin: the donor page) register and heartbeat with fetch: answer CORS preflights.
    if (req.method === 'OPTIONS') {
      res.writeHead(204, { ...CORS_HEADERS, 'access-control-max-age': '600' });
      res.end();
      return;
    }
    const headers = new Headers();
    for (const [k, v] of Object.entries(req.headers)) if (typeof v === 'string') headers.set(k, v);
    else if (Array.isArray(v)) headers.set(k, v.join(', '));
    const method = req.method ?? 'GET';
    const body = method === 'GET' || method === 'HEAD' ? undefined : Buffer.concat(chunks);
    const request = new Request(`http://${req.headers.host ?? host}${req.url ?? '/'}`, { method, headers, body, signal: abort.signal });
    const response = await fetchFn(request);
    const outHeaders: Record<string, string> = { 'access-control-allow-origin': '*' };
    response.headers.forEach((v, k) => (outHeaders[k] = v));
    res.writeHead(response.status, outHeaders);
    if (!response.body || method === 'HEAD') {
      res.end();
      return;
    }
    const source = bodySource(response);
    if (source) {
      // The client going away aborts the request's signal, which the source's producer follows (completion.ts); return() ends it.
      for await (const value of source) {
        // A write to a closed response would wait for a 'drain' that never comes.
        if (abort.signal.aborted || res.destroyed) break;
        if (!res.write(value)) await new Promise<void>((r) => res.once('drain', r).once('close', r));
      }
      res.end();
      return;
    }
    const reader = response.body.getReader();
    abort.signal.addEventListener('abort', () => void reader.cancel().catch(() => {}), { once: true });
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      if (!res.write(value)) await new Promise<void>((r) => res.once('drain', r).once('close', r));
      if (abort.signal.aborted) break;
    }
    res.end();
  } catch {
    if (!res.headersSent) {
      const err = new MeshError('MESH_ERR_INTERNAL', 'internal error');
      res.writeHead(err.status, { 'content-type': 'application/json' });
      res.end(JSON.stringify(err.toBody()));
    } else res.destroy();
  }
}
