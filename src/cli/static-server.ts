/**
 * A static file server for tests, the demo and `meshnet` roles: Range
 * requests (what the model loader needs), CORS, and the COOP/COEP headers
 * that cross-origin isolation (SharedArrayBuffer, WASM threads) requires.
 * Counts body bytes so tests can prove a node fetched only its layers.
 */
import { createServer } from 'node:http';
import type { IncomingMessage, ServerResponse } from 'node:http';
import { open, stat } from 'node:fs/promises';
import { extname, resolve, sep } from 'node:path';
import type { AddressInfo } from 'node:net';

const CONTENT_TYPES: Record<string, string> = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript; charset=utf-8',
  '.mjs': 'text/javascript; charset=utf-8',
  '.wasm': 'application/wasm',
  '.json': 'application/json; charset=utf-8',
  '.css': 'text/css; charset=utf-8',
  '.svg': 'image/svg+xml',
  '.png': 'image/png',
  '.webmanifest': 'application/manifest+json',
  '.txt': 'text/plain; charset=utf-8',
  '.onnx': 'application/octet-stream',
  '.safetensors': 'application/octet-stream',
};

export interface StaticServerStats {
  /** Body bytes written, all paths. */
  bytesSent: number;
  requests: number;
  /** Body bytes written per URL path. */
  bytesByPath: Map<string, number>;
  /** Range header of each request (null when absent), in order. */
  ranges: Array<{ path: string; range: string | null; status: number }>;
}

export interface AbortRule {
  /** Path (as requested, e.g. "/model.safetensors") whose body should be cut. */
  path: string;
  /** Destroy the socket after this many body bytes of the response. */
  afterBytes: number;
  /** How many responses to cut; default every one. */
  times?: number;
}

export interface StaticServer {
  url: string;
  port: number;
  stats: StaticServerStats;
  resetStats(): void;
  /** Cut matching responses mid-body (e.g. "model server killed mid-download"); null clears. */
  setAbort(rule: AbortRule | null): void;
  /** Serve 200 with the whole file even when a Range is asked (servers that ignore Range). */
  setIgnoreRange(ignore: boolean): void;
  close(): Promise<void>;
}

export interface StaticServerOptions {
  root: string;
  port?: number;
  host?: string;
}

function newStats(): StaticServerStats {
  return { bytesSent: 0, requests: 0, bytesByPath: new Map(), ranges: [] };
}

/** Parse one `bytes=` range against `size`: [start, end] inclusive, 'unsatisfiable', or null to ignore. */
export function parseRange(header: string, size: number): [number, number] | 'unsatisfiable' | null {
  const m = /^bytes=(\d*)-(\d*)$/.exec(header.trim());
  // Multi-range and malformed headers are ignored (RFC 9110 allows serving 200).
  if (!m || (m[1] === '' && m[2] === '')) return null;
  if (m[1] === '') {
    const n = Number(m[2]);
    if (n === 0 || size === 0) return 'unsatisfiable';
    return [Math.max(0, size - n), size - 1];
  }
  const start = Number(m[1]);
  const end = m[2] === '' ? size - 1 : Math.min(Number(m[2]), size - 1);
  if (m[2] !== '' && Number(m[2]) < start) return null;
  if (start >= size) return 'unsatisfiable';
  return [start, end];
}

export async function startStaticServer(opts: StaticServerOptions): Promise<StaticServer> {
  const root = resolve(opts.root);
  let stats = newStats();
  let abortRule: (AbortRule & { left: number }) | null = null;
  let ignoreRange = false;

  const count = (path: string, n: number): void => {
    stats.bytesSent += n;
    stats.bytesByPath.set(path, (stats.bytesByPath.get(path) ?? 0) + n);
  };

  const handle = async (req: IncomingMessage, res: ServerResponse): Promise<void> => {
    stats.requests++;
    res.setHeader('Access-Control-Allow-Origin', '*');
    res.setHeader('Access-Control-Allow-Methods', 'GET, HEAD, OPTIONS');
    res.setHeader('Access-Control-Allow-Headers', 'Range, Content-Type');
    res.setHeader('Access-Control-Expose-Headers', 'Content-Range, Content-Length, Accept-Ranges, ETag');
    res.setHeader('Cross-Origin-Opener-Policy', 'same-origin');
    res.setHeader('Cross-Origin-Embedder-Policy', 'require-corp');
    res.setHeader('Cross-Origin-Resource-Policy', 'cross-origin');
    const urlPath = decodeURIComponent(new URL(req.url ?? '/', 'http://x').pathname);
    const rangeHeader = req.headers.range ?? null;
    const record = (status: number): void => void stats.ranges.push({ path: urlPath, range: rangeHeader, status });

    if (req.method === 'OPTIONS') {
      res.writeHead(204).end();
      return record(204);
    }
    if (req.method !== 'GET' && req.method !== 'HEAD') {
      res.writeHead(405, { Allow: 'GET, HEAD, OPTIONS' }).end();
      return record(405);
    }
    let file = resolve(root, '.' + urlPath);
    if (file !== root && !file.startsWith(root + sep)) {
      res.writeHead(403).end();
      return record(403);
    }
    let info = await stat(file).catch(() => null);
    if (info?.isDirectory()) {
      file = resolve(file, 'index.html');
      info = await stat(file).catch(() => null);
    }
    if (!info || !info.isFile()) {
      res.writeHead(404, { 'Content-Type': 'text/plain' }).end('not found');
      return record(404);
    }
    const size = info.size;
    const headers: Record<string, string> = {
      'Content-Type': CONTENT_TYPES[extname(file).toLowerCase()] ?? 'application/octet-stream',
      'Accept-Ranges': 'bytes',
      'Last-Modified': info.mtime.toUTCString(),
      'Cache-Control': 'no-cache',
    };
    let start = 0;
    let end = size - 1;
    let status = 200;
    if (rangeHeader !== null && !ignoreRange) {
      const r = parseRange(rangeHeader, size);
      if (r === 'unsatisfiable') {
        res.writeHead(416, { ...headers, 'Content-Range': `bytes */${size}` }).end();
        return record(416);
      }
      if (r) {
        [start, end] = r;
        status = 206;
        headers['Content-Range'] = `bytes ${start}-${end}/${size}`;
      }
    }
    const length = Math.max(0, end - start + 1);
    headers['Content-Length'] = String(length);
    res.writeHead(status, headers);
    record(status);
    if (req.method === 'HEAD' || length === 0) {
      res.end();
      return;
    }
    let cutAfter = Infinity;
    if (abortRule && abortRule.path === urlPath && abortRule.left > 0) {
      abortRule.left--;
      cutAfter = abortRule.afterBytes;
    }
    if (cutAfter <= 0) {
      res.flushHeaders();
      await new Promise((ok) => setTimeout(ok, 20));
      res.destroy();
      return;
    }
    const fh = await open(file, 'r');
    try {
      const buf = Buffer.allocUnsafe(Math.min(256 * 1024, length));
      let pos = start;
      let sent = 0;
      while (pos <= end) {
        const want = Math.min(buf.byteLength, end + 1 - pos, cutAfter - sent);
        const { bytesRead } = await fh.read(buf, 0, want, pos);
        if (bytesRead === 0) break;
        const chunk = Buffer.from(buf.subarray(0, bytesRead));
        count(urlPath, bytesRead);
        sent += bytesRead;
        pos += bytesRead;
        if (sent >= cutAfter) {
          // Let the partial body reach the socket before killing it: destroy() drops unflushed writes.
          await new Promise<void>((ok) => res.write(chunk, () => ok()));
          await new Promise((ok) => setTimeout(ok, 20));
          res.destroy();
          return;
        }
        if (!res.write(chunk)) await new Promise<void>((ok) => res.once('drain', ok));
        if (res.destroyed) return;
      }
      res.end();
    } finally {
      await fh.close();
    }
  };

  const server = createServer((req, res) => {
    handle(req, res).catch((e: unknown) => {
      if (!res.headersSent) res.writeHead(500, { 'Content-Type': 'text/plain' }).end(String(e));
      else res.destroy();
    });
  });
  await new Promise<void>((ok, fail) => {
    server.once('error', fail);
    server.listen(opts.port ?? 0, opts.host ?? '127.0.0.1', () => ok());
  });
  const addr = server.address() as AddressInfo;
  const host = addr.family === 'IPv6' ? `[${addr.address}]` : addr.address;
  return {
    url: `http://${host}:${addr.port}`,
    port: addr.port,
    get stats() {
      return stats;
    },
    resetStats() {
      stats = newStats();
    },
    setAbort(rule) {
      abortRule = rule ? { ...rule, left: rule.times ?? Infinity } : null;
    },
    setIgnoreRange(ignore) {
      ignoreRange = ignore;
    },
    close: () =>
      new Promise<void>((ok) => {
        server.closeAllConnections();
        server.close(() => ok());
      }),
  };
}
