/**
 * Chained steps the head no longer waits for are dropped before they run: a
 * step that arrives later than that head's steps do by more than its budget
 * (a frozen page resumed and its socket's queue delivered at once), or one of
 * a session the head already ended. No clock agreement: each hop keeps the
 * head's smallest (receive − sent) as its offset.
 */
import { describe, expect, it } from 'vitest';
import { StaleSteps, createChainHop } from '../../../src/node/hop/chain-hop.ts';
import { HopTransport } from '../../../src/net/hop-transport.ts';
import { Identity } from '../../../src/net/identity.ts';
import { encodeBase64Url } from '../../../src/protocol/base64.ts';
import type { MeshRequest, MeshResponse } from '../../../src/protocol/envelopes.ts';
import { chainReplySigningMessage, routeSigningMessage, type RouteHop } from '../../../src/protocol/tracker.ts';

const HEAD = 'a'.repeat(32);
const ME = 'b'.repeat(32);

describe('StaleSteps', () => {
  it('learns a head\'s clock offset from its quickest steps, whatever the skew, and calls a step stale once it is later than that by more than its budget', () => {
    const s = new StaleSteps();
    const skew = 7_777_000; // the head's clock is two hours behind: it does not matter
    const at = (sent: number, recv: number, budget = 2_000) => s.check(HEAD, 'sess', sent - skew, budget, recv);
    expect(at(1_000, 1_005)).toBeUndefined();
    expect(at(1_100, 1_103)).toBeUndefined(); // quicker: the new offset
    expect(at(1_200, 1_210)).toBeUndefined();
    expect(at(1_300, 3_200)).toBeUndefined(); // 1.9 s late, within 2 s
    expect(at(1_400, 3_500)).toMatch(/arrived \d+ ms later than this head's steps do, past its budget of 2000 ms/);
    // A generous budget (a prompt) lets a slow one through.
    expect(at(1_400, 3_500, 60_000)).toBeUndefined();
    // Another head has its own offset.
    expect(s.check('c'.repeat(32), 'x', 5, 2_000, 1_000_000)).toBeUndefined();
  });

  it('forgets the offset after a minute (the head\'s clock was set, the path changed), and never drops a step without a send time', () => {
    const s = new StaleSteps();
    expect(s.check(HEAD, 's', 1_000, 2_000, 1_010)).toBeUndefined();
    // The head's clock jumped back 10 s: everything looks late, for at most a minute.
    expect(s.check(HEAD, 's', 2_000 - 10_000, 2_000, 2_010)).toMatch(/later/);
    expect(s.check(HEAD, 's', 70_000 - 10_000, 2_000, 70_010)).toBeUndefined();
    expect(s.check(HEAD, 's', 71_000 - 10_000, 2_000, 71_010)).toBeUndefined();
    expect(s.check(HEAD, 's', undefined, 2_000, 99_999_999)).toBeUndefined();
  });

  it('drops every step of a session the head ended', () => {
    const s = new StaleSteps();
    expect(s.check(HEAD, 'done.1', undefined, 2_000, 0)).toBeUndefined();
    s.end('done.1');
    expect(s.check(HEAD, 'done.1', undefined, 2_000, 0)).toMatch(/ended by the head/);
    expect(s.check(HEAD, 'other.1', undefined, 2_000, 0)).toBeUndefined();
  });
});

describe('a chain hop with stale steps', () => {
  it('does not run, push on or report a late step; it answers the caller that it was dropped and logs one line', async () => {
    const tracker = await Identity.generate();
    const hops: RouteHop[] = [{ peer_id: ME, start_layer: 1, end_layer: 2 }];
    const expires = Date.now() + 60_000;
    const text = JSON.stringify(hops);
    const reply = JSON.stringify({ endpoint: 'http://head.test' });
    const headers = {
      'x-meshnet-route': text,
      'x-meshnet-route-expires': String(expires),
      'x-meshnet-route-signature': encodeBase64Url(await tracker.sign(routeSigningMessage(HEAD, expires, text))),
      'x-meshnet-chain-reply': reply,
      'x-meshnet-chain-reply-signature': encodeBase64Url(await tracker.sign(chainReplySigningMessage(HEAD, expires, reply))),
      'x-meshnet-chain-head': HEAD,
      'x-meshnet-chain-index': '0',
      'x-meshnet-chain-budget-ms': '2000',
      'x-meshnet-shape': '1,1,2',
      'x-meshnet-dtype': 'f32',
      'x-meshnet-session': 's.1',
    };
    let ran = 0;
    const sent: string[] = [];
    const logs: string[] = [];
    let clock = 1_000_000;
    const hop = createChainHop({
      peerId: ME,
      trackerKey: () => tracker.publicKey,
      transport: new HopTransport({ fetch: (async (url: string) => (sent.push(String(url)), new Response(null, { status: 204 }))) as typeof fetch }),
      local: async (): Promise<MeshResponse> => (ran++, { status: 200, headers: {}, body: new TextEncoder().encode('{"token_id":1,"text":"x","logprob":0}') }),
      stale: new StaleSteps(),
      now: () => clock,
      onLog: (m) => logs.push(m),
    });
    const step = (sentAt: number, position: number): MeshRequest => ({ method: 'POST', path: '/forward', headers: { ...headers, 'x-meshnet-position': String(position), 'x-meshnet-chain-sent-at': `${sentAt};2000` }, body: new Uint8Array(8) });
    expect((await hop(step(clock - 5, 0))).status).toBe(202);
    expect(ran).toBe(1);
    // Frozen for 30 s: the queued step arrives all at once.
    clock += 30_000;
    const late = await hop(step(clock - 30_000, 1));
    expect(late.status).toBe(499);
    expect(late.headers['x-meshnet-chain-reported']).toBe('1');
    expect(ran).toBe(1);
    await new Promise((r) => setTimeout(r, 20));
    expect(sent.filter((u) => u.includes('/chain/failed'))).toEqual([]);
    expect(logs.filter((l) => l.includes('dropped'))).toHaveLength(1);
  });
});
