/**
 * The data-channel pool (src/net/rtc-pool.ts) with a fake host: peer
 * connections that pair two in-memory channels when offer and answer have
 * crossed, signalling handed straight to the other pool's onSignal (what
 * the relay does, naming the sender). The real channels, in Chromium, are
 * the Playwright meshes' (e2e/fortunes-tiny.spec.ts).
 */
import { afterEach, describe, expect, it } from 'vitest';
import type { MeshReply, MeshRequest } from '../../src/protocol/envelopes.ts';
import { MeshError } from '../../src/protocol/errors.ts';
import { randomHex } from '../../src/protocol/ids.ts';
import type { MeshHandler } from '../../src/net/contract.ts';
import type { DataChannelLike, RtcFactory, RtcPeerHandle, RtcPeerInit, RtcSignal } from '../../src/net/rtc-peer.ts';
import { RtcPool, type RtcPoolInit } from '../../src/net/rtc-pool.ts';
import { RTC_SIGNAL_PATH, proofFromHeaders, type RouteProof, type SignalMessage } from '../../src/net/rtc-signal.ts';
import { ChannelSocket } from '../../src/net/rtc-socket.ts';

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

/** One in-memory data channel end; `link` pairs two. Delivery is async, in order, as a real channel's. */
class FakeChannel implements DataChannelLike {
  binaryType = 'arraybuffer';
  readyState: DataChannelLike['readyState'] = 'connecting';
  bufferedAmount = 0;
  onopen: ((ev: unknown) => void) | null = null;
  onmessage: ((ev: { data: unknown }) => void) | null = null;
  onclose: ((ev: unknown) => void) | null = null;
  onerror: ((ev: unknown) => void) | null = null;
  other: FakeChannel | undefined;
  sent = 0;
  send(data: string | Uint8Array | ArrayBuffer): void {
    if (this.readyState !== 'open') throw new Error('not open');
    this.sent++;
    const copy = typeof data === 'string' ? data : (data instanceof ArrayBuffer ? new Uint8Array(data) : data).slice().buffer;
    const to = this.other!;
    setTimeout(() => to.readyState === 'open' && to.onmessage?.({ data: copy }), 0);
  }
  open(): void {
    this.readyState = 'open';
    this.onopen?.({});
  }
  close(): void {
    if (this.readyState === 'closed') return;
    this.readyState = 'closed';
    setTimeout(() => this.onclose?.({}), 0);
    this.other?.close();
  }
}

/** Peer connections of many fake hosts: an offer names its channel, the answer opens both ends. */
class Switchboard {
  private readonly offers = new Map<string, FakeChannel>();
  /** When set, no answer comes (ICE never connects). */
  blackhole = false;
  created = 0;
  factory(): RtcFactory & { handles: RtcPeerHandle[] } {
    const handles: RtcPeerHandle[] = [];
    const offers = this.offers;
    const blackhole = () => this.blackhole;
    const created = () => this.created++;
    return {
      handles,
      create(init: RtcPeerInit): RtcPeerHandle {
        created();
        const mine = new FakeChannel();
        let resolve!: (c: DataChannelLike) => void;
        const channel = new Promise<DataChannelLike>((r) => (resolve = r));
        let closed = false;
        if (init.initiator) {
          const token = randomHex(8);
          offers.set(token, mine);
          resolve(mine);
          setTimeout(() => {
            init.onSignal({ type: 'offer', sdp: `fake-offer ${token}` });
            init.onSignal({ type: 'candidate', candidate: 'candidate:1 1 udp 1 10.200.0.1 5000 typ host' });
          }, 0);
        }
        const handle: RtcPeerHandle = {
          channel,
          async signal(s: RtcSignal) {
            if (closed) throw new Error('closed');
            if (s.type === 'offer') {
              const theirs = offers.get(s.sdp.split(' ')[1]!);
              if (!theirs) throw new Error('unknown offer');
              mine.other = theirs;
              theirs.other = mine;
              resolve(mine);
              if (blackhole()) return;
              setTimeout(() => init.onSignal({ type: 'answer', sdp: 'fake-answer' }), 0);
            } else if (s.type === 'answer') {
              setTimeout(() => {
                mine.open();
                mine.other!.open();
              }, 0);
            }
          },
          close() {
            closed = true;
            mine.close();
          },
        };
        handles.push(handle);
        return handle;
      },
    };
  }
}

const echo: MeshHandler = async (req) => ({ status: 200, headers: { 'x-path': req.path }, body: req.body });

interface TestNode {
  id: string;
  pool: RtcPool;
  signals: Array<{ to: string; msg: SignalMessage; status?: number }>;
}

const pools: RtcPool[] = [];
afterEach(() => {
  for (const p of pools.splice(0)) p.close();
});

/** Nodes whose signals reach each other's pools as the relay would deliver them (`from` = the sender). */
function mesh(board: Switchboard, n: number, over: (i: number) => Partial<RtcPoolInit> = () => ({})): TestNode[] {
  const nodes: TestNode[] = [];
  for (let i = 0; i < n; i++) {
    const id = randomHex(16);
    const node: TestNode = { id, pool: undefined as unknown as RtcPool, signals: [] };
    node.pool = new RtcPool({
      selfId: id,
      factory: board.factory(),
      authorize: async () => {},
      handler: echo,
      retryMs: 1_000,
      async sendSignal(peerId, msg) {
        const rec: { to: string; msg: SignalMessage; status?: number } = { to: peerId, msg };
        node.signals.push(rec);
        const to = nodes.find((x) => x.id === peerId);
        let reply: MeshReply;
        if (!to) reply = { status: 404, headers: {}, body: utf8.encode(JSON.stringify({ error: { code: 'MESH_ERR_NO_SUCH_PEER', message: 'gone' } })) };
        else {
          const res = await to.pool.onSignal(id, signalRequest(msg));
          reply = { status: res.status, headers: res.headers, body: res.body as Uint8Array };
        }
        rec.status = reply.status;
        return reply;
      },
      ...over(i),
    });
    pools.push(node.pool);
    nodes.push(node);
  }
  return nodes;
}

function signalRequest(msg: unknown): MeshRequest {
  return { method: 'POST', path: RTC_SIGNAL_PATH, headers: { 'content-type': 'application/json' }, body: utf8.encode(JSON.stringify(msg)) };
}

const proof: RouteProof = { head: 'a'.repeat(32), route: '[]', expires: Date.now() + 60_000, signature: 'sig' };

async function until<T>(f: () => T | undefined, ms = 3_000): Promise<T> {
  const end = Date.now() + ms;
  for (;;) {
    const v = f();
    if (v !== undefined && v !== false) return v;
    if (Date.now() > end) throw new Error('timed out');
    await new Promise((r) => setTimeout(r, 5));
  }
}

describe('RtcPool', () => {
  it('dials in the background, then carries requests both ways and one-way pushes', async () => {
    const board = new Switchboard();
    const [a, b] = mesh(board, 2);
    expect(a!.pool.requester(b!.id, proof)).toBeUndefined();
    expect(a!.pool.state(b!.id)).toBe('connecting');
    // A second call while dialling starts no second connection.
    expect(a!.pool.requester(b!.id, proof)).toBeUndefined();
    const req = await until(() => a!.pool.requester(b!.id));
    expect(board.created).toBe(2);
    const reply = await req(b!.id, { method: 'POST', path: '/forward', body: utf8.encode('hi') });
    expect(reply.status).toBe(200);
    expect(utf8d.decode(reply.body)).toBe('hi');
    // The answering side uses the same channel without dialling.
    const back = await until(() => b!.pool.requester(a!.id));
    expect((await back(a!.id, { method: 'GET', path: '/info' })).headers['x-path']).toBe('/info');
    expect(board.created).toBe(2);
    const pushed = await req.push!(b!.id, { method: 'POST', path: '/chain/token' }, { timeoutMs: 50 });
    expect(pushed?.status).toBe(202);
    expect(a!.pool.state(b!.id)).toBe('open');
    expect(a!.pool.snapshot()).toEqual([expect.objectContaining({ peer_id: b!.id, state: 'open' })]);
  });

  it('the handler sees the far side as the caller, and a frame naming another peer is refused', async () => {
    const board = new Switchboard();
    const seen: string[] = [];
    const [a, b] = mesh(board, 2, () => ({ handler: async (req) => (seen.push(req.from ?? '?'), { status: 200, headers: {}, body: new Uint8Array(0) }) }));
    a!.pool.requester(b!.id, proof);
    const req = await until(() => a!.pool.requester(b!.id));
    await req(b!.id, { method: 'POST', path: '/forward' });
    expect(seen).toEqual([a!.id]);
    const wrong = await req(randomHex(16), { method: 'POST', path: '/forward' });
    expect(wrong.status).toBe(404);
    expect(utf8d.decode(wrong.body)).toContain('MESH_ERR_NO_SUCH_PEER');
  });

  it('refuses an offer from a peer the route check refuses (403), and the dialler backs off', async () => {
    const board = new Switchboard();
    let t = 1_000_000;
    const [a, b] = mesh(board, 2, (i) => ({
      now: () => t,
      ...(i === 1 ? { authorize: async (caller: string) => Promise.reject(new MeshError('MESH_ERR_FORBIDDEN', `${caller} is not on the route`)) } : {}),
    }));
    a!.pool.requester(b!.id, proof);
    await until(() => a!.pool.state(b!.id) === 'failed');
    expect(a!.signals[0]!.status).toBe(403);
    expect(b!.pool.counts.refused).toBe(1);
    expect(b!.pool.state(a!.id)).toBe('none');
    // Within the backoff: no new dial.
    const before = board.created;
    a!.pool.requester(b!.id, proof);
    expect(board.created).toBe(before);
    t += 1_001;
    a!.pool.requester(b!.id, proof);
    expect(board.created).toBe(before + 1);
  });

  it('refuses an offer without a route proof, signals for connections it does not have, and another peer\'s connection', async () => {
    const board = new Switchboard();
    const [a, b, c] = mesh(board, 3);
    const noProof = await b!.pool.onSignal(a!.id, signalRequest({ conn: randomHex(12), signal: { type: 'offer', sdp: 'v=0' } }));
    expect(noProof.status).toBe(403);
    const unknown = await b!.pool.onSignal(a!.id, signalRequest({ conn: randomHex(12), signal: { type: 'candidate', candidate: 'x' } }));
    expect(unknown.status).toBe(404);
    // c tries to inject an answer into a's connection with b.
    a!.pool.requester(b!.id, proof);
    const conn = await until(() => a!.signals.find((s) => s.msg.signal.type === 'offer')?.msg.conn);
    const hijack = await b!.pool.onSignal(c!.id, signalRequest({ conn, signal: { type: 'candidate', candidate: 'candidate:9 1 udp 1 10.0.0.9 9 typ host' } }));
    expect(hijack.status).toBe(403);
    expect(utf8d.decode((hijack.body as Uint8Array))).toContain('MESH_ERR_FORBIDDEN');
    const bad = await b!.pool.onSignal(a!.id, { ...signalRequest({}), body: utf8.encode('{nope') });
    expect(bad.status).toBe(400);
    const big = await b!.pool.onSignal(a!.id, { ...signalRequest({}), body: new Uint8Array(70_000) });
    expect(big.status).toBe(413);
    // The real dial still opens.
    await until(() => a!.pool.requester(b!.id));
  });

  it('marks a peer that does not know /rtc/signal as unsupported, and does not dial it again', async () => {
    const board = new Switchboard();
    const [a] = mesh(board, 1);
    const nodeJs = randomHex(16);
    const pool = new RtcPool({
      selfId: a!.id,
      factory: board.factory(),
      authorize: async () => {},
      handler: echo,
      sendSignal: async () => ({ status: 404, headers: {}, body: utf8.encode(JSON.stringify({ error: { code: 'MESH_ERR_NOT_FOUND', message: 'no route for POST /rtc/signal' } })) }),
    });
    pools.push(pool);
    pool.requester(nodeJs, proof);
    await until(() => pool.state(nodeJs) === 'unsupported');
    const n = board.created;
    pool.requester(nodeJs, proof);
    expect(board.created).toBe(n);
  });

  it('gives up on a channel that does not open in time', async () => {
    const board = new Switchboard();
    board.blackhole = true;
    const [a, b] = mesh(board, 2, () => ({ openTimeoutMs: 50 }));
    a!.pool.requester(b!.id, proof);
    await until(() => a!.pool.state(b!.id) === 'failed');
    expect(a!.pool.snapshot()[0]!.failure).toContain('did not open within 50 ms');
    // The far side heard of it and dropped its half.
    await until(() => b!.pool.state(a!.id) === 'none');
  });

  it('a channel that closes fails its requests at once, and the peer is dialled again after a pause', async () => {
    const board = new Switchboard();
    let t = 5_000_000;
    const slow: MeshHandler = () => new Promise(() => {});
    const [a, b] = mesh(board, 2, (i) => ({ now: () => t, ...(i === 1 ? { handler: slow } : {}) }));
    a!.pool.requester(b!.id, proof);
    const req = await until(() => a!.pool.requester(b!.id));
    const pending = req(b!.id, { method: 'POST', path: '/forward' }, { timeoutMs: 10_000 });
    await new Promise((r) => setTimeout(r, 10));
    const t0 = Date.now();
    b!.pool.closePeer(a!.id, 'test');
    await expect(pending).rejects.toMatchObject({ code: 'MESH_ERR_PEER_GONE' });
    expect(Date.now() - t0).toBeLessThan(500);
    await until(() => a!.pool.state(b!.id) !== 'open');
    expect(a!.pool.requester(b!.id, proof)).toBeUndefined();
    const before = board.created;
    t += 1_001;
    a!.pool.requester(b!.id, proof);
    expect(board.created).toBe(before + 1);
    expect(a!.pool.counts.closed).toBe(1);
  });

  it('closes idle channels and keeps at most maxChannels, evicting the least recently used', async () => {
    const board = new Switchboard();
    let t = 9_000_000;
    const nodes = mesh(board, 4, () => ({ now: () => t, maxChannels: 2, idleMs: 60_000 }));
    const [a, b, c, d] = nodes;
    a!.pool.requester(b!.id, proof);
    await until(() => a!.pool.requester(b!.id));
    t += 10;
    a!.pool.requester(c!.id, proof);
    await until(() => a!.pool.requester(c!.id));
    t += 10;
    a!.pool.requester(d!.id, proof);
    await until(() => a!.pool.requester(d!.id));
    expect(a!.pool.state(b!.id)).not.toBe('open');
    expect(a!.pool.openCount).toBe(2);
    // A node at its most refuses an offer (503) rather than evicting a channel in use.
    b!.pool.requester(c!.id, proof);
    await until(() => b!.pool.requester(c!.id));
    expect(c!.pool.openCount).toBe(2);
    const full = await c!.pool.onSignal(d!.id, signalRequest({ conn: randomHex(12), signal: { type: 'offer', sdp: 'v=0' }, proof }));
    expect(full.status).toBe(503);
    expect(utf8d.decode(full.body as Uint8Array)).toContain('its most');
    t += 120_000;
    a!.pool.requester(randomHex(16));
    (a!.pool as unknown as { sweep(): void }).sweep();
    expect(a!.pool.openCount).toBe(0);
  });
});

describe('ChannelSocket', () => {
  function pair(fragmentBytes: number, maxMessageBytes?: number): [ChannelSocket, ChannelSocket, FakeChannel] {
    const x = new FakeChannel();
    const y = new FakeChannel();
    x.other = y;
    y.other = x;
    x.readyState = 'open';
    y.readyState = 'open';
    return [new ChannelSocket(x, { fragmentBytes }), new ChannelSocket(y, { fragmentBytes, ...(maxMessageBytes ? { maxMessageBytes } : {}) }), x];
  }

  it('sends small messages whole and big ones as fragments, reassembled in order', async () => {
    const [s, r, raw] = pair(1024);
    const got: unknown[] = [];
    r.onmessage = (e) => got.push(e.data);
    const big = new Uint8Array(5000).map((_, i) => i & 255);
    big[0] = 1; // a frame's version byte
    s.send(new Uint8Array([1, 2, 3]));
    s.send(big);
    s.send('text');
    await until(() => got.length === 3 || undefined);
    expect(new Uint8Array(got[0] as ArrayBuffer)).toEqual(new Uint8Array([1, 2, 3]));
    expect(got[1]).toEqual(big);
    expect(got[2]).toBe('text');
    expect(raw.sent).toBe(1 + 5 + 1);
  });

  it('closes on a fragmented message over its limit', async () => {
    const [s, r] = pair(1024, 2048);
    let closed: { code?: number; reason?: string } | undefined;
    r.onclose = (e) => (closed = e);
    r.onerror = () => {};
    s.send(new Uint8Array(4096).fill(1));
    await until(() => closed);
    expect(closed!.code).toBe(1002);
  });

  it('delays every received message, in order, when asked (benches)', async () => {
    const x = new FakeChannel();
    const y = new FakeChannel();
    x.other = y;
    y.other = x;
    x.readyState = y.readyState = 'open';
    const s = new ChannelSocket(x);
    const r = new ChannelSocket(y, { delayMs: 30 });
    const got: number[] = [];
    const t0 = Date.now();
    r.onmessage = () => got.push(Date.now() - t0);
    s.send(new Uint8Array([1]));
    s.send(new Uint8Array([2]));
    await until(() => got.length === 2 || undefined);
    expect(got[0]).toBeGreaterThanOrEqual(28);
  });
});

describe('proofFromHeaders', () => {
  it('reads a chained request\'s signed route, and nothing from a partial one', () => {
    const h = { 'x-meshnet-chain-head': 'a'.repeat(32), 'x-meshnet-route': '[{"peer_id":"b"}]', 'x-meshnet-route-expires': '1700000000000', 'x-meshnet-route-signature': 'abc' };
    expect(proofFromHeaders(h)).toEqual({ head: 'a'.repeat(32), route: '[{"peer_id":"b"}]', expires: 1700000000000, signature: 'abc' });
    expect(proofFromHeaders({ ...h, 'x-meshnet-route-expires': 'soon' })).toBeUndefined();
    const { 'x-meshnet-chain-head': _, ...noHead } = h;
    expect(proofFromHeaders(noHead)).toBeUndefined();
  });
});
