/**
 * A local stand-in for the Hugging Face hub, on two origins (two ports) like
 * the real one: the hub answers /api/models/ORG/REPO/revision/REV and
 * /ORG/REPO/resolve/REV/FILE (small files directly with X-Repo-Commit,
 * .safetensors with a 302 to the CDN origin, as LFS files are), the CDN
 * serves bytes with Range. Gated repos answer 401 without the right Bearer
 * token; unknown repo, revision or file answer 404 with the hub's
 * X-Error-Code; a file can be set to be cut mid-body. Every request is
 * logged with its Range and Authorization headers, per origin.
 */
import { createHash } from 'node:crypto';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';

export interface MimicRepo {
  files: Map<string, Uint8Array>;
  /** Branch/tag → commit sha; "main" always exists. */
  refs?: Record<string, string>;
  /** 401 unless `Authorization: Bearer <token>` with this token. */
  gatedToken?: string;
  /** Answer 404 on /api/ (a mirror that serves files only): the commit comes from X-Repo-Commit. */
  noApi?: boolean;
}

export interface MimicRequest {
  origin: 'hub' | 'cdn';
  method: string;
  path: string;
  range: string | null;
  authorization: string | null;
  /** User-Agent: tells a browser node's requests from Node's. */
  userAgent: string;
  status: number;
}

export interface HubMimic {
  /** HF_ENDPOINT for clients. */
  endpoint: string;
  cdnOrigin: string;
  log: MimicRequest[];
  /** Commit sha of `repo` at `ref` ("main" by default). */
  sha(repo: string, ref?: string): string;
  /** Cut the CDN's responses for this repo file after half of the body (Content-Length still promises all). */
  truncate(repo: string, file: string, on: boolean): void;
  /** Send half of the body, then nothing, keeping the connection open. */
  stall(repo: string, file: string, on: boolean): void;
  close(): Promise<void>;
}

const shaOf = (s: string) => createHash('sha1').update(s).digest('hex');

async function listen(server: Server): Promise<string> {
  // Longer than any pause in a test: a client reusing a socket the server just timed out sees ECONNRESET.
  server.keepAliveTimeout = 120_000;
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

/** CORS as the hub serves it (browser nodes fetch cross-origin); true when the request was a preflight, answered here. */
function cors(req: IncomingMessage, res: ServerResponse): boolean {
  res.setHeader('Access-Control-Allow-Origin', '*');
  res.setHeader('Access-Control-Expose-Headers', 'Content-Range, Content-Length, X-Repo-Commit, X-Linked-Size, X-Error-Code, ETag');
  // Cross-origin isolated pages (COEP require-corp) also accept it by CORP.
  res.setHeader('Cross-Origin-Resource-Policy', 'cross-origin');
  if (req.method !== 'OPTIONS') return false;
  res.setHeader('Access-Control-Allow-Methods', 'GET, HEAD, OPTIONS');
  res.setHeader('Access-Control-Allow-Headers', 'Range, Authorization, Content-Type');
  res.statusCode = 204;
  res.end();
  return true;
}

export async function startHubMimic(repos: Record<string, MimicRepo>): Promise<HubMimic> {
  const log: MimicRequest[] = [];
  const cut = new Set<string>();
  const stalls = new Set<string>();
  const refs = new Map<string, Record<string, string>>();
  for (const [id, r] of Object.entries(repos)) refs.set(id, { main: shaOf(`${id}@main`), ...r.refs });
  const repoAt = (id: string, rev: string): string | null => {
    const r = refs.get(id);
    if (!r) return null;
    if (r[rev]) return r[rev]!;
    return Object.values(r).includes(rev) ? rev : null;
  };

  const record = (origin: 'hub' | 'cdn', req: IncomingMessage, res: ServerResponse, status: number) => {
    log.push({ origin, method: req.method ?? 'GET', path: req.url ?? '', range: req.headers.range ?? null, authorization: req.headers.authorization ?? null, userAgent: req.headers['user-agent'] ?? '', status });
    res.statusCode = status;
  };
  const notFound = (origin: 'hub' | 'cdn', req: IncomingMessage, res: ServerResponse, code: string, message: string) => {
    record(origin, req, res, 404);
    res.setHeader('X-Error-Code', code);
    res.setHeader('Content-Type', 'application/json');
    res.end(JSON.stringify({ error: message }));
  };

  let cdnOrigin = '';
  const hub = createServer((req, res) => {
    if (cors(req, res)) return;
    const path = decodeURIComponent((req.url ?? '/').split('?')[0]!);
    const api = /^\/api\/models\/([^/]+\/[^/]+)\/revision\/([^/]+)$/.exec(path);
    const resolve = /^\/([^/]+\/[^/]+)\/resolve\/([^/]+)\/(.+)$/.exec(path);
    const id = api?.[1] ?? resolve?.[1];
    const repo = id ? repos[id] : undefined;
    if (!id || (!api && !resolve)) return notFound('hub', req, res, 'EntryNotFound', 'no such route');
    // Like the hub: a gated or private repo answers 401 before anything about its contents.
    if (repo?.gatedToken !== undefined && req.headers.authorization !== `Bearer ${repo.gatedToken}`) {
      record('hub', req, res, 401);
      res.setHeader('X-Error-Code', 'GatedRepo');
      return res.end(JSON.stringify({ error: `Access to model ${id} is restricted. You must have access to it and be authenticated to access it. Please log in.` }));
    }
    if (!repo) {
      // The real hub says 401 for an unknown repo without a token; with one, 404.
      if (!req.headers.authorization) {
        record('hub', req, res, 401);
        res.setHeader('X-Error-Code', 'RepoNotFound');
        return res.end(JSON.stringify({ error: 'Repository not found' }));
      }
      return notFound('hub', req, res, 'RepoNotFound', 'Repository not found');
    }
    const rev = (api?.[2] ?? resolve?.[2])!;
    const sha = repoAt(id, rev);
    if (!sha) return notFound('hub', req, res, 'RevisionNotFound', `Invalid rev id: ${rev}`);
    if (api && repo.noApi) return notFound('hub', req, res, 'EntryNotFound', 'no API here');
    if (api) {
      record('hub', req, res, 200);
      res.setHeader('Content-Type', 'application/json');
      return res.end(JSON.stringify({ id, modelId: id, sha, private: false, gated: repo.gatedToken !== undefined ? 'manual' : false }));
    }
    const file = resolve![3]!;
    const bytes = repo.files.get(file);
    if (!bytes) return notFound('hub', req, res, 'EntryNotFound', `${file} does not exist on "${rev}"`);
    res.setHeader('X-Repo-Commit', sha);
    if (file.endsWith('.safetensors')) {
      record('hub', req, res, 302);
      res.setHeader('X-Linked-Size', String(bytes.byteLength));
      res.setHeader('Location', `${cdnOrigin}/repos/${encodeURIComponent(id)}/${sha}/${encodeURIComponent(file)}?X-Amz-Signature=${shaOf(file).slice(0, 16)}`);
      return res.end();
    }
    record('hub', req, res, 200);
    res.setHeader('Content-Length', String(bytes.byteLength));
    res.end(req.method === 'HEAD' ? undefined : bytes);
  });

  const cdn = createServer((req, res) => {
    if (cors(req, res)) return;
    const m = /^\/repos\/([^/]+)\/([0-9a-f]{40})\/([^/?]+)/.exec(req.url ?? '');
    const id = m ? decodeURIComponent(m[1]!) : '';
    const file = m ? decodeURIComponent(m[3]!) : '';
    const bytes = repos[id]?.files.get(file);
    if (!m || !bytes) return notFound('cdn', req, res, 'EntryNotFound', 'no such object');
    let start = 0;
    let end = bytes.byteLength;
    const range = req.headers.range;
    let status = 200;
    if (range) {
      const r = /^bytes=(\d+)-(\d*)$/.exec(range);
      if (!r || Number(r[1]) >= bytes.byteLength) {
        record('cdn', req, res, 416);
        res.setHeader('Content-Range', `bytes */${bytes.byteLength}`);
        return res.end();
      }
      start = Number(r[1]);
      end = r[2] ? Math.min(bytes.byteLength, Number(r[2]) + 1) : bytes.byteLength;
      status = 206;
      res.setHeader('Content-Range', `bytes ${start}-${end - 1}/${bytes.byteLength}`);
    }
    record('cdn', req, res, status);
    res.setHeader('Accept-Ranges', 'bytes');
    res.setHeader('Content-Length', String(end - start));
    if (req.method === 'HEAD') return res.end();
    const body = bytes.subarray(start, end);
    if (stalls.has(`${id}/${file}`)) {
      res.flushHeaders();
      res.write(body.subarray(0, Math.floor(body.byteLength / 2)));
      return;
    }
    if (cut.has(`${id}/${file}`)) {
      // Promise every byte, send half, hang up.
      res.flushHeaders();
      res.write(body.subarray(0, Math.floor(body.byteLength / 2)), () => res.destroy());
      return;
    }
    res.end(body);
  });

  const endpoint = await listen(hub);
  cdnOrigin = await listen(cdn);
  return {
    endpoint,
    cdnOrigin,
    log,
    sha(repo, ref = 'main') {
      const s = repoAt(repo, ref);
      if (!s) throw new Error(`mimic: no ${repo}@${ref}`);
      return s;
    },
    truncate(repo, file, on) {
      if (on) cut.add(`${repo}/${file}`);
      else cut.delete(`${repo}/${file}`);
    },
    stall(repo, file, on) {
      if (on) stalls.add(`${repo}/${file}`);
      else stalls.delete(`${repo}/${file}`);
    },
    async close() {
      for (const s of [hub, cdn]) {
        s.closeAllConnections();
        await new Promise<void>((resolve) => s.close(() => resolve()));
      }
    },
  };
}
