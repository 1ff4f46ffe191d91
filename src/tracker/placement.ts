/**
 * One model's placement, kept up to date by changes instead of rebuilt: per
 * layer how many nodes are assigned it and serve it (and their summed
 * throughput), the serving nodes grouped by span, and node counts by status.
 *
 * The registry detaches a node before it changes anything routing or
 * placement depends on (assignment, serving span, throughput, status) and
 * attaches it again after, each in O(span length); so a register, a
 * heartbeat or a removal costs the same with ten nodes or ten thousand, and
 * the assignment, the rebalancing, the availability map and the gauges read
 * these sums instead of walking every node (they did, on every heartbeat and
 * every sweep, which held one tracker to about a thousand donors).
 *
 * Throughput sums are floats added and taken away many times: `recount`
 * rebuilds them exactly from the nodes (the sweep calls it), so rounding
 * never builds up.
 */
import type { Coverage, Span } from './assignment.ts';

/** What one node adds to its model's sums; the registry keeps it to take away exactly what it added. */
export interface Contribution {
  assignment: Span | null;
  serving: Span | null;
  throughput: number;
  /** What routing sorts the nodes of one span by: ms per layer × (1 + load). */
  cost: number;
  status: PlacementStatus;
  /** Serving one span while loading another: a moved node (no further move until it lands). */
  mover: boolean;
}

export type PlacementStatus = 'loading' | 'serving' | 'idle' | 'draining';

/** A node as its model's placement holds it. */
export interface Placed {
  peerId: string;
  contribution: Contribution | undefined;
}

function spanKey(s: Span): string {
  return `${s.start}:${s.end}`;
}

export class ModelPlacement<N extends Placed = Placed> {
  /** Every node of this model, in the order they joined. */
  readonly nodes = new Set<N>();
  /** Over assignments: what placement decisions (chooseSpan, rebalance) look at. */
  readonly assigned: Coverage;
  /** Over served spans: what routing and the availability map see. */
  readonly serving: Coverage;
  /** Serving nodes by span ("start:end"), cheapest first: routing walks the first few of each. */
  readonly groups = new Map<string, SpanGroup<N>>();
  readonly statusCount: Record<PlacementStatus, number> = { loading: 0, serving: 0, idle: 0, draining: 0 };
  /** Moved nodes still loading their new span. */
  movers = 0;
  /** Something placement depends on changed since the last rebalance. */
  dirty = true;

  constructor(readonly numLayers: number) {
    this.assigned = { count: new Array<number>(numLayers).fill(0), throughput: new Array<number>(numLayers).fill(0) };
    this.serving = { count: new Array<number>(numLayers).fill(0), throughput: new Array<number>(numLayers).fill(0) };
  }

  get size(): number {
    return this.nodes.size;
  }

  attach(n: N, c: Contribution): void {
    this.nodes.add(n);
    n.contribution = c;
    this.add(c, 1);
    if (c.serving) {
      const key = spanKey(c.serving);
      let g = this.groups.get(key);
      if (!g) this.groups.set(key, (g = new SpanGroup<N>({ start: c.serving.start, end: c.serving.end })));
      g.insert(n, c.cost);
    }
  }

  detach(n: N): void {
    const c = n.contribution;
    if (!c) return;
    this.add(c, -1);
    n.contribution = undefined;
    if (c.serving) {
      const key = spanKey(c.serving);
      const g = this.groups.get(key);
      if (g) {
        g.remove(n, c.cost);
        if (g.size === 0) this.groups.delete(key);
      }
    }
  }

  /** Gone for good (detached first). */
  forget(n: N): void {
    this.detach(n);
    this.nodes.delete(n);
    this.dirty = true;
  }

  private add(c: Contribution, sign: 1 | -1): void {
    if (c.assignment) addSpan(this.assigned, c.assignment, c.throughput * sign, sign, this.numLayers);
    if (c.serving) addSpan(this.serving, c.serving, c.throughput * sign, sign, this.numLayers);
    this.statusCount[c.status] += sign;
    if (c.mover) this.movers += sign;
  }

  /** Rebuild every sum from the nodes' contributions (float drift never builds up). */
  recount(): void {
    for (const cov of [this.assigned, this.serving]) {
      cov.count.fill(0);
      cov.throughput.fill(0);
    }
    this.statusCount.loading = this.statusCount.serving = this.statusCount.idle = this.statusCount.draining = 0;
    this.movers = 0;
    for (const n of this.nodes) if (n.contribution) this.add(n.contribution, 1);
  }

  /** Layers of [from, to) no node serves. */
  missing(from = 0, to = this.numLayers): number[] {
    const out: number[] = [];
    for (let l = from; l < to; l++) if (this.serving.count[l]! <= 0) out.push(l);
    return out;
  }
}

function addSpan(cov: Coverage, s: Span, tp: number, n: number, numLayers: number): void {
  const end = Math.min(numLayers, s.end);
  for (let l = Math.max(0, s.start); l < end; l++) {
    cov.count[l]! += n;
    cov.throughput[l]! += tp;
  }
}

/**
 * The serving nodes of one span, kept sorted by their routing cost: a node
 * whose cost changes (a heartbeat, a chat starting or ending on it) is
 * taken out and put back in O(log n) + a move of the array's tail, so a
 * route pick reads the cheapest few without looking at the rest.
 */
export class SpanGroup<N> {
  private readonly items: N[] = [];
  private readonly costs: number[] = [];

  constructor(readonly span: Span) {}

  get size(): number {
    return this.items.length;
  }

  /** Cheapest first. */
  get nodes(): readonly N[] {
    return this.items;
  }

  /** The cost `nodes[i]` was put in with (what routing ranks it by, kept beside it so a pick need not work it out again). */
  costAt(i: number): number {
    return this.costs[i]!;
  }

  /** First index whose cost is above `cost` (after its equals: insertion order among equals). */
  private upper(cost: number): number {
    let lo = 0;
    let hi = this.costs.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (this.costs[mid]! <= cost) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  insert(n: N, cost: number): void {
    const i = this.upper(cost);
    this.items.splice(i, 0, n);
    this.costs.splice(i, 0, cost);
  }

  /** Remove `n`, inserted with `cost`. */
  remove(n: N, cost: number): void {
    // Among its equals: scan back from the end of the run of `cost`.
    for (let i = this.upper(cost) - 1; i >= 0 && this.costs[i] === cost; i--) {
      if (this.items[i] === n) {
        this.items.splice(i, 1);
        this.costs.splice(i, 1);
        return;
      }
    }
    // Not where its cost says (NaN, or a bug): find it anyway rather than keep a stale entry.
    const j = this.items.indexOf(n);
    if (j >= 0) {
      this.items.splice(j, 1);
      this.costs.splice(j, 1);
    }
  }
}
