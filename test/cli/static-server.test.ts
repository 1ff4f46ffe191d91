import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { mkdtemp, mkdir, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseRange, startStaticServer } from '../../src/cli/static-server.ts';
import type { StaticServer } from '../../src/cli/static-server.ts';

const body = Uint8Array.from({ length: 1000 }, (_, i) => i % 251);

describe('static server', () => {
  let dir: string;
  let s: StaticServer;

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'meshnet-static-'));
    await writeFile(join(dir, 'data.bin'), body);
    await writeFile(join(dir, 'index.html'), '<!doctype html><p>hi</p>');
    await mkdir(join(dir, 'sub'));
    for (const ext of ['js', 'mjs', 'wasm', 'json', 'css', 'svg', 'png', 'webmanifest']) await writeFile(join(dir, 'sub', `f.${ext}`), 'x');
    s = await startStaticServer({ root: dir });
  });
  afterAll(async () => {
    await s.close();
    await rm(dir, { recursive: true, force: true });
  });

  const get = (path: string, headers: Record<string, string> = {}, method = 'GET'): Promise<Response> => fetch(s.url + path, { headers, method });

  it('serves whole files with isolation and CORS headers', async () => {
    const r = await get('/data.bin');
    expect(r.status).toBe(200);
    expect(new Uint8Array(await r.arrayBuffer())).toEqual(body);
    expect(r.headers.get('accept-ranges')).toBe('bytes');
    expect(r.headers.get('access-control-allow-origin')).toBe('*');
    expect(r.headers.get('access-control-expose-headers')).toMatch(/Content-Range/);
    expect(r.headers.get('cross-origin-opener-policy')).toBe('same-origin');
    expect(r.headers.get('cross-origin-embedder-policy')).toBe('require-corp');
    expect(r.headers.get('cross-origin-resource-policy')).toBe('cross-origin');
    const pre = await get('/data.bin', { 'Access-Control-Request-Headers': 'range' }, 'OPTIONS');
    expect(pre.status).toBe(204);
    expect(pre.headers.get('access-control-allow-headers')).toMatch(/Range/);
  });

  it('answers single ranges with 206 and Content-Range', async () => {
    const cases: Array<[string, number, number]> = [['bytes=10-19', 10, 19], ['bytes=990-', 990, 999], ['bytes=-5', 995, 999], ['bytes=995-5000', 995, 999], ['bytes=0-0', 0, 0]];
    for (const [range, a, b] of cases) {
      const r = await get('/data.bin', { Range: range });
      expect(r.status).toBe(206);
      expect(r.headers.get('content-range')).toBe(`bytes ${a}-${b}/1000`);
      expect(r.headers.get('content-length')).toBe(String(b - a + 1));
      expect(new Uint8Array(await r.arrayBuffer())).toEqual(body.slice(a, b + 1));
    }
  });

  it('416 when unsatisfiable', async () => {
    const r = await get('/data.bin', { Range: 'bytes=1000-1001' });
    expect(r.status).toBe(416);
    expect(r.headers.get('content-range')).toBe('bytes */1000');
    expect((await get('/data.bin', { Range: 'bytes=-0' })).status).toBe(416);
  });

  it('HEAD sends headers and no body; counters count body bytes per path', async () => {
    s.resetStats();
    const h = await get('/data.bin', {}, 'HEAD');
    expect(h.status).toBe(200);
    expect(h.headers.get('content-length')).toBe('1000');
    expect(s.stats.bytesSent).toBe(0);
    await (await get('/data.bin', { Range: 'bytes=100-199' })).arrayBuffer();
    await (await get('/index.html')).arrayBuffer();
    expect(s.stats.requests).toBe(3);
    expect(s.stats.bytesByPath.get('/data.bin')).toBe(100);
    expect(s.stats.bytesSent).toBe(100 + 24);
  });

  it('content types, directory index, 404 and no escaping the root', async () => {
    const want: Record<string, string> = { js: 'text/javascript', mjs: 'text/javascript', wasm: 'application/wasm', json: 'application/json', css: 'text/css', svg: 'image/svg+xml', png: 'image/png', webmanifest: 'application/manifest+json' };
    for (const [ext, type] of Object.entries(want)) expect((await get(`/sub/f.${ext}`)).headers.get('content-type')).toMatch(type);
    expect(await (await get('/')).text()).toMatch(/hi/);
    expect((await get('/missing')).status).toBe(404);
    expect((await get('/..%2f..%2fetc%2fpasswd')).status).toBeGreaterThanOrEqual(403);
  });

  it('can cut a response mid-body', async () => {
    s.setAbort({ path: '/data.bin', afterBytes: 300, times: 1 });
    const r = await get('/data.bin');
    await expect(r.arrayBuffer()).rejects.toThrow();
    expect(new Uint8Array(await (await get('/data.bin')).arrayBuffer())).toEqual(body);
  });

  it('parseRange edge cases', () => {
    expect(parseRange('bytes=5-2', 10)).toBeNull();
    expect(parseRange('bytes=0-1,4-5', 10)).toBeNull();
    expect(parseRange('items=0-1', 10)).toBeNull();
    expect(parseRange('bytes=-20', 10)).toEqual([0, 9]);
    expect(parseRange('bytes=0-', 0)).toBe('unsatisfiable');
  });
});
