/**
 * Heartbeats over the relay socket (`POST /api/nodes/beat`): the relay
 * vouches for the sender (the frame's source peer id), so the body is the
 * NodeMessage unsigned. The tracker takes it only from the node it speaks
 * for, with the key it registered; anything else is refused.
 */
import pino from 'pino';
import { describe, expect, it } from 'vitest';
import { Identity } from '../../src/net/identity.ts';
import { RelayClient } from '../../src/net/relay-client.ts';
import { TrackerClient, type TrackerRelay } from '../../src/node/tracker-client.ts';
import { relayHandlerFor, startTracker } from '../../src/tracker/server.ts';
import { NodeWebSocket } from '../helpers/ws-host.ts';
import { startRelayProcess } from '../helpers/relay-process.ts';
import { FakeNode, makeTracker, smallSpec } from '../helpers/tracker.ts';

const json = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));
const until = async (cond: () => boolean, ms = 5_000): Promise<void> => {
  const t0 = Date.now();
  while (!cond()) {
    if (Date.now() - t0 > ms) throw new Error('condition not met in time');
    await new Promise((r) => setTimeout(r, 10));
  }
};
const parse = (b: Uint8Array | AsyncIterable<Uint8Array>) => JSON.parse(new TextDecoder().decode(b as Uint8Array)) as { assignment?: unknown; heartbeat_interval_ms?: number; error?: { code: string; message: string } };

describe('heartbeats over the relay socket', () => {
  it('answers a registered node\'s unsigned beat like a signed one, and refuses a beat the relay does not vouch for', async () => {
    const t = await makeTracker();
    const n = await FakeNode.create({ memory_budget_mb: 64 });
    const reg = await n.register(t, { load: true });
    const handler = relayHandlerFor(t.app.fetch, t.relayBeat);
    const beat = (from: string | undefined, body: unknown) => handler({ method: 'POST', path: '/api/nodes/beat', headers: {}, body: json(body), ...(from !== undefined ? { from } : {}) });

    const ok = await beat(n.peerId, n.message(t.clock.now));
    expect(ok.status).toBe(200);
    expect(parse(ok.body).assignment).toEqual(reg.assignment);
    expect(t.registry.status(t.registry.nodes.get(n.peerId)!)).toBe('serving');
    // Seen now: the beat moved the node's deadline.
    t.clock.now += 2500;
    expect((await beat(n.peerId, n.message(t.clock.now))).status).toBe(200);
    t.clock.now += 14_000;
    expect(t.sweep()).toEqual([]);

    // No relay word for the sender (an /rpc or envelope request): sign it instead.
    expect((await beat(undefined, n.message(t.clock.now))).status).toBe(401);
    // The relay says another peer sent it.
    const other = await Identity.generate();
    const forged = await beat(other.peerId, n.message(t.clock.now));
    expect(forged.status).toBe(403);
    expect(parse(forged.body).error!.code).toBe('MESH_ERR_FORBIDDEN');
    // A key other than the registered one.
    const swapped = await beat(n.peerId, { ...n.message(t.clock.now), public_key: 'A'.repeat(43) });
    expect(swapped.status).toBe(403);
    // Unknown node: register first.
    const stranger = await FakeNode.create();
    expect((await beat(stranger.peerId, stranger.message(t.clock.now))).status).toBe(404);
    // Malformed.
    expect((await handler({ method: 'POST', path: '/api/nodes/beat', headers: {}, body: new TextEncoder().encode('{nope'), from: n.peerId })).status).toBe(400);
    expect((await beat(n.peerId, { peer_id: n.peerId })).status).toBe(400);
  });
});

describe('heartbeats over a real relay', () => {
  it('a node registered over HTTP beats over its relay socket; the tracker sees who sent it from the relay\'s stamp', async () => {
    const relay = await startRelayProcess();
    const tracker = await startTracker({ port: 0, relayUrl: relay.url, logLevel: 'silent', heartbeatIntervalMs: 1000, models: [] }, { modelSpecs: [smallSpec()], logger: pino({ level: 'silent' }) });
    const node = await FakeNode.create({ memory_budget_mb: 64 });
    const client = new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity: node.identity });
    try {
      client.start();
      await client.ready(10_000);
      const tc = new TrackerClient({ trackerUrl: tracker.url, fetch: globalThis.fetch, identity: node.identity, relay: client });
      const reg = await tc.register(node.message(Date.now()));
      expect(reg.tracker_peer_id).toBe(tracker.identity.peerId);
      for (let i = 0; i < 3; i++) expect((await tc.heartbeat(node.message(Date.now()))).assignment).toEqual(reg.assignment);
      expect(tc.beats).toEqual({ relay: 3, http: 0, batched: 3, skipped: 0 });
      const metrics = await (await fetch(`${tracker.url}/metrics`)).text();
      expect(metrics).toMatch(/meshnet_tracker_registrations_total\{kind="heartbeat",result="ok"\} 3/);
      // Another peer of the relay cannot beat for this node: the relay stamps who really sent it.
      const other = new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity: await Identity.generate() });
      other.start();
      await other.ready(10_000);
      const r = await other.request(tracker.identity.peerId, { method: 'POST', path: '/api/nodes/beat', headers: { 'content-type': 'application/json' }, body: json(node.message(Date.now())) });
      expect(r.status).toBe(403);
      other.close();
      // Batched (beat-batch): several nodes' beats reach the tracker in one message and each gets its own answer.
      // One unknown to the tracker: 404 to it alone; one speaking for another node: 403 to it alone.
      const stranger = await FakeNode.create({ memory_budget_mb: 64 });
      const liar = await FakeNode.create({ memory_budget_mb: 64 });
      const [sc, lc] = [stranger, liar].map((f) => new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity: f.identity }));
      for (const c of [sc!, lc!]) c.start();
      await Promise.all([sc!.ready(10_000), lc!.ready(10_000)]);
      const to = tracker.identity.peerId;
      const [okB, unknownB, liarB] = await Promise.all([
        client.beat(to, node.message(Date.now()), 5_000)!,
        sc!.beat(to, stranger.message(Date.now()), 5_000)!,
        lc!.beat(to, node.message(Date.now()), 5_000)!,
      ]);
      sc!.close();
      lc!.close();
      expect(okB.status).toBe(200);
      expect((okB.body as { assignment: unknown }).assignment).toEqual(reg.assignment);
      expect(unknownB.status).toBe(404);
      expect((unknownB.body as { error: { code: string } }).error.code).toBe('MESH_ERR_NOT_FOUND');
      expect(liarB.status).toBe(403);
      expect((liarB.body as { error: { code: string } }).error.code).toBe('MESH_ERR_FORBIDDEN');
      const after = await (await fetch(`${tracker.url}/metrics`)).text();
      expect(after).toMatch(/meshnet_tracker_registrations_total\{kind="heartbeat",result="ok"\} 4/);
      // 6 beats in fewer batches than beats: the three sent together shared one.
      const batches = Number(/meshnet_tracker_beat_batches_total\{result="ok"\} (\d+)/.exec(after)?.[1]);
      expect(batches).toBeGreaterThanOrEqual(4);
      expect(batches).toBeLessThan(6);
      // A malformed batch: refused whole with a clear error, counted; the tracker keeps taking batches.
      expect(JSON.parse(tracker.relayBeats({ type: 'beats', batch: 9, beats: [{ from: 'XYZ', body: {} }] }))).toMatchObject({ type: 'beats-answer', batch: 9, error: { code: 'MESH_ERR_BAD_REQUEST' } });
      expect(JSON.parse(tracker.relayBeats({ type: 'beats' }))).toMatchObject({ type: 'error', code: 'MESH_ERR_BAD_REQUEST' });
      expect(await (await fetch(`${tracker.url}/metrics`)).text()).toMatch(/meshnet_tracker_beat_batches_total\{result="malformed"\} 2/);
      expect((await tc.heartbeat(node.message(Date.now()))).assignment).toEqual(reg.assignment);
      expect(tc.beats).toEqual({ relay: 4, http: 0, batched: 4, skipped: 0 });
      // A node of an older build (no beat()) beats over the request path, as before.
      const oldStyle = new TrackerClient({ trackerUrl: tracker.url, fetch: globalThis.fetch, identity: node.identity, relay: { get state() { return client.state; }, request: (p, r, o) => client.request(p, r, o) } });
      await oldStyle.register(node.message(Date.now()));
      expect((await oldStyle.heartbeat(node.message(Date.now()))).assignment).toEqual(reg.assignment);
      expect(oldStyle.beats).toEqual({ relay: 1, http: 0, batched: 0, skipped: 0 });

      // The relay gone: beats go signed over HTTP, and back over the relay once it returns.
      await relay.stop();
      await new Promise((res) => setTimeout(res, 300));
      await tc.heartbeat(node.message(Date.now()));
      expect(tc.beats.http).toBe(1);
    } finally {
      client.close();
      await tracker.close();
      await relay.stop();
    }
  });

  it('a node whose tracker is not attached to its relay tries the batch once, beats without it meanwhile, and batches again once the tracker attaches there', async () => {
    const [a, b] = await Promise.all([startRelayProcess(), startRelayProcess()]);
    // The tracker dials relay a, and fails over to b when a goes; the node is on b.
    const tracker = await startTracker({ port: 0, relayUrl: `${a.url},${b.url}`, logLevel: 'silent', heartbeatIntervalMs: 1000, models: [] }, { modelSpecs: [smallSpec()], logger: pino({ level: 'silent' }) });
    const node = await FakeNode.create({ memory_budget_mb: 64 });
    const client = new RelayClient({ relayUrl: b.url, WebSocket: NodeWebSocket, identity: node.identity });
    const watches = new AbortController();
    try {
      client.start();
      await client.ready(10_000);
      let tries = 0;
      let asks = 0;
      let heldTold = 0;
      const counted: TrackerRelay = {
        get state() {
          return client.state;
        },
        get currentRegistration() {
          return client.currentRegistration;
        },
        request: (p, r, o) => client.request(p, r, o),
        watchPeer: (p, s, attached, absent) => {
          asks++;
          return client.watchPeer(p, s, attached, () => {
            heldTold++;
            absent?.();
          });
        },
        beat: (p, body, ms) => {
          tries++;
          return client.beat(p, body, ms);
        },
      };
      const tc = new TrackerClient({ trackerUrl: tracker.url, fetch: globalThis.fetch, identity: node.identity, relay: counted });
      const reg = await tc.register(node.message(Date.now()));
      for (let i = 0; i < 3; i++) expect((await tc.heartbeat(node.message(Date.now()))).assignment).toEqual(reg.assignment);
      // Tried batched once (relay b: no such peer), then the request path at once (b has no such peer either: signed HTTP).
      expect(tries).toBe(1);
      expect(tc.beats).toEqual({ relay: 0, http: 3, batched: 0, skipped: 2 });
      // The relay's peer-watch says the same: not attached there; relay b (peer-back) holds the watch.
      void tc.watch(watches.signal);
      await until(() => heldTold === 1);
      expect(tc.noBatchNow).toBe('not-attached');
      // Relay a goes: the tracker fails over to b, and b says so on the watch it held: batched at once, not asked again.
      await a.stop();
      await until(() => tracker.relay?.state === 'registered' && tracker.relay.relayUrl.endsWith(`:${b.port}`), 10_000);
      await until(() => tc.noBatchNow === undefined);
      expect(asks).toBe(1);
      expect(await (await fetch(`${b.httpUrl}/metrics`)).text()).toMatch(/meshnet_relay_watch_peer_total 1\b/);
      expect((await tc.heartbeat(node.message(Date.now()))).assignment).toEqual(reg.assignment);
      expect(tries).toBe(2);
      expect(tc.beats).toEqual({ relay: 1, http: 3, batched: 1, skipped: 2 });
    } finally {
      watches.abort();
      client.close();
      await tracker.close();
      await Promise.all([a.stop(), b.stop()]);
    }
  });
});
