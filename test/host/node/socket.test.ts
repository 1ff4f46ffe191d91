/**
 * The Node.js host's WebSocket (src/relay/node-socket.ts), checked on the
 * wire against a raw TCP server that speaks just enough RFC 6455.
 */
import { createHash } from 'node:crypto';
import { createServer, type Server, type Socket } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { NodeWebSocket } from '../../../src/host/node/socket.ts';

const GUID = '258EAFA5-E914-47DA-95CA-C5AB0DC85B11';

interface RawServer {
  url: string;
  /** The client's upgrade request headers, lowercase names. */
  headers: Promise<Record<string, string>>;
  /** Every byte the client sent after the handshake. */
  received(): Buffer;
  /** Number of TCP reads the server saw after the handshake. */
  reads(): number;
  server: Server;
}

async function rawServer(): Promise<RawServer> {
  let resolveHeaders!: (h: Record<string, string>) => void;
  const headers = new Promise<Record<string, string>>((r) => (resolveHeaders = r));
  const chunks: Buffer[] = [];
  let reads = 0;
  const server = createServer((socket: Socket) => {
    let pending = Buffer.alloc(0);
    let upgraded = false;
    socket.on('data', (d: Buffer) => {
      if (upgraded) {
        reads++;
        chunks.push(d);
        return;
      }
      pending = Buffer.concat([pending, d]);
      const end = pending.indexOf('\r\n\r\n');
      if (end < 0) return;
      const lines = pending.subarray(0, end).toString('latin1').split('\r\n').slice(1);
      const h = Object.fromEntries(lines.map((l) => [l.slice(0, l.indexOf(':')).toLowerCase(), l.slice(l.indexOf(':') + 1).trim()]));
      const accept = createHash('sha1').update(h['sec-websocket-key'] + GUID).digest('base64');
      socket.write(`HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: ${accept}\r\n\r\n`);
      upgraded = true;
      resolveHeaders(h);
      const rest = pending.subarray(end + 4);
      if (rest.byteLength > 0) {
        reads++;
        chunks.push(rest);
      }
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return {
    url: `ws://127.0.0.1:${(server.address() as { port: number }).port}/ws`,
    headers,
    received: () => Buffer.concat(chunks),
    reads: () => reads,
    server,
  };
}

/** Client frames as [mask key, unmasked payload], for short payloads (< 64 KiB). */
function parseClientFrames(buf: Buffer): Array<{ opcode: number; mask: Buffer; payload: Buffer }> {
  const out = [];
  let off = 0;
  while (off < buf.byteLength) {
    const opcode = buf[off]! & 0x0f;
    expect(buf[off + 1]! & 0x80).toBe(0x80); // clients always set the mask bit
    let len = buf[off + 1]! & 0x7f;
    off += 2;
    if (len === 126) {
      len = buf.readUInt16BE(off);
      off += 2;
    }
    const mask = buf.subarray(off, off + 4);
    off += 4;
    const payload = Buffer.from(buf.subarray(off, off + len));
    for (let i = 0; i < payload.byteLength; i++) payload[i]! ^= mask[i & 3]!;
    off += len;
    out.push({ opcode, mask, payload });
  }
  return out;
}

const open = (ws: NodeWebSocket) => new Promise<void>((resolve, reject) => {
  ws.once('open', () => resolve());
  ws.once('error', reject);
});
const nextTick = () => new Promise<void>((r) => process.nextTick(r));
const settle = (ms = 50) => new Promise<void>((r) => setTimeout(r, ms));

let srv: RawServer | undefined;
let client: NodeWebSocket | undefined;
afterEach(async () => {
  client?.terminate();
  client = undefined;
  await new Promise<void>((r) => (srv ? srv.server.close(() => r()) : r()));
  srv = undefined;
});

describe('NodeWebSocket', () => {
  it('offers no permessage-deflate', async () => {
    srv = await rawServer();
    client = new NodeWebSocket(srv.url);
    const headers = await srv.headers;
    expect(headers['sec-websocket-extensions']).toBeUndefined();
    await open(client);
  });

  it('masks with an all-zero key, so the payload goes out as it is', async () => {
    srv = await rawServer();
    client = new NodeWebSocket(srv.url);
    await open(client);
    const body = Buffer.from(Array.from({ length: 300 }, (_, i) => (i * 7) & 0xff));
    client.send(body);
    client.send('text too');
    await settle();
    const frames = parseClientFrames(srv.received());
    expect(frames.map((f) => f.opcode)).toEqual([2, 1]);
    expect(frames.every((f) => f.mask.equals(Buffer.alloc(4)))).toBe(true);
    expect(frames[0]!.payload.equals(body)).toBe(true);
    expect(frames[1]!.payload.toString()).toBe('text too');
    // The caller's buffer is not touched (no in-place masking).
    expect(body[1]).toBe(7);
  });

  it('sends of one tick leave together at the end of the tick, in order', async () => {
    srv = await rawServer();
    client = new NodeWebSocket(srv.url);
    await open(client);
    for (let i = 0; i < 20; i++) client.send(new Uint8Array(1000).fill(i));
    // Held for this tick only: counted as buffered, not yet on the wire.
    expect(client.bufferedAmount).toBeGreaterThanOrEqual(20 * 1000);
    await nextTick();
    expect(client.bufferedAmount).toBe(0);
    await settle();
    const frames = parseClientFrames(srv.received());
    expect(frames.map((f) => f.payload[0])).toEqual(Array.from({ length: 20 }, (_, i) => i));
    expect(frames.every((f) => f.payload.byteLength === 1000)).toBe(true);
    expect(srv.reads()).toBeLessThan(20);
    // The next tick's sends go out too.
    client.send('after');
    await settle();
    expect(parseClientFrames(srv.received()).at(-1)!.payload.toString()).toBe('after');
  });

  it('a close in the same tick as sends still delivers them first', async () => {
    srv = await rawServer();
    client = new NodeWebSocket(srv.url);
    await open(client);
    client.send('one');
    client.send('two');
    client.close(1000, 'done');
    await settle();
    const frames = parseClientFrames(srv.received());
    expect(frames.map((f) => f.opcode)).toEqual([1, 1, 8]);
    expect(frames.slice(0, 2).map((f) => f.payload.toString())).toEqual(['one', 'two']);
  });
});
