import { describe, expect, it } from 'vitest';
import { Identity } from '../../src/net/identity.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import type { TrackerOptions } from '../../src/tracker/options.ts';
import { signBody } from '../../src/tracker/signing.ts';
import { FakeNode, makeTracker } from '../helpers/tracker.ts';

async function errorOf(res: Response): Promise<{ code: string; message: string }> {
  return ((await res.json()) as { error: { code: string; message: string } }).error;
}

describe('POST /api/nodes/register', () => {
  it('accepts a correctly signed registration and answers an assignment, heartbeat period and tracker key', async () => {
    const t = await makeTracker({ heartbeatIntervalMs: 2000 });
    const node = await FakeNode.create();
    const res = await node.post(t, '/api/nodes/register', t.clock.now);
    expect(res.status).toBe(200);
    const body = (await res.json()) as { assignment: { model: string; start_layer: number; end_layer: number; model_url: string }; heartbeat_interval_ms: number; tracker_public_key: string };
    expect(body.assignment.model).toBe('small');
    expect(body.assignment.model_url).toBe('http://models.test/small');
    expect(body.assignment.end_layer).toBeGreaterThan(body.assignment.start_layer);
    expect(body.heartbeat_interval_ms).toBe(2000);
    expect(body.tracker_public_key).toBe(t.publicKey);
    expect(t.registry.nodes.has(node.peerId)).toBe(true);
    // bf16 unless the tracker says otherwise.
    expect((body.assignment as { wire_dtype?: string }).wire_dtype).toBe('bf16');
  });

  it('gives each model its wire dtype with the assignment (the tracker\'s default, or the model\'s own)', async () => {
    const cases: Array<[Partial<TrackerOptions>, string]> = [
      [{ wireDtype: 'f32' }, 'f32'],
      [{ wireDtype: 'f32', models: [{ name: 'small', url: 'http://models.test/small', wireDtype: 'f16' }] }, 'f16'],
    ];
    for (const [o, want] of cases) {
      const t = await makeTracker(o);
      const node = await FakeNode.create();
      const body = (await (await node.post(t, '/api/nodes/register', t.clock.now)).json()) as { assignment: { wire_dtype?: string } };
      expect(body.assignment.wire_dtype).toBe(want);
    }
  });

  it('refuses a public key that does not hash to the claimed peer id (403) and registers nothing', async () => {
    const t = await makeTracker();
    const victim = await FakeNode.create();
    const attacker = await Identity.generate();
    // The attacker signs correctly with its own key but claims the victim's id.
    const forged = await signBody(attacker, { ...victim.message(t.clock.now), public_key: encodeBase64Url(attacker.publicKey) });
    const res = await t.app.request('/api/nodes/register', { method: 'POST', body: JSON.stringify(forged) });
    expect(res.status).toBe(403);
    const err = await errorOf(res);
    expect(err.code).toBe('MESH_ERR_FORBIDDEN');
    expect(err.message).toMatch(/does not belong to this public key/);
    expect(t.registry.nodes.size).toBe(0);
  });

  it('refuses a signature made by another key (401)', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create();
    const other = await Identity.generate();
    const signed = await signBody(other, node.message(t.clock.now));
    const res = await t.app.request('/api/nodes/register', { method: 'POST', body: JSON.stringify(signed) });
    expect(res.status).toBe(401);
    expect((await errorOf(res)).code).toBe('MESH_ERR_UNAUTHORIZED');
    expect(t.registry.nodes.size).toBe(0);
  });

  it('refuses a body altered after signing (401)', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create();
    const signed = await signBody(node.identity, node.message(t.clock.now));
    signed.body.info = { ...signed.body.info, memory_budget_mb: 100_000 };
    const res = await t.app.request('/api/nodes/register', { method: 'POST', body: JSON.stringify(signed) });
    expect(res.status).toBe(401);
  });

  it('verifies the body as sent: a newer node\'s extra fields (stripped here) are covered by its signature, and altering one is refused', async () => {
    const t = await makeTracker();
    const node = (await FakeNode.create()).withStats(1);
    const body = { ...node.message(t.clock.now), stats: { ...node.stats!, kv_some_future_field: 7 } };
    const signed = await signBody(node.identity, body);
    expect((await t.app.request('/api/nodes/register', { method: 'POST', body: JSON.stringify(signed) })).status).toBe(200);
    const altered = { ...signed, body: { ...signed.body, stats: { ...signed.body.stats, kv_some_future_field: 8 } } };
    expect((await t.app.request('/api/nodes/heartbeat', { method: 'POST', body: JSON.stringify(altered) })).status).toBe(401);
  });

  it('refuses a stale timestamp (replayed message) and one from the future, 61 s off', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create();
    for (const skew of [-61_000, 61_000]) {
      const res = await node.post(t, '/api/nodes/register', t.clock.now + skew);
      expect(res.status).toBe(401);
      expect((await errorOf(res)).message).toMatch(/off the tracker's clock/);
    }
    expect(t.registry.nodes.size).toBe(0);
    // 59 s is within the window.
    expect((await node.post(t, '/api/nodes/register', t.clock.now - 59_000)).status).toBe(200);
  });

  it('answers malformed bodies with 400 and keeps serving', async () => {
    const t = await makeTracker();
    const cases: Array<string> = ['not json', '{}', JSON.stringify({ body: { peer_id: 'zz' }, signature: 'x'.repeat(60) }), JSON.stringify([1, 2, 3])];
    for (const body of cases) {
      const res = await t.app.request('/api/nodes/register', { method: 'POST', body });
      expect(res.status, body).toBe(400);
      expect((await errorOf(res)).code).toBe('MESH_ERR_BAD_REQUEST');
    }
    const node = await FakeNode.create();
    expect((await node.post(t, '/api/nodes/register', t.clock.now)).status).toBe(200);
  });

  it('answers an unknown model with 404 naming the models it serves', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create({ model: 'gpt-9' });
    const res = await node.post(t, '/api/nodes/register', t.clock.now);
    expect(res.status).toBe(404);
    expect((await errorOf(res)).message).toMatch(/serves: small/);
  });
});

describe('POST /api/nodes/heartbeat', () => {
  it('answers 404 MESH_ERR_NOT_FOUND for a peer it does not know, so the node registers again', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create();
    const res = await node.post(t, '/api/nodes/heartbeat', t.clock.now);
    expect(res.status).toBe(404);
    expect((await errorOf(res)).code).toBe('MESH_ERR_NOT_FOUND');
  });

  it('verifies heartbeats like registrations (a forged heartbeat cannot keep a dead node alive)', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create();
    await node.register(t);
    const other = await Identity.generate();
    const signed = await signBody(other, node.message(t.clock.now));
    const res = await t.app.request('/api/nodes/heartbeat', { method: 'POST', body: JSON.stringify(signed) });
    expect(res.status).toBe(401);
  });

  it('removes a node after three missed heartbeat periods, not before', async () => {
    const t = await makeTracker({ heartbeatIntervalMs: 1000 });
    const node = await FakeNode.create();
    await node.register(t);
    t.clock.now += 2900;
    expect(t.sweep()).toEqual([]);
    await node.heartbeat(t);
    t.clock.now += 3001;
    expect(t.sweep()).toEqual([node.peerId]);
    expect(t.registry.nodes.has(node.peerId)).toBe(false);
    const res = await node.post(t, '/api/nodes/heartbeat', t.clock.now);
    expect(res.status).toBe(404);
  });

  it('keeps rolling stats: EWMA of layer_ms and a bounded history for the dashboard', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create();
    await node.register(t, { load: true });
    for (let i = 0; i < 20; i++) {
      node.withStats(4, 1);
      node.stats!.rpm = i;
      await node.heartbeat(t);
    }
    const dash = (await (await t.app.request('/api/dashboard')).json()) as { nodes: Array<{ peer_id: string; layer_ms: number; rpm: number; rpm_history: unknown[]; backend: string; status: string }> };
    const n = dash.nodes.find((x) => x.peer_id === node.peerId)!;
    expect(n.layer_ms).toBeCloseTo(4, 3);
    expect(n.rpm).toBe(19);
    expect(n.rpm_history.length).toBe(12);
    expect(n.backend).toBe('onnxruntime-node');
    expect(n.status).toBe('serving');
  });

  it('shows a head\'s speculative decoding on the dashboard (drafted, accepted, trips, tokens)', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create();
    await node.register(t, { load: true });
    node.withStats(4, 1);
    const spec = { drafted: 40, accepted: 30, trips: 10, tokens: 40 };
    node.stats!.speculation = spec;
    await node.heartbeat(t);
    const dash = (await (await t.app.request('/api/dashboard')).json()) as { nodes: Array<{ peer_id: string; speculation: unknown }> };
    expect(dash.nodes.find((x) => x.peer_id === node.peerId)!.speculation).toEqual(spec);
    // A malformed one is refused with the heartbeat (validated like every stat).
    node.stats!.speculation = { drafted: -1 } as never;
    expect((await node.post(t, '/api/nodes/heartbeat', t.clock.now)).status).toBe(400);
  });
});

describe('hop paths on the dashboard', () => {
  it('passes on which path each of a node\'s hops takes (data channel, relay …), and refuses a malformed report', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create();
    await node.register(t, { load: true });
    node.withStats(4, 1);
    const peer = 'e'.repeat(32);
    node.stats!.hops_sent = { rtc: 96, fast: 3 };
    node.stats!.hop_paths = [{ peer_id: peer, path: 'rtc', rtc: 'open', sent: { rtc: 96, fast: 3 } }];
    await node.heartbeat(t);
    const dash = (await (await t.app.request('/api/dashboard')).json()) as { nodes: Array<{ peer_id: string; hops_sent: unknown; hop_paths: unknown }> };
    const n = dash.nodes.find((x) => x.peer_id === node.peerId)!;
    expect(n.hops_sent).toEqual({ rtc: 96, fast: 3 });
    expect(n.hop_paths).toEqual([{ peer_id: peer, path: 'rtc', rtc: 'open', sent: { rtc: 96, fast: 3 } }]);
    const html = await (await t.app.request('/dashboard')).text();
    expect(html).toContain('hops go by');
    node.stats!.hop_paths = [{ peer_id: peer, path: 'carrier-pigeon' as 'rtc', sent: {} }];
    await expect(node.heartbeat(t)).rejects.toMatchObject({ status: 400 });
  });
});

describe('tracker restart', () => {
  it('rebuilds the same availability map from heartbeats: 404 → re-register with serving → spans adopted', async () => {
    const t1 = await makeTracker({ heartbeatIntervalMs: 1000 });
    const nodes = await Promise.all([0, 1, 2, 3, 4].map(() => FakeNode.create()));
    for (const n of nodes) await n.join(t1);
    const before = (await (await t1.app.request('/api/availability')).json()) as { models: Array<{ complete: boolean; layers: Array<{ nodes: string[] }> }> };
    expect(before.models[0]!.complete).toBe(true);

    // A new tracker process: empty state, same clock.
    const t2 = await makeTracker({ heartbeatIntervalMs: 1000 });
    t2.clock.now = t1.clock.now + 1000;
    const unavailable = await t2.app.request('/v1/chat/completions', { method: 'POST', body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'hi' }] }) });
    expect(unavailable.status).toBe(503);
    for (const n of nodes) {
      const hb = await n.post(t2, '/api/nodes/heartbeat', t2.clock.now);
      expect(hb.status).toBe(404);
      const before = n.serving;
      const answer = await n.register(t2);
      // The answer keeps what it serves: no reload after a tracker restart.
      expect(answer.assignment && { start_layer: answer.assignment.start_layer, end_layer: answer.assignment.end_layer }).toEqual(before);
    }
    const after = (await (await t2.app.request('/api/availability')).json()) as typeof before;
    expect(after.models[0]!.complete).toBe(true);
    const norm = (m: typeof before) => m.models[0]!.layers.map((l) => [...l.nodes].sort());
    expect(norm(after)).toEqual(norm(before));
  });
});
