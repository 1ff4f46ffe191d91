/**
 * Trackers as replicas of one cluster when one of them, or NATS, goes (the
 * rest is in cluster.test.ts: two files, so each stays short), on a real
 * nats-server: one leader removes silent nodes while liveness heard by a
 * follower holds, and the follower leads once the leader goes; NATS lost:
 * trackers keep serving from their copy and catch up; the bucket lost:
 * rebuilt from what the trackers know.
 */
import { Kvm } from '@nats-io/kv';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { connectNats } from '../../src/cluster/nats.ts';
import { trackerSubjects } from '../../src/cluster/subjects.ts';
import type { RegisterAnswer } from '../../src/protocol/tracker.ts';
import { startTracker, type RunningTracker } from '../../src/tracker/server.ts';
import { startNats, type NatsServer } from '../helpers/cluster.ts';
import { FakeNode, layerMib, smallSpec, type TestTracker } from '../helpers/tracker.ts';

const spec = smallSpec();
const silent = pino({ level: 'silent' });
let nats: NatsServer;
let cluster = 0;
const running: RunningTracker[] = [];

beforeAll(async () => {
  nats = await startNats();
});
afterAll(async () => {
  await nats?.stop();
});
afterEach(async () => {
  await Promise.all(running.splice(0).map((t) => t.close().catch(() => undefined)));
});

/** A tracker of cluster `name`, with short silences so the test waits seconds, not minutes. */
async function tracker(name: string, o: { heartbeatIntervalMs?: number; relayUrl?: string } = {}): Promise<RunningTracker> {
  const t = await startTracker(
    { port: 0, nats: [nats.url], cluster: name, heartbeatIntervalMs: o.heartbeatIntervalMs ?? 1000, logLevel: 'silent', models: [], ...(o.relayUrl ? { relayUrl: o.relayUrl } : {}) },
    { modelSpecs: [spec], logger: silent, cluster: { leaseMs: 1500, overdueMs: 1500, trackerGoneMs: 4000 } },
  );
  running.push(t);
  return t;
}

/** What FakeNode needs of a tracker: its app, and a clock that is the real one. */
function asTest(t: RunningTracker): TestTracker {
  return Object.assign(Object.create(t) as RunningTracker, { clock: { get now() { return Date.now(); } } }) as unknown as TestTracker;
}

async function until<T>(f: () => T | undefined | false | Promise<T | undefined | false>, ms = 15_000, what = 'condition'): Promise<T> {
  const end = Date.now() + ms;
  for (;;) {
    const v = await f();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

const span = (a: RegisterAnswer) => a.assignment && `${a.assignment.start_layer}-${a.assignment.end_layer}`;
const mb = Math.ceil(4.2 * layerMib(spec));

describe('a tracker or NATS lost', () => {
  it('one leader removes silent nodes; a node heard only by a follower stays; the other tracker leads once the leader goes', async () => {
    const name = `c${++cluster}`;
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
      running.splice(running.indexOf(leader), 1);
      await until(() => follower.cluster!.isLeader(), 10_000, 'the follower leading');
      expect((await chatty.heartbeat(asTest(follower))).assignment).not.toBeNull();
    } finally {
      clearInterval(beat);
    }
  });
});

describe('NATS lost and restarted', () => {
  it('serves from its copy while NATS is down (and says so), catches up after; rebuilds the registry when the bucket was lost', async () => {
    const name = `c${++cluster}`;
    const [a, b] = [await tracker(name), await tracker(name)];
    const n = await FakeNode.create({ memory_budget_mb: mb });
    const first = await n.register(asTest(a), { load: true });
    await until(() => b.registry.nodes.get(n.peerId), 5000);
    // The nodes keep beating all along, as nodes do (to either tracker): whoever is heard within its deadline is written back.
    const beating: FakeNode[] = [n];
    const beat = setInterval(() => {
      for (const [i, x] of beating.entries()) void x.heartbeat(asTest(i % 2 ? b : a)).catch(() => undefined);
    }, 400);
    await nats.kill();
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
      await nats.restart();
      await until(() => a.registry.nodes.has(late.peerId), 15_000, 'the node registered while NATS was down, at the other tracker');
      await until(async () => ((await (await fetch(`${a.url}/healthz`)).json()) as { cluster: { nats: string } }).cluster.nats === 'connected', 10_000);
      // The bucket lost (NATS restarted with an empty store): rebuilt, every node still answered.
      await nats.restart({ wipe: true });
      const h2 = await connectNats({ servers: nats.url, name: 'check' });
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
      await nats.restart().catch(() => undefined);
    }
  }, 90_000);
});

