/**
 * The tracker's direct HTTP path to a head (head-transport.ts) against a
 * real node:http server playing the head: chunks as they come, the idle
 * timeout before the answer and between chunks (but not while the reader
 * holds a chunk), cancellation and early stops reaching the head as a
 * closed connection, answered errors, a broken stream, keep-alive reuse.
 */
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo, Socket } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { MeshError } from '../../src/protocol/errors.ts';
import { createHeadTransport } from '../../src/tracker/head-transport.ts';

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();
const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

interface FakeHead {
  url: string;
  server: Server;
  /** Requests whose connection closed before the answer ended (the head would cancel). */
  closedEarly: number;
  connections: number;
  bodies: string[];
}

const servers: Server[] = [];
afterEach(async () => {
  for (const s of servers.splice(0)) {
    s.closeAllConnections();
    await new Promise<void>((r) => s.close(() => r()));
  }
});

async function fakeHead(answer: (req: IncomingMessage, res: ServerResponse) => void | Promise<void>): Promise<FakeHead> {
  const head: FakeHead = { url: '', server: undefined as unknown as Server, closedEarly: 0, connections: 0, bodies: [] };
  head.server = createServer((req, res) => {
    let body = '';
    req.on('data', (c: Buffer) => (body += c.toString()));
    req.on('end', () => {
      head.bodies.push(body);
      res.on('close', () => {
        if (!res.writableFinished) head.closedEarly++;
      });
      void answer(req, res);
    });
  });
  head.server.on('connection', (_s: Socket) => head.connections++);
  servers.push(head.server);
  await new Promise<void>((r) => head.server.listen(0, '127.0.0.1', () => r()));
  head.url = `http://127.0.0.1:${(head.server.address() as AddressInfo).port}`;
  return head;
}

const line = (o: unknown) => JSON.stringify(o) + '\n';

async function open(head: FakeHead, o: { idleTimeoutMs?: number; signal?: AbortSignal } = {}) {
  const transport = createHeadTransport({});
  return transport.open({ peerId: 'h'.repeat(32), endpoint: head.url }, { 'content-type': 'application/json' }, utf8.encode('{"x":1}'), { signal: o.signal ?? new AbortController().signal, idleTimeoutMs: o.idleTimeoutMs ?? 2000 });
}

async function readAll(body: AsyncIterable<Uint8Array>): Promise<string> {
  let s = '';
  for await (const c of body) s += utf8d.decode(c);
  return s;
}

async function until(cond: () => boolean, ms = 3000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!cond() && Date.now() < deadline) await sleep(10);
}

describe('direct HTTP to a head', () => {
  it('sends the body and yields the answer chunk by chunk as the head writes it', async () => {
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const head = await fakeHead(async (_req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      res.write(line({ type: 'start' }));
      await gate;
      res.end(line({ type: 'done' }));
    });
    const body = (await open(head))[Symbol.asyncIterator]();
    // The first line arrives while the head still holds the second.
    expect(utf8d.decode((await body.next()).value as Uint8Array)).toBe(line({ type: 'start' }));
    release();
    let rest = '';
    for (let r = await body.next(); !r.done; r = await body.next()) rest += utf8d.decode(r.value);
    expect(rest).toBe(line({ type: 'done' }));
    expect(head.bodies).toEqual(['{"x":1}']);
    expect(head.closedEarly).toBe(0);
  });

  it('reuses one connection for generations one after another (keep-alive)', async () => {
    const head = await fakeHead((_req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      res.end(line({ type: 'done' }));
    });
    const transport = createHeadTransport({});
    for (let i = 0; i < 3; i++) {
      const body = await transport.open({ peerId: 'h'.repeat(32), endpoint: head.url }, {}, utf8.encode('{}'), { signal: new AbortController().signal, idleTimeoutMs: 2000 });
      expect(await readAll(body)).toBe(line({ type: 'done' }));
    }
    expect(head.connections).toBe(1);
  });

  it('cuts a head that stalls mid-stream with MESH_ERR_TIMEOUT and closes its connection', async () => {
    const head = await fakeHead((_req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      res.write(line({ type: 'start' }));
      res.write(line({ type: 'token' }));
      // …and then nothing.
    });
    const body = await open(head, { idleTimeoutMs: 300 });
    const got: string[] = [];
    const err = await (async () => {
      for await (const c of body) got.push(utf8d.decode(c));
    })().catch((e: unknown) => e);
    expect(err).toBeInstanceOf(MeshError);
    expect((err as MeshError).code).toBe('MESH_ERR_TIMEOUT');
    expect(got.join('')).toBe(line({ type: 'start' }) + line({ type: 'token' }));
    await until(() => head.closedEarly === 1);
    expect(head.closedEarly).toBe(1);
  });

  it('does not count the time the reader holds a chunk as the head\'s silence', async () => {
    const head = await fakeHead(async (req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      for (let i = 0; i < 3; i++) {
        res.write(line({ i }));
        await sleep(20);
      }
      res.end();
    });
    const body = await open(head, { idleTimeoutMs: 150 });
    let text = '';
    for await (const c of body) {
      text += utf8d.decode(c);
      // A slow client: far longer than the idle timeout per chunk, while the head answers at once.
      await sleep(400);
    }
    expect(text).toBe(line({ i: 0 }) + line({ i: 1 }) + line({ i: 2 }));
  });

  it('refuses a head that accepts the connection but never answers as unreachable (MESH_ERR_PEER_GONE), within the idle timeout', async () => {
    const head = await fakeHead(() => {
      // never writes the answer's head
    });
    await expect(open(head, { idleTimeoutMs: 200 })).rejects.toMatchObject({ code: 'MESH_ERR_PEER_GONE' });
    await until(() => head.closedEarly === 1);
    expect(head.closedEarly).toBe(1);
  });

  it('closes the head\'s connection when the generation is cancelled mid-stream, and the reader gets MESH_ERR_CANCELLED', async () => {
    const head = await fakeHead((_req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      res.write(line({ type: 'start' }));
    });
    const ctl = new AbortController();
    const body = (await open(head, { signal: ctl.signal }))[Symbol.asyncIterator]();
    await body.next();
    const pending = body.next();
    ctl.abort();
    await expect(pending).rejects.toMatchObject({ code: 'MESH_ERR_CANCELLED' });
    await until(() => head.closedEarly === 1);
    expect(head.closedEarly).toBe(1);
  });

  it('closes the head\'s connection when the reader stops early (a stop string, max_tokens, the client gone)', async () => {
    const head = await fakeHead((_req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      res.write(line({ type: 'start' }));
      res.write(line({ type: 'token' }));
    });
    for await (const c of await open(head)) {
      expect(utf8d.decode(c)).toContain('start');
      break;
    }
    await until(() => head.closedEarly === 1);
    expect(head.closedEarly).toBe(1);
  });

  it('throws the head\'s own error for a non-200 answer, and MESH_ERR_PEER_GONE for a stream that breaks or a head that is not there', async () => {
    const refusing = await fakeHead((_req, res) => {
      res.writeHead(403, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ error: { code: 'MESH_ERR_FORBIDDEN', message: 'route signature does not verify' } }));
    });
    await expect(open(refusing)).rejects.toMatchObject({ code: 'MESH_ERR_FORBIDDEN', message: expect.stringContaining('does not verify') });

    const breaking = await fakeHead((_req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      res.write(line({ type: 'start' }), () => setTimeout(() => res.socket?.destroy(), 20));
    });
    const err = await readAll(await open(breaking)).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: 'MESH_ERR_PEER_GONE' });

    const gone = await fakeHead(() => {});
    const url = gone.url;
    gone.server.close();
    servers.splice(servers.indexOf(gone.server), 1);
    await expect(createHeadTransport({}).open({ peerId: 'h'.repeat(32), endpoint: url }, {}, utf8.encode('{}'), { signal: new AbortController().signal, idleTimeoutMs: 2000 })).rejects.toMatchObject({ code: 'MESH_ERR_PEER_GONE' });
  });
});
