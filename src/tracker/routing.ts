/**
 * Throughput routing (ADR-0012, ADR-0013): the cheapest chain of serving
 * nodes over layer boundaries `from → to`.
 *
 *   boundaries  0 ─── 4 ─── 6 ─── 8 ─── 12
 *   node A      [0 ─────────── 8)                    edges 0→8 (and 1→8 … 7→8)
 *   node B            [4 ─────────────── 12)         edges 4→12, 5→12, … 8→12
 *   route       A runs 0..8, B starts at 8 (inside its range: ADR-0012 overlap)
 *
 * A node holding [a, b) gives an edge from every boundary s in [a, b) to b
 * (or to `to`, when it ends later: X-Meshnet-End-Layer), costing a hop's
 * network latency + its compute (layer_ms × layers) × (1 + its load). The
 * boundaries form a DAG, so shortest paths are a single pass in boundary
 * order (Dijkstra without a heap); we keep the K cheapest per boundary so
 * traffic can be spread over near-optimal routes in proportion to their
 * throughput instead of piling on the single fastest chain.
 */

export interface ServingNode {
  id: string;
  start: number;
  /** Exclusive. */
  end: number;
  /** ms per layer per decode step. */
  layerMs: number;
  /** Requests waiting at the node (its queue + what this tracker has in flight through it). */
  load: number;
}

export interface PlannedHop {
  id: string;
  start: number;
  end: number;
}

export interface RoutePlan {
  hops: PlannedHop[];
  /** Estimated ms per token over the whole route. */
  costMs: number;
}

export interface RoutingCosts {
  hopLatencyMs: number;
  /** Routes kept per boundary. @defaultValue 16 */
  keep?: number;
}

export function hopCostMs(n: ServingNode, start: number, end: number, hopLatencyMs: number): number {
  return hopLatencyMs + n.layerMs * (end - start) * (1 + Math.max(0, n.load));
}

/** The K cheapest routes covering [from, to), cheapest first; empty when no chain exists. */
export function findRoutes(nodes: readonly ServingNode[], from: number, to: number, costs: RoutingCosts): RoutePlan[] {
  const keep = costs.keep ?? 16;
  const best: RoutePlan[][] = Array.from({ length: to + 1 }, () => []);
  best[from] = [{ hops: [], costMs: 0 }];
  for (let b = from; b < to; b++) {
    const here = best[b]!;
    if (here.length === 0) continue;
    for (const n of nodes) {
      if (!(n.start <= b && b < n.end)) continue;
      const e = Math.min(n.end, to);
      const c = hopCostMs(n, b, e, costs.hopLatencyMs);
      const into = best[e]!;
      for (const p of here) {
        // A node appears once per route: a second visit would mean reusing its KV session twice.
        if (p.hops.some((h) => h.id === n.id)) continue;
        into.push({ hops: [...p.hops, { id: n.id, start: b, end: e }], costMs: p.costMs + c });
      }
      into.sort((x, y) => x.costMs - y.costMs);
      if (into.length > keep) into.length = keep;
    }
  }
  return best[to]!;
}

/**
 * One route among those within (1 + slack) × the best cost, with probability
 * proportional to its throughput (1 / cost): a node twice as fast gets twice
 * the traffic, a much slower one none.
 */
export function pickRoute(routes: readonly RoutePlan[], slack: number, random: () => number): RoutePlan | undefined {
  if (routes.length === 0) return undefined;
  const limit = routes[0]!.costMs * (1 + slack);
  const near = routes.filter((r) => r.costMs <= limit + 1e-9);
  const weights = near.map((r) => 1 / Math.max(r.costMs, 1e-6));
  const total = weights.reduce((a, b) => a + b, 0);
  let x = random() * total;
  for (let i = 0; i < near.length; i++) {
    x -= weights[i]!;
    if (x < 0) return near[i];
  }
  return near[near.length - 1];
}

/** Layers of [from, to) no serving node holds. */
export function missingLayers(nodes: readonly ServingNode[], from: number, to: number): number[] {
  const missing: number[] = [];
  for (let l = from; l < to; l++) if (!nodes.some((n) => n.start <= l && l < n.end)) missing.push(l);
  return missing;
}

/** "3-5, 9" for [3, 4, 5, 9]. */
export function formatLayers(layers: readonly number[]): string {
  const parts: string[] = [];
  for (let i = 0; i < layers.length; ) {
    let j = i;
    while (j + 1 < layers.length && layers[j + 1] === layers[j]! + 1) j++;
    parts.push(i === j ? `${layers[i]}` : `${layers[i]}-${layers[j]}`);
    i = j + 1;
  }
  return parts.join(', ');
}
