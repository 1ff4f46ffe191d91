import { afterEach, describe, expect, it, vi } from 'vitest';
import { Identity, verifyEd25519 } from '../../src/net/identity.ts';
import { NotRegisteredError, TrackerClient, TrackerTrust, verifySignedRoute, type TrackerRelay } from '../../src/node/tracker-client.ts';
import { decodeBase64, encodeBase64Url } from '../../src/protocol/base64.ts';
import { canonicalJson, routeSigningMessage, trackerCertMessage, type NodeMessage, type RouteHop, type TrackerKey } from '../../src/protocol/tracker.ts';

const FAILED: RouteHop = { peer_id: 'f'.repeat(32), start_layer: 1, end_layer: 3 };
const REPL: RouteHop = { peer_id: 'e'.repeat(32), start_layer: 1, end_layer: 3, endpoint: 'http://e' };

/** A scripted tracker: answers in order, records what it was sent. */
function scripted(answers: Array<(body: unknown) => Promise<Response> | Response>): { fetch: typeof fetch; sent: Array<{ url: string; body: { body: Record<string, unknown>; signature: string } }> } {
  const sent: Array<{ url: string; body: { body: Record<string, unknown>; signature: string } }> = [];
  let i = 0;
  return {
    sent,
    fetch: (async (url: string, init: RequestInit) => {
      const body = JSON.parse(String(init.body));
      sent.push({ url: String(url), body });
      return answers[Math.min(i++, answers.length - 1)]!(body);
    }) as typeof fetch,
  };
}
const json = (status: number, v: unknown) => new Response(JSON.stringify(v), { status, headers: { 'content-type': 'application/json' } });

async function signedReplace(key: Identity, head: string, hops: RouteHop[]) {
  const route = JSON.stringify(hops);
  const expires_at = Date.now() + 60_000;
  return { route, expires_at, signature: encodeBase64Url(await key.sign(routeSigningMessage(head, expires_at, route))) };
}

describe('TrackerClient', () => {
  it('signs register bodies over canonicalJson with the node key and keeps the tracker key it answers with', async () => {
    const node = await Identity.generate();
    const trackerKey = await Identity.generate();
    const t = scripted([() => json(200, { assignment: null, heartbeat_interval_ms: 1000, tracker_public_key: encodeBase64Url(trackerKey.publicKey) })]);
    const c = new TrackerClient({ trackerUrl: 'http://tracker/', fetch: t.fetch, identity: node });
    const msg: NodeMessage = { peer_id: node.peerId, public_key: encodeBase64Url(node.publicKey), info: { model: 'tiny', backend: 'cpu', memory_budget_mb: 1, host: 'node' }, timestamp: Date.now() };
    const ans = await c.register(msg);
    expect(ans.heartbeat_interval_ms).toBe(1000);
    expect(t.sent[0]!.url).toBe('http://tracker/api/nodes/register');
    const ok = await verifyEd25519(node.publicKey, new TextEncoder().encode(canonicalJson(t.sent[0]!.body.body)), decodeBase64(t.sent[0]!.body.signature));
    expect(ok).toBe(true);
    expect(c.trackerKey!.map((k) => [...k])).toEqual([[...trackerKey.publicKey]]);
  });

  it('reports a heartbeat 404 as NotRegisteredError (the tracker restarted)', async () => {
    const node = await Identity.generate();
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: scripted([() => json(404, { error: { code: 'MESH_ERR_NOT_FOUND', message: 'no' } })]).fetch, identity: node });
    await expect(c.heartbeat({} as NodeMessage)).rejects.toBeInstanceOf(NotRegisteredError);
  });

  it('keeps asking for a replacement through 503s and answers naming the failed peer, then returns the signed hops', async () => {
    const head = await Identity.generate();
    const tracker = await Identity.generate();
    const t = scripted([
      () => json(503, { error: { code: 'MESH_ERR_UNAVAILABLE', message: 'layers 1-2 not served' } }),
      async () => json(200, await signedReplace(tracker, head.peerId, [FAILED])),
      async () => json(200, await signedReplace(tracker, head.peerId, [REPL])),
    ]);
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: t.fetch, identity: head });
    c.trackerKey = tracker.publicKey;
    expect(await c.replace('tiny', FAILED)).toEqual({ hops: [REPL] });
    expect(t.sent).toHaveLength(3);
    expect(t.sent[0]!.body.body).toMatchObject({ head_peer_id: head.peerId, failed_peer_id: FAILED.peer_id, start_layer: 1, end_layer: 3, model: 'tiny' });
  });

  it('refuses a replacement not signed by the tracker for this head', async () => {
    const head = await Identity.generate();
    const tracker = await Identity.generate();
    const forger = await Identity.generate();
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: scripted([async () => json(200, await signedReplace(forger, head.peerId, [REPL]))]).fetch, identity: head });
    c.trackerKey = tracker.publicKey;
    await expect(c.replace('tiny', FAILED)).rejects.toMatchObject({ code: 'MESH_ERR_FORBIDDEN' });
    const c2 = new TrackerClient({ trackerUrl: 'http://tracker', fetch: scripted([async () => json(200, await signedReplace(tracker, 'c'.repeat(32), [REPL]))]).fetch, identity: head });
    c2.trackerKey = tracker.publicKey;
    await expect(c2.replace('tiny', FAILED)).rejects.toMatchObject({ code: 'MESH_ERR_FORBIDDEN' });
  });

  it('gives up after its deadline while the tracker has no replacement', async () => {
    const head = await Identity.generate();
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: scripted([() => json(503, { error: { code: 'MESH_ERR_UNAVAILABLE', message: 'none' } })]).fetch, identity: head, replaceDeadlineMs: 300 });
    c.trackerKey = head.publicKey;
    const t0 = Date.now();
    await expect(c.replace('tiny', FAILED)).rejects.toMatchObject({ code: 'MESH_ERR_UNAVAILABLE' });
    expect(Date.now() - t0).toBeLessThan(2_000);
  });
});

/** A tracker key certified by `operator` until `expires`. */
async function certified(operator: Identity, key: Identity, expires = Date.now() + 60_000): Promise<TrackerKey> {
  const pub = encodeBase64Url(key.publicKey);
  return { public_key: pub, cert: { operator_key: encodeBase64Url(operator.publicKey), expires_at: expires, signature: encodeBase64Url(await operator.sign(trackerCertMessage(pub, expires))) } };
}

describe('tracker keys of a cluster', () => {
  it('takes routes signed by any tracker of the cluster: keys from the answers, the answering one first', async () => {
    const [a, b, c] = await Promise.all([Identity.generate(), Identity.generate(), Identity.generate()]);
    const trust = new TrackerTrust();
    await trust.absorb(encodeBase64Url(b.publicKey), [{ public_key: encodeBase64Url(a.publicKey) }, { public_key: encodeBase64Url(b.publicKey) }]);
    expect(trust.current.map((k) => encodeBase64Url(k))).toEqual([encodeBase64Url(b.publicKey), encodeBase64Url(a.publicKey)]);
    const head = 'd'.repeat(32);
    const route = JSON.stringify([REPL]);
    const expires = Date.now() + 60_000;
    const by = async (id: Identity) => encodeBase64Url(await id.sign(routeSigningMessage(head, expires, route)));
    expect(await verifySignedRoute(trust.current, head, route, expires, await by(a), Date.now())).toEqual([REPL]);
    expect(await verifySignedRoute(trust.current, head, route, expires, await by(b), Date.now())).toEqual([REPL]);
    await expect(verifySignedRoute(trust.current, head, route, expires, await by(c), Date.now())).rejects.toMatchObject({ code: 'MESH_ERR_FORBIDDEN' });
  });

  it('with an operator key: only certified keys, the operator pinned from the first certificate; expired, forged and other operators\' certificates refused', async () => {
    const [op, other, a, b, rogue] = await Promise.all([Identity.generate(), Identity.generate(), Identity.generate(), Identity.generate(), Identity.generate()]);
    const trust = new TrackerTrust();
    const ka = await certified(op, a);
    await trust.absorb(ka.public_key, [ka, await certified(op, b)]);
    expect(trust.operatorKey).toBe(encodeBase64Url(op.publicKey));
    expect(trust.current).toHaveLength(2);
    // A rogue tracker answering behind the same URL: not certified, or certified by another operator, or expired, or forged.
    const forged = { ...(await certified(op, rogue)), public_key: encodeBase64Url(rogue.publicKey) };
    forged.cert!.signature = (await certified(op, a)).cert!.signature;
    await trust.absorb(encodeBase64Url(rogue.publicKey), [{ public_key: encodeBase64Url(rogue.publicKey) }, await certified(other, rogue), await certified(op, rogue, Date.now() - 1), forged, ka]);
    expect(trust.current.map((k) => encodeBase64Url(k)).sort()).toEqual([ka.public_key, encodeBase64Url(b.publicKey)].sort());
    // Configured: a cluster certified by someone else is not trusted at all.
    const strict = new TrackerTrust(encodeBase64Url(other.publicKey));
    await strict.absorb(ka.public_key, [ka]);
    expect(strict.current).toHaveLength(0);
    // A tracker alone (no list) is trusted as its URL says, unless an operator is required.
    const alone = new TrackerTrust();
    await alone.absorb(ka.public_key, undefined);
    expect(alone.current).toHaveLength(1);
    await strict.absorb(ka.public_key, undefined);
    expect(strict.current).toHaveLength(0);
  });

  it('forgets a key a while after its tracker stops being listed', async () => {
    const [a, b] = await Promise.all([Identity.generate(), Identity.generate()]);
    const trust = new TrackerTrust(undefined, 1000);
    const [ka, kb] = [encodeBase64Url(a.publicKey), encodeBase64Url(b.publicKey)];
    await trust.absorb(ka, [{ public_key: ka }, { public_key: kb }], 0);
    await trust.absorb(ka, [{ public_key: ka }], 500);
    expect(trust.current).toHaveLength(2);
    await trust.absorb(ka, [{ public_key: ka }], 1600);
    expect(trust.current.map((k) => encodeBase64Url(k))).toEqual([ka]);
  });
});

describe('heartbeats over the relay socket', () => {
  const msg = (node: Identity): NodeMessage => ({ peer_id: node.peerId, public_key: encodeBase64Url(node.publicKey), info: { model: 'tiny', backend: 'cpu', memory_budget_mb: 1, host: 'node' }, timestamp: Date.now() });
  const reply = (status: number, v: unknown) => ({ status, headers: {}, body: new TextEncoder().encode(JSON.stringify(v)) });

  it('sends the beat unsigned to the tracker that answered, over the relay; falls back to the signed request when that fails', async () => {
    const node = await Identity.generate();
    const tracker = await Identity.generate();
    const answer = { assignment: null, heartbeat_interval_ms: 1000, tracker_public_key: encodeBase64Url(tracker.publicKey), tracker_peer_id: tracker.peerId };
    const http = scripted([() => json(200, answer)]);
    const sentOverRelay: Array<{ peer: string; path: string; body: unknown }> = [];
    const answers: Array<() => ReturnType<typeof reply>> = [];
    const relay: TrackerRelay & { state: string } = {
      state: 'registered',
      async request(peer, req) {
        sentOverRelay.push({ peer, path: req.path, body: JSON.parse(new TextDecoder().decode(req.body)) });
        const a = answers.shift();
        if (!a) throw new Error('relay down');
        return a();
      },
    };
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: http.fetch, identity: node, relay });
    // Before any tracker answered: signed HTTP.
    await c.heartbeat(msg(node));
    expect(http.sent).toHaveLength(1);
    expect(c.trackerPeerId).toBe(tracker.peerId);
    // Now over the relay, the NodeMessage itself, to that tracker.
    answers.push(() => reply(200, { ...answer, heartbeat_interval_ms: 2000 }));
    expect((await c.heartbeat(msg(node))).heartbeatIntervalMs).toBe(2000);
    expect(http.sent).toHaveLength(1);
    expect(sentOverRelay[0]).toMatchObject({ peer: tracker.peerId, path: '/api/nodes/beat', body: { peer_id: node.peerId } });
    expect(c.beats).toEqual({ relay: 1, http: 1, batched: 0, skipped: 0 });
    // The relay cannot reach that tracker (gone): signed HTTP again, whoever answers.
    answers.push(() => reply(404, { error: { code: 'MESH_ERR_NO_SUCH_PEER', message: 'not connected' } }));
    await c.heartbeat(msg(node));
    expect(http.sent).toHaveLength(2);
    // The relay itself is down: signed HTTP.
    await c.heartbeat(msg(node));
    expect(http.sent).toHaveLength(3);
    relay.state = 'disconnected';
    answers.push(() => reply(200, answer));
    await c.heartbeat(msg(node));
    expect(http.sent).toHaveLength(4);
    // The tracker forgot us: register again.
    relay.state = 'registered';
    answers.push(() => reply(404, { error: { code: 'MESH_ERR_NOT_FOUND', message: 'register again' } }));
    answers.shift();
    await expect(c.heartbeat(msg(node))).rejects.toBeInstanceOf(NotRegisteredError);
  });
});

describe('batched beats to a tracker the relay says is not attached (docs/protocol.md §9.1)', () => {
  afterEach(() => vi.useRealTimers());
  const msg = (node: Identity): NodeMessage => ({ peer_id: node.peerId, public_key: encodeBase64Url(node.publicKey), info: { model: 'tiny', backend: 'cpu', memory_budget_mb: 1, host: 'node' }, timestamp: Date.now() });
  const ok = (peer: string) => ({ status: 200, headers: {}, body: new TextEncoder().encode(JSON.stringify({ assignment: null, tracker_peer_id: peer })) });
  const KEY = encodeBase64Url(new Uint8Array(32).fill(7));
  const noSuchPeer = (batch?: string) => ({ status: 404, body: { error: { code: 'MESH_ERR_NO_SUCH_PEER', message: 'not here', ...(batch ? { batch } : {}) } } });

  /** A relay where the tracker peers in `attached` take batched beats; the others are on another relay (the request path reaches them). */
  function fakeRelay(attached: Set<string>) {
    const tries: string[] = [];
    const relay = {
      state: 'registered',
      currentRegistration: {} as object,
      request: async (peer: string) => ok(peer),
      beat: (peer: string) => {
        tries.push(peer);
        return Promise.resolve(attached.has(peer) ? { status: 200, body: { assignment: null } } : noSuchPeer());
      },
      watchPeer: (peer: string, _signal?: AbortSignal, onAttached?: () => void) => {
        if (!attached.has(peer)) return Promise.resolve('absent' as const);
        onAttached?.();
        return new Promise<never>(() => {});
      },
    } satisfies TrackerRelay;
    return { relay, tries };
  }

  it('tries the batch once, then beats as requests without it until the bound, a reconnect, another tracker, or the relay saying it attached', async () => {
    vi.useFakeTimers({ toFake: ['Date'] });
    const node = await Identity.generate();
    const [t1, t2] = ['1'.repeat(32), '2'.repeat(32)];
    const attached = new Set<string>();
    const { relay, tries } = fakeRelay(attached);
    let named = t1;
    const http = scripted([() => json(200, { assignment: null, heartbeat_interval_ms: 5000, tracker_public_key: KEY, tracker_peer_id: named })]);
    // random 0: the shortest bound, half of 30 s.
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: http.fetch, identity: node, relay, random: () => 0 });
    await c.register(msg(node));
    await c.heartbeat(msg(node));
    await c.heartbeat(msg(node));
    expect(tries).toEqual([t1]);
    expect(c.beats).toEqual({ relay: 2, http: 0, batched: 0, skipped: 1 });
    expect(c.noBatchNow).toBe('not-attached');
    // Within the bound: still skipped; past it: tried again (once), and remembered again.
    vi.setSystemTime(Date.now() + 14_000);
    await c.heartbeat(msg(node));
    expect(tries).toHaveLength(1);
    vi.setSystemTime(Date.now() + 1_500);
    await c.heartbeat(msg(node));
    await c.heartbeat(msg(node));
    expect(tries).toEqual([t1, t1]);
    // The node's relay reconnected (maybe to another relay): what the last connection said is forgotten.
    relay.currentRegistration = {};
    await c.heartbeat(msg(node));
    expect(tries).toEqual([t1, t1, t1]);
    // A watch answered "not attached" renews the memo; "attached" ends it: the next beat goes batched.
    vi.setSystemTime(Date.now() + 10_000);
    expect(await c.watch(new AbortController().signal)).toBe('rearm');
    vi.setSystemTime(Date.now() + 10_000);
    await c.heartbeat(msg(node));
    expect(tries).toHaveLength(3);
    attached.add(t1);
    void c.watch(new AbortController().signal);
    expect(c.noBatchNow).toBeUndefined();
    await c.heartbeat(msg(node));
    expect(tries).toHaveLength(4);
    expect(c.beats.batched).toBe(1);
    // Another tracker named (by an HTTP answer): not remembered, tried batched.
    attached.delete(t1);
    await c.heartbeat(msg(node));
    expect(c.noBatchNow).toBe('not-attached');
    named = t2;
    relay.state = 'disconnected';
    await c.heartbeat(msg(node));
    expect(c.trackerPeerId).toBe(t2);
    relay.state = 'registered';
    await c.heartbeat(msg(node));
    expect(tries.slice(-2)).toEqual([t1, t2]);
  });

  it('a tracker that takes no batches (an older one) is remembered 60 s, and not forgotten when the relay says it is attached', async () => {
    vi.useFakeTimers({ toFake: ['Date'] });
    const node = await Identity.generate();
    const t1 = '1'.repeat(32);
    const { relay, tries } = fakeRelay(new Set([t1]));
    relay.beat = (peer: string) => {
      tries.push(peer);
      return Promise.resolve(noSuchPeer('unsupported'));
    };
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: scripted([() => json(200, { assignment: null, heartbeat_interval_ms: 5000, tracker_public_key: KEY, tracker_peer_id: t1 })]).fetch, identity: node, relay, random: () => 0 });
    await c.register(msg(node));
    await c.heartbeat(msg(node));
    void c.watch(new AbortController().signal);
    expect(c.noBatchNow).toBe('unsupported');
    vi.setSystemTime(Date.now() + 59_000);
    await c.heartbeat(msg(node));
    expect(tries).toHaveLength(1);
    vi.setSystemTime(Date.now() + 1_500);
    await c.heartbeat(msg(node));
    expect(tries).toHaveLength(2);
  });
});

describe('the HTTP watch held for want of a tracker peer id', () => {
  const msg = (node: Identity): NodeMessage => ({ peer_id: node.peerId, public_key: encodeBase64Url(node.publicKey), info: { model: 'tiny', backend: 'cpu', memory_budget_mb: 1, host: 'node' }, timestamp: Date.now() });
  const KEY = encodeBase64Url(new Uint8Array(32).fill(7));
  const T1 = '1'.repeat(32);

  /** A tracker that refuses the first registration (shedding load), then answers; its watch streams stay open until cancelled. */
  function shedding() {
    const streams: Array<{ cancelled: boolean }> = [];
    let registrations = 0;
    const fetch = (async (url: string) => {
      if (String(url).endsWith('/api/nodes/watch')) {
        const s = { cancelled: false };
        streams.push(s);
        return new Response(new ReadableStream({ cancel: () => void (s.cancelled = true) }), { status: 200, headers: { 'content-type': 'text/event-stream' } });
      }
      if (registrations++ === 0) return json(503, { error: { code: 'MESH_ERR_UNAVAILABLE', message: 'the tracker is overloaded' } });
      return json(200, { assignment: null, heartbeat_interval_ms: 5000, tracker_public_key: KEY, tracker_peer_id: T1 });
    }) as typeof globalThis.fetch;
    return { fetch, streams };
  }

  it('gives way to the relay watch as soon as an answer names the tracker', async () => {
    const node = await Identity.generate();
    const t = shedding();
    const watched: string[] = [];
    const relay = {
      state: 'registered',
      request: () => Promise.reject(new Error('not used')),
      watchPeer: (peer: string) => {
        watched.push(peer);
        return new Promise<never>(() => {});
      },
    } satisfies TrackerRelay;
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: t.fetch, identity: node, relay });
    await expect(c.register(msg(node))).rejects.toThrow();
    let end: string | undefined;
    void c.watch(new AbortController().signal).then((e) => (end = e));
    await vi.waitFor(() => expect(t.streams).toHaveLength(1));
    await c.register(msg(node));
    await vi.waitFor(() => expect(end).toBe('rearm'));
    expect(t.streams[0]!.cancelled).toBe(true);
    // Watched again: over the relay, no second stream.
    void c.watch(new AbortController().signal);
    expect(watched).toEqual([T1]);
    expect(t.streams).toHaveLength(1);
  });

  it('is kept by a node with no relay (nothing else can watch), and ended by its own signal', async () => {
    const node = await Identity.generate();
    const t = shedding();
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: t.fetch, identity: node });
    await expect(c.register(msg(node))).rejects.toThrow();
    const stop = new AbortController();
    let end: string | undefined;
    void c.watch(stop.signal).then((e) => (end = e));
    await vi.waitFor(() => expect(t.streams).toHaveLength(1));
    await c.register(msg(node));
    await new Promise((r) => setTimeout(r, 20));
    expect(end).toBeUndefined();
    expect(t.streams[0]!.cancelled).toBe(false);
    stop.abort();
    await vi.waitFor(() => expect(end).toBe('ended'));
  });
});
