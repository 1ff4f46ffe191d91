import { describe, expect, it } from 'vitest';
import { Identity } from '../../src/net/identity.ts';
import { replaceAnswerSchema, routeSchema } from '../../src/protocol/tracker.ts';
import { decodeBase64 } from '../../src/protocol/base64.ts';
import { verifyChainReply } from '../../src/node/tracker-client.ts';
import { findRoutes, missingLayers, perLayerMs, pickRoute, type ServingNode } from '../../src/tracker/routing.ts';
import { signBody, verifyRoute } from '../../src/tracker/signing.ts';
import { FakeNode, makeTracker } from '../helpers/tracker.ts';

const node = (id: string, start: number, end: number, layerMs = 1, load = 0): ServingNode => ({ id, start, end, perLayerMs: perLayerMs(layerMs, load) });

/** Register a node that already serves [start, end) (e.g. started with fixed layers). */
async function serving(t: Awaited<ReturnType<typeof makeTracker>>, start: number, end: number, layerMs: number, extra: { endpoint?: string } = {}): Promise<FakeNode> {
  const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(layerMs);
  n.serving = { start_layer: start, end_layer: end };
  if (extra.endpoint) n.endpoint = extra.endpoint;
  await n.register(t);
  return n;
}

describe('findRoutes / pickRoute', () => {
  it('prefers the fast node over a slow one covering the same span', () => {
    const routes = findRoutes([node('slow', 0, 12, 5), node('fast', 0, 12, 1)], 0, 12, { hopLatencyMs: 10 });
    expect(routes[0]!.hops.map((h) => h.id)).toEqual(['fast']);
    expect(routes[0]!.costMs).toBe(10 + 12);
    expect(pickRoute(routes, 0, Math.random)!.hops[0]!.id).toBe('fast');
  });

  it('joins overlapping spans by start layer (ADR-0012): the second hop starts inside its range', () => {
    const routes = findRoutes([node('a', 0, 8), node('b', 4, 12)], 0, 12, { hopLatencyMs: 10 });
    expect(routes.length).toBe(1);
    expect(routes[0]!.hops).toEqual([
      { id: 'a', start: 0, end: 8 },
      { id: 'b', start: 8, end: 12 },
    ]);
  });

  it('counts load: a busy fast node loses to an idle one', () => {
    const routes = findRoutes([node('busy', 0, 12, 1, 5), node('idle', 0, 12, 2, 0)], 0, 12, { hopLatencyMs: 0 });
    expect(routes[0]!.hops[0]!.id).toBe('idle');
  });

  it('finds no route and names the missing layers when a layer is bare', () => {
    const nodes = [node('a', 0, 4), node('b', 6, 12)];
    expect(findRoutes(nodes, 0, 12, { hopLatencyMs: 1 })).toEqual([]);
    expect(missingLayers(nodes, 0, 12)).toEqual([4, 5]);
  });

  it('splits traffic in proportion to throughput among near-optimal routes (statistical)', () => {
    // fast: 12 × 1 ms, slow: 12 × 2 ms → throughput 2:1 → shares 2/3 : 1/3.
    const routes = findRoutes([node('fast', 0, 12, 1), node('slow', 0, 12, 2)], 0, 12, { hopLatencyMs: 0 });
    let seed = 12345;
    const rnd = () => ((seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31);
    const n = 6000;
    let fast = 0;
    for (let i = 0; i < n; i++) if (pickRoute(routes, 1, rnd)!.hops[0]!.id === 'fast') fast++;
    // 3σ of a binomial(6000, 2/3) is ≈ 0.018.
    expect(fast / n).toBeGreaterThan(2 / 3 - 0.03);
    expect(fast / n).toBeLessThan(2 / 3 + 0.03);
    // A node far slower than the best gets no traffic at all.
    const far = findRoutes([node('fast', 0, 12, 1), node('crawl', 0, 12, 10)], 0, 12, { hopLatencyMs: 0 });
    for (let i = 0; i < 500; i++) expect(pickRoute(far, 1, rnd)!.hops[0]!.id).toBe('fast');
  });
});

describe('routing through the tracker', () => {
  it('GET /api/route picks the fast head most of the time; shares follow throughput over many picks', async () => {
    let seed = 7;
    const t = await makeTracker({ hopLatencyMs: 0, random: () => ((seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31) });
    const fast = await serving(t, 0, 12, 1);
    const slow = await serving(t, 0, 12, 2);
    const counts = new Map<string, number>();
    for (let i = 0; i < 3000; i++) {
      const plan = t.registry.pick('small');
      counts.set(plan.hops[0]!.id, (counts.get(plan.hops[0]!.id) ?? 0) + 1);
    }
    const share = (counts.get(fast.peerId) ?? 0) / 3000;
    expect(share).toBeGreaterThan(0.62);
    expect(share).toBeLessThan(0.71);
    expect(counts.get(slow.peerId)).toBeGreaterThan(0);
  });

  it('answers 503 naming the missing layers when no full route exists', async () => {
    const t = await makeTracker();
    await serving(t, 0, 5, 1);
    await serving(t, 8, 12, 1);
    const res = await t.app.request('/v1/chat/completions', { method: 'POST', body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'hi' }] }) });
    expect(res.status).toBe(503);
    const body = (await res.json()) as { error: { message: string; type: string; code: string; missing_layers: number[] } };
    expect(body.error.missing_layers).toEqual([5, 6, 7]);
    expect(body.error.message).toMatch(/layers 5-7 of 0-11/);
    expect(body.error.type).toBe('service_unavailable');
    const route = await t.app.request('/api/route?model=small');
    expect(route.status).toBe(503);
  });

  it('signs routes for one head: the signature verifies, and a tampered route, other head or late use fails', async () => {
    const t = await makeTracker({ routeTtlMs: 60_000 });
    const head = await serving(t, 0, 8, 1, { endpoint: 'http://127.0.0.1:9/' });
    const tail = await serving(t, 4, 12, 1);
    const res = await t.app.request('/api/route?model=small');
    expect(res.status).toBe(200);
    const r = (await res.json()) as { head: string; hops: unknown; route_header: string; expires_at: number; signature: string };
    expect(r.head).toBe(head.peerId);
    const hops = routeSchema.parse(JSON.parse(r.route_header));
    expect(hops).toEqual([{ peer_id: tail.peerId, start_layer: 8, end_layer: 12 }]);
    const now = t.clock.now;
    const signed = { header: r.route_header, expiresAt: r.expires_at, signature: r.signature };
    expect(await verifyRoute(t.publicKey, head.peerId, signed, now)).toBeNull();
    const tampered = r.route_header.replace('"start_layer":8', '"start_layer":7');
    expect(tampered).not.toBe(r.route_header);
    expect(await verifyRoute(t.publicKey, head.peerId, { ...signed, header: tampered }, now)).toMatch(/does not verify/);
    expect(await verifyRoute(t.publicKey, tail.peerId, signed, now)).toMatch(/does not verify/);
    expect(await verifyRoute(t.publicKey, head.peerId, { ...signed, expiresAt: signed.expiresAt + 1 }, now)).toMatch(/does not verify/);
    expect(await verifyRoute(t.publicKey, head.peerId, signed, r.expires_at + 1)).toMatch(/expired/);
    const other = await Identity.generate();
    const { encodeBase64Url } = await import('../../src/protocol/base64.ts');
    expect(await verifyRoute(encodeBase64Url(other.publicKey), head.peerId, signed, now)).toMatch(/does not verify/);
  });

  it('POST /api/route/replace gives a signed replacement for a failed span, avoiding the failed node and the head', async () => {
    const t = await makeTracker();
    const head = await serving(t, 0, 6, 1);
    const failed = await serving(t, 6, 12, 1);
    const spare = await serving(t, 4, 12, 3);
    const body = { head_peer_id: head.peerId, failed_peer_id: failed.peerId, start_layer: 6, end_layer: 12, model: 'small', timestamp: t.clock.now };
    const res = await t.app.request('/api/route/replace', { method: 'POST', body: JSON.stringify(await signBody(head.identity, body)) });
    expect(res.status).toBe(200);
    const a = (await res.json()) as { route: string; expires_at: number; signature: string };
    expect(JSON.parse(a.route)).toEqual([{ peer_id: spare.peerId, start_layer: 6, end_layer: 12 }]);
    expect(await verifyRoute(t.publicKey, head.peerId, { header: a.route, expiresAt: a.expires_at, signature: a.signature }, t.clock.now)).toBeNull();
    // Signed by someone else than the head: refused.
    const forged = await signBody(failed.identity, body);
    expect((await t.app.request('/api/route/replace', { method: 'POST', body: JSON.stringify(forged) })).status).toBe(401);
    // Nothing else covers the span: 503 naming the layers.
    const none = { ...body, failed_peer_id: spare.peerId, start_layer: 4, end_layer: 12 };
    t.registry.remove(failed.peerId, 'test');
    const res2 = await t.app.request('/api/route/replace', { method: 'POST', body: JSON.stringify(await signBody(head.identity, none)) });
    expect(res2.status).toBe(503);
    expect(((await res2.json()) as { error: { missing_layers: number[] } }).error.missing_layers).toEqual([4, 5, 6, 7, 8, 9, 10, 11]);
  });

  it('with no spare, answers the failed node itself once it answers a probe (failed_reachable), else 503; a failure counts against the failed node while it is away, not once it answers', async () => {
    let up = false;
    const probed: string[] = [];
    const t = await makeTracker({}, {
      open: () => Promise.reject(new Error('no generations here')),
      probe: async (node) => {
        probed.push(node.peerId);
        return up;
      },
    });
    const head = await serving(t, 0, 6, 1);
    const failed = await serving(t, 6, 12, 1);
    const ask = async () => {
      const body = { head_peer_id: head.peerId, failed_peer_id: failed.peerId, start_layer: 6, end_layer: 12, model: 'small', timestamp: t.clock.now };
      return t.app.request('/api/route/replace', { method: 'POST', body: JSON.stringify(await signBody(head.identity, body)) });
    };
    // Still away (a relay restart it has not reconnected from): nothing to offer yet.
    expect((await ask()).status).toBe(503);
    expect(probed).toEqual([failed.peerId]);
    // Back: it is its own replacement, said so, and the head resumes on it.
    up = true;
    const res = await ask();
    expect(res.status).toBe(200);
    const a = replaceAnswerSchema.parse(await res.json());
    expect(JSON.parse(a.route)).toEqual([{ peer_id: failed.peerId, start_layer: 6, end_layer: 12 }]);
    expect(a.failed_reachable).toBe(true);
    // Only the report made while it was away counts: the head lost its way to it for a moment, a relay restarting.
    expect(t.registry.nodes.get(failed.peerId)!.failures).toBe(1);
    // Removed meanwhile (missed heartbeats, a frozen page), reported once more, then back: its count is its own.
    t.registry.remove(failed.peerId, 'test');
    expect((await ask()).status).toBe(503);
    await failed.register(t);
    expect(t.registry.nodes.get(failed.peerId)!.failures).toBe(2);
    expect(t.registry.nodes.get(head.peerId)!.failures).toBe(0);
  });

  it('re-signs the head\'s whole route with the replacement in place (and its reply address) when the head sends the route it runs', async () => {
    const t = await makeTracker();
    const head = await serving(t, 0, 4, 1, { endpoint: 'http://head.test' });
    const failed = await serving(t, 4, 8, 1);
    const tail = await serving(t, 8, 12, 1, { endpoint: 'http://tail.test' });
    const spare = await serving(t, 4, 8, 3);
    const route = [{ peer_id: failed.peerId, start_layer: 4, end_layer: 8 }, { peer_id: tail.peerId, start_layer: 8, end_layer: 12 }];
    const ask = async (r: unknown[]) => {
      const body = { head_peer_id: head.peerId, failed_peer_id: failed.peerId, start_layer: 4, end_layer: 8, model: 'small', timestamp: t.clock.now, route: r };
      const res = await t.app.request('/api/route/replace', { method: 'POST', body: JSON.stringify(await signBody(head.identity, body)) });
      expect(res.status).toBe(200);
      return replaceAnswerSchema.parse(await res.json());
    };
    const a = await ask(route);
    expect(JSON.parse(a.route)).toEqual([{ peer_id: spare.peerId, start_layer: 4, end_layer: 8 }]);
    const chain = a.chain!;
    expect(JSON.parse(chain.route)).toEqual([{ peer_id: spare.peerId, start_layer: 4, end_layer: 8 }, { peer_id: tail.peerId, start_layer: 8, end_layer: 12, endpoint: 'http://tail.test' }]);
    expect(await verifyRoute(t.publicKey, head.peerId, { header: chain.route, expiresAt: chain.expires_at, signature: chain.signature }, t.clock.now)).toBeNull();
    expect(chain.reply).toBe(JSON.stringify({ endpoint: 'http://head.test' }));
    const key = decodeBase64(t.publicKey);
    expect(await verifyChainReply(key, head.peerId, chain.expires_at, chain.reply!, chain.reply_signature!)).toBe(true);
    expect(await verifyChainReply(key, head.peerId, chain.expires_at, JSON.stringify({ endpoint: 'http://evil.test' }), chain.reply_signature!)).toBe(false);
    // A route with a gap, or one that does not hold the failed hop: the span alone, nothing re-signed.
    expect((await ask([route[0]!])).chain).toBeUndefined();
    expect((await ask([route[1]!])).chain).toBeUndefined();
  });
});
