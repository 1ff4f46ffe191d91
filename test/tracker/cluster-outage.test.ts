/**
 * Trackers as replicas of one cluster when one of them, or NATS, goes (the
 * rest is in cluster.test.ts: two files, so each stays short), on a real
 * nats-server: one leader removes silent nodes while liveness heard by a
 * follower holds, and the follower leads once the leader goes; NATS lost:
 * trackers keep serving from their copy and catch up; the bucket lost:
 * rebuilt from what the trackers know.
 */
import { Kvm } from '@nats-io/kv';
import { describe, expect, it } from 'vitest';
import { connectNats } from '../../src/cluster/nats.ts';
import { trackerSubjects } from '../../src/cluster/subjects.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import type { RunningTracker } from '../../src/tracker/server.ts';
import { FakeNode } from '../helpers/tracker.ts';
import { asTest, mb, span, trackerCluster, until } from '../helpers/tracker-cluster.ts';

const c = trackerCluster();
const tracker = c.tracker;

describe('a tracker or NATS lost', () => {
  it('one leader removes silent nodes; a node heard only by a follower stays; the other tracker leads once the leader goes', async () => {
    const name = c.name();
    const [a, b] = [await tracker(name), await tracker(name)];
    const leaderOf = () => [a, b].find((t) => t.cluster!.isLeader());
    const leader = await until(leaderOf, 8000, 'a leader');
    expect([a, b].filter((t) => t.cluster!.isLeader())).toHaveLength(1);
    const follower = leader === a ? b : a;
    const quiet = await FakeNode.create({ memory_budget_mb: mb });
    const chatty = await FakeNode.create({ memory_budget_mb: mb });
    await quiet.register(asTest(follower), { load: true });
    await chatty.register(asTest(follower), { load: true });
    // chatty beats only to the follower; quiet says nothing. After > 3 periods (and the start grace), quiet is gone everywhere.
    const beat = setInterval(() => void chatty.heartbeat(asTest(follower)).catch(() => undefined), 400);
    try {
      await until(() => !leader.registry.nodes.has(quiet.peerId) && !follower.registry.nodes.has(quiet.peerId), 15_000, 'the silent node removed');
      expect(leader.registry.nodes.has(chatty.peerId)).toBe(true);
      expect(follower.registry.nodes.has(chatty.peerId)).toBe(true);
      // The leader goes; the follower takes the lease and keeps serving the node.
      await leader.close();
      c.release(leader);
      await until(() => follower.cluster!.isLeader(), 10_000, 'the follower leading');
      expect((await chatty.heartbeat(asTest(follower))).assignment).not.toBeNull();
    } finally {
      clearInterval(beat);
    }
  });
});

describe('the rejoin grace across a leader failover', () => {
  it('a node the leader dropped for silence keeps its layers from moves after another tracker takes over; it comes back with its span; an ended grace is deleted', async () => {
    const name = c.name();
    const [a, b] = [await tracker(name, { heartbeatIntervalMs: 500, rejoinGraceMs: 60_000 }), await tracker(name, { heartbeatIntervalMs: 500, rejoinGraceMs: 60_000 })];
    const leader = await until(() => [a, b].find((t) => t.cluster!.isLeader()), 5000, 'a leader');
    const follower = leader === a ? b : a;
    // Four nodes, each the only holder of its quarter, each able to hold the whole model: without the grace, a
    // neighbour is grown over a gap at once (test/tracker/assignment.test.ts).
    const nodes: FakeNode[] = [];
    for (const [s0, e0] of [[0, 3], [3, 6], [6, 9], [9, 12]] as const) {
      const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1);
      n.serving = { start_layer: s0, end_layer: e0 };
      await n.register(asTest(follower));
      nodes.push(n);
    }
    const leaving = nodes[2]!;
    const staying = nodes.filter((n) => n !== leaving);
    await until(() => nodes.every((n) => leader.registry.nodes.get(n.peerId)?.assignment), 3000, 'every node at the leader');
    const spans = (t: RunningTracker) => staying.map((n) => { const x = t.registry.nodes.get(n.peerId)?.assignment; return x ? `${x.start}-${x.end}` : '-'; }).join(' ');
    expect(spans(follower)).toBe('0-3 3-6 9-12');
    const beat = setInterval(() => {
      for (const n of staying) void n.heartbeat(asTest(follower)).catch(() => undefined);
    }, 200);
    try {
      // The leader's next sweep finds it silent for long (its clock says so) and drops it, with the grace.
      leader.registry.nodes.get(leaving.peerId)!.lastSeen -= 60_000;
      await until(() => !follower.registry.nodes.has(leaving.peerId) && follower.registry.vacatedUntil(leaving.peerId), 3000, 'the drop and its grace at the follower');
      expect(leader.registry.vacatedUntil(leaving.peerId)).toBe(follower.registry.vacatedUntil(leaving.peerId));
      // The leader goes; the follower leads, and through three of its sweeps grows nobody over the bare layers.
      await leader.close();
      c.release(leader);
      await until(() => follower.cluster!.isLeader(), 3000, 'the follower leading');
      await new Promise((r) => setTimeout(r, 1600));
      expect(spans(follower)).toBe('0-3 3-6 9-12');
      // Back within the grace: its span again, and a live document (the tombstone rewritten).
      expect((await leaving.register(asTest(follower))).assignment).toMatchObject({ start_layer: 6, end_layer: 9 });
      expect(follower.registry.vacatedUntil(leaving.peerId)).toBeUndefined();
    } finally {
      clearInterval(beat);
    }
    // A tombstone whose grace ended (its leader died before deleting it) is deleted by the leader, and routes nobody.
    const h = await connectNats({ servers: c.nats().url, name: 'check' });
    try {
      const kv = await new Kvm(h.nc).open(trackerSubjects(name).registryBucket);
      const stored = (await kv.get(`node.${leaving.peerId}`))!.json<Record<string, unknown>>();
      expect(stored.vacated_until).toBeUndefined();
      const ghost = await FakeNode.create({ memory_budget_mb: 4096 });
      await kv.put(`node.${ghost.peerId}`, JSON.stringify({ ...stored, peer_id: ghost.peerId, public_key: encodeBase64Url(ghost.identity.publicKey), vacated_until: Date.now() - 1 }));
      await until(async () => (await kv.get(`node.${ghost.peerId}`))?.operation === 'DEL', 3000, 'the ended tombstone deleted');
      expect(follower.registry.nodes.has(ghost.peerId)).toBe(false);
    } finally {
      await h.close();
    }
  });
});

describe('NATS lost and restarted', () => {
  it('serves from its copy while NATS is down (and says so), catches up after; rebuilds the registry when the bucket was lost', async () => {
    const name = c.name();
    const [a, b] = [await tracker(name), await tracker(name)];
    const n = await FakeNode.create({ memory_budget_mb: mb });
    const first = await n.register(asTest(a), { load: true });
    await until(() => b.registry.nodes.get(n.peerId), 5000);
    // The nodes keep beating all along, as nodes do (to either tracker): whoever is heard within its deadline is written back.
    const beating: FakeNode[] = [n];
    const beat = setInterval(() => {
      for (const [i, x] of beating.entries()) void x.heartbeat(asTest(i % 2 ? b : a)).catch(() => undefined);
    }, 400);
    await c.nats().kill();
    try {
      const health = await until(async () => {
        const h = (await (await fetch(`${a.url}/healthz`)).json()) as { status: string; cluster: { nats: string } };
        return h.cluster.nats !== 'connected' && h;
      }, 10_000, 'healthz saying NATS is down');
      expect(health.status).toBe('ok');
      // Both trackers keep answering the node; nobody is removed while blind.
      for (let i = 0; i < 3; i++) {
        expect(span(await n.heartbeat(asTest(a)))).toBe(span(first));
        expect(span(await n.heartbeat(asTest(b)))).toBe(span(first));
        await new Promise((r) => setTimeout(r, 400));
      }
      // A node that registers meanwhile is answered from the copy, and stored once NATS is back.
      const late = await FakeNode.create({ memory_budget_mb: mb });
      expect((await late.register(asTest(b))).assignment).not.toBeNull();
      beating.push(late);
      await c.nats().restart();
      await until(() => a.registry.nodes.has(late.peerId), 15_000, 'the node registered while NATS was down, at the other tracker');
      await until(async () => ((await (await fetch(`${a.url}/healthz`)).json()) as { cluster: { nats: string } }).cluster.nats === 'connected', 10_000);
      // The bucket lost (NATS restarted with an empty store): rebuilt, every node still answered.
      await c.nats().restart({ wipe: true });
      const h2 = await connectNats({ servers: c.nats().url, name: 'check' });
      try {
        await until(async () => {
          const kv = await new Kvm(h2.nc).open(trackerSubjects(name).registryBucket).catch(() => undefined);
          if (!kv) return false;
          const e = await kv.get(`node.${n.peerId}`).catch(() => null);
          const e2 = await kv.get(`node.${late.peerId}`).catch(() => null);
          return e?.operation === 'PUT' && e2?.operation === 'PUT';
        }, 20_000, 'the nodes written back to the new bucket');
      } finally {
        await h2.close();
      }
      expect(span(await n.heartbeat(asTest(a)))).toBe(span(first));
      expect(span(await n.heartbeat(asTest(b)))).toBe(span(first));
    } finally {
      clearInterval(beat);
      await c.nats().restart().catch(() => undefined);
    }
  }, 90_000);
});

