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
 * order; we keep the K cheapest per boundary so traffic can be spread over
 * near-optimal routes in proportion to their throughput instead of piling
 * on the single fastest chain.
 */

export interface ServingNode {
  id: string;
  start: number;
  /** Exclusive. */
  end: number;
  /**
   * What one layer of a decode step costs through it: its ms per layer ×
   * (1 + its load), the load being the requests waiting at the node (its
   * queue + what this tracker has in flight through it). {@link perLayerMs}.
   */
  perLayerMs: number;
}

/** A node's cost per layer, from its speed and its load (negative load counts as none). */
export function perLayerMs(layerMs: number, load: number): number {
  return layerMs * (1 + Math.max(0, load));
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
  return hopLatencyMs + n.perLayerMs * (end - start);
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

function sortedByCost(nodes: readonly ServingNode[]): boolean {
  for (let k = 1; k < nodes.length; k++) if (nodes[k]!.perLayerMs < nodes[k - 1]!.perLayerMs) return false;
  return true;
}

/** A span's nodes, cheapest per layer first (so their hop costs over any stretch rise with the index). */
interface SpanNodes {
  start: number;
  end: number;
  nodes: ServingNode[];
}

/**
 * One way into a boundary not yet taken: route `i` of boundary `b` extended
 * by node `j` of span `g`. Ties between equal costs go by (b, g, i, j), the
 * order a search pushing every route through every node tries them in (as
 * this one did before the heap), so the same routes are kept, and the same
 * one of two equal routes.
 */
interface Step {
  costMs: number;
  b: number;
  g: number;
  i: number;
  j: number;
}

function before(x: Step, y: Step): boolean {
  if (x.costMs !== y.costMs) return x.costMs < y.costMs;
  if (x.b !== y.b) return x.b < y.b;
  if (x.g !== y.g) return x.g < y.g;
  if (x.i !== y.i) return x.i < y.i;
  return x.j < y.j;
}

/** A binary min-heap of steps: hundreds at most, so a plain array. */
class StepHeap {
  /** Takes `steps` over, as a heap built in place (linear time, not a push each). */
  constructor(private readonly a: Step[]) {
    for (let k = (a.length >> 1) - 1; k >= 0; k--) this.down(k, a[k]!);
  }
  get size(): number {
    return this.a.length;
  }
  push(s: Step): void {
    const a = this.a;
    let k = a.length;
    a.push(s);
    while (k > 0) {
      const up = (k - 1) >> 1;
      if (!before(s, a[up]!)) break;
      a[k] = a[up]!;
      k = up;
    }
    a[k] = s;
  }
  pop(): Step {
    const a = this.a;
    const top = a[0]!;
    const last = a.pop()!;
    if (a.length > 0) this.down(0, last);
    return top;
  }
  /** Settles `s` at slot `k` or below. */
  private down(k: number, s: Step): void {
    const a = this.a;
    for (;;) {
      let c = 2 * k + 1;
      if (c >= a.length) break;
      if (c + 1 < a.length && before(a[c + 1]!, a[c]!)) c++;
      if (!before(a[c]!, s)) break;
      a[k] = a[c]!;
      k = c;
    }
    a[k] = s;
  }
}

/**
 * The K cheapest routes covering [from, to), cheapest first; empty when no
 * chain exists. Boundaries are settled in order: the routes into boundary e
 * are the K cheapest of (a route into some b < e) + (a node whose span runs
 * from at or before b to e). For one span and one b those sums form a table
 * sorted along both sides (routes into b cheapest first, the span's nodes
 * cheapest first), so a heap holding each table's next cell yields them in
 * cost order and stops after K: the search takes about K cells per boundary
 * and one per (span, b), whether a span holds 10 nodes or 2,000.
 */
export function findRoutes(nodes: readonly ServingNode[], from: number, to: number, costs: RoutingCosts): RoutePlan[] {
  const keep = costs.keep ?? 16;
  const lat = costs.hopLatencyMs;
  // Nodes by span, in the order spans first appear; each span's nodes by their cost per layer.
  const bySpan = new Map<number, SpanNodes>();
  for (const n of nodes) {
    if (n.end <= from || n.start >= to) continue;
    const key = n.start * 0x10000 + n.end;
    let g = bySpan.get(key);
    if (!g) bySpan.set(key, (g = { start: n.start, end: n.end, nodes: [] }));
    g.nodes.push(n);
  }
  const groups: SpanNodes[] = [];
  const ending: number[][] = Array.from({ length: to + 1 }, () => []);
  for (const g of bySpan.values()) {
    // Array sort is stable: equal nodes keep the order they came in. The tracker's candidates come sorted already.
    if (!sortedByCost(g.nodes)) g.nodes.sort((x, y) => x.perLayerMs - y.perLayerMs);
    ending[Math.min(g.end, to)]!.push(groups.length);
    groups.push(g);
  }
  const best: Partial[][] = Array.from({ length: to + 1 }, () => []);
  best[from] = [{ costMs: 0, hop: null, prev: null }];
  for (let e = from + 1; e <= to; e++) {
    const spans = ending[e]!;
    if (spans.length === 0) continue;
    const first: Step[] = [];
    for (const g of spans) {
      const span = groups[g]!;
      for (let b = Math.max(span.start, from); b < e; b++) {
        const here = best[b]!;
        if (here.length > 0) first.push({ costMs: here[0]!.costMs + hopCostMs(span.nodes[0]!, b, e, lat), b, g, i: 0, j: 0 });
      }
    }
    const heap = new StepHeap(first);
    const into = best[e]!;
    while (into.length < keep && heap.size > 0) {
      const s = heap.pop();
      const span = groups[s.g]!;
      const here = best[s.b]!;
      const p = here[s.i]!;
      const n = span.nodes[s.j]!;
      // A node appears once per route: a second visit would mean reusing its KV session twice. (A hop ends
      // where its node's span ends, so only a node listed under two spans could come back.)
      if (!holds(p, n.id)) into.push({ costMs: s.costMs, hop: { id: n.id, start: s.b, end: e }, prev: p });
      // Each cell has one way in (from its left, or from above in the first column), so none is taken twice.
      if (s.j + 1 < span.nodes.length) heap.push({ costMs: p.costMs + hopCostMs(span.nodes[s.j + 1]!, s.b, e, lat), b: s.b, g: s.g, i: s.i, j: s.j + 1 });
      if (s.j === 0 && s.i + 1 < here.length) heap.push({ costMs: here[s.i + 1]!.costMs + hopCostMs(span.nodes[0]!, s.b, e, lat), b: s.b, g: s.g, i: s.i + 1, j: 0 });
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
