import { describe, expect, it } from 'vitest';
import { candidateSpans, chooseSpan, coverage, layersThatFit, rebalance } from '../../src/tracker/assignment.ts';
import { spanBytes } from '../../src/tracker/model-registry.ts';
import { FakeNode, MIB, layerMib, makeTracker, smallSpec } from '../helpers/tracker.ts';

type Availability = { models: Array<{ complete: boolean; missing_layers: number[]; layers: Array<{ layer: number; count: number; nodes: string[] }>; nodes: Array<{ peer_id: string; status: string; serving: { start_layer: number; end_layer: number } | null }> }> };

async function availability(t: { app: { request(p: string): Promise<Response> } }) {
  return ((await (await t.app.request('/api/availability')).json()) as Availability).models[0]!;
}

describe('memory budget → layers', () => {
  const spec = smallSpec();

  it('sizes a layer as f32 weights + KV reserve, and adds the embedding at layer 0 and the LM head at the end', () => {
    // q,o: 512×512; k,v: 128×512; mlp: 3×1536×512; two norms of 512: f32.
    const params = 2 * 512 * 512 + 2 * 128 * 512 + 3 * 1536 * 512 + 2 * 512;
    expect(spec.layerBytes[5]).toBe(params * 4);
    expect(spec.kvBytesPerLayer).toBe(2 * 2048 * 2 * 64 * 4);
    expect(spanBytes(spec, 3, 5)).toBe(2 * (params * 4 + spec.kvBytesPerLayer));
    expect(spanBytes(spec, 0, 1)).toBe(params * 4 + spec.kvBytesPerLayer + 2048 * 512 * 4);
    expect(spanBytes(spec, 11, 12)).toBe(params * 4 + spec.kvBytesPerLayer + 2048 * 512 * 4 + 512 * 4);
  });

  it('fits floor(budget / layer cost) layers in the middle and fewer where the embedding or head must fit too', () => {
    const per = layerMib(spec);
    const budget = Math.ceil(per * 4) * MIB; // 4 layers + change, not enough for 4 + embedding
    expect(layersThatFit(spec, budget)).toBe(4);
    const spans = candidateSpans(spec, budget);
    const at0 = spans.find((s) => s.start === 0)!;
    expect(at0.end).toBe(3);
    expect(spans.find((s) => s.start === 4)!.end).toBe(8);
    expect(layersThatFit(spec, per * 0.5 * MIB)).toBe(0);
    expect(chooseSpan(spec, per * 0.5 * MIB, [])).toBeNull();
  });

  it('places a node on the least-covered layers (uncovered first, then lowest throughput)', () => {
    const budget = 4 * layerMib(spec) * MIB + 1;
    const span = chooseSpan(spec, budget, [{ id: 'a', start: 0, end: 8, throughput: 100 }])!;
    // 8..11 are bare; the LM head leaves room for 3 layers at the end, so the best span covers 3 of them.
    const bare = [8, 9, 10, 11].filter((l) => span.start <= l && l < span.end).length;
    expect(bare).toBe(3);
    expect(span.start).toBeGreaterThanOrEqual(7);
    // Everything covered once: the slower holder's layers get the next node.
    const next = chooseSpan(spec, budget, [
      { id: 'a', start: 0, end: 6, throughput: 100 },
      { id: 'b', start: 6, end: 12, throughput: 10 },
    ]);
    expect(next!.start).toBeGreaterThanOrEqual(6);
  });

  it('rebalance moves the node whose move uncovers nothing and covers bare layers; no move when nothing improves', () => {
    const budget = 4 * layerMib(spec) * MIB + 1;
    const nodes = [
      { id: 'a', start: 0, end: 3, throughput: 100, budgetBytes: budget, movable: true },
      { id: 'b', start: 3, end: 7, throughput: 100, budgetBytes: budget, movable: true },
      { id: 'c', start: 3, end: 7, throughput: 100, budgetBytes: budget, movable: true },
      { id: 'd', start: 7, end: 11, throughput: 100, budgetBytes: budget, movable: true },
    ];
    // Layer 11 is bare; b or c (duplicates) can move without uncovering anything… but only a span reaching 11 helps.
    const moves = rebalance(spec, nodes, 0.75);
    expect(moves.length).toBeGreaterThanOrEqual(1);
    const after = coverage(12, nodes.map((n) => ({ ...n, ...(moves.find((m) => m.id === n.id)?.to ?? {}) })));
    expect(after.count.every((c) => c > 0)).toBe(true);
    expect(moves.some((m) => m.id === 'a')).toBe(false); // a is the only holder of 0..2
    // A balanced placement stays put.
    const settled = nodes.map((n) => ({ ...n, ...(moves.find((m) => m.id === n.id)?.to ?? {}) }));
    expect(rebalance(spec, settled, 0.75)).toEqual([]);
    // A node still loading is never moved.
    expect(rebalance(spec, nodes.map((n) => ({ ...n, movable: false })), 0.75)).toEqual([]);
  });

  it('never moves a node off a layer it alone holds to cover another gap (the node that left may come back; the gap would only move)', () => {
    // Three nodes held 0..3, 3..7 (gone now) and 7..12; the last one could hold 3..7 instead, but it alone holds 7..11.
    const budget = 5 * layerMib(spec) * MIB + 1;
    const nodes = [
      // The head is not the subject here (it could grow by a layer): it is loading.
      { id: 'head', start: 0, end: 3, throughput: 100, budgetBytes: budget, movable: false },
      { id: 'tail', start: 7, end: 12, throughput: 100, budgetBytes: budget, movable: true },
    ];
    expect(chooseSpan(spec, budget, [nodes[0]!])!.start).toBeLessThan(7); // it would rather cover the gap…
    expect(rebalance(spec, nodes, 0.75)).toEqual([]); // …but that would bare 7..11.
    // A second holder of 7..12 is free to go: nothing loses its last holder.
    const moves = rebalance(spec, [...nodes, { id: 'spare', start: 7, end: 12, throughput: 100, budgetBytes: budget, movable: true }], 0.75);
    expect(moves).toHaveLength(1);
    expect(['tail', 'spare']).toContain(moves[0]!.id);
    expect(moves[0]!.to.start).toBeLessThan(7);
  });
});

describe('assignment through the tracker', () => {
  it('gives nodes joining one by one spans until every layer is covered, and the availability map follows each step', async () => {
    const t = await makeTracker();
    const budgetMb = Math.ceil(4 * layerMib(smallSpec())); // 4 layers each (3 at the ends)
    let covered = 0;
    const nodes: FakeNode[] = [];
    for (let i = 0; i < 4 && covered < 12; i++) {
      const n = await FakeNode.create({ memory_budget_mb: budgetMb });
      nodes.push(n);
      const a = (await n.register(t, { load: true })).assignment!;
      expect(a.end_layer - a.start_layer).toBeGreaterThanOrEqual(3);
      // Loading: assigned but not serving yet, not in the map.
      let av = await availability(t);
      expect(av.nodes.find((x) => x.peer_id === n.peerId)!.status).toBe('loading');
      await n.heartbeat(t, { load: true });
      av = await availability(t);
      expect(av.nodes.find((x) => x.peer_id === n.peerId)!.status).toBe('serving');
      for (let l = a.start_layer; l < a.end_layer; l++) expect(av.layers[l]!.nodes).toContain(n.peerId);
      const nowCovered = av.layers.filter((l) => l.count > 0).length;
      // Each new node covers layers nobody held before.
      expect(nowCovered).toBeGreaterThan(covered);
      covered = nowCovered;
      expect(av.missing_layers.length).toBe(12 - covered);
    }
    expect(covered).toBe(12);
    expect(nodes.length).toBeLessThanOrEqual(4);
    expect((await availability(t)).complete).toBe(true);
  });

  it('when a node goes silent, grows no serving node over its layers during the rejoin grace (it comes back with its span, or a joiner takes them), then grows one', async () => {
    const t = await makeTracker({ heartbeatIntervalMs: 1000, rejoinGraceMs: 10_000 });
    // Four nodes, each the only holder of its quarter, each able to hold the whole model (a neighbour could grow over a gap).
    const nodes: FakeNode[] = [];
    for (const [s0, e0] of [[0, 3], [3, 6], [6, 9], [9, 12]] as const) {
      const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1);
      n.serving = { start_layer: s0, end_layer: e0 };
      await n.register(t);
      nodes.push(n);
    }
    expect((await availability(t)).complete).toBe(true);
    const leaving = nodes[2]!;
    const staying = nodes.filter((n) => n !== leaving);
    const spans = () => staying.map((n) => { const a = t.registry.nodes.get(n.peerId)!.assignment!; return `${a.start}-${a.end}`; });
    const held = spans();
    /** The staying nodes beat for `ms` (fake time, sweeping as the tracker does): the spans they are told to hold. */
    const live = async (ms: number) => {
      for (let left = ms; left > 0; left -= 500) {
        t.clock.now += Math.min(500, left);
        for (const n of staying) await n.heartbeat(t);
        t.sweep();
      }
      return spans();
    };
    await live(2_000);
    t.clock.now += 1_500;
    expect(t.sweep()).toEqual([leaving.peerId]);
    expect((await availability(t)).missing_layers).toEqual([6, 7, 8]);
    // Within the grace nobody that serves is grown over the gap (a download), however often the tracker looks.
    expect(await live(8_000)).toEqual(held);
    // The node comes back (a tab reopened): its span again, no download, nobody moved.
    expect((await leaving.register(t)).assignment).toMatchObject({ start_layer: 6, end_layer: 9 });
    expect((await availability(t)).complete).toBe(true);
    expect(await live(1_000)).toEqual(held);

    // Silent again. A node that joins during the grace is given the bare layers at once.
    t.clock.now += 3_600;
    for (const n of staying) await n.heartbeat(t);
    expect(t.sweep()).toEqual([leaving.peerId]);
    const joiner = await FakeNode.create({ memory_budget_mb: Math.ceil(4 * layerMib(smallSpec())) });
    const got = (await joiner.join(t)).assignment!;
    expect(got.start_layer).toBeLessThanOrEqual(6);
    expect(got.end_layer).toBeGreaterThanOrEqual(9);
    expect((await availability(t)).complete).toBe(true);
    expect(await live(1_000)).toEqual(held);

    // Silent for good, and the joiner leaves too: past the grace, the last resort — a serving node grows over the gap.
    t.registry.remove(joiner.peerId, 'left');
    expect(await live(8_000)).toEqual(held);
    await live(3_000);
    // The next heartbeats carry a new assignment for some node; it loads it and the map is whole again.
    let moved = 0;
    for (const n of staying) {
      const before = n.serving;
      const a = (await n.heartbeat(t)).assignment!;
      if (a.start_layer !== before!.start_layer || a.end_layer !== before!.end_layer) {
        moved++;
        n.serving = { start_layer: a.start_layer, end_layer: a.end_layer };
        await n.heartbeat(t);
      }
    }
    expect(moved).toBeGreaterThanOrEqual(1);
    const healed = await availability(t);
    expect(healed.missing_layers).toEqual([]);
    expect(healed.complete).toBe(true);
  });

  it('gives a node whose budget holds no layer no assignment (null) and does not route through it', async () => {
    const t = await makeTracker();
    const n = await FakeNode.create({ memory_budget_mb: 5 });
    const answer = await n.register(t);
    expect(answer.assignment).toBeNull();
    const av = await availability(t);
    expect(av.nodes[0]!.status).toBe('idle');
  });
});
