/**
 * A node started with `--layers a-b` announces `info.pinned`: the tracker
 * adopts the span it serves and never moves it. Before, rebalancing widened
 * such a node's assignment (its budget allowed more); the node never
 * followed, so the tracker counted it as loading and routed around it.
 */
import { describe, expect, it } from 'vitest';
import { NodeStatus } from '../../src/tracker/registry.ts';
import { FakeNode, makeTracker } from '../helpers/tracker.ts';

async function pinnedVsFree(pinned: boolean) {
  const t = await makeTracker();
  // A big budget: the whole model fits, so a free node would be widened to it.
  const node = await FakeNode.create({ memory_budget_mb: 1024, ...(pinned ? { pinned: true } : {}) });
  node.serving = { start_layer: 0, end_layer: 3 };
  await node.register(t);
  await node.heartbeat(t);
  const other = await FakeNode.create({ memory_budget_mb: 1024 });
  await other.join(t);
  // The other node leaves: layers lie bare, and rebalancing looks for someone to cover them.
  t.registry.remove(other.peerId, 'test');
  t.registry.rebalance('small');
  const rec = t.registry.nodes.get(node.peerId)!;
  return { t, node, rec, answer: await node.heartbeat(t) };
}

describe('pinned nodes', () => {
  it('keeps a pinned node on the span it serves through registration, heartbeats and rebalancing', async () => {
    const { t, rec, answer } = await pinnedVsFree(true);
    expect(rec.assignment).toEqual({ start: 0, end: 3 });
    expect(answer.assignment).toMatchObject({ start_layer: 0, end_layer: 3 });
    expect(t.registry.status(rec)).toBe(NodeStatus.Serving);
  });

  it('moves a free node with the same budget (what a pinned node must not get)', async () => {
    const { rec } = await pinnedVsFree(false);
    expect(rec.assignment!.end - rec.assignment!.start).toBeGreaterThan(3);
  });

  it('assigns nothing to a pinned node that does not serve yet, and adopts its span once it does', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create({ memory_budget_mb: 1024, pinned: true });
    const first = await node.register(t);
    expect(first.assignment ?? null).toBeNull();
    t.registry.rebalance('small');
    expect(t.registry.nodes.get(node.peerId)!.assignment).toBeNull();
    node.serving = { start_layer: 4, end_layer: 8 };
    const next = await node.heartbeat(t);
    expect(next.assignment).toMatchObject({ start_layer: 4, end_layer: 8 });
  });
});
