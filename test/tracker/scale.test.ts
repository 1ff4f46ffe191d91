/**
 * The tracker at swarm scale: what it keeps up to date by changes (placement
 * sums, span groups, status counts) equals what a full recount gives; the
 * route search over the few cheapest nodes of each span finds the routes a
 * search over every node finds; one rebalance move equals the first move of
 * the all-rounds rebalance; silence while the tracker itself was late is
 * never counted against a node; the tracker sheds load; the dashboard pages.
 * The fast versions are checked against the plain ones in ./reference.ts.
 */
import { request } from 'node:http';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { bestMove, chooseSpan, chooseSpanIn, coverage, rebalance, type RebalanceNode } from '../../src/tracker/assignment.ts';
import { serveApp } from '../../src/tracker/http.ts';
import { LoadMonitor } from '../../src/tracker/load.ts';
import { NodeStatus } from '../../src/tracker/registry.ts';
import { findRoutes, perLayerMs, type ServingNode } from '../../src/tracker/routing.ts';
import { naiveCoverage, naiveFindRoutes } from '../helpers/tracker-reference.ts';
import { FakeNode, MIB, layerMib, makeTracker, smallSpec, type TestTracker } from '../helpers/tracker.ts';

const spec = smallSpec();
const L = spec.numLayers;

const servingNodeArb = fc
  .array(fc.record({ start: fc.integer({ min: 0, max: L - 1 }), len: fc.integer({ min: 1, max: L }), ms: fc.integer({ min: 1, max: 9 }), load: fc.integer({ min: 0, max: 3 }) }), { minLength: 1, maxLength: 40 })
  .map((xs) => xs.map((x, i): ServingNode => ({ id: `n${i}`, start: x.start, end: Math.min(L, x.start + x.len), perLayerMs: perLayerMs(x.ms + i * 1e-4, x.load) })));

describe('route search over thousands of nodes', () => {
  it('finds the same K cheapest routes as trying every node at every boundary', () => {
    fc.assert(
      fc.property(servingNodeArb, fc.integer({ min: 0, max: 20 }), fc.integer({ min: 1, max: 16 }), (nodes, lat, keep) => {
        const fast = findRoutes(nodes, 0, L, { hopLatencyMs: lat, keep });
        const slow = naiveFindRoutes(nodes, 0, L, lat, keep);
        expect(fast.map((r) => r.costMs)).toEqual(slow.map((r) => r.costMs));
        for (const r of fast) {
          // Contiguous from 0 to L, each node once, each hop inside its node's span.
          let at = 0;
          for (const h of r.hops) {
            const n = nodes.find((x) => x.id === h.id)!;
            expect(h.start).toBe(at);
            expect(n.start <= h.start && h.end <= n.end && h.start < h.end).toBe(true);
            at = h.end;
          }
          expect(at).toBe(L);
          expect(new Set(r.hops.map((h) => h.id)).size).toBe(r.hops.length);
        }
      }),
      { numRuns: 300 },
    );
  });

  it('finds the same K cheapest costs when many routes cost the same', () => {
    // Whole-ms speeds and loads: ties everywhere. Ids are unique, so no route could hold a node twice (a hop
    // ends where its node's span ends) and the K cheapest costs do not depend on which of equal routes is kept.
    const tiedArb = fc
      .array(fc.record({ start: fc.integer({ min: 0, max: L - 1 }), len: fc.integer({ min: 1, max: L }), ms: fc.integer({ min: 1, max: 3 }), load: fc.integer({ min: 0, max: 2 }) }), { minLength: 1, maxLength: 40 })
      .map((xs) => xs.map((x, i): ServingNode => ({ id: `n${i}`, start: x.start, end: Math.min(L, x.start + x.len), perLayerMs: perLayerMs(x.ms, x.load) })));
    fc.assert(
      fc.property(tiedArb, fc.integer({ min: 0, max: 3 }), fc.integer({ min: 1, max: 16 }), fc.integer({ min: 0, max: L - 1 }), (nodes, lat, keep, from) => {
        expect(findRoutes(nodes, from, L, { hopLatencyMs: lat, keep }).map((r) => r.costMs)).toEqual(naiveFindRoutes(nodes, from, L, lat, keep).map((r) => r.costMs));
      }),
      { numRuns: 300 },
    );
  });

  it('routes the registry picks from (the cheapest few of each span) give the routes of every serving node', async () => {
    const t = await makeTracker();
    // 120 nodes on a handful of spans, with speeds and loads that differ.
    for (let i = 0; i < 120; i++) {
      const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1 + (i % 7) + i * 1e-3, i % 3);
      const start = [0, 0, 4, 6, 8][i % 5]!;
      const end = [4, 6, 8, 12, 12][i % 5]!;
      n.serving = { start_layer: start, end_layer: end };
      await n.register(t);
    }
    const all = t.registry.servingNodes('small');
    expect(all).toHaveLength(120);
    const candidates = t.registry.routeCandidates('small');
    expect(candidates.length).toBeLessThanOrEqual(5 * 16);
    expect(t.registry.routes('small', 0, L).map((r) => r.costMs)).toEqual(naiveFindRoutes(all, 0, L, 10).map((r) => r.costMs));
    expect(t.registry.routes('small', 4, 12).map((r) => r.costMs)).toEqual(naiveFindRoutes(all, 4, 12, 10).map((r) => r.costMs));
    // Chats starting and ending move nodes within their span's order; the picks follow.
    const recs = [...t.registry.nodes.values()];
    for (let i = 0; i < 300; i++) t.registry.addInFlight(recs[(i * 37) % recs.length]!, i % 3 === 0 ? -1 : 1);
    const now = t.registry.servingNodes('small');
    expect(t.registry.routes('small', 0, L).map((r) => r.costMs)).toEqual(naiveFindRoutes(now, 0, L, 10).map((r) => r.costMs));
    for (const g of t.registry.placement('small').groups.values()) {
      const costs = g.nodes.map((n) => t.registry.layerMs(n) * (1 + (n.stats?.queue_depth ?? 0) + n.inFlight));
      expect(costs).toEqual([...costs].sort((a, b) => a - b));
    }
  });
});

const holdersArb = fc.array(fc.record({ start: fc.integer({ min: 0, max: L - 1 }), len: fc.integer({ min: 1, max: 6 }), tp: fc.integer({ min: 1, max: 400 }) }), { maxLength: 30 });

describe('placement by sums', () => {
  const budgets = [1.5, 2.5, 4.2, 6.1].map((k) => Math.ceil(k * layerMib(spec) * MIB));

  it('chooses the span the per-holder choice does, against summed coverage', () => {
    fc.assert(
      fc.property(holdersArb, fc.constantFrom(...budgets), fc.constantFrom(undefined, 'q4' as const), (hs, budget, format) => {
        const holders = hs.map((h, i) => ({ id: `h${i}`, start: h.start, end: Math.min(L, h.start + h.len), throughput: h.tp }));
        expect(chooseSpanIn(spec, budget, coverage(L, holders), format)).toEqual(chooseSpan(spec, budget, holders, format));
      }),
      { numRuns: 300 },
    );
  });

  it('makes the move the all-rounds rebalance makes first', () => {
    fc.assert(
      fc.property(holdersArb, fc.array(fc.boolean(), { minLength: 30, maxLength: 30 }), (hs, movable) => {
        const nodes: RebalanceNode[] = hs.map((h, i) => ({ id: `h${i}`, start: h.start, end: Math.min(L, h.start + h.len), throughput: h.tp, budgetBytes: budgets[i % budgets.length]!, movable: movable[i]! }));
        const first = rebalance(spec, nodes, 0.75)[0] ?? null;
        expect(bestMove(spec, naiveCoverage(L, nodes), nodes, 0.75)).toEqual(first);
      }),
      { numRuns: 300 },
    );
  });

  it('keeps coverage, span groups and status counts equal to a recount through joins, loads, moves, budget changes and removals', async () => {
    let seed = 99;
    const rnd = () => ((seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31);
    const t = await makeTracker({ heartbeatIntervalMs: 1000 });
    const nodes: FakeNode[] = [];
    const check = () => {
      const recs = [...t.registry.nodes.values()];
      const serving = recs.filter((n) => n.serving).map((n) => ({ ...n.serving!, throughput: t.registry.throughput(n) }));
      const ref = naiveCoverage(L, serving);
      const cov = t.registry.coverageOf('small');
      expect(cov.count).toEqual(ref.count);
      cov.throughput.forEach((v, l) => expect(v).toBeCloseTo(ref.throughput[l]!, 2));
      const p = t.registry.placement('small');
      const assigned = naiveCoverage(L, recs.filter((n) => n.assignment).map((n) => ({ ...n.assignment!, throughput: t.registry.throughput(n) })));
      expect(p.assigned.count).toEqual(assigned.count);
      for (const s of [NodeStatus.Loading, NodeStatus.Serving, NodeStatus.Idle]) expect(t.registry.statusCounts('small')[s]).toBe(recs.filter((n) => t.registry.status(n) === s).length);
      expect(p.movers).toBe(recs.filter((n) => n.serving && t.registry.status(n) === NodeStatus.Loading).length);
      const grouped = [...p.groups.values()].flatMap((g) => [...g.nodes].map((n) => `${n.peerId}@${g.span.start}:${g.span.end}`)).sort();
      expect(grouped).toEqual(recs.filter((n) => n.serving).map((n) => `${n.peerId}@${n.serving!.start}:${n.serving!.end}`).sort());
      expect(cov.missing).toEqual(ref.count.flatMap((c, l) => (c === 0 ? [l] : [])));
    };
    for (let step = 0; step < 150; step++) {
      const r = rnd();
      if (r < 0.3 || nodes.length < 3) {
        const n = (await FakeNode.create({ memory_budget_mb: Math.ceil((1 + rnd() * 6) * layerMib(spec)) })).withStats(1 + Math.floor(rnd() * 8));
        await n.register(t, { load: rnd() < 0.5 });
        nodes.push(n);
      } else if (r < 0.75) {
        const n = nodes[Math.floor(rnd() * nodes.length)]!;
        n.stats!.layer_ms = 1 + Math.floor(rnd() * 8);
        await n.heartbeat(t, { load: rnd() < 0.7 }).catch(() => {});
      } else if (r < 0.82) {
        const n = nodes[Math.floor(rnd() * nodes.length)]!;
        n.info = { ...n.info, memory_budget_mb: Math.ceil((1 + rnd() * 6) * layerMib(spec)) };
        await n.heartbeat(t).catch(() => {});
      } else if (r < 0.92) {
        const n = nodes.splice(Math.floor(rnd() * nodes.length), 1)[0]!;
        t.registry.remove(n.peerId, 'test');
      } else {
        t.clock.now += 1500;
        for (const n of nodes) if (rnd() < 0.8) await n.heartbeat(t).catch(() => {});
        t.sweep();
      }
      check();
    }
  });
});

/** A registry whose own late time the test sets. */
async function lateTracker(): Promise<TestTracker & { late: { ms: number } }> {
  const late = { ms: 0 };
  const t = await makeTracker({ heartbeatIntervalMs: 1000 });
  // The registry reads late time through its options: point it at the test's counter.
  (t.registry as unknown as { o: { lateMs: () => number } }).o.lateMs = () => late.ms;
  return Object.assign(t, { late });
}

describe('deadlines the tracker keeps honestly', () => {
  it('does not count silence while the tracker was late against a node', async () => {
    const t = await lateTracker();
    const n = await FakeNode.create();
    await n.register(t);
    // 4 periods of silence, 2 of which the tracker spent behind (a stall, or beats waiting in its backlog).
    t.clock.now += 4000;
    t.late.ms += 2000;
    expect(t.sweep()).toEqual([]);
    // Past 3 periods of the node's own silence: gone.
    t.clock.now += 1500;
    expect(t.sweep()).toEqual([n.peerId]);
  });

  it('counts a node\'s deadline in the period it was told, so a longer one never expires it', async () => {
    const t = await lateTracker();
    const n = await FakeNode.create();
    await n.register(t);
    t.registry.toldInterval(t.registry.nodes.get(n.peerId)!, 10_000);
    t.clock.now += 25_000;
    expect(t.sweep()).toEqual([]);
    t.clock.now += 6000;
    expect(t.sweep()).toEqual([n.peerId]);
  });
});

describe('load monitor', () => {
  it('doubles the heartbeat period after two busy ticks, up to the ceiling, and halves it back when calm', () => {
    const m = new LoadMonitor({ baseIntervalMs: 5000, maxIntervalMs: 20_000, calmTicks: 3 });
    expect(m.intervalMs()).toBe(5000);
    m.tick({ utilization: 0.95, elapsedMs: 500 });
    expect(m.intervalMs()).toBe(5000);
    m.tick({ utilization: 0.95, elapsedMs: 500 });
    expect(m.intervalMs()).toBe(10_000);
    for (let i = 0; i < 6; i++) m.tick({ utilization: 0.99, elapsedMs: 500 });
    expect(m.intervalMs()).toBe(20_000);
    expect(m.saturated).toBe(true);
    // Busy ticks are late time, whole.
    expect(m.lateMs()).toBe(8 * 500);
    for (let i = 0; i < 3; i++) m.tick({ utilization: 0.1, elapsedMs: 500 });
    expect(m.intervalMs()).toBe(10_000);
    expect(m.saturated).toBe(false);
    for (let i = 0; i < 6; i++) m.tick({ utilization: 0.1, elapsedMs: 500 });
    expect(m.intervalMs()).toBe(5000);
    expect(m.lateMs()).toBe(4000);
  });

  it('counts a stalled loop\'s lateness (a tick that fired late) as late time', () => {
    const m = new LoadMonitor({ baseIntervalMs: 5000 });
    m.tick({ utilization: 0.2, elapsedMs: 1300 });
    expect(m.lateMs()).toBe(800);
    expect(m.current.behind).toBe(true);
    m.tick({ utilization: 0.2, elapsedMs: 550 });
    expect(m.lateMs()).toBe(800);
  });

  it('hands out the longer period in answers, and refuses newcomers (503 + Retry-After) only while saturated', async () => {
    const t = await makeTracker({ heartbeatIntervalMs: 5000 });
    const known = await FakeNode.create();
    await known.register(t);
    for (let i = 0; i < 2; i++) t.load.tick({ utilization: 0.97, elapsedMs: 500 });
    expect((await known.heartbeat(t)).heartbeat_interval_ms).toBe(10_000);
    for (let i = 0; i < 10; i++) t.load.tick({ utilization: 0.97, elapsedMs: 500 });
    expect(t.load.saturated).toBe(true);
    const newcomer = await FakeNode.create();
    const res = await newcomer.post(t, '/api/nodes/register', t.clock.now);
    expect(res.status).toBe(503);
    expect(Number(res.headers.get('retry-after'))).toBeGreaterThanOrEqual(1);
    expect(((await res.json()) as { error: { retry_after_ms: number } }).error.retry_after_ms).toBeGreaterThan(0);
    // The nodes already here keep registering and beating.
    expect((await known.register(t)).heartbeat_interval_ms).toBe(60_000);
    expect((await known.heartbeat(t)).heartbeat_interval_ms).toBe(60_000);
  });
});

describe('dashboard and availability past a few hundred nodes', () => {
  it('pages the nodes and sums the rest', async () => {
    const t = await makeTracker();
    const mb = Math.ceil(4.2 * layerMib(spec));
    for (let i = 0; i < 230; i++) await (await FakeNode.create({ memory_budget_mb: mb, backend: i % 2 ? 'webgpu' : 'wasm', host: 'browser' })).register(t, { load: true });
    type Dash = { page: { offset: number; limit: number; total: number }; nodes: Array<{ peer_id: string }>; summary: { nodes: number; by_backend: Record<string, number> }; refresh_ms: number; models: Array<{ nodes: number; spans: Array<{ serving: number; loading: number }>; status: Record<string, number> }> };
    const first = (await (await t.app.request('/api/dashboard')).json()) as Dash;
    expect(first.page).toEqual({ offset: 0, limit: 200, total: 230 });
    expect(first.nodes).toHaveLength(200);
    expect(first.summary.nodes).toBe(230);
    expect(first.summary.by_backend).toEqual({ wasm: 115, webgpu: 115 });
    expect(first.refresh_ms).toBeGreaterThan(1000);
    expect(first.models[0]!.nodes).toBe(230);
    expect(first.models[0]!.spans.reduce((a, g) => a + g.serving + g.loading, 0)).toBe(230);
    const second = (await (await t.app.request('/api/dashboard?offset=200&limit=50')).json()) as Dash;
    expect(second.nodes).toHaveLength(30);
    const ids = new Set([...first.nodes, ...second.nodes].map((n) => n.peer_id));
    expect(ids.size).toBe(230);
    type Av = { models: Array<{ nodes_total: number; nodes: unknown[]; layers: Array<{ count: number; nodes: string[] }> }> };
    const av = (await (await t.app.request('/api/availability?limit=10')).json()) as Av;
    expect(av.models[0]!.nodes_total).toBe(230);
    expect(av.models[0]!.nodes).toHaveLength(10);
    for (const l of av.models[0]!.layers) expect(l.nodes.length).toBe(Math.min(l.count, 256));
  });
});

describe('HTTP keep-alive', () => {
  it('keeps an idle connection past the longest heartbeat period handed out', async () => {
    const served = await serveApp(async () => new Response('{}', { status: 200 }), 0, '127.0.0.1', 1 << 20);
    try {
      const keepAlive = await new Promise<string | undefined>((resolve, reject) => {
        const req = request(`${served.url}/healthz`, { agent: false, headers: { connection: 'keep-alive' } }, (res) => {
          res.resume();
          resolve(res.headers["keep-alive"] as string | undefined);
        });
        req.on('error', reject);
        req.end();
      });
      expect(keepAlive).toBe('timeout=65');
    } finally {
      await served.close();
    }
  });
});
