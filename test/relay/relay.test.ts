/**
 * The relay, checked from outside: a real `meshnet relay` process on
 * loopback, real WebSocket peers, the wire contract of docs/protocol.md §1–4.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { WebSocket } from 'ws';
import { decodeTensor, encodeTensor, peerIdFromPublicKey } from '../../src/protocol/index.ts';
import { makeKeys, nextJson, RawPeer, registerMessage, RpcSocket, once } from '../helpers/raw-peer.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';

let relay: RelayProcess;
beforeAll(async () => {
  relay = await startRelayProcess(['--request-timeout-ms', '1500', '--max-body-bytes', String(1 << 20)]);
});
afterAll(async () => {
  await relay.stop();
});

async function peersOnRelay(): Promise<string[]> {
  const r = await fetch(`${relay.httpUrl}/peers`);
  return ((await r.json()) as { peers: Array<{ peer_id: string }> }).peers.map((p) => p.peer_id);
}

function randomActivation(n: number): Float32Array {
  const a = new Float32Array(n);
  for (let i = 0; i < n; i++) a[i] = (Math.random() - 0.5) * 8;
  return a;
}

describe('registration on /ws', () => {
  it('challenges first, then registers a signed key under sha256(key)[0..16] with its relay_addr', async () => {
    const keys = makeKeys();
    const ws = new WebSocket(`${relay.url}/ws`);
    const challenge = await nextJson(ws);
    expect(challenge.type).toBe('challenge');
    expect(challenge.nonce).toMatch(/^[0-9a-f]{32}$/);
    ws.send(JSON.stringify(registerMessage(keys, challenge.nonce as string)));
    const reg = await nextJson(ws);
    const expectedId = await peerIdFromPublicKey(new Uint8Array(keys.publicRaw));
    expect(reg).toEqual({ type: 'registered', peer_id: expectedId, relay_addr: `${relay.url}/rpc/${expectedId}`, features: ['one-way', 'peer-watch', 'peer-back', 'beat-batch'] });
    expect(await peersOnRelay()).toContain(expectedId);
    ws.close();
  });

  it('refuses a bad signature with a clear reason and registers nothing', async () => {
    const keys = makeKeys();
    const ws = new WebSocket(`${relay.url}/ws`);
    const challenge = await nextJson(ws);
    const msg = registerMessage(keys, challenge.nonce as string);
    const sig = Buffer.from(msg.signature, 'base64url');
    sig[0] = sig[0]! ^ 0xff;
    ws.send(JSON.stringify({ ...msg, signature: sig.toString('base64url') }));
    const [err] = await Promise.all([nextJson(ws), once(ws, 'close')]).then(([e, c]) => [e, c] as const);
    expect(err).toMatchObject({ type: 'error', code: 'MESH_ERR_UNAUTHORIZED' });
    expect(String(err.message)).toMatch(/bad signature/);
    expect(await peersOnRelay()).not.toContain(keys.peerId);
  });

  it('refuses a signature over another connection\'s nonce', async () => {
    const keys = makeKeys();
    const a = new WebSocket(`${relay.url}/ws`);
    const b = new WebSocket(`${relay.url}/ws`);
    const [ca, cb] = await Promise.all([nextJson(a), nextJson(b)]);
    expect(ca.nonce).not.toBe(cb.nonce);
    const closed = once<[number, Buffer]>(b, 'close');
    b.send(JSON.stringify(registerMessage(keys, ca.nonce as string)));
    const [code, reason] = await closed;
    expect(code).toBe(4001);
    expect(reason.toString()).toMatch(/bad signature/);
    expect(await peersOnRelay()).not.toContain(keys.peerId);
    a.close();
  });

  it('refuses frames before registration and malformed register messages', async () => {
    const ws = new WebSocket(`${relay.url}/ws`);
    await nextJson(ws);
    const closed = once<[number, Buffer]>(ws, 'close');
    ws.send(Buffer.from([1, 1, 1, 0, 1, 0, 0, 0]));
    const [code, reason] = await closed;
    expect(code).toBe(1008);
    expect(reason.toString()).toMatch(/register/);
  });

  it('a second connection with the same key replaces the first', async () => {
    const keys = makeKeys();
    const first = new RawPeer(keys);
    await first.open(relay.url);
    const firstClosed = once<[number, Buffer]>(first.ws, 'close');
    const second = new RawPeer(keys, () => ({ status: 200, headers: {}, body: new TextEncoder().encode('second') }));
    await second.open(relay.url);
    const [code, reason] = await firstClosed;
    expect(code).toBe(4002);
    expect(reason.toString()).toMatch(/replaced/);
    expect(second.peerId).toBe(first.peerId);
    const caller = await RawPeer.connect(relay.url);
    const r = await caller.request(second.peerId, { path: '/x' });
    expect(new TextDecoder().decode(r.body)).toBe('second');
    await Promise.all([second.close(), caller.close()]);
  });
});

describe('tensors cross bit-exact', () => {
  it('a bf16 1×1×4096 activation crosses /rpc (base64) and the fast path (binary) unchanged', async () => {
    const echo = await RawPeer.connect(relay.url);
    const caller = await RawPeer.connect(relay.url);
    const bytes = encodeTensor(randomActivation(4096), 'bf16');
    expect(bytes.byteLength).toBe(8192);
    const headers = { 'x-meshnet-shape': '1,1,4096', 'x-meshnet-dtype': 'bf16', 'content-type': 'application/octet-stream' };

    const fast = await caller.request(echo.peerId, { headers, body: bytes });
    expect(fast.status).toBe(200);
    expect(Buffer.compare(Buffer.from(fast.body), Buffer.from(bytes))).toBe(0);
    expect(Array.from(decodeTensor(fast.body, 'bf16'))).toEqual(Array.from(decodeTensor(bytes, 'bf16')));

    const rpc = await RpcSocket.open(echo.relayAddr);
    const answer = await rpc.call({ request_id: 'abc123', method: 'POST', path: '/forward', headers, body_base64: Buffer.from(bytes).toString('base64') });
    expect(answer.request_id).toBe('abc123');
    expect(answer.status).toBe(200);
    expect(Buffer.compare(Buffer.from(answer.body_base64 as string, 'base64'), Buffer.from(bytes))).toBe(0);
    rpc.close();
    await Promise.all([echo.close(), caller.close()]);
  });

  it('the relay delivers the caller as source peer id and never sees the caller\'s stream id', async () => {
    const seen: string[] = [];
    const target = await RawPeer.connect(relay.url, (r) => {
      seen.push(r.from);
      return { status: 204, headers: {}, body: new Uint8Array(0) };
    });
    const caller = await RawPeer.connect(relay.url);
    const r = await caller.request(target.peerId, { path: '/health', method: 'GET' }, 0xdeadbeef);
    expect(r.status).toBe(204);
    expect(seen).toEqual([caller.peerId]);
    expect(target.received[0]!.streamId).not.toBe(0xdeadbeef);
    await Promise.all([target.close(), caller.close()]);
  });
});

describe('many callers, many peers', () => {
  it('200 concurrent requests from 4 callers to 2 peers each reach the right caller (fast path and /rpc)', async () => {
    const tag = (name: string) => async (r: { body: Uint8Array }) => {
      await new Promise((res) => setTimeout(res, Math.random() * 5));
      return { status: 200, headers: { 'x-served-by': name }, body: r.body };
    };
    const peers = [await RawPeer.connect(relay.url, tag('p0')), await RawPeer.connect(relay.url, tag('p1'))];
    const callers = await Promise.all([0, 1, 2, 3].map(() => RawPeer.connect(relay.url)));
    const rpcs = await Promise.all(peers.map((p) => RpcSocket.open(p.relayAddr)));
    const jobs: Array<Promise<void>> = [];
    for (let i = 0; i < 200; i++) {
      const c = i % 4;
      const p = i % 2;
      const payload = `caller${c}-req${i}`;
      if (i % 5 === 0) {
        jobs.push(
          rpcs[p]!.call({ request_id: `r${i}`, method: 'POST', path: '/echo', headers: { 'content-type': 'text/plain' }, body: payload }).then((a) => {
            expect(a.request_id).toBe(`r${i}`);
            expect(a.headers).toMatchObject({ 'x-served-by': `p${p}` });
            expect(Buffer.from(a.body_base64 as string, 'base64').toString()).toBe(payload);
          }),
        );
      } else {
        jobs.push(
          callers[c]!.request(peers[p]!.peerId, { body: new TextEncoder().encode(payload) }).then((r) => {
            expect(r.headers['x-served-by']).toBe(`p${p}`);
            expect(new TextDecoder().decode(r.body)).toBe(payload);
          }),
        );
      }
    }
    await Promise.all(jobs);
    rpcs.forEach((r) => r.close());
    await Promise.all([...peers, ...callers].map((p) => p.close()));
  });

  it('keeps request ids of different /rpc callers apart when they reuse the same id', async () => {
    const peer = await RawPeer.connect(relay.url, async (r) => {
      await new Promise((res) => setTimeout(res, 10));
      return { status: 200, headers: {}, body: r.body };
    });
    const a = await RpcSocket.open(peer.relayAddr);
    const b = await RpcSocket.open(peer.relayAddr);
    const [ra, rb] = await Promise.all([
      a.call({ request_id: 'same', path: '/forward', body: 'from-a' }),
      b.call({ request_id: 'same', path: '/forward', body: 'from-b' }),
    ]);
    expect(Buffer.from(ra.body_base64 as string, 'base64').toString()).toBe('from-a');
    expect(Buffer.from(rb.body_base64 as string, 'base64').toString()).toBe('from-b');
    a.close();
    b.close();
    await peer.close();
  });
});

describe('errors of docs/protocol.md §3 arrive with their status and a JSON body', () => {
  it('404: /rpc handshake to a peer that is not connected', async () => {
    const err = await RpcSocket.open(`${relay.url}/rpc/${'0'.repeat(32)}`).catch((e: { status: number; body: string }) => e);
    expect((err as { status: number }).status).toBe(404);
    expect(JSON.parse((err as { body: string }).body).error.code).toBe('MESH_ERR_NO_SUCH_PEER');
  });

  it('404: fast-path request to an unknown peer, and /rpc request after the peer left', async () => {
    const caller = await RawPeer.connect(relay.url);
    const r = await caller.request('f'.repeat(32), { body: new Uint8Array(4) });
    expect(r.status).toBe(404);
    expect(JSON.parse(Buffer.from(r.body).toString()).error.code).toBe('MESH_ERR_NO_SUCH_PEER');

    const peer = await RawPeer.connect(relay.url);
    const rpc = await RpcSocket.open(peer.relayAddr);
    await peer.close();
    await new Promise((res) => setTimeout(res, 50));
    const a = await rpc.call({ request_id: 'gone', path: '/forward', body: 'x' });
    expect(a.status).toBe(404);
    expect(JSON.parse(a.body as string).error.code).toBe('MESH_ERR_NO_SUCH_PEER');
    rpc.close();
    await caller.close();
  });

  it('502: the peer goes away mid-request (fast path and /rpc)', async () => {
    const peer = await RawPeer.connect(relay.url, () => null);
    const caller = await RawPeer.connect(relay.url);
    const rpc = await RpcSocket.open(peer.relayAddr);
    const fast = caller.request(peer.peerId, { body: new Uint8Array(8) });
    const viaRpc = rpc.call({ request_id: 'mid', path: '/forward', body: 'x' });
    await new Promise((res) => setTimeout(res, 100));
    peer.ws.terminate();
    const [f, r] = await Promise.all([fast, viaRpc]);
    expect(f.status).toBe(502);
    expect(JSON.parse(Buffer.from(f.body).toString()).error.code).toBe('MESH_ERR_PEER_GONE');
    expect(r.status).toBe(502);
    expect(JSON.parse(r.body as string).error.code).toBe('MESH_ERR_PEER_GONE');
    rpc.close();
    await caller.close();
  });

  it('504: the peer never answers within the request timeout, and it is told to cancel', async () => {
    const peer = await RawPeer.connect(relay.url, () => null);
    const caller = await RawPeer.connect(relay.url);
    const rpc = await RpcSocket.open(peer.relayAddr);
    const t0 = Date.now();
    const [f, r] = await Promise.all([caller.request(peer.peerId, { body: new Uint8Array(8) }), rpc.call({ request_id: 'slow', path: '/forward', body: 'x' })]);
    expect(Date.now() - t0).toBeGreaterThanOrEqual(1400);
    expect(f.status).toBe(504);
    expect(JSON.parse(Buffer.from(f.body).toString()).error.code).toBe('MESH_ERR_TIMEOUT');
    expect(r.status).toBe(504);
    expect(peer.received.some((fr) => fr.kind === 4)).toBe(true); // CANCEL reached the peer
    rpc.close();
    await Promise.all([peer.close(), caller.close()]);
  });

  it('413: a body over the relay limit, on both paths, and the sockets stay usable', async () => {
    const peer = await RawPeer.connect(relay.url);
    const caller = await RawPeer.connect(relay.url);
    const big = new Uint8Array((1 << 20) + 1);
    const f = await caller.request(peer.peerId, { body: big });
    expect(f.status).toBe(413);
    expect(JSON.parse(Buffer.from(f.body).toString()).error.code).toBe('MESH_ERR_TOO_LARGE');
    const rpc = await RpcSocket.open(peer.relayAddr);
    const r = await rpc.call({ request_id: 'big', path: '/forward', body_base64: Buffer.from(big).toString('base64') });
    expect(r.status).toBe(413);
    const ok = await rpc.call({ request_id: 'small', path: '/forward', body: 'fine' });
    expect(ok.status).toBe(200);
    expect((await caller.request(peer.peerId, { body: new Uint8Array(10) })).status).toBe(200);
    rpc.close();
    await Promise.all([peer.close(), caller.close()]);
  });

  it('400: malformed /rpc requests (not JSON, missing path, bad base64) with the request_id when readable', async () => {
    const peer = await RawPeer.connect(relay.url);
    const rpc = await RpcSocket.open(peer.relayAddr);
    rpc.sendRaw('{not json');
    const a = await rpc.nextOther();
    expect(a).toMatchObject({ request_id: null, status: 400 });
    expect(JSON.parse(a.body as string).error.code).toBe('MESH_ERR_BAD_REQUEST');
    const b = await rpc.call({ request_id: 'nopath', method: 'POST' });
    expect(b.status).toBe(400);
    expect(JSON.parse(b.body as string).error.message).toMatch(/path/);
    const c = await rpc.call({ request_id: 'b64', path: '/forward', body_base64: '***' });
    expect(c.status).toBe(400);
    rpc.close();
    await peer.close();
  });

  it('400: malformed fast-path frames are answered on their stream', async () => {
    const caller = await RawPeer.connect(relay.url);
    const answered = new Promise<Buffer>((resolve) => caller.ws.once('message', (d: Buffer) => resolve(d)));
    // version 1, REQUEST, stream 7, but cut short before the peer id ends
    caller.ws.send(Buffer.from([1, 1, 1, 0, 7, 0, 0, 0, 1, 2, 3]));
    const d = await answered;
    expect(d[1]).toBe(2); // RESPONSE
    expect(d.readUInt32LE(4)).toBe(7);
    expect(d.readUInt16LE(8)).toBe(400);
    await caller.close();
  });
});

describe('backpressure and legacy peers', () => {
  it('503 once a peer has its limit of requests in flight', async () => {
    const limited = await startRelayProcess(['--max-in-flight-per-peer', '2']);
    const release: Array<() => void> = [];
    const peer = await RawPeer.connect(limited.url, () => new Promise((res) => release.push(() => res({ status: 200, headers: {}, body: new Uint8Array(0) }))));
    const caller = await RawPeer.connect(limited.url);
    const first = [caller.request(peer.peerId, {}), caller.request(peer.peerId, {})];
    const third = await caller.request(peer.peerId, {});
    expect(third.status).toBe(503);
    expect(JSON.parse(Buffer.from(third.body).toString()).error.code).toBe('MESH_ERR_BACKPRESSURE');
    while (release.length < 2) await new Promise((res) => setTimeout(res, 5));
    release.forEach((r) => r());
    expect((await Promise.all(first)).map((r) => r.status)).toEqual([200, 200]);
    await Promise.all([peer.close(), caller.close()]);
    await limited.stop();
  });

  it('an ADR-era peer (JSON envelopes only) still answers fast-path callers', async () => {
    const legacy = await RawPeer.connect(relay.url, (r) => ({ status: 200, headers: { 'content-type': 'application/octet-stream' }, body: r.body }), {});
    const caller = await RawPeer.connect(relay.url);
    const body = encodeTensor(randomActivation(64), 'bf16');
    const r = await caller.request(legacy.peerId, { headers: { 'x-meshnet-shape': '1,1,64' }, body });
    expect(r.status).toBe(200);
    expect(Buffer.compare(Buffer.from(r.body), Buffer.from(body))).toBe(0);
    expect(legacy.envelopes.some((e) => e.type === 'relay-http-request')).toBe(true);
    expect(legacy.received).toHaveLength(0);
    await Promise.all([legacy.close(), caller.close()]);
  });
});

describe('HTTP surface', () => {
  it('/healthz and /metrics report peers, hops and latency', async () => {
    const peer = await RawPeer.connect(relay.url);
    const caller = await RawPeer.connect(relay.url);
    await caller.request(peer.peerId, { body: new Uint8Array(16) });
    const h = (await (await fetch(`${relay.httpUrl}/healthz`)).json()) as { status: string; peers: number };
    expect(h.status).toBe('ok');
    expect(h.peers).toBeGreaterThanOrEqual(2);
    const m = await (await fetch(`${relay.httpUrl}/metrics`)).text();
    expect(m).toMatch(/meshnet_relay_peers \d+/);
    expect(m).toMatch(/meshnet_relay_hops_total\{path="fast"\} [1-9]/);
    expect(m).toMatch(/meshnet_relay_hop_seconds_count\{path="fast"\} [1-9]/);
    const nf = await fetch(`${relay.httpUrl}/nope`);
    expect(nf.status).toBe(404);
    expect(((await nf.json()) as { error: { code: string } }).error.code).toBe('MESH_ERR_NOT_FOUND');
    await Promise.all([peer.close(), caller.close()]);
  });

  it('graceful shutdown answers what is in flight, then closes every socket', async () => {
    const r2 = await startRelayProcess();
    const peer = await RawPeer.connect(r2.url, async (r) => {
      await new Promise((res) => setTimeout(res, 300));
      return { status: 200, headers: {}, body: r.body };
    });
    const caller = await RawPeer.connect(r2.url);
    const inFlight = caller.request(peer.peerId, { body: new TextEncoder().encode('finish me') });
    await new Promise((res) => setTimeout(res, 50));
    const exited = r2.stop('SIGTERM');
    const r = await inFlight;
    expect(r.status).toBe(200);
    expect(new TextDecoder().decode(r.body)).toBe('finish me');
    expect(await exited).toBe(0);
    await new Promise((res) => setTimeout(res, 50));
    expect(caller.closed?.code).toBe(1001);
  });
});
