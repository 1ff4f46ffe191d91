/**
 * Direct links over real sockets: a Node.js node's HTTP surface accepting
 * /link, and LinkPool callers.
 */
import { afterEach, describe, expect, it } from 'vitest';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { WebSocket } from 'ws';
import { LinkPool, linkUrl, type AcceptedLink } from '../../src/net/direct-link.ts';
import { openSurface } from '../../src/host/node/surface.ts';
import type { MuxOptions } from '../../src/net/relay-options.ts';
import { HopTransport } from '../../src/net/hop-transport.ts';
import { Identity } from '../../src/net/identity.ts';
import type { MeshHandler } from '../../src/net/contract.ts';
import type { WebSocketConstructor } from '../../src/net/socket.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import type { MeshError } from '../../src/protocol/errors.ts';
import { randomHex } from '../../src/protocol/ids.ts';

const WS = WebSocket as unknown as WebSocketConstructor;
const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

interface LinkNode {
  identity: Identity;
  endpoint: string;
  accepted: ReadonlySet<AcceptedLink>;
  close(): Promise<void>;
}

/** A node's real HTTP surface (src/host/node/surface.ts) accepting /link with `handler`. */
async function startLinkNode(handler: MeshHandler, linkOptions: Partial<MuxOptions> = {}): Promise<LinkNode> {
  const identity = await Identity.generate();
  const surface = await openSurface({ port: 0, host: '127.0.0.1', maxBodyBytes: 1 << 20, links: true, linkOptions, linkRegisterTimeoutMs: 2_000, identity, http: handler, link: handler, onLinkOpen: () => {}, log: () => {} });
  return { identity, endpoint: surface.endpoint, accepted: surface.links, close: () => surface.close() };
}

const echo: MeshHandler = async (req) => ({ status: 200, headers: { 'x-meshnet-shape': req.headers['x-meshnet-shape'] ?? '', 'x-path': req.path }, body: req.body });

async function until<T>(f: () => T | undefined, ms = 5_000): Promise<T> {
  const end = Date.now() + ms;
  for (;;) {
    const v = f();
    if (v !== undefined) return v;
    if (Date.now() > end) throw new Error('timed out');
    await new Promise((r) => setTimeout(r, 10));
  }
}

/** A raw socket to the link, for handshake misbehaviour. */
async function rawLink(endpoint: string): Promise<{ ws: WebSocket; challenge: { nonce: string }; closed: Promise<{ code: number; reason: string }> }> {
  const ws = new WebSocket(linkUrl(endpoint)!);
  const closed = new Promise<{ code: number; reason: string }>((r) => ws.once('close', (code, reason) => r({ code, reason: reason.toString() })));
  const challenge = await new Promise<{ nonce: string }>((resolve, reject) => {
    ws.once('message', (d) => resolve(JSON.parse(d.toString()) as { nonce: string }));
    ws.once('error', reject);
  });
  return { ws, challenge, closed };
}

describe('direct links', () => {
  const cleanups: Array<() => unknown> = [];
  afterEach(async () => {
    for (const c of cleanups.splice(0).reverse()) await c();
  });

  async function setup(handler: MeshHandler = echo, options?: Partial<MuxOptions>) {
    const node = await startLinkNode(handler, options);
    cleanups.push(() => node.close());
    const caller = await Identity.generate();
    const pool = new LinkPool({ identity: caller, WebSocket: WS });
    cleanups.push(() => pool.close());
    expect(pool.get(node.endpoint)).toBeUndefined(); // dialling starts on first sight
    const client = await until(() => pool.get(node.endpoint));
    return { node, caller, pool, client };
  }

  it('answers 64 concurrent requests over one socket, each with its own body, and knows the caller by its key', async () => {
    const { node, caller, client } = await setup();
    const replies = await Promise.all(
      Array.from({ length: 64 }, (_, i) => client.request(node.identity.peerId, { method: 'POST', path: `/forward?i=${i}`, headers: { 'x-meshnet-shape': `1,${i},8` }, body: utf8.encode(`body ${i}`) })),
    );
    replies.forEach((r, i) => {
      expect(r.status).toBe(200);
      expect(utf8d.decode(r.body)).toBe(`body ${i}`);
      expect(r.headers['x-meshnet-shape']).toBe(`1,${i},8`);
      expect(r.headers['x-path']).toBe(`/forward?i=${i}`);
    });
    expect([...node.accepted].map((l) => l.callerId)).toEqual([caller.peerId]);
  });

  it('refuses a frame addressed to another peer with 404 MESH_ERR_NO_SUCH_PEER and keeps serving', async () => {
    const { node, client } = await setup();
    const wrong = await client.request(randomHex(16), { method: 'POST', path: '/forward', body: utf8.encode('x') });
    expect(wrong.status).toBe(404);
    expect(utf8d.decode(wrong.body)).toContain('MESH_ERR_NO_SUCH_PEER');
    const right = await client.request(node.identity.peerId, { method: 'POST', path: '/forward', body: utf8.encode('y') });
    expect(utf8d.decode(right.body)).toBe('y');
  });

  it('streams an answer chunk by chunk, and answers a handler that never finishes with a timeout', async () => {
    const handler: MeshHandler = async (req) => {
      if (req.path === '/hang') return new Promise(() => {});
      return {
        status: 200,
        headers: {},
        body: (async function* () {
          for (let i = 0; i < 5; i++) yield utf8.encode(`chunk${i};`);
        })(),
      };
    };
    const { node, client } = await setup(handler, { handlerTimeoutMs: 200 });
    const stream = await client.requestStream(node.identity.peerId, { method: 'GET', path: '/stream' });
    const parts: string[] = [];
    for await (const c of stream.body) parts.push(utf8d.decode(c));
    expect(parts.join('')).toBe('chunk0;chunk1;chunk2;chunk3;chunk4;');
    const hung = await client.request(node.identity.peerId, { method: 'GET', path: '/hang' });
    expect(hung.status).toBe(504);
    expect(utf8d.decode(hung.body)).toContain('MESH_ERR_TIMEOUT');
  });

  it('closes a link whose register signature is wrong (4001) or that sends frames first (1008), and serves others meanwhile', async () => {
    const { node, client } = await setup();
    const forger = await Identity.generate();
    const bad = await rawLink(node.endpoint);
    const reg = await forger.registerMessage(randomHex(16), {}); // signs another nonce
    bad.ws.send(JSON.stringify(reg));
    expect((await bad.closed).code).toBe(4001);

    const early = await rawLink(node.endpoint);
    early.ws.send(new Uint8Array(40));
    expect((await early.closed).code).toBe(1008);

    const garbage = await rawLink(node.endpoint);
    garbage.ws.send(JSON.stringify({ type: 'register', public_key: encodeBase64Url(new Uint8Array(32)), signature: 'x', info: {} }));
    expect((await garbage.closed).code).toBe(4001); // a zero key of the right length, a signature that is not base64url

    expect((await client.request(node.identity.peerId, { method: 'POST', path: '/forward', body: utf8.encode('still') })).status).toBe(200);
  });

  it('rejects what is in flight when the node goes away, and the pool stops offering the link', async () => {
    let release: () => void = () => {};
    const handler: MeshHandler = () => new Promise((r) => (release = () => r({ status: 200, headers: {}, body: new Uint8Array(0) })));
    const { node, pool, client } = await setup(handler);
    const pending = client.request(node.identity.peerId, { method: 'POST', path: '/forward', body: new Uint8Array(1) });
    await until(() => (node.accepted.size > 0 ? true : undefined));
    await new Promise((r) => setTimeout(r, 50));
    await node.close();
    const err = (await pending.catch((e: unknown) => e)) as MeshError;
    expect(err.code).toBe('MESH_ERR_PEER_GONE');
    release();
    await until(() => (pool.get(node.endpoint) === undefined ? true : undefined));
  });

  it('feeds HopTransport: link before direct HTTP once it is up, and direct HTTP when the endpoint has no link', async () => {
    const { node, pool } = await setup();
    const used: string[] = [];
    const transport = new HopTransport({
      link: (endpoint, peerId) => {
        const c = pool.get(endpoint, peerId);
        return c ? (peer, req, opts) => (used.push('link'), c.request(peer, req, opts)) : undefined;
      },
      direct: async () => (used.push('direct'), { status: 200, headers: {}, body: utf8.encode('http') }),
    });
    const hop = { peer_id: node.identity.peerId, start_layer: 0, end_layer: 1, endpoint: node.endpoint };
    expect(transport.plan(hop)).toEqual(['link', 'direct']);
    // The same endpoint named for another peer (a wrong or machine-local address): not that link.
    expect(transport.plan({ ...hop, peer_id: randomHex(16) })).toEqual(['direct']);
    const r = await transport.send(hop, { method: 'POST', path: '/forward', body: utf8.encode('via link') }, 1_000);
    expect(utf8d.decode(r.body)).toBe('via link');

    // An endpoint that does not accept links (404 on upgrade): HTTP serves while the pool keeps redialling with backoff.
    const plain = createServer((_q, s) => s.writeHead(404).end());
    plain.on('upgrade', (_q, socket) => socket.end('HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n'));
    await new Promise<void>((res) => plain.listen(0, '127.0.0.1', res));
    cleanups.push(() => new Promise<void>((res) => plain.close(() => res())));
    const other = { ...hop, endpoint: `http://127.0.0.1:${(plain.address() as AddressInfo).port}` };
    expect(transport.plan(other)).toEqual(['direct']);
    await new Promise((res) => setTimeout(res, 100));
    expect(transport.plan(other)).toEqual(['direct']);
    expect(utf8d.decode((await transport.send(other, { method: 'POST', path: '/forward' }, 1_000)).body)).toBe('http');
    expect(used).toEqual(['link', 'direct']);
  });

  it('keeps at most maxLinks links, closing the least recently used', async () => {
    const nodes = await Promise.all([0, 1, 2].map(() => startLinkNode(echo)));
    for (const n of nodes) cleanups.push(() => n.close());
    const pool = new LinkPool({ identity: await Identity.generate(), WebSocket: WS, maxLinks: 2 });
    cleanups.push(() => pool.close());
    await until(() => pool.get(nodes[0]!.endpoint));
    await until(() => pool.get(nodes[1]!.endpoint));
    pool.get(nodes[0]!.endpoint); // 1 is now the least recently used
    await until(() => pool.get(nodes[2]!.endpoint));
    expect(pool.size).toBe(2);
    await until(() => (nodes[1]!.accepted.size === 0 ? true : undefined));
    expect(nodes[0]!.accepted.size).toBe(1);
  });

  it('maps endpoints to link URLs', () => {
    expect(linkUrl('http://10.0.0.2:7000')).toBe('ws://10.0.0.2:7000/link');
    expect(linkUrl('https://node.example/')).toBe('wss://node.example/link');
    expect(linkUrl('http://h:1/base/')).toBe('ws://h:1/base/link');
    expect(linkUrl('not a url')).toBeUndefined();
    expect(linkUrl('ftp://h/')).toBeUndefined();
  });
});
