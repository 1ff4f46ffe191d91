/**
 * A `fetch` over an in-memory file map with single-range support, so loaders
 * can be tested (and fixtures served in a browser worker) without a server.
 */
export interface MemoryFetchStats {
  requests: number;
  bytesSent: number;
}

export function memoryFetch(files: ReadonlyMap<string, Uint8Array>, stats: MemoryFetchStats = { requests: 0, bytesSent: 0 }): typeof fetch {
  const fn = async (input: string | URL | Request, init?: RequestInit): Promise<Response> => {
    const url = typeof input === 'string' ? input : input instanceof URL ? input.href : input.url;
    init?.signal?.throwIfAborted();
    stats.requests++;
    const name = decodeURIComponent(url.replace(/[?#].*$/, '').split('/').pop() ?? '');
    const body = files.get(name);
    if (!body) return new Response('not found', { status: 404 });
    const range = new Headers(init?.headers).get('range');
    if (range === null) {
      stats.bytesSent += body.byteLength;
      return new Response(body.slice(), { status: 200, headers: { 'content-length': String(body.byteLength) } });
    }
    const m = /^bytes=(\d*)-(\d*)$/.exec(range.trim());
    if (!m || (m[1] === '' && m[2] === '')) return new Response('bad range', { status: 416 });
    const size = body.byteLength;
    let start: number;
    let end: number;
    if (m[1] === '') {
      start = Math.max(0, size - Number(m[2]));
      end = size - 1;
    } else {
      start = Number(m[1]);
      end = m[2] === '' ? size - 1 : Math.min(Number(m[2]), size - 1);
    }
    if (start >= size || end < start) return new Response(null, { status: 416, headers: { 'content-range': `bytes */${size}` } });
    stats.bytesSent += end + 1 - start;
    return new Response(body.slice(start, end + 1), {
      status: 206,
      headers: { 'content-range': `bytes ${start}-${end}/${size}`, 'content-length': String(end + 1 - start) },
    });
  };
  return fn as typeof fetch;
}
