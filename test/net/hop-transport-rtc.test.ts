/**
 * The hop transport's data-channel path (kind 'rtc', docs/protocol.md §12):
 * an open channel leads every order, the route proof reaches the dialler
 * (from the chain headers or the caller), and a channel that fails a
 * request hands it to the relay at once and stops leading for a while.
 */
import { describe, expect, it } from 'vitest';
import type { FastPathClient, PeerRequester } from '../../src/net/contract.ts';
import { HopTransport } from '../../src/net/hop-transport.ts';
import type { RouteProof } from '../../src/net/rtc-signal.ts';
import { MeshError } from '../../src/protocol/errors.ts';
import type { MeshReply } from '../../src/protocol/envelopes.ts';
import type { RouteHop } from '../../src/protocol/tracker.ts';

const PEER = 'c'.repeat(32);
const HOP: RouteHop = { peer_id: PEER, start_layer: 1, end_layer: 2, relay_addr: 'ws://127.0.0.1:9000/rpc/' + PEER };
const ok: MeshReply = { status: 200, headers: {}, body: new Uint8Array([1]) };
const req = { method: 'POST', path: '/forward', body: new Uint8Array(2) };
const chainHeaders = { 'x-meshnet-chain-head': 'a'.repeat(32), 'x-meshnet-route': '[]', 'x-meshnet-route-expires': '1900000000000', 'x-meshnet-route-signature': 'sig' };

function setup() {
  const used: string[] = [];
  const proofs: Array<RouteProof | undefined> = [];
  let open = false;
  let fail: MeshError | undefined;
  const channel: PeerRequester = async () => {
    used.push('rtc');
    if (fail) throw fail;
    return ok;
  };
  channel.push = () => (used.push('rtc push'), fail ? Promise.reject(fail) : Promise.resolve({ status: 202, headers: {}, body: new Uint8Array(0) }));
  const fast: FastPathClient = {
    relayUrl: 'ws://127.0.0.1:9000',
    isRegistered: true,
    request: async () => (used.push('fast'), ok),
    push: () => (used.push('fast push'), Promise.resolve({ status: 202, headers: {}, body: new Uint8Array(0) })),
  };
  const t = new HopTransport({
    fast,
    rtc: (peer, proof) => {
      proofs.push(proof);
      return open && peer === PEER ? channel : undefined;
    },
  });
  return { t, used, proofs, setOpen: (v: boolean) => (open = v), setFail: (e: MeshError | undefined) => (fail = e), channel };
}

describe('HopTransport over data channels', () => {
  it('goes by the relay while no channel is open, handing the dialler the proof from the chain headers or the caller', async () => {
    const s = setup();
    await s.t.send(HOP, { ...req, headers: chainHeaders }, 1000);
    expect(s.used).toEqual(['fast']);
    expect(s.proofs[0]).toEqual({ head: 'a'.repeat(32), route: '[]', expires: 1900000000000, signature: 'sig' });
    const proof: RouteProof = { head: 'd'.repeat(32), route: '[1]', expires: 5, signature: 'x' };
    await s.t.push(HOP, { method: 'POST', path: '/chain/token' }, 1000, 50, undefined, { proof });
    expect(s.proofs.at(-1)).toEqual(proof);
    expect(s.used).toEqual(['fast', 'fast push']);
    expect(s.t.paths()).toEqual([expect.objectContaining({ peer_id: PEER, path: 'fast', sent: { fast: 2 } })]);
  });

  it('an open channel leads sends and one-way pushes, and /info counts them', async () => {
    const s = setup();
    s.setOpen(true);
    expect(s.t.plan(HOP)).toEqual(['rtc', 'fast']);
    await s.t.send(HOP, req, 1000);
    expect((await s.t.push(HOP, req, 1000, 50)).status).toBe(202);
    expect(s.used).toEqual(['rtc', 'rtc push']);
    expect(s.t.sent.rtc).toBe(2);
    expect(s.t.paths()[0]).toMatchObject({ path: 'rtc', sent: { rtc: 2 } });
  });

  it('a request that fails on the channel goes by the relay at once, and the channel does not lead for a while', async () => {
    const s = setup();
    s.setOpen(true);
    s.setFail(new MeshError('MESH_ERR_PEER_GONE', 'data channel with x lost'));
    const t0 = performance.now();
    expect((await s.t.send(HOP, req, 10_000)).status).toBe(200);
    expect(performance.now() - t0).toBeLessThan(100);
    expect(s.used).toEqual(['rtc', 'fast']);
    expect(s.t.plan(HOP)).toEqual(['fast', 'rtc']);
    // A one-way push over a channel that fails within its window is sent again over every path.
    const u = setup();
    u.setOpen(true);
    u.setFail(new MeshError('MESH_ERR_PEER_GONE', 'closed'));
    expect((await u.t.push(HOP, req, 1000, 50)).status).toBe(200);
    expect(u.used).toEqual(['rtc push', 'fast']);
  });

  it('a hop\'s 204 (a dropped session) and its own 404 are answers: the channel keeps leading, nothing goes again by the relay', async () => {
    const used: string[] = [];
    let status = 204;
    let code = '';
    const channel: PeerRequester = async () => (used.push('rtc'), { status, headers: {}, body: new TextEncoder().encode(code ? JSON.stringify({ error: { code, message: 'x' } }) : '') });
    const fast: FastPathClient = { relayUrl: 'ws://127.0.0.1:9000', isRegistered: true, request: async () => (used.push('fast'), ok) };
    const t = new HopTransport({ fast, rtc: () => channel });
    expect((await t.send(HOP, { method: 'DELETE', path: '/sessions/x' }, 1000)).status).toBe(204);
    expect(t.plan(HOP)).toEqual(['rtc', 'fast']);
    status = 404;
    code = 'MESH_ERR_NOT_FOUND';
    t.bestEffort(HOP, { method: 'DELETE', path: '/sessions/y' });
    await new Promise((r) => setTimeout(r, 20));
    expect(used).toEqual(['rtc', 'rtc']);
    expect(t.plan(HOP)).toEqual(['rtc', 'fast']);
  });

  it('a new channel to the peer (the failed one closed and was dialled again) leads at once', async () => {
    let current: PeerRequester | undefined;
    const used: string[] = [];
    const channelOf = (name: string, fails: boolean): PeerRequester => async () => {
      used.push(name);
      if (fails) throw new MeshError('MESH_ERR_PEER_GONE', `${name} closed`);
      return ok;
    };
    const fast: FastPathClient = { relayUrl: 'ws://127.0.0.1:9000', isRegistered: true, request: async () => (used.push('fast'), ok) };
    const t = new HopTransport({ fast, rtc: () => current });
    current = channelOf('old', true);
    await t.send(HOP, req, 1000);
    expect(used).toEqual(['old', 'fast']);
    // The same channel, still open: held back.
    expect(t.plan(HOP)).toEqual(['fast', 'rtc']);
    current = channelOf('new', false);
    expect(t.plan(HOP)).toEqual(['rtc', 'fast']);
    await t.send(HOP, req, 1000);
    expect(used).toEqual(['old', 'fast', 'new']);
  });

  it('a channel that closed (the pool has none open) is skipped without a failed attempt', async () => {
    const s = setup();
    s.setOpen(true);
    await s.t.send(HOP, req, 1000);
    s.setOpen(false);
    await s.t.send(HOP, req, 1000);
    expect(s.used).toEqual(['rtc', 'fast']);
  });
});
