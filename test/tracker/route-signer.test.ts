/**
 * RouteSigner: chats on one route within a bucket share one signed route
 * and reply address; a different head, hop list or reply address, or the
 * next bucket, gets its own; every signature verifies for its head only and
 * the route lives at least its TTL.
 */
import { describe, expect, it } from 'vitest';
import { Identity } from '../../src/net/identity.ts';
import { verifyChainReply } from '../../src/node/tracker-client.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import type { RouteHop } from '../../src/protocol/tracker.ts';
import { RouteSigner } from '../../src/tracker/route-signer.ts';
import { verifyRoute } from '../../src/tracker/signing.ts';

const HEAD = 'a'.repeat(32);
const OTHER = 'b'.repeat(32);
const hops: RouteHop[] = [{ peer_id: 'c'.repeat(32), start_layer: 6, end_layer: 12, endpoint: 'http://127.0.0.1:9' }];
const addr = { relayAddr: `ws://relay.test/rpc/${HEAD}` };

describe('RouteSigner', () => {
  it('hands chats on the same route within a bucket one signature, and each new head, hop list, address or bucket its own', async () => {
    const id = await Identity.generate();
    const key = encodeBase64Url(id.publicKey);
    const clock = { now: 1_800_000_000_123 };
    const ttl = 300_000;
    const signer = new RouteSigner(id, ttl, () => clock.now);

    const a = await signer.sign(HEAD, hops, addr);
    expect(a.route.expiresAt).toBeGreaterThanOrEqual(clock.now + ttl);
    expect(a.route.expiresAt).toBeLessThan(clock.now + ttl + 10_000);
    expect(await verifyRoute(key, HEAD, a.route, clock.now)).toBeNull();
    expect(await verifyRoute(key, OTHER, a.route, clock.now)).not.toBeNull();
    expect(a.reply).toBeDefined();
    expect(await verifyChainReply(id.publicKey, HEAD, a.route.expiresAt, a.reply!.text, a.reply!.signature)).toBe(true);

    clock.now += 1;
    const again = await signer.sign(HEAD, hops, addr);
    expect(again.route.expiresAt).toBe(a.route.expiresAt);
    expect(again.route.signature).toBe(a.route.signature);
    expect(again.reply!.signature).toBe(a.reply!.signature);

    const otherHead = await signer.sign(OTHER, hops, addr);
    expect(otherHead.route.signature).not.toBe(a.route.signature);
    expect(await verifyRoute(key, OTHER, otherHead.route, clock.now)).toBeNull();
    const otherHops = await signer.sign(HEAD, [{ ...hops[0]!, end_layer: 11 }], addr);
    expect(otherHops.route.signature).not.toBe(a.route.signature);
    const otherAddr = await signer.sign(HEAD, hops, { endpoint: 'http://127.0.0.1:8' });
    expect(otherAddr.reply!.signature).not.toBe(a.reply!.signature);
    expect(otherAddr.reply!.text).toBe('{"endpoint":"http://127.0.0.1:8"}');
    expect(await verifyChainReply(id.publicKey, HEAD, otherAddr.route.expiresAt, otherAddr.reply!.text, otherAddr.reply!.signature)).toBe(true);

    // The next bucket: a fresh expiry and signature, still at least the TTL away.
    clock.now += 10_000;
    const later = await signer.sign(HEAD, hops, addr);
    expect(later.route.expiresAt).toBeGreaterThan(a.route.expiresAt);
    expect(later.route.expiresAt).toBeGreaterThanOrEqual(clock.now + ttl);
    expect(later.route.signature).not.toBe(a.route.signature);
    expect(await verifyRoute(key, HEAD, later.route, clock.now)).toBeNull();
  });

  it('signs no reply address for a head that registered neither a relay nor an endpoint, and keeps a short TTL\'s bucket short', async () => {
    const id = await Identity.generate();
    const clock = { now: 1_000 };
    const signer = new RouteSigner(id, 50, () => clock.now);
    const s = await signer.sign(HEAD, [], {});
    expect(s.reply).toBeUndefined();
    // A tenth of a 50 ms TTL: the route lives 50 to 55 ms.
    expect(s.route.expiresAt - clock.now).toBeGreaterThanOrEqual(50);
    expect(s.route.expiresAt - clock.now).toBeLessThan(55);
  });
});
