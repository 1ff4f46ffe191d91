import { describe, expect, it } from 'vitest';
import type { DirectRequest, FastPathClient } from '../../src/net/contract.ts';
import { HopTransport, HopUnreachableError } from '../../src/net/hop-transport.ts';
import type { MeshReply } from '../../src/protocol/envelopes.ts';
import type { MeshError } from '../../src/protocol/errors.ts';
import type { RouteHop } from '../../src/protocol/tracker.ts';

const PEER = 'b'.repeat(32);
const HOP: RouteHop = { peer_id: PEER, start_layer: 1, end_layer: 2, relay_addr: 'ws://127.0.0.1:9000/rpc/' + PEER, endpoint: 'http://127.0.0.1:7000' };
const ok: MeshReply = { status: 200, headers: {}, body: new Uint8Array([1]) };
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const req = { method: 'POST', path: '/forward', body: new Uint8Array(2) };

function paths(fastMs: number, directMs: number, opts: { fastFails?: boolean; directStatus?: number } = {}) {
  const used: string[] = [];
  const fast: FastPathClient = {
    relayUrl: 'ws://127.0.0.1:9000',
    isRegistered: true,
    async request() {
      used.push('fast');
      await sleep(fastMs);
      if (opts.fastFails) return { status: 404, headers: { 'content-type': 'application/json' }, body: new TextEncoder().encode('{"error":{"code":"MESH_ERR_NO_SUCH_PEER","message":"gone"}}') };
      return ok;
    },
  };
  const direct: DirectRequest = async (url) => {
    used.push(`direct ${url}`);
    await sleep(directMs);
    if (opts.directStatus) return { ...ok, status: opts.directStatus };
    return ok;
  };
  return { used, fast, direct };
}

describe('HopTransport', () => {
  it('takes the fast path for a hop on its own relay, and falls back to direct HTTP when the relay answers 404', async () => {
    const p = paths(0, 0, { fastFails: true });
    const t = new HopTransport({ fast: p.fast, direct: p.direct });
    expect(t.plan(HOP)).toEqual(['fast', 'direct']);
    expect((await t.send(HOP, req, 1000)).status).toBe(200);
    expect(p.used).toEqual(['fast', 'direct http://127.0.0.1:7000/forward']);
    // The path that answered goes first next time.
    expect(t.plan(HOP)).toEqual(['direct', 'fast']);
  });

  it('push: one-way on the fast path when the relay forwards them; when it refuses (the hop is gone) or cannot, an ordinary request over every path', async () => {
    const p = paths(0, 0, { fastFails: true });
    const pushed: string[] = [];
    let pushAnswer: MeshReply = { status: 202, headers: {}, body: new Uint8Array(0) };
    const fast: FastPathClient = { ...p.fast, push: (peer) => (pushed.push(peer), Promise.resolve(pushAnswer)) };
    const t = new HopTransport({ fast, direct: p.direct });
    // No news within the window: delivered, nothing else sent.
    expect((await t.push(HOP, req, 1000, 100)).status).toBe(202);
    expect([pushed, p.used]).toEqual([[PEER], []]);
    // The relay's 404: the hop is not there; every path is tried as for send() (fast 404, then direct).
    pushAnswer = { status: 404, headers: { 'content-type': 'application/json' }, body: new TextEncoder().encode('{"error":{"code":"MESH_ERR_NO_SUCH_PEER","message":"gone"}}') };
    expect((await t.push(HOP, req, 1000, 100)).status).toBe(200);
    expect(p.used).toEqual(['fast', 'direct http://127.0.0.1:7000/forward']);
    // A relay that does not forward one-way frames (push gives undefined): an ordinary request.
    const q = paths(0, 0);
    const old = new HopTransport({ fast: { ...q.fast, push: () => undefined }, direct: q.direct });
    expect((await old.push(HOP, req, 1000, 100)).status).toBe(200);
    expect(q.used).toEqual(['fast']);
  });

  it('uses /rpc for a relay address on another relay and direct HTTP for a hop with only an endpoint', () => {
    const p = paths(0, 0);
    const t = new HopTransport({ fast: p.fast, direct: p.direct, rpc: () => ({ request: async () => ok, close() {} }) });
    expect(t.plan({ ...HOP, relay_addr: 'ws://relay.example:443/rpc/' + PEER })).toEqual(['rpc', 'direct']);
    expect(t.plan({ peer_id: PEER, start_layer: 1, end_layer: 2, endpoint: 'http://x' })).toEqual(['direct']);
  });

  it('puts a link that is up first in the relay and direct orders, and measures it as a direct path in adaptive order', async () => {
    const p = paths(0, 0);
    let up = false;
    const viaLink: string[] = [];
    const link = () => (up ? async (peer: string) => (viaLink.push(peer), ok) : undefined);
    const relayOrder = new HopTransport({ fast: p.fast, direct: p.direct, link });
    expect(relayOrder.plan(HOP)).toEqual(['fast', 'direct']);
    up = true;
    expect(relayOrder.plan(HOP)).toEqual(['link', 'fast', 'direct']);
    expect(new HopTransport({ fast: p.fast, direct: p.direct, link, order: 'direct' }).plan(HOP)).toEqual(['link', 'direct', 'fast']);
    await relayOrder.send(HOP, req, 1000);
    expect(viaLink).toEqual([PEER]);
    expect(p.used).toEqual([]);
    // The link went down: the relay again, with no failed attempt first.
    up = false;
    await relayOrder.send(HOP, req, 1000);
    expect(p.used).toEqual(['fast']);
    const adaptive = new HopTransport({ fast: p.fast, direct: p.direct, link: () => async () => ok, order: 'adaptive' });
    const first = adaptive.plan(HOP);
    expect(first.slice().sort()).toEqual(['direct', 'fast', 'link']);
  });

  it('a link that comes up leads even for a hop first reached another way, until a request over it fails', async () => {
    const endpointOnly: RouteHop = { peer_id: PEER, start_layer: 1, end_layer: 2, endpoint: 'http://127.0.0.1:7000' };
    for (const hop of [endpointOnly, HOP]) {
      const p = paths(0, 0);
      let up = false;
      let linkFails = false;
      const viaLink: string[] = [];
      const link = () => (up ? async (peer: string) => (viaLink.push(peer), linkFails ? Promise.reject(new Error('link reset')) : ok) : undefined);
      const t = new HopTransport({ fast: p.fast, direct: p.direct, link });
      // While the link dials, the hop answers over the relay (or HTTP): that path is remembered...
      await t.send(hop, req, 1000);
      expect(p.used).toHaveLength(1);
      // ...but once the link is up it leads (it was stuck behind the remembered path before).
      up = true;
      await t.send(hop, req, 1000);
      await t.send(hop, req, 1000);
      expect(viaLink).toHaveLength(2);
      expect(p.used).toHaveLength(1);
      // A link that fails: the other path answers, and leads for a while (no failing attempt first on every request).
      linkFails = true;
      await t.send(hop, req, 1000);
      expect(viaLink).toHaveLength(3);
      expect(p.used).toHaveLength(2);
      await t.send(hop, req, 1000);
      expect(viaLink).toHaveLength(3);
      expect(p.used).toHaveLength(3);
    }
  });

  it('passes a 409 through (the caller replays) and rejects with HopUnreachableError when every path fails', async () => {
    const p409 = paths(0, 0, { fastFails: true, directStatus: 409 });
    expect((await new HopTransport({ fast: p409.fast, direct: p409.direct }).send(HOP, req, 1000)).status).toBe(409);
    const dead = paths(0, 0, { fastFails: true, directStatus: 502 });
    const err = await new HopTransport({ fast: dead.fast, direct: dead.direct }).send(HOP, req, 1000).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(HopUnreachableError);
    expect((err as MeshError).code).toBe('MESH_ERR_PEER_GONE');
  });

  it('hands a 503 MESH_ERR_BUSY (the hop has no KV room) to the caller without trying another path, but tries on after a relay\'s 503', async () => {
    const utf8 = new TextEncoder();
    const busy: MeshReply = { status: 503, headers: { 'content-type': 'application/json', 'retry-after': '1' }, body: utf8.encode('{"error":{"code":"MESH_ERR_BUSY","message":"no KV room","retry_after_ms":1000}}') };
    const relay503: MeshReply = { status: 503, headers: { 'content-type': 'application/json' }, body: utf8.encode('{"error":{"code":"MESH_ERR_BACKPRESSURE","message":"full"}}') };
    for (const [first, tried] of [[busy, ['fast']], [relay503, ['fast', 'direct']]] as const) {
      const used: string[] = [];
      const fast: FastPathClient = { relayUrl: 'ws://127.0.0.1:9000', isRegistered: true, request: async () => (used.push('fast'), first) };
      const direct: DirectRequest = async () => (used.push('direct'), busy);
      const reply = await new HopTransport({ fast, direct }).send(HOP, req, 1000);
      expect(reply.status).toBe(503);
      expect(used).toEqual(tried);
    }
  });

  it("with order 'adaptive', moves one-token steps to the path with the lower measured round trip", async () => {
    const p = paths(40, 1);
    const t = new HopTransport({ fast: p.fast, direct: p.direct, order: 'adaptive' });
    for (let i = 0; i < 40; i++) await t.send(HOP, req, 1000, undefined, { sample: true });
    const last = p.used.slice(10).map((u) => u.split(' ')[0]);
    expect(last.filter((u) => u === 'direct').length, last.join(' ')).toBeGreaterThanOrEqual(last.length - 2);
    const q = paths(1, 40);
    const t2 = new HopTransport({ fast: q.fast, direct: q.direct, order: 'adaptive' });
    for (let i = 0; i < 40; i++) await t2.send(HOP, req, 1000, undefined, { sample: true });
    const last2 = q.used.slice(10).map((u) => u.split(' ')[0]);
    expect(last2.filter((u) => u === 'fast').length, last2.join(' ')).toBeGreaterThanOrEqual(last2.length - 2);
  });
});
