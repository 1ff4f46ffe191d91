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
import { TrackerClient } from '../../src/node/tracker-client.ts';
import { relayHandlerFor, startTracker } from '../../src/tracker/server.ts';
import { NodeWebSocket } from '../helpers/ws-host.ts';
import { startRelayProcess } from '../helpers/relay-process.ts';
import { FakeNode, makeTracker, smallSpec } from '../helpers/tracker.ts';

const json = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));
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
      expect(tc.beats).toEqual({ relay: 3, http: 0, batched: 3 });
      const metrics = await (await fetch(`${tracker.url}/metrics`)).text();
      expect(metrics).toMatch(/meshnet_tracker_registrations_total\{kind="heartbeat",result="ok"\} 3/);
      // Another peer of the relay cannot beat for this node: the relay stamps who really sent it.
      const other = new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity: await Identity.generate() });
      other.start();
      await other.ready(10_000);
      const r = await other.request(tracker.identity.peerId, { method: 'POST', path: '/api/nodes/beat', headers: { 'content-type': 'application/json' }, body: json(node.message(Date.now())) });
      expect(r.status).toBe(403);
      other.close();
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
});
