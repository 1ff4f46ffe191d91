/**
 * Rebalancing moves one node at a time and waits for it: a node switches to
 * its new span only when that span has loaded, so two moves planned together
 * (one node leaving layers another is moving onto) left layers bare between
 * the two switches, and chats in that gap got 503 "no route".
 */
import { describe, expect, it } from 'vitest';
import { NodeStatus } from '../../src/tracker/registry.ts';
import { FakeNode, layerMib, makeTracker, smallSpec } from '../helpers/tracker.ts';

describe('rebalancing, one move at a time', () => {
  it('moves one node per rebalance, none while a moved node still loads, the next once it serves', async () => {
    const t = await makeTracker();
    // Each node holds a third of `small` (4 of 12 layers, plus the KV floor and the embedding or head).
    const mb = Math.ceil(layerMib(smallSpec()) * 6);
    const nodes: FakeNode[] = [];
    for (let i = 0; i < 6; i++) {
      const n = await FakeNode.create({ memory_budget_mb: mb });
      await n.join(t);
      nodes.push(n);
    }
    const spans = () => nodes.map((n) => t.registry.nodes.get(n.peerId)?.assignment).filter(Boolean).map((a) => `${a!.start}-${a!.end}`);
    const before = spans();
    // Everyone but the holders of one span leave: several layers lie bare, so more than one move is wanted.
    // Keep the nodes of a span held twice: one of them is free to move onto the bare layers.
    const keepSpan = before.find((s, i) => before.indexOf(s) !== i)!;
    expect(keepSpan).toBeDefined();
    const leaving = nodes.filter((n) => `${t.registry.nodes.get(n.peerId)!.assignment!.start}-${t.registry.nodes.get(n.peerId)!.assignment!.end}` !== keepSpan);
    const staying = nodes.filter((n) => !leaving.includes(n));
    expect(staying.length).toBeGreaterThanOrEqual(2);
    for (const n of leaving) t.registry.remove(n.peerId, 'test');
    // remove() rebalanced already: exactly one node was moved and it is loading now.
    const loading = staying.filter((n) => t.registry.status(t.registry.nodes.get(n.peerId)!) === NodeStatus.Loading);
    expect(loading).toHaveLength(1);
    // While it loads, nothing else moves, however often the tracker looks.
    expect(t.registry.rebalance('small')).toEqual([]);
    expect(t.registry.rebalance('small')).toEqual([]);
    // The moved node serves its new span: the next move may come.
    await loading[0]!.heartbeat(t, { load: true });
    await loading[0]!.heartbeat(t, { load: true });
    expect(t.registry.status(t.registry.nodes.get(loading[0]!.peerId)!)).toBe(NodeStatus.Serving);
    expect(t.registry.rebalance('small').length).toBeLessThanOrEqual(1);
  });
});
