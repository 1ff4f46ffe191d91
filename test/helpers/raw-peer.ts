/**
 * A deliberately minimal peer built from `ws`, node:crypto and the frame
 * codec: it checks the relay from outside, independent of src/node's client.
 */
import { createHash, generateKeyPairSync, sign, type KeyObject } from 'node:crypto';
import { WebSocket } from 'ws';
import {
  FrameError,
  FrameKind,
  decodeFrame,
  encodeErrorFrame,
  encodeRequestFrame,
  encodeResponseFrame,
  hexToBytes,
  registrationMessage,
  type Frame,
  type HeaderMap,
} from '../../src/protocol/index.ts';

export interface Keys {
  privateKey: KeyObject;
  publicRaw: Buffer;
  peerId: string;
}

export function makeKeys(): Keys {
  const { privateKey, publicKey } = generateKeyPairSync('ed25519');
  const jwk = publicKey.export({ format: 'jwk' }) as { x: string };
  const publicRaw = Buffer.from(jwk.x, 'base64url');
  return { privateKey, publicRaw, peerId: createHash('sha256').update(publicRaw).digest().subarray(0, 16).toString('hex') };
}

export function registerMessage(keys: Keys, nonce: string, info: Record<string, unknown> = { protocols: ['mesh-frames/1'] }) {
  return {
    type: 'register',
    public_key: keys.publicRaw.toString('base64url'),
    signature: sign(null, registrationMessage(nonce), keys.privateKey).toString('base64url'),
    info,
  };
}

export function once<T>(ws: WebSocket, event: string): Promise<T> {
  return new Promise((resolve) => ws.once(event, (...a: unknown[]) => resolve(a as T)));
}

export async function nextJson(ws: WebSocket): Promise<Record<string, unknown>> {
  const [data] = await once<[Buffer]>(ws, 'message');
  return JSON.parse(data.toString()) as Record<string, unknown>;
}

export interface Reply {
  status: number;
  headers: HeaderMap;
  body: Uint8Array;
}

export type Handler = (req: { method: string; path: string; headers: HeaderMap; body: Uint8Array; from: string }) => Promise<Reply> | Reply | null;

/** A registered peer that answers fast-path frames and JSON envelopes with `handler`. */
export class RawPeer {
  ws!: WebSocket;
  peerId = '';
  relayAddr = '';
  private nextStream = 1;
  private pending = new Map<number, { resolve: (r: Reply) => void; chunks: Uint8Array[]; status: number; headers: HeaderMap }>();
  received: Frame[] = [];
  envelopes: Array<Record<string, unknown>> = [];
  closed: { code: number; reason: string } | null = null;

  constructor(
    readonly keys: Keys = makeKeys(),
    public handler: Handler = (r) => ({ status: 200, headers: r.headers, body: r.body }),
    readonly info: Record<string, unknown> = { protocols: ['mesh-frames/1'] },
  ) {}

  static async connect(url: string, handler?: Handler, info?: Record<string, unknown>): Promise<RawPeer> {
    const p = new RawPeer(makeKeys(), handler, info);
    await p.open(url);
    return p;
  }

  async open(url: string): Promise<void> {
    this.ws = new WebSocket(`${url}/ws`);
    this.ws.binaryType = 'nodebuffer';
    const challenge = await nextJson(this.ws);
    this.ws.send(JSON.stringify(registerMessage(this.keys, challenge.nonce as string, this.info)));
    const reg = await nextJson(this.ws);
    if (reg.type !== 'registered') throw new Error(`not registered: ${JSON.stringify(reg)}`);
    this.peerId = reg.peer_id as string;
    this.relayAddr = reg.relay_addr as string;
    this.ws.on('message', (data: Buffer, isBinary: boolean) => void this.onMessage(data, isBinary));
    this.ws.on('close', (code, reason) => (this.closed = { code, reason: reason.toString() }));
  }

  private async onMessage(data: Buffer, isBinary: boolean): Promise<void> {
    if (!isBinary) {
      const msg = JSON.parse(data.toString()) as Record<string, unknown>;
      this.envelopes.push(msg);
      if (msg.type === 'relay-http-request') {
        const body = msg.body_base64 ? Buffer.from(msg.body_base64 as string, 'base64') : Buffer.from((msg.body as string) ?? '');
        const r = await this.handler({ method: msg.method as string, path: msg.path as string, headers: msg.headers as HeaderMap, body, from: '' });
        if (r === null) return;
        this.ws.send(JSON.stringify({ type: 'relay-http-response', request_id: msg.request_id, status: r.status, headers: r.headers, body_base64: Buffer.from(r.body).toString('base64') }));
      }
      return;
    }
    let f: Frame;
    try {
      f = decodeFrame(new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
    } catch (e) {
      // What a real bridge does with a frame the relay forwarded unparsed: answer 400 on its stream.
      if (e instanceof FrameError && e.streamId !== null && this.ws.readyState === WebSocket.OPEN) this.ws.send(encodeErrorFrame(e.streamId, e));
      return;
    }
    this.received.push(f);
    if (f.kind === FrameKind.Request) {
      const r = await this.handler({ method: f.method, path: f.path, headers: f.headers, body: f.body, from: Buffer.from(f.peerId).toString('hex') });
      if (r === null) return;
      if (this.ws.readyState === WebSocket.OPEN) this.ws.send(encodeResponseFrame({ streamId: f.streamId, status: r.status, headers: r.headers, body: r.body }));
    } else if (f.kind === FrameKind.Response || f.kind === FrameKind.Data) {
      const p = this.pending.get(f.streamId);
      if (!p) return;
      if (f.kind === FrameKind.Response) {
        p.status = f.status;
        p.headers = f.headers;
      }
      p.chunks.push(new Uint8Array(f.body));
      if (f.flags & 1) {
        this.pending.delete(f.streamId);
        p.resolve({ status: p.status, headers: p.headers, body: Buffer.concat(p.chunks) });
      }
    }
  }

  /** Send a fast-path request to `target` and await the whole answer. */
  request(target: string, req: { method?: string; path?: string; headers?: HeaderMap; body?: Uint8Array }, streamId = this.nextStream++): Promise<Reply> {
    return new Promise((resolve) => {
      this.pending.set(streamId, { resolve, chunks: [], status: 0, headers: {} });
      this.ws.send(encodeRequestFrame({ streamId, peerId: hexToBytes(target), method: req.method ?? 'POST', path: req.path ?? '/forward', headers: req.headers ?? {}, body: req.body ?? new Uint8Array(0) }));
    });
  }

  close(): Promise<void> {
    return new Promise((resolve) => {
      if (this.ws.readyState === WebSocket.CLOSED) return resolve();
      this.ws.once('close', () => resolve());
      this.ws.close();
    });
  }
}

/** One `/rpc` socket used for many requests, answers matched by request_id. */
export class RpcSocket {
  private waiters = new Map<string, (m: Record<string, unknown>) => void>();
  others: Array<Record<string, unknown>> = [];
  private constructor(readonly ws: WebSocket) {
    ws.on('message', (d: Buffer) => {
      const m = JSON.parse(d.toString()) as Record<string, unknown>;
      const w = this.waiters.get(m.request_id as string);
      if (w) {
        this.waiters.delete(m.request_id as string);
        w(m);
      } else this.others.push(m);
    });
  }
  static open(addr: string): Promise<RpcSocket> {
    const ws = new WebSocket(addr);
    return new Promise((resolve, reject) => {
      ws.once('open', () => resolve(new RpcSocket(ws)));
      ws.once('unexpected-response', (_req, res) => {
        let body = '';
        res.on('data', (c: Buffer) => (body += c));
        res.on('end', () => reject(Object.assign(new Error(`handshake ${res.statusCode}`), { status: res.statusCode, body })));
      });
      ws.once('error', (e) => reject(e));
    });
  }
  call(msg: Record<string, unknown>): Promise<Record<string, unknown>> {
    return new Promise((resolve) => {
      this.waiters.set(msg.request_id as string, resolve);
      this.ws.send(JSON.stringify(msg));
    });
  }
  sendRaw(data: string | Buffer): void {
    this.ws.send(data);
  }
  nextOther(): Promise<Record<string, unknown>> {
    if (this.others.length) return Promise.resolve(this.others.shift()!);
    return new Promise((resolve) => this.ws.once('message', () => setImmediate(() => resolve(this.others.shift()!))));
  }
  close(): void {
    this.ws.close();
  }
}
