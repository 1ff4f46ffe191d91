/**
 * A Node.js node's disk cache of hub files. A URL pinned to a commit
 * (`ENDPOINT/ORG/REPO/resolve/SHA/FILE`) names immutable bytes, so the file
 * is fetched whole once, written to a temporary name, checked against its
 * Content-Length and renamed into `DIR/hub/ORG--REPO/SHA/FILE`; every later
 * request, Range included, is answered from disk (a restart, or a new span
 * of the same model, costs no download). Unpinned URLs (a branch name) and
 * URLs outside the hub pass through: their bytes may change.
 */
import { createReadStream, createWriteStream } from 'node:fs';
import { mkdir, rename, rm, stat } from 'node:fs/promises';
import { homedir } from 'node:os';
import { dirname, join, sep } from 'node:path';
import { Readable, Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import type { ReadableStream as WebReadableStream } from 'node:stream/web';
import { ModelFetchError } from '../../model/errors.ts';
import { isCommitSha, parseHubFileUrl } from '../../model/hub.ts';

/** `MESHNET_CACHE_DIR`, else `$XDG_CACHE_HOME/meshnet`, else `~/.cache/meshnet`. */
export function defaultCacheDir(env: Record<string, string | undefined> = process.env): string {
  if (env.MESHNET_CACHE_DIR) return env.MESHNET_CACHE_DIR;
  return join(env.XDG_CACHE_HOME || join(homedir(), '.cache'), 'meshnet');
}

/** Where a pinned hub file lives in the cache. */
export function cachePath(dir: string, repo: string, sha: string, file: string): string {
  const parts = file.split('/');
  if (parts.some((p) => p === '' || p === '.' || p === '..' || p.includes(sep) || p.includes('\\'))) throw new ModelFetchError(file, 'not a cacheable file name');
  return join(dir, 'hub', repo.replace('/', '--'), sha, ...parts);
}

function parseRange(h: string | null): [number, number | null] | null {
  if (!h) return null;
  const m = /^bytes=(\d+)-(\d*)$/.exec(h.trim());
  if (!m) return null;
  return [Number(m[1]), m[2] ? Number(m[2]) : null];
}

export interface HubCacheStats {
  /** Files downloaded into the cache. */
  downloads: number;
  /** Requests answered from disk. */
  hits: number;
}

/**
 * `fetchFn` (hubFetch: redirects, token, truncation check) with the cache in
 * front for pinned files under `endpoint`.
 */
export function cachingHubFetch(fetchFn: typeof fetch, o: { endpoint: string; dir: string; stats?: HubCacheStats }): typeof fetch {
  /** A non-OK answer, read once so that every waiter can get its own copy. */
  type Failed = { status: number; headers: Headers; text: string };
  const inflight = new Map<string, Promise<Failed | null>>();
  const stats = o.stats ?? { downloads: 0, hits: 0 };

  /** Download into `path`; null when done, else the non-OK answer to hand back (a 404 for an absent index.json is normal). */
  async function download(url: string, path: string, what: string): Promise<Failed | null> {
    const res = await fetchFn(url);
    if (!res.ok || !res.body) return { status: res.status, headers: res.headers, text: await res.text().catch(() => '') };
    const len = res.headers.get('content-length');
    const expected = len !== null && /^\d+$/.test(len) ? Number(len) : null;
    await mkdir(dirname(path), { recursive: true });
    const tmp = `${path}.${process.pid}-${Math.random().toString(36).slice(2)}.part`;
    let got = 0;
    const count = new Transform({
      transform(chunk: Buffer, _enc, cb) {
        got += chunk.byteLength;
        cb(null, chunk);
      },
    });
    try {
      await pipeline(Readable.fromWeb(res.body as WebReadableStream), count, createWriteStream(tmp));
      if (expected !== null && got !== expected) throw new ModelFetchError(what, `truncated: the server sent ${got} of ${expected} bytes`);
      await rename(tmp, path);
    } catch (e) {
      await rm(tmp, { force: true });
      if (e instanceof ModelFetchError) throw e;
      throw new ModelFetchError(what, `download failed after ${got} bytes: ${(e as Error).message}`);
    }
    stats.downloads++;
    return null;
  }

  const wrapped = async (input: RequestInfo | URL, init: RequestInit = {}): Promise<Response> => {
    const url = typeof input === 'string' ? input : input instanceof URL ? input.href : input.url;
    const hub = parseHubFileUrl(o.endpoint, url);
    const method = (init.method ?? 'GET').toUpperCase();
    if (!hub || !isCommitSha(hub.revision) || (method !== 'GET' && method !== 'HEAD')) return fetchFn(input, init);
    const path = cachePath(o.dir, hub.repo, hub.revision, hub.file);
    const what = `${hub.repo}@${hub.revision}/${hub.file}`;
    let size: number;
    try {
      size = (await stat(path)).size;
      stats.hits++;
    } catch {
      let p = inflight.get(path);
      if (!p) {
        p = download(url, path, what).finally(() => inflight.delete(path));
        inflight.set(path, p);
      }
      const failed = await p;
      if (failed) return new Response(failed.text, { status: failed.status, headers: failed.headers });
      size = (await stat(path)).size;
    }
    const range = parseRange(new Headers(init.headers).get('range'));
    const headers = new Headers({ 'accept-ranges': 'bytes', 'content-type': 'application/octet-stream' });
    if (!range) {
      headers.set('content-length', String(size));
      return new Response(method === 'HEAD' ? null : (Readable.toWeb(createReadStream(path)) as ReadableStream<Uint8Array>), { status: 200, headers });
    }
    const [start, endIncl] = range;
    if (start >= size) return new Response(null, { status: 416, headers: { 'content-range': `bytes */${size}` } });
    const last = Math.min(size - 1, endIncl ?? size - 1);
    headers.set('content-range', `bytes ${start}-${last}/${size}`);
    headers.set('content-length', String(last - start + 1));
    const body = method === 'HEAD' ? null : (Readable.toWeb(createReadStream(path, { start, end: last })) as ReadableStream<Uint8Array>);
    return new Response(body, { status: 206, headers });
  };
  return wrapped as typeof fetch;
}
