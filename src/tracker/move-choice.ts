/**
 * The one move a rebalance makes, if any (the registry applies it): which
 * serving nodes may move, and the best move among them (assignment.ts
 * bestMove), a spare one first while spans in their rejoin grace are absent.
 */
import { bestMove, type Coverage, type Move, type RebalanceNode, type Span } from './assignment.ts';
import type { ModelSpec } from './model-registry.ts';
import { NodeStatus, budgetBytes, nodeStatus, type NodeRecord } from './node-record.ts';
import type { ModelPlacement } from './placement.ts';

/** Up to this many nodes of a model, a rebalance weighs every node's move; past it, one per span, budget and format. */
const EXACT_REBALANCE_NODES = 256;

/**
 * The best move on `p`'s sums, judged with `absent` (spans in their rejoin grace: rejoin-grace.ts) as still
 * held, except that a spare node may move onto them at once. `throughput`: the registry's figure of a node.
 */
export function chooseMove(model: ModelSpec, p: ModelPlacement<NodeRecord>, absent: Coverage | undefined, balanceQuality: number, throughput: (n: NodeRecord) => number): Move | null {
  // Movers only (every node's span is in the sums already). In a large swarm, nodes of one span, budget and
  // weight format differ only by speed: the fastest of each such group stands for it (its move gains most).
  const candidates = new Map<string, RebalanceNode>();
  const exact = p.size <= EXACT_REBALANCE_NODES;
  for (const n of p.nodes) {
    // Only nodes whose span the sums count (not draining for long, not quarantined): the move is judged on the sums without it.
    if (!n.assignment || !n.contribution?.assignment || n.info.pinned || nodeStatus(n) !== NodeStatus.Serving) continue;
    const c: RebalanceNode = {
      id: n.peerId,
      start: n.assignment.start,
      end: n.assignment.end,
      throughput: n.contribution?.throughput ?? throughput(n),
      budgetBytes: budgetBytes(n.info),
      ...(n.info.weight_format ? { format: n.info.weight_format } : {}),
      movable: true,
    };
    const key = exact ? n.peerId : `${c.start}:${c.end}:${c.budgetBytes}:${c.format ?? ''}`;
    const had = candidates.get(key);
    if (!had || c.throughput > had.throughput) candidates.set(key, c);
  }
  // Nodes in their rejoin grace: a spare (a node none of whose layers it alone holds) may be moved onto their
  // layers at once; any other move is judged as if they were still there.
  const spares = absent ? [...candidates.values()].filter((c) => isSpare(c, p.assigned.count)) : [];
  return (spares.length > 0 ? bestMove(model, p.assigned, spares, balanceQuality) : null) ?? bestMove(model, p.assigned, candidates.values(), balanceQuality, absent);
}

/** A node every layer of whose span another node holds too: moving it bares nothing. */
function isSpare(n: Span, count: readonly number[]): boolean {
  for (let l = n.start; l < n.end; l++) if ((count[l] ?? 0) < 2) return false;
  return true;
}
