/**
 * A node that drains (`draining: true`: paused, frozen, closing) on the
 * tracker: left out of new routes, replacements and failovers from that
 * message on, kept registered with its span, covering its layers for
 * placement only while a silent node would still be kept; messages applied
 * in timestamp order (a drain beacon released late cannot undo a resume,
 * and one racing its own heartbeat holds); a stored span restored at
 * registration.
 */
import { describe, expect, it } from 'vitest';
import { signBody } from '../../src/tracker/signing.ts';
import { FakeNode, makeTracker, type TestTracker } from '../helpers/tracker.ts';

/** A node already serving [start, end) with a large budget. */
async function serving(t: TestTracker, start: number, end: number, layerMs = 1): Promise<FakeNode> {
  const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(layerMs);
  n.serving = { start_layer: start, end_layer: end };
  await n.register(t);
  return n;
}

async function beat(t: TestTracker, n: FakeNode, at: number, draining?: boolean): Promise<Response> {
  return n.post(t, '/api/nodes/heartbeat', at, draining === undefined ? {} : { draining });
}

function routeIds(t: TestTracker, n = 200): Set<string> {
  const seen = new Set<string>();
  for (let i = 0; i < n; i++) for (const h of t.registry.pick('small').hops) seen.add(h.id);
  return seen;
}

describe('draining nodes on the tracker', () => {
  it('are left out of routes from the draining message on, keep their span, and come back with the next plain beat', async () => {
    const t = await makeTracker();
    const a = await serving(t, 0, 12, 1);
    const b = await serving(t, 0, 12, 1);
    expect(routeIds(t)).toEqual(new Set([a.peerId, b.peerId]));
    t.clock.now += 100;
    expect((await beat(t, b, t.clock.now, true)).status).toBe(200);
    const rec = t.registry.nodes.get(b.peerId)!;
    expect(rec.draining).toBe(true);
    expect(rec.drainingSince).toBe(t.clock.now);
    expect(rec.serving).toEqual({ start: 0, end: 12 });
    expect(t.registry.status(rec)).toBe('draining');
    expect(routeIds(t)).toEqual(new Set([a.peerId]));
    // Admission's routes too.
    expect(t.registry.pickWithRoom('small', 100)!.hops.map((h) => h.id)).toEqual([a.peerId]);
    const avail = t.registry.availability('small');
    expect(avail.nodes.find((n) => n.peer_id === b.peerId)).toMatchObject({ status: 'draining', draining: true, draining_since: t.clock.now });
    expect(avail.layers[0]!.nodes).toEqual([a.peerId]);
    t.clock.now += 100;
    await beat(t, b, t.clock.now);
    expect(rec.draining).toBe(false);
    expect(rec.drainingSince).toBeUndefined();
    expect(routeIds(t)).toEqual(new Set([a.peerId, b.peerId]));
  });

  it('a draining only holder: no route (503 naming its layers) and no replacement through it', async () => {
    const t = await makeTracker();
    const head = await serving(t, 0, 6);
    const mid = await serving(t, 6, 12);
    t.clock.now += 10;
    await beat(t, mid, t.clock.now, true);
    expect(() => t.registry.pick('small')).toThrow(/layers 6-11/);
    const body = { head_peer_id: head.peerId, failed_peer_id: mid.peerId, start_layer: 6, end_layer: 12, model: 'small', timestamp: t.clock.now };
    const res = await t.app.request('/api/route/replace', { method: 'POST', body: JSON.stringify(await signBody(head.identity, body)) });
    expect(res.status).toBe(503);
    // A spare joins: it is the replacement, the draining node never.
    const spare = await serving(t, 6, 12, 5);
    const res2 = await t.app.request('/api/route/replace', { method: 'POST', body: JSON.stringify(await signBody(head.identity, { ...body, failed_peer_id: head.peerId, start_layer: 6 })) });
    expect(res2.status).toBe(200);
    expect(JSON.parse(((await res2.json()) as { route: string }).route)[0].peer_id).toBe(spare.peerId);
  });

  it('applies messages in timestamp order: a late drain cannot undo a resume, and a drain racing its own heartbeat holds', async () => {
    const t = await makeTracker();
    await serving(t, 0, 12);
    const n = await serving(t, 0, 12);
    const rec = t.registry.nodes.get(n.peerId)!;
    const t0 = t.clock.now;
    // Beat T1, then the resume beat T2, then the drain beacon signed at T1 arrives late: ignored.
    await beat(t, n, t0 + 1);
    await beat(t, n, t0 + 2);
    const seen = rec.lastSeen;
    t.clock.now += 50;
    expect((await beat(t, n, t0 + 1, true)).status).toBe(200);
    expect(rec.draining).toBe(false);
    expect(rec.lastSeen).toBe(seen);
    // The drain beacon of T3 arrives before the heartbeat of T3 it was signed beside: it holds.
    await beat(t, n, t0 + 3, true);
    await beat(t, n, t0 + 3);
    expect(rec.draining).toBe(true);
    // The next beat after resume undoes it.
    await beat(t, n, t0 + 4);
    expect(rec.draining).toBe(false);
  });

  it('counts a draining node as holding its layers for placement only while a silent one would still be kept', async () => {
    const t = await makeTracker({ heartbeatIntervalMs: 1000, deadAfterMissedHeartbeats: 3 });
    const a = await serving(t, 0, 6);
    const b = await serving(t, 6, 12);
    t.clock.now += 10;
    await beat(t, b, t.clock.now, true);
    // A joiner right away: layers 6-11 still count as held (a short freeze moves nobody, draws nobody), so it goes by throughput among a's layers and b's alike.
    const small = await FakeNode.create({ memory_budget_mb: 30 });
    const early = await small.register(t);
    expect(early.assignment!.end_layer).toBeLessThanOrEqual(6);
    // Past 3 intervals of draining (b keeps beating: a paused page), a joiner covers b's layers.
    t.clock.now += 3_500;
    await beat(t, b, t.clock.now, true);
    await beat(t, a, t.clock.now);
    const late = await (await FakeNode.create({ memory_budget_mb: 30 })).register(t);
    expect(late.assignment!.start_layer).toBeGreaterThanOrEqual(6);
    // b is still registered and keeps its assignment (it is paused, not gone).
    expect(t.registry.nodes.get(b.peerId)!.assignment).toEqual({ start: 6, end: 12 });
    expect(t.registry.sweep()).toEqual([small.peerId]);
  });

  it('moves no serving node onto the layers of a node paused past its cover until the rejoin grace ends', async () => {
    const t = await makeTracker({ heartbeatIntervalMs: 1000, deadAfterMissedHeartbeats: 3, rejoinGraceMs: 5_000 });
    // a can grow over 6-11 (its budget holds the whole model); b, paused, is their only holder.
    const a = await serving(t, 0, 6);
    const b = await serving(t, 6, 12);
    t.clock.now += 10;
    await beat(t, b, t.clock.now, true);
    const assigned = () => t.registry.nodes.get(a.peerId)!.assignment;
    for (let i = 0; i < 7; i++) {
      t.clock.now += 1000;
      await beat(t, b, t.clock.now, true);
      await beat(t, a, t.clock.now);
      t.registry.sweep();
    }
    // 3 s of cover + 5 s of grace not yet over (7 s): a keeps its span.
    expect(assigned()).toEqual({ start: 0, end: 6 });
    t.clock.now += 1500;
    await beat(t, b, t.clock.now, true);
    await beat(t, a, t.clock.now);
    t.registry.sweep();
    expect(assigned()!.end).toBe(12);
  });

  it('moves a spare (a node whose every layer another holds too) onto a silent node\'s layers at once, within the grace', async () => {
    const t = await makeTracker({ heartbeatIntervalMs: 1000, deadAfterMissedHeartbeats: 3, rejoinGraceMs: 60_000 });
    const a = await serving(t, 0, 6);
    const spare = await serving(t, 0, 6);
    const b = await serving(t, 6, 12);
    t.clock.now += 3_500;
    await beat(t, a, t.clock.now);
    await beat(t, spare, t.clock.now);
    expect(t.registry.sweep()).toEqual([b.peerId]);
    const moved = [a, spare].filter((n) => t.registry.nodes.get(n.peerId)!.assignment!.end === 12);
    expect(moved).toHaveLength(1);
    // Whichever of the two it was, the other keeps 0-5 alone now: it is no spare, and stays.
    t.clock.now += 1000;
    for (const n of [a, spare]) await beat(t, n, t.clock.now);
    t.registry.sweep();
    expect([a, spare].filter((n) => t.registry.nodes.get(n.peerId)!.assignment!.end === 12)).toEqual(moved);
  });

  it('gives a reloaded node the span it keeps in storage, unless others hold it while layers lie bare', async () => {
    const t = await makeTracker();
    const n = await FakeNode.create({ memory_budget_mb: 4096 });
    const first = await n.post(t, '/api/nodes/register', t.clock.now, { stored: { start_layer: 3, end_layer: 9 } });
    expect(((await first.json()) as { assignment: { start_layer: number; end_layer: number } }).assignment).toMatchObject({ start_layer: 3, end_layer: 9 });
    // A stored span over the budget is not given back.
    const tight = await FakeNode.create({ memory_budget_mb: 30 });
    const r2 = (await (await tight.post(t, '/api/nodes/register', t.clock.now, { stored: { start_layer: 0, end_layer: 12 } })).json()) as { assignment: { start_layer: number; end_layer: number } };
    expect(r2.assignment.end_layer - r2.assignment.start_layer).toBeLessThan(12);
    // [0, 3) and [9, 12) are bare (n holds 3-8, tight holds some), and 3-8 is held by n: a stored 3-9 goes elsewhere.
    const other = await FakeNode.create({ memory_budget_mb: 4096 });
    const r3 = (await (await other.post(t, '/api/nodes/register', t.clock.now, { stored: { start_layer: 3, end_layer: 9 } })).json()) as { assignment: { start_layer: number; end_layer: number } };
    expect(r3.assignment).not.toMatchObject({ start_layer: 3, end_layer: 9 });
  });

  it('registers a node that says it drains as draining (a paused page that reloaded)', async () => {
    const t = await makeTracker();
    await serving(t, 0, 12);
    const n = await FakeNode.create({ memory_budget_mb: 4096 });
    n.serving = { start_layer: 0, end_layer: 12 };
    await n.post(t, '/api/nodes/register', t.clock.now, { draining: true });
    expect(t.registry.nodes.get(n.peerId)!.draining).toBe(true);
    expect(routeIds(t).has(n.peerId)).toBe(false);
  });
});

describe('a node back after the tracker dropped it', () => {
  it('keeps the span it serves when nothing else is bare, and is placed as a fresh join when others took its layers and some lie bare', async () => {
    const t = await makeTracker({ heartbeatIntervalMs: 1000, deadAfterMissedHeartbeats: 3 });
    const a = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1);
    a.serving = { start_layer: 0, end_layer: 6 };
    await a.register(t);
    const b = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1);
    b.serving = { start_layer: 6, end_layer: 12 };
    await b.register(t);
    // b is frozen: silent past the timeout, dropped.
    t.clock.now += 3_500;
    await a.heartbeat(t);
    expect(t.registry.sweep()).toEqual([b.peerId]);
    // Back with nothing else changed: it keeps what it serves (no download).
    const back = await b.register(t);
    expect(back.assignment).toMatchObject({ start_layer: 6, end_layer: 12 });
    // Dropped again; meanwhile c took 6-11 and a left, so 0-5 lie bare: b comes back and is given the bare layers
    // (a download, as a fresh join does), not its old span.
    t.clock.now += 3_500;
    await a.heartbeat(t);
    t.registry.sweep();
    // c holds 6-11 and cannot hold more (90 MiB): nobody can cover 0-5 once a leaves.
    const c = (await FakeNode.create({ memory_budget_mb: 90 })).withStats(1);
    c.serving = { start_layer: 6, end_layer: 12 };
    await c.register(t);
    t.registry.remove(a.peerId, 'left');
    expect(t.registry.nodes.get(c.peerId)!.assignment).toEqual({ start: 6, end: 12 });
    const again = await b.register(t);
    expect(again.assignment!.start_layer).toBe(0);
    // A restarted tracker (it never dropped anyone) adopts what a node serves, whatever the coverage.
    const fresh = await makeTracker();
    await c.register(fresh);
    const d = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1);
    d.serving = { start_layer: 6, end_layer: 12 };
    expect((await d.register(fresh)).assignment).toMatchObject({ start_layer: 6, end_layer: 12 });
  });
});
