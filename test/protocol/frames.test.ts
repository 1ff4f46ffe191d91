import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { decodeBase64, encodeBase64, encodeBase64Url } from '../../src/protocol/base64.ts';
import { MeshError } from '../../src/protocol/errors.ts';
import {
  FLAG_END,
  FrameError,
  FrameKind,
  METHODS,
  STATIC_HEADERS,
  decodeFrame,
  encodeCancelFrame,
  encodeDataFrame,
  encodeErrorFrame,
  encodeRequestFrame,
  encodeResponseFrame,
  readFrameHead,
  requestBodyBytes,
  requestPeerId,
} from '../../src/protocol/frames.ts';

const headerName = fc.oneof(fc.constantFrom(...STATIC_HEADERS), fc.stringMatching(/^x-[a-z0-9-]{1,40}$/));
const headers = fc.dictionary(headerName, fc.string({ maxLength: 40 }), { maxKeys: 8 });
const bytes = fc.uint8Array({ maxLength: 300 });
const u32 = fc.integer({ min: 0, max: 0xffffffff });

describe('frame codec', () => {
  it('round-trips REQUEST frames', () => {
    fc.assert(fc.property(u32, fc.uint8Array({ minLength: 16, maxLength: 16 }), fc.constantFrom(...METHODS), fc.string({ minLength: 1, maxLength: 60 }), headers, bytes, (streamId, peerId, method, path, h, body) => {
      const f = decodeFrame(encodeRequestFrame({ streamId, peerId, method, path, headers: h, body }));
      expect(f).toMatchObject({ kind: FrameKind.Request, streamId, method, path, headers: h, flags: FLAG_END });
      if (f.kind !== FrameKind.Request) throw new Error('kind');
      expect(Array.from(f.peerId)).toEqual(Array.from(peerId));
      expect(Array.from(f.body)).toEqual(Array.from(body));
    }));
  });
  it('round-trips RESPONSE, DATA and CANCEL frames', () => {
    fc.assert(fc.property(u32, fc.integer({ min: 100, max: 599 }), headers, bytes, fc.boolean(), (streamId, status, h, body, end) => {
      expect(decodeFrame(encodeResponseFrame({ streamId, status, headers: h, body, end }))).toMatchObject({ kind: FrameKind.Response, streamId, status, headers: h, flags: end ? FLAG_END : 0 });
      const d = decodeFrame(encodeDataFrame(streamId, body, end));
      expect(d).toMatchObject({ kind: FrameKind.Data, streamId, flags: end ? FLAG_END : 0 });
      expect(decodeFrame(encodeCancelFrame(streamId))).toMatchObject({ kind: FrameKind.Cancel, streamId });
    }));
  });
  it('round-trips any Unicode in paths and header values, long ones and mixed-case names included', () => {
    const text = fc.string({ unit: 'grapheme', maxLength: 300 });
    const names = fc.oneof(headerName, fc.stringMatching(/^X-[A-Za-z0-9-]{1,40}$/), fc.string({ unit: 'grapheme', minLength: 1, maxLength: 20 }).filter((n) => new TextEncoder().encode(n.toLowerCase()).byteLength <= 127));
    fc.assert(fc.property(fc.string({ unit: 'grapheme', minLength: 1, maxLength: 400 }), fc.dictionary(names, text, { maxKeys: 6 }), bytes, (path, h, body) => {
      const lower = Object.fromEntries(Object.entries(h).map(([k, v]) => [k.toLowerCase(), v]));
      fc.pre(Object.keys(lower).length === Object.keys(h).length);
      const f = decodeFrame(encodeRequestFrame({ streamId: 5, peerId: new Uint8Array(16), method: 'put', path, headers: h, body }));
      expect(f).toMatchObject({ kind: FrameKind.Request, method: 'PUT', path, headers: lower });
      const r = decodeFrame(encodeResponseFrame({ streamId: 5, status: 201, headers: h, body }));
      expect(r).toMatchObject({ kind: FrameKind.Response, status: 201, headers: lower });
      if (r.kind !== FrameKind.Response) throw new Error('kind');
      expect(Array.from(r.body)).toEqual(Array.from(body));
    }));
  });
  it('keeps a header named __proto__ as a header (seed 1539088431 found it dropped)', () => {
    const headers = JSON.parse('{"__proto__":"x","a":"b"}') as Record<string, string>;
    const f = decodeFrame(encodeRequestFrame({ streamId: 1, peerId: new Uint8Array(16), method: 'GET', path: '/', headers }));
    if (f.kind !== FrameKind.Request) throw new Error('kind');
    expect(Object.entries(f.headers)).toEqual([['__proto__', 'x'], ['a', 'b']]);
    expect(Object.getPrototypeOf(f.headers)).toBe(Object.prototype);
  });
  it('costs ≤ 64 bytes over the payload for a forward hop (incl. a 8-byte masked WebSocket header)', () => {
    const body = new Uint8Array(8192);
    const req = encodeRequestFrame({ streamId: 1, peerId: new Uint8Array(16), method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': '1,1,4096', 'x-meshnet-dtype': 'bf16' }, body });
    const res = encodeResponseFrame({ streamId: 1, status: 200, headers: { 'x-meshnet-shape': '1,1,4096', 'x-meshnet-dtype': 'bf16' }, body });
    expect(req.byteLength - body.byteLength + 8).toBeLessThanOrEqual(64);
    expect(res.byteLength - body.byteLength + 4).toBeLessThanOrEqual(64);
    expect(requestBodyBytes(req)).toBe(8192);
  });
  it('reads the fixed head and peer id without parsing the rest', () => {
    const peerId = new Uint8Array(16).fill(7);
    const f = encodeRequestFrame({ streamId: 0x01020304, peerId, method: 'GET', path: '/health' });
    expect(readFrameHead(f)).toEqual({ version: 1, kind: 1, flags: FLAG_END, streamId: 0x01020304 });
    expect(Array.from(requestPeerId(f))).toEqual(Array.from(peerId));
  });
  it('decodes error frames into {error:{code,message}} with the code\'s status', () => {
    const f = decodeFrame(encodeErrorFrame(9, new MeshError('MESH_ERR_TIMEOUT', 'slow')));
    if (f.kind !== FrameKind.Response) throw new Error('kind');
    expect(f.status).toBe(504);
    expect(JSON.parse(new TextDecoder().decode(f.body))).toEqual({ error: { code: 'MESH_ERR_TIMEOUT', message: 'slow' } });
  });
  it('throws only FrameError on random and truncated input, with the stream id when readable', () => {
    fc.assert(fc.property(fc.uint8Array({ maxLength: 64 }), (b) => {
      try {
        decodeFrame(b);
      } catch (e) {
        expect(e).toBeInstanceOf(FrameError);
        if (b.byteLength >= 8) expect((e as FrameError).streamId).not.toBeNull();
      }
    }), { numRuns: 5000 });
    const good = encodeRequestFrame({ streamId: 5, peerId: new Uint8Array(16), method: 'POST', path: '/forward', headers: { a: 'b', 'x-meshnet-shape': '1,2,3' } });
    for (let cut = 0; cut < good.byteLength - 1; cut++) {
      // cutting into the meta must fail; cutting only the body cannot be detected (there is none)
      if (cut < 26 + (good[24]! | (good[25]! << 8))) expect(() => decodeFrame(good.subarray(0, cut))).toThrow(FrameError);
    }
  });
  it('refuses unknown versions, kinds, methods and out-of-range statuses', () => {
    const f = encodeCancelFrame(1);
    f[0] = 2;
    expect(() => decodeFrame(f)).toThrow(/version 2/);
    const k = encodeCancelFrame(1);
    k[1] = 9;
    expect(() => decodeFrame(k)).toThrow(/kind 9/);
    expect(() => encodeRequestFrame({ streamId: 1, peerId: new Uint8Array(16), method: 'BREW', path: '/' })).toThrow(/method/);
    const r = encodeResponseFrame({ streamId: 1, status: 200 });
    r[8] = 0xff;
    r[9] = 0xff;
    expect(() => decodeFrame(r)).toThrow(/status/);
  });
});

describe('base64', () => {
  it('matches Node\'s encoder and round-trips', () => {
    fc.assert(fc.property(fc.uint8Array({ maxLength: 500 }), (b) => {
      const s = encodeBase64(b);
      expect(s).toBe(Buffer.from(b).toString('base64'));
      expect(Array.from(decodeBase64(s))).toEqual(Array.from(b));
      expect(Array.from(decodeBase64(encodeBase64Url(b)))).toEqual(Array.from(b));
    }));
  });
  it('rejects invalid characters and lengths', () => {
    expect(() => decodeBase64('ab$d')).toThrow(SyntaxError);
    expect(() => decodeBase64('abcde')).toThrow(SyntaxError);
  });
});
