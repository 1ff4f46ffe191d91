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

/** A route being built: the last hop and the route before it (routes share their prefixes). */
interface Partial {
  costMs: number;
  hop: PlannedHop | null;
  prev: Partial | null;
}

function holds(p: Partial | null, id: string): boolean {
  for (let q = p; q !== null; q = q.prev) if (q.hop?.id === id) return true;
  return false;
}

function planOf(p: Partial): RoutePlan {
  const hops: PlannedHop[] = [];
  for (let q: Partial | null = p; q !== null && q.hop !== null; q = q.prev) hops.push(q.hop);
  return { hops: hops.reverse(), costMs: p.costMs };
}

/** Insert into a list sorted by cost, after its equals, keeping at most `keep`. */
function insertKept(into: Partial[], r: Partial, keep: number): void {
  let k = into.length;
  while (k > 0 && into[k - 1]!.costMs > r.costMs) k--;
  if (k >= keep) return;
  into.splice(k, 0, r);
  if (into.length > keep) into.length = keep;
}

/**
 * The K cheapest routes covering [from, to), cheapest first; empty when no
 * chain exists. Nodes of one span are taken cheapest first, and a node (or a
 * route so far) that cannot beat the K-th route already found ends the
 * search along it: with thousands of nodes of a few spans the search looks
 * at a handful of each, not every pair of route and node.
 */
export function findRoutes(nodes: readonly ServingNode[], from: number, to: number, costs: RoutingCosts): RoutePlan[] {
  const keep = costs.keep ?? 16;
  const lat = costs.hopLatencyMs;
  // Nodes by span, each span's nodes by their cost per layer (the order of their hop costs over any stretch).
  const bySpan = new Map<string, { start: number; end: number; nodes: Array<{ n: ServingNode; perLayer: number }> }>();
  for (const n of nodes) {
    if (n.end <= from || n.start >= to) continue;
    const key = `${n.start}:${n.end}`;
    let g = bySpan.get(key);
    if (!g) bySpan.set(key, (g = { start: n.start, end: n.end, nodes: [] }));
    g.nodes.push({ n, perLayer: n.layerMs * (1 + Math.max(0, n.load)) });
  }
  const groups = [...bySpan.values()];
  for (const g of groups) g.nodes.sort((a, b) => a.perLayer - b.perLayer);
  const best: Partial[][] = Array.from({ length: to + 1 }, () => []);
  best[from] = [{ costMs: 0, hop: null, prev: null }];
  for (let b = from; b < to; b++) {
    const here = best[b]!;
    if (here.length === 0) continue;
    for (const g of groups) {
      if (!(g.start <= b && b < g.end)) continue;
      const e = Math.min(g.end, to);
      const into = best[e]!;
      const cheapest = hopCostMs(g.nodes[0]!.n, b, e, lat);
      for (const p of here) {
        // `here` is cheapest first: once even the cheapest node cannot make the cut, no later route can.
        if (into.length >= keep && p.costMs + cheapest >= into[keep - 1]!.costMs) break;
        for (const { n } of g.nodes) {
          const c = p.costMs + hopCostMs(n, b, e, lat);
          if (into.length >= keep && c >= into[keep - 1]!.costMs) break;
          // A node appears once per route: a second visit would mean reusing its KV session twice.
          if (holds(p, n.id)) continue;
          insertKept(into, { costMs: c, hop: { id: n.id, start: b, end: e }, prev: p }, keep);
        }
      }
    }
  }
  return best[to]!.map(planOf);
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
