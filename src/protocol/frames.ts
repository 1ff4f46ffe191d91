/**
 * The fast path's binary frames (docs/protocol.md §4).
 *
 *   0        1        2        3        4                8
 *   +--------+--------+--------+--------+----------------+
 *   |version | kind   | flags  |reserved| stream id u32LE|   fixed head, stable across versions
 *   +--------+--------+--------+--------+----------------+
 *   REQUEST : peer id (16 B) | meta length u16 | meta | body
 *   RESPONSE: status u16     | meta length u16 | meta | body
 *   DATA    : body
 *   CANCEL  : (nothing)
 *
 * The relay reads only the fixed head and the peer id, and rewrites both in
 * place (target → source, caller's stream id → its own), so a hop costs no
 * body copy and no parse. Integers are little-endian.
 */
import { MeshError } from './errors.ts';
import { setHeader, type HeaderMap } from './headers.ts';
import { PEER_ID_BYTES } from './ids.ts';

export const FRAME_VERSION = 1;
export const FRAME_HEAD_BYTES = 8;

export const FrameKind = { Request: 1, Response: 2, Data: 3, Cancel: 4 } as const;
export type FrameKind = (typeof FrameKind)[keyof typeof FrameKind];

/** Flag bit: no more frames follow on this stream. */
export const FLAG_END = 0x01;
/**
 * Flag bit on a DATA frame (with END): a streamed answer failed after its
 * RESPONSE head was sent, so the status can no longer say so; the body is a
 * JSON `{error:{code,message}}`. The relay forwards it like any DATA frame.
 */
export const FLAG_ERROR = 0x02;
/**
 * Flag bit on a REQUEST frame (with END): a one-way request. The caller
 * waits for no answer; a relay that announced `one-way` in its `registered`
 * message forwards it without opening a stream, and the receiver runs its
 * handler and sends no answer. Only errors the relay itself (or, on a direct
 * link, the receiver's admission) produces come back on the caller's stream
 * id. Sent only where the far side announced it (chained hops' pushes).
 */
export const FLAG_ONE_WAY = 0x04;
/**
 * Flag bit on a CANCEL frame a relay sends: the caller did not ask to stop,
 * its connection to the relay dropped (it may come back and ask again: a
 * head keeps such a generation parked a while, docs/protocol.md). Peers that
 * do not know it read a plain CANCEL.
 */
export const FLAG_CALLER_GONE = 0x08;

/** Header names sent as one byte (HPACK-style static table); order is wire format. */
export const STATIC_HEADERS = [
  'content-type',
  'x-meshnet-shape',
  'x-meshnet-dtype',
  'x-meshnet-start-layer',
  'x-meshnet-end-layer',
  'x-meshnet-session',
  'x-meshnet-position',
  'x-meshnet-sampling',
  'x-meshnet-route',
  'x-meshnet-request-id',
  'x-meshnet-route-signature',
  'accept',
  'authorization',
  'content-encoding',
] as const;
const STATIC_INDEX = new Map<string, number>(STATIC_HEADERS.map((h, i) => [h, i]));

export const METHODS = ['GET', 'POST', 'PUT', 'DELETE', 'PATCH', 'HEAD', 'OPTIONS'] as const;
export type Method = (typeof METHODS)[number];

export interface RequestFrame {
  kind: typeof FrameKind.Request;
  flags: number;
  streamId: number;
  /** Target peer when a caller sends it; source peer when the relay delivers it. */
  peerId: Uint8Array;
  method: string;
  path: string;
  headers: HeaderMap;
  body: Uint8Array;
}
export interface ResponseFrame {
  kind: typeof FrameKind.Response;
  flags: number;
  streamId: number;
  status: number;
  headers: HeaderMap;
  body: Uint8Array;
}
export interface DataFrame {
  kind: typeof FrameKind.Data;
  flags: number;
  streamId: number;
  body: Uint8Array;
}
export interface CancelFrame {
  kind: typeof FrameKind.Cancel;
  flags: number;
  streamId: number;
}
export type Frame = RequestFrame | ResponseFrame | DataFrame | CancelFrame;

export interface FrameHead {
  version: number;
  kind: number;
  flags: number;
  streamId: number;
}

const utf8 = new TextEncoder();
const NO_HEADERS: HeaderMap = {};
const utf8d = new TextDecoder('utf-8', { fatal: true });

/** A frame that cannot be parsed; `streamId` is set when the head was readable. */
export class FrameError extends MeshError {
  constructor(message: string, readonly streamId: number | null) {
    super('MESH_ERR_BAD_FRAME', message);
  }
}

export function readFrameHead(bytes: Uint8Array): FrameHead {
  if (bytes.byteLength < FRAME_HEAD_BYTES) throw new FrameError(`frame of ${bytes.byteLength} bytes is shorter than its 8-byte head`, null);
  return {
    version: bytes[0]!,
    kind: bytes[1]!,
    flags: bytes[2]!,
    streamId: (bytes[4]! | (bytes[5]! << 8) | (bytes[6]! << 16) | (bytes[7]! << 24)) >>> 0,
  };
}

export function writeStreamId(bytes: Uint8Array, streamId: number): void {
  bytes[4] = streamId & 0xff;
  bytes[5] = (streamId >>> 8) & 0xff;
  bytes[6] = (streamId >>> 16) & 0xff;
  bytes[7] = (streamId >>> 24) & 0xff;
}

/** The peer id field of a REQUEST frame (a view, not a copy). */
export function requestPeerId(bytes: Uint8Array): Uint8Array {
  if (bytes.byteLength < FRAME_HEAD_BYTES + PEER_ID_BYTES + 2) throw new FrameError('request frame too short for its peer id', null);
  return bytes.subarray(FRAME_HEAD_BYTES, FRAME_HEAD_BYTES + PEER_ID_BYTES);
}

export function writeRequestPeerId(bytes: Uint8Array, peerId: Uint8Array): void {
  bytes.set(peerId, FRAME_HEAD_BYTES);
}

/** Size of a REQUEST frame's body without parsing its meta. */
export function requestBodyBytes(bytes: Uint8Array): number {
  const metaLen = bytes[24]! | (bytes[25]! << 8);
  return bytes.byteLength - 26 - metaLen;
}

// ---------------------------------------------------------------- encoding

/** UTF-8 length of `s` when it is short ASCII (nearly every header and path), else -1: such text is written inline, not through TextEncoder (which showed in profiles). */
function shortAsciiLength(s: string): number {
  const n = s.length;
  if (n > 256) return -1;
  for (let i = 0; i < n; i++) if (s.charCodeAt(i) > 0x7f) return -1;
  return n;
}

/** Header names and values that are not short ASCII, encoded once while sizing (rare). */
type Encoded = Map<string, Uint8Array>;

function encodedLength(s: string, enc: { map: Encoded | undefined }): number {
  const n = shortAsciiLength(s);
  if (n >= 0) return n;
  let map = enc.map;
  if (map === undefined) map = enc.map = new Map();
  let bytes = map.get(s);
  if (bytes === undefined) {
    bytes = utf8.encode(s);
    map.set(s, bytes);
  }
  return bytes.byteLength;
}

/** The static-table index of a lowercase header name, or -1. */
function staticIndex(name: string): number {
  return STATIC_INDEX.get(name) ?? -1;
}

/**
 * Bytes the header block takes (count byte included), validating as it goes.
 * Names are lowercased on the wire; values must be strings.
 */
function headerBlockBytes(headers: HeaderMap, enc: { map: Encoded | undefined }): number {
  let size = 1;
  let count = 0;
  for (const rawName in headers) {
    const value = headers[rawName]!;
    const name = rawName.toLowerCase();
    const vLen = encodedLength(value, enc);
    if (vLen > 0xffff) throw new MeshError('MESH_ERR_TOO_LARGE', `header ${name} is over 65535 bytes`);
    if (staticIndex(name) >= 0) size += 1 + 2 + vLen;
    else {
      const nLen = encodedLength(name, enc);
      if (nLen === 0 || nLen > 0x7f) throw new MeshError('MESH_ERR_BAD_REQUEST', `header name "${name}" must be 1..127 bytes`);
      size += 1 + nLen + 2 + vLen;
    }
    count++;
  }
  if (count > 0xff) throw new MeshError('MESH_ERR_BAD_REQUEST', 'more than 255 headers');
  return size;
}

function writeText(out: Uint8Array, off: number, t: string, enc: { map: Encoded | undefined }): number {
  const bytes = enc.map?.get(t);
  if (bytes !== undefined) {
    out.set(bytes, off);
    return off + bytes.byteLength;
  }
  for (let i = 0; i < t.length; i++) out[off + i] = t.charCodeAt(i);
  return off + t.length;
}

function writeU16(out: Uint8Array, off: number, v: number): void {
  out[off] = v & 0xff;
  out[off + 1] = v >>> 8;
}

/** Writes the block sized by {@link headerBlockBytes} (same headers, same `enc`). */
function writeHeaders(out: Uint8Array, off: number, headers: HeaderMap, enc: { map: Encoded | undefined }): number {
  const countAt = off++;
  let count = 0;
  for (const rawName in headers) {
    const value = headers[rawName]!;
    const name = rawName.toLowerCase();
    const idx = staticIndex(name);
    if (idx >= 0) out[off++] = 0x80 | idx;
    else {
      const nameAt = off++;
      off = writeText(out, off, name, enc);
      out[nameAt] = off - nameAt - 1;
    }
    const lenAt = off;
    off = writeText(out, off + 2, value, enc);
    writeU16(out, lenAt, off - lenAt - 2);
    count++;
  }
  out[countAt] = count;
  return off;
}

function writeHead(out: Uint8Array, kind: FrameKind, flags: number, streamId: number): void {
  out[0] = FRAME_VERSION;
  out[1] = kind;
  out[2] = flags;
  out[3] = 0;
  writeStreamId(out, streamId);
}

/** Method code for a method name, any case; -1 if unsupported. */
function methodCode(method: string): number {
  const m = METHODS.indexOf(method as Method);
  return m >= 0 ? m : METHODS.indexOf(method.toUpperCase() as Method);
}

export interface RequestInit {
  streamId: number;
  peerId: Uint8Array;
  method: string;
  path: string;
  headers?: HeaderMap;
  body?: Uint8Array;
  flags?: number;
}

export function encodeRequestFrame(r: RequestInit): Uint8Array {
  if (r.peerId.byteLength !== PEER_ID_BYTES) throw new MeshError('MESH_ERR_BAD_REQUEST', 'peer id must be 16 bytes');
  const m = methodCode(r.method);
  if (m < 0) throw new MeshError('MESH_ERR_BAD_REQUEST', `unsupported method ${r.method}`);
  const enc: { map: Encoded | undefined } = { map: undefined };
  const pathLen = encodedLength(r.path, enc);
  if (pathLen > 0xffff) throw new MeshError('MESH_ERR_TOO_LARGE', 'path over 65535 bytes');
  const headers = r.headers ?? NO_HEADERS;
  const metaLen = 1 + 2 + pathLen + headerBlockBytes(headers, enc);
  if (metaLen > 0xffff) throw new MeshError('MESH_ERR_TOO_LARGE', 'request meta over 65535 bytes');
  const body = r.body ?? EMPTY;
  const out = new Uint8Array(26 + metaLen + body.byteLength);
  writeHead(out, FrameKind.Request, r.flags ?? FLAG_END, r.streamId);
  out.set(r.peerId, 8);
  writeU16(out, 24, metaLen);
  out[26] = m;
  writeU16(out, 27, pathLen);
  let off = writeText(out, 29, r.path, enc);
  off = writeHeaders(out, off, headers, enc);
  out.set(body, off);
  return out;
}

export interface ResponseInit {
  streamId: number;
  status: number;
  headers?: HeaderMap;
  body?: Uint8Array;
  /** False when DATA frames follow (a streamed answer). */
  end?: boolean;
}

export function encodeResponseFrame(r: ResponseInit): Uint8Array {
  const enc: { map: Encoded | undefined } = { map: undefined };
  const headers = r.headers ?? NO_HEADERS;
  const metaLen = headerBlockBytes(headers, enc);
  if (metaLen > 0xffff) throw new MeshError('MESH_ERR_TOO_LARGE', 'response meta over 65535 bytes');
  const body = r.body ?? EMPTY;
  const out = new Uint8Array(12 + metaLen + body.byteLength);
  writeHead(out, FrameKind.Response, r.end === false ? 0 : FLAG_END, r.streamId);
  writeU16(out, 8, r.status & 0xffff);
  writeU16(out, 10, metaLen);
  const off = writeHeaders(out, 12, headers, enc);
  out.set(body, off);
  return out;
}

export function encodeDataFrame(streamId: number, body: Uint8Array, end: boolean): Uint8Array {
  const out = new Uint8Array(FRAME_HEAD_BYTES + body.byteLength);
  writeHead(out, FrameKind.Data, end ? FLAG_END : 0, streamId);
  out.set(body, FRAME_HEAD_BYTES);
  return out;
}

/** The last frame of a streamed answer that failed midway (see {@link FLAG_ERROR}). */
export function encodeStreamErrorFrame(streamId: number, err: MeshError): Uint8Array {
  const body = utf8.encode(JSON.stringify(err.toBody()));
  const out = new Uint8Array(FRAME_HEAD_BYTES + body.byteLength);
  writeHead(out, FrameKind.Data, FLAG_END | FLAG_ERROR, streamId);
  out.set(body, FRAME_HEAD_BYTES);
  return out;
}

/** `callerGone`: sent by a relay whose caller's connection dropped (FLAG_CALLER_GONE). */
export function encodeCancelFrame(streamId: number, callerGone = false): Uint8Array {
  const out = new Uint8Array(FRAME_HEAD_BYTES);
  writeHead(out, FrameKind.Cancel, FLAG_END | (callerGone ? FLAG_CALLER_GONE : 0), streamId);
  return out;
}

/** An error answer as one RESPONSE frame with a JSON `{error:{code,message}}` body. */
export function encodeErrorFrame(streamId: number, err: MeshError): Uint8Array {
  return encodeResponseFrame({
    streamId,
    status: err.status,
    headers: { 'content-type': 'application/json' },
    body: utf8.encode(JSON.stringify(err.toBody())),
  });
}

// ---------------------------------------------------------------- decoding

const EMPTY = new Uint8Array(0);

class Cursor {
  off: number;
  constructor(readonly bytes: Uint8Array, off: number, readonly end: number, readonly streamId: number) {
    this.off = off;
  }
  need(n: number, what: string): void {
    if (this.off + n > this.end) throw new FrameError(`frame truncated in ${what}`, this.streamId);
  }
  u8(what: string): number {
    this.need(1, what);
    return this.bytes[this.off++]!;
  }
  u16(what: string): number {
    this.need(2, what);
    const v = this.bytes[this.off]! | (this.bytes[this.off + 1]! << 8);
    this.off += 2;
    return v;
  }
  text(n: number, what: string): string {
    this.need(n, what);
    if (n <= 64) {
      let ascii = true;
      for (let i = this.off; i < this.off + n; i++) if (this.bytes[i]! > 0x7f) ascii = false;
      if (ascii) {
        const s = String.fromCharCode.apply(null, this.bytes.subarray(this.off, this.off + n) as unknown as number[]);
        this.off += n;
        return s;
      }
    }
    try {
      return utf8d.decode(this.bytes.subarray(this.off, (this.off += n)));
    } catch {
      throw new FrameError(`${what} is not valid UTF-8`, this.streamId);
    }
  }
}

function readHeaders(c: Cursor): HeaderMap {
  const count = c.u8('header count');
  const headers: HeaderMap = {};
  for (let i = 0; i < count; i++) {
    const n = c.u8('header name');
    let name: string;
    if (n & 0x80) {
      const s = STATIC_HEADERS[n & 0x7f];
      if (s === undefined) throw new FrameError(`unknown static header index ${n & 0x7f}`, c.streamId);
      name = s;
    } else {
      if (n === 0) throw new FrameError('empty header name', c.streamId);
      name = c.text(n, 'header name').toLowerCase();
    }
    setHeader(headers, name, c.text(c.u16('header value length'), `header ${name}`));
  }
  return headers;
}

/** Parse a whole frame. Bodies are views into `bytes` (zero copy). */
export function decodeFrame(bytes: Uint8Array): Frame {
  const head = readFrameHead(bytes);
  if (head.version !== FRAME_VERSION) throw new FrameError(`unsupported frame version ${head.version} (this peer speaks ${FRAME_VERSION})`, head.streamId);
  switch (head.kind) {
    case FrameKind.Request: {
      if (bytes.byteLength < 26) throw new FrameError('request frame truncated in head', head.streamId);
      const peerId = bytes.subarray(8, 24);
      const metaLen = bytes[24]! | (bytes[25]! << 8);
      const metaEnd = 26 + metaLen;
      if (metaEnd > bytes.byteLength) throw new FrameError('request meta runs past the frame', head.streamId);
      const c = new Cursor(bytes, 26, metaEnd, head.streamId);
      const m = c.u8('method');
      const method = METHODS[m];
      if (method === undefined) throw new FrameError(`unknown method code ${m}`, head.streamId);
      const path = c.text(c.u16('path length'), 'path');
      const headers = readHeaders(c);
      if (c.off !== metaEnd) throw new FrameError('request meta length does not match its contents', head.streamId);
      return { kind: FrameKind.Request, flags: head.flags, streamId: head.streamId, peerId, method, path, headers, body: bytes.subarray(metaEnd) };
    }
    case FrameKind.Response: {
      if (bytes.byteLength < 12) throw new FrameError('response frame truncated in head', head.streamId);
      const status = bytes[8]! | (bytes[9]! << 8);
      if (status < 100 || status > 599) throw new FrameError(`status ${status} out of range`, head.streamId);
      const metaLen = bytes[10]! | (bytes[11]! << 8);
      const metaEnd = 12 + metaLen;
      if (metaEnd > bytes.byteLength) throw new FrameError('response meta runs past the frame', head.streamId);
      const c = new Cursor(bytes, 12, metaEnd, head.streamId);
      const headers = readHeaders(c);
      if (c.off !== metaEnd) throw new FrameError('response meta length does not match its contents', head.streamId);
      return { kind: FrameKind.Response, flags: head.flags, streamId: head.streamId, status, headers, body: bytes.subarray(metaEnd) };
    }
    case FrameKind.Data:
      return { kind: FrameKind.Data, flags: head.flags, streamId: head.streamId, body: bytes.subarray(FRAME_HEAD_BYTES) };
    case FrameKind.Cancel:
      return { kind: FrameKind.Cancel, flags: head.flags, streamId: head.streamId };
    default:
      throw new FrameError(`unknown frame kind ${head.kind}`, head.streamId);
  }
}
