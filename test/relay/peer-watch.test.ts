/**
 * `peer-watch` (docs/protocol.md §9): a node that beats over its relay asks
 * the relay to say when the tracker's peer detaches, instead of holding an
 * HTTP watch stream to the tracker; and `beat-batch` (§9.1): the relay batches
 * nodes' heartbeats towards a tracker. An in-process relay, real RelayClients.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { WebSocket } from 'ws';
import { Identity } from '../../src/net/identity.ts';
import { RelayClient } from '../../src/net/relay-client.ts';
import { startRelay, type Relay } from '../../src/relay/server.ts';
import { TrackerClient } from '../../src/node/tracker-client.ts';
import { TrackerSession } from '../../src/node/tracker-session.ts';
import type { NodeMessage } from '../../src/protocol/tracker.ts';
import { NodeWebSocket } from '../helpers/ws-host.ts';
import { makeKeys, nextJson, registerMessage } from '../helpers/raw-peer.ts';

let relay: Relay;
const clients: RelayClient[] = [];
beforeAll(async () => {
  relay = await startRelay({ port: 0, host: '127.0.0.1', logLevel: 'silent' });
});
afterAll(async () => {
  for (const c of clients) c.close();
  await relay.close();
});

async function client(handler?: (path: string) => { status: number; body: unknown }): Promise<RelayClient> {
  const c = new RelayClient({
    relayUrl: relay.url,
    WebSocket: NodeWebSocket,
    identity: await Identity.generate(),
    handler: async (req) => {
      const a = handler?.(req.path) ?? { status: 200, body: {} };
      return { status: a.status, headers: { 'content-type': 'application/json' }, body: new TextEncoder().encode(JSON.stringify(a.body)) };
    },
  });
  clients.push(c);
  c.start();
  await c.ready(5_000);
  return c;
}

const until = async (cond: () => boolean, ms = 3_000): Promise<void> => {
  const t0 = Date.now();
  while (!cond()) {
    if (Date.now() - t0 > ms) throw new Error('condition not met in time');
    await new Promise((r) => setTimeout(r, 10));
  }
};

describe('relay peer-watch', () => {
  it('tells each watcher once when the watched peer detaches; a peer not attached is answered absent; a replaced connection of the same key is not gone', async () => {
    const trackerId = await Identity.generate();
    const tracker = new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity: trackerId });
    clients.push(tracker);
    tracker.start();
    await tracker.ready(5_000);
    const [a, b] = [await client(), await client()];
    expect((await a.ready()).peerWatch).toBe(true);
    const told: string[] = [];
    // A peer not attached: answered absent, and (peer-back) the watch is held until it attaches or is cancelled.
    const stopAbsent = new AbortController();
    const absent = a.watchPeer('0'.repeat(32), stopAbsent.signal, () => told.push('absent one'), () => told.push('held'));
    await until(() => told.length === 1);
    expect(told).toEqual(['held']);
    stopAbsent.abort();
    expect(await absent).toBe('cancelled');
    told.length = 0;

    // Each watcher hears that the peer is attached (a node learns its tracker takes beats on this relay, §9.1) …
    const wa = a.watchPeer(trackerId.peerId, undefined, () => told.push('a'));
    const wb = b.watchPeer(trackerId.peerId, undefined, () => told.push('b'));
    const cancel = new AbortController();
    const wc = b.watchPeer(trackerId.peerId, cancel.signal);
    cancel.abort();
    expect(await wc).toBe('cancelled');
    await until(() => told.length === 2);
    expect(told.sort()).toEqual(['a', 'b']);
    // … a watcher joining a watch already answered at once.
    const wa2 = a.watchPeer(trackerId.peerId, undefined, () => told.push('a2'));
    expect(told).toContain('a2');
    // A second connection with the tracker's key replaces the first: the tracker is still here.
    const again = new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity: trackerId });
    clients.push(again);
    again.start();
    await again.ready(5_000);
    tracker.close();
    let settled = false;
    void wa.then(() => (settled = true));
    await new Promise((r) => setTimeout(r, 200));
    expect(settled).toBe(false);
    again.close();
    expect(await wa).toBe('gone');
    expect(await wa2).toBe('gone');
    expect(await wb).toBe('gone');
  });

  it('a watch ends lost when the watcher’s own relay connection drops', async () => {
    const target = await client();
    const a = new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity: await Identity.generate(), outageBudgetMs: 0 });
    clients.push(a);
    a.start();
    await a.ready(5_000);
    const w = a.watchPeer(target.peerId);
    await new Promise((r) => setTimeout(r, 50));
    a.close();
    expect(await w).toBe('lost');
  });

  it('answers a malformed watch with a clear error and keeps serving the connection', async () => {
    const keys = makeKeys();
    const ws = new WebSocket(`${relay.url}/ws`);
    const challenge = await nextJson(ws);
    ws.send(JSON.stringify(registerMessage(keys, challenge.nonce as string)));
    expect((await nextJson(ws)).features).toContain('peer-watch');
    for (const bad of [{ type: 'watch-peer' }, { type: 'watch-peer', peer_id: 'XYZ' }, { type: 'unwatch-peer', peer_id: 42 }]) {
      ws.send(JSON.stringify(bad));
      const err = await nextJson(ws);
      expect(err).toMatchObject({ type: 'error', code: 'MESH_ERR_BAD_REQUEST' });
      expect(String(err.message)).toMatch(/peer_id: 32 lowercase hex/);
    }
    // Still registered and served: a valid watch of a peer that is here is answered attached.
    const here = await client();
    ws.send(JSON.stringify({ type: 'watch-peer', peer_id: here.peerId }));
    expect(await nextJson(ws)).toEqual({ type: 'peer-watch', peer_id: here.peerId, attached: true });
    expect(relay.peers().some((p) => p.peer_id === keys.peerId)).toBe(true);
    ws.close();
  });
});

describe('a tracker session beating over a relay with peer-watch', () => {
  it('holds no HTTP watch stream; when the tracker peer detaches it beats at once and registers with the tracker back on the relay', async () => {
    let trackerUp = true;
    let registrations = 0;
    let httpWatches = 0;
    const trackerIdentity = await Identity.generate();
    const answer = () => ({ assignment: null, heartbeat_interval_ms: 60_000, tracker_public_key: 'k', tracker_peer_id: trackerIdentity.peerId });
    // The tracker over HTTP: registrations; beats only when it is up, else connection refused.
    const fetchFn = (async (url: string) => {
      if (url.endsWith('/api/nodes/watch')) {
        httpWatches++;
        return new Response(new ReadableStream(), { status: 200 });
      }
      if (!trackerUp) throw Object.assign(new TypeError('fetch failed'), { cause: { code: 'ECONNREFUSED' } });
      if (url.endsWith('/api/nodes/register')) registrations++;
      else answered++;
      return new Response(JSON.stringify(answer()), { status: 200, headers: { 'content-type': 'application/json' } });
    }) as unknown as typeof fetch;
    let answered = 0;
    const beatHandler = (path: string) => {
      if (path !== '/api/nodes/beat') return { status: 404, body: {} };
      answered++;
      return { status: 200, body: answer() };
    };
    const attachTracker = async () => {
      const t = new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity: trackerIdentity, handler: async (req) => ({ status: 200, headers: {}, body: new TextEncoder().encode(JSON.stringify(beatHandler(req.path).body)) }) });
      clients.push(t);
      t.start();
      await t.ready(5_000);
      return t;
    };
    let trackerPeer = await attachTracker();
    const node = await client();
    const identity = await Identity.generate();
    const tc = new TrackerClient({ trackerUrl: 'http://tracker.test', fetch: fetchFn, identity, relay: node });
    const msg = (): NodeMessage => ({ peer_id: identity.peerId, public_key: 'x', info: { model: 'm', backend: 'wasm', memory_budget_mb: 1 }, stats: { rpm: 0, layer_ms: 0, queue_depth: 0, kv_free_bytes: 0, tokens_served: 0 }, serving: null, timestamp: Date.now() }) as NodeMessage;
    const session = new TrackerSession({ client: tc, message: msg, onAssignment: () => {} });
    try {
      await session.start();
      expect(registrations).toBe(1);
      // Watched over the relay from the registration on (a 60 s period: nothing else beats in this test).
      await session.beatNow();
      expect(tc.beats.relay).toBe(1);
      await new Promise((r) => setTimeout(r, 100));
      expect(httpWatches).toBe(0);
      // The tracker dies: the relay says so, the node beats on a short schedule (refused) …
      trackerUp = false;
      trackerPeer.close();
      await until(() => tc.beats.http >= 1);
      // … and it is back (same key): a beat of the short schedule reaches it within about a second (over the relay,
      // or signed over HTTP when it came before the tracker's relay connection), not a heartbeat period (60 s) later.
      const before = answered;
      trackerUp = true;
      trackerPeer = await attachTracker();
      await until(() => answered > before, 3_000);
      expect(httpWatches).toBe(0);
    } finally {
      session.close();
    }
  });

  it('with a relay that has no peer-watch (an older one) it holds the HTTP watch stream, as before', async () => {
    let httpWatches = 0;
    const trackerPeer = 'ab'.repeat(16);
    const answer = { assignment: null, heartbeat_interval_ms: 60_000, tracker_public_key: 'k', tracker_peer_id: trackerPeer };
    const fetchFn = (async (url: string) => {
      if (url.endsWith('/api/nodes/watch')) {
        httpWatches++;
        return new Response(new ReadableStream(), { status: 200 });
      }
      return new Response(JSON.stringify(answer), { status: 200 });
    }) as unknown as typeof fetch;
    const old = {
      state: 'registered',
      request: async () => ({ status: 200, headers: {}, body: new TextEncoder().encode(JSON.stringify(answer)) }),
      watchPeer: async () => 'unsupported' as const,
    };
    const identity = await Identity.generate();
    const tc = new TrackerClient({ trackerUrl: 'http://tracker.test', fetch: fetchFn, identity, relay: old });
    const msg = (): NodeMessage => ({ peer_id: identity.peerId, public_key: 'x', info: { model: 'm', backend: 'wasm', memory_budget_mb: 1 }, stats: { rpm: 0, layer_ms: 0, queue_depth: 0, kv_free_bytes: 0, tokens_served: 0 }, serving: null, timestamp: Date.now() }) as NodeMessage;
    const session = new TrackerSession({ client: tc, message: msg, onAssignment: () => {} });
    try {
      await session.start();
      await until(() => httpWatches === 1);
      await session.beatNow();
      expect(tc.beats.relay).toBe(1);
      expect(httpWatches).toBe(1);
    } finally {
      session.close();
    }
  });
});

describe('relay beat-batch', () => {
  /** A raw peer registered with `info`: a stand-in tracker that reads and answers the relay's batches itself. */
  async function rawPeer(info: Record<string, unknown>): Promise<{ ws: WebSocket; peerId: string }> {
    const keys = makeKeys();
    const ws = new WebSocket(`${relay.url}/ws`);
    const challenge = await nextJson(ws);
    ws.send(JSON.stringify(registerMessage(keys, challenge.nonce as string, info)));
    const reg = await nextJson(ws);
    expect(reg.features).toContain('beat-batch');
    return { ws, peerId: reg.peer_id as string };
  }
  const code = (r: { body: unknown }) => (r.body as { error?: { code?: string; batch?: string } }).error;

  it('sends a tracker the beats of several nodes as one message and fans its answers out, one per node; refuses what it cannot batch', async () => {
    const tracker = await rawPeer({ features: ['beat-batch'] });
    const nodes = [await client(), await client(), await client()];
    const replies = nodes.map((n, i) => n.beat(tracker.peerId, { peer_id: n.peerId, n: i }, 3_000)!);
    const batch = await nextJson(tracker.ws);
    expect(batch.type).toBe('beats');
    // One message, each beat with the sender the relay vouches for and the body as the node wrote it.
    const beats = batch.beats as Array<{ from: string; body: { peer_id: string; n: number } }>;
    expect(beats.map((b) => b.from).sort()).toEqual(nodes.map((n) => n.peerId).sort());
    for (const b of beats) expect(b.body.peer_id).toBe(b.from);
    const byFrom = (id: string) => beats.findIndex((b) => b.from === id);
    const answers: unknown[] = [];
    answers[byFrom(nodes[0]!.peerId)] = { status: 200, body: { heartbeat_interval_ms: 5000 } };
    answers[byFrom(nodes[1]!.peerId)] = { status: 404, body: { error: { code: 'MESH_ERR_NOT_FOUND', message: 'register again' } } };
    answers[byFrom(nodes[2]!.peerId)] = 'not an answer';
    tracker.ws.send(JSON.stringify({ type: 'beats-answer', batch: batch.batch, answers }));
    const [ok, unknown, garbled] = await Promise.all(replies);
    expect(ok).toEqual({ status: 200, body: { heartbeat_interval_ms: 5000 } });
    expect(unknown!.status).toBe(404);
    expect(code(unknown!)!.code).toBe('MESH_ERR_NOT_FOUND');
    expect(garbled!.status).toBe(502);
    expect(code(garbled!)!.code).toBe('MESH_ERR_UPSTREAM');

    // A malformed answer: an error to the tracker, whose connection stays, and whose next batch is served.
    tracker.ws.send(JSON.stringify({ type: 'beats-answer', batch: 'seven' }));
    expect(await nextJson(tracker.ws)).toMatchObject({ type: 'error', code: 'MESH_ERR_BAD_REQUEST' });
    const next = nodes[0]!.beat(tracker.peerId, { peer_id: nodes[0]!.peerId }, 3_000)!;
    const again = await nextJson(tracker.ws);
    tracker.ws.send(JSON.stringify({ type: 'beats-answer', batch: again.batch, answers: [] }));
    // Answers that do not match the beats: each beat is answered 502, none is left waiting.
    expect(code(await next)!.code).toBe('MESH_ERR_UPSTREAM');

    // The tracker leaves with a batch in flight: each beat is answered 502 at once.
    const stranded = nodes[1]!.beat(tracker.peerId, { peer_id: nodes[1]!.peerId }, 3_000)!;
    await nextJson(tracker.ws);
    tracker.ws.close();
    expect(code(await stranded)!.code).toBe('MESH_ERR_PEER_GONE');

    // An older tracker (no beat-batch in its info), and a peer not attached here: 404, the node takes the request path.
    const old = await rawPeer({ protocols: ['mesh-frames/1'] });
    expect(code((await nodes[0]!.beat(old.peerId, {}, 3_000))!)).toMatchObject({ code: 'MESH_ERR_NO_SUCH_PEER', batch: 'unsupported' });
    const absent = code((await nodes[0]!.beat('0'.repeat(32), {}, 3_000))!);
    expect(absent!.code).toBe('MESH_ERR_NO_SUCH_PEER');
    expect(absent!.batch).toBeUndefined();
    old.ws.close();
  });

  it('answers a malformed beat with a clear error and keeps serving the connection', async () => {
    const node = await rawPeer({ protocols: ['mesh-frames/1'] });
    node.ws.send(JSON.stringify({ type: 'beat', to: '0'.repeat(32), body: {} }));
    expect(await nextJson(node.ws)).toMatchObject({ type: 'error', code: 'MESH_ERR_BAD_REQUEST' });
    node.ws.send(JSON.stringify({ type: 'beat', id: 5, to: 'XYZ', body: {} }));
    const bad = await nextJson(node.ws);
    expect(bad).toMatchObject({ type: 'beat-answer', id: 5, status: 400 });
    expect(String((bad.body as { error: { message: string } }).error.message)).toMatch(/to: a peer id/);
    node.ws.send(JSON.stringify({ type: 'beat', id: 6, to: '0'.repeat(32), body: { pad: 'x'.repeat(70_000) } }));
    expect(await nextJson(node.ws)).toMatchObject({ type: 'beat-answer', id: 6, status: 413 });
    // Still registered and served.
    node.ws.send(JSON.stringify({ type: 'beat', id: 7, to: '0'.repeat(32), body: {} }));
    expect(await nextJson(node.ws)).toMatchObject({ type: 'beat-answer', id: 7, status: 404 });
    expect(relay.peers().some((p) => p.peer_id === node.peerId)).toBe(true);
    node.ws.close();
  });
});
