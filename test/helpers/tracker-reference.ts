/**
 * Reference implementations of the tracker's placement and routing, as
 * they were written before the tracker kept its sums up to date by changes:
 * every node against every other, every time. Slow and plainly correct;
 * the tests check the fast versions against them.
 */
import type { Coverage } from '../../src/tracker/assignment.ts';
import { hopCostMs, type RoutePlan, type ServingNode } from '../../src/tracker/routing.ts';

/** The K cheapest routes by trying every node at every boundary with every route so far. */
export function naiveFindRoutes(nodes: readonly ServingNode[], from: number, to: number, hopLatencyMs: number, keep = 16): RoutePlan[] {
  const best: RoutePlan[][] = Array.from({ length: to + 1 }, () => []);
  best[from] = [{ hops: [], costMs: 0 }];
  for (let b = from; b < to; b++) {
    const here = best[b]!;
    if (here.length === 0) continue;
    for (const n of nodes) {
      if (!(n.start <= b && b < n.end)) continue;
      const e = Math.min(n.end, to);
      const c = hopCostMs(n, b, e, hopLatencyMs);
      const into = best[e]!;
      for (const p of here) {
        if (p.hops.some((h) => h.id === n.id)) continue;
        into.push({ hops: [...p.hops, { id: n.id, start: b, end: e }], costMs: p.costMs + c });
      }
      into.sort((x, y) => x.costMs - y.costMs);
      if (into.length > keep) into.length = keep;
    }
  }
  return best[to]!;
}

/** Per-layer count and summed throughput of `spans`, summed afresh. */
export function naiveCoverage(numLayers: number, spans: Iterable<{ start: number; end: number; throughput: number }>): Coverage {
  const count = new Array<number>(numLayers).fill(0);
  const throughput = new Array<number>(numLayers).fill(0);
  for (const s of spans) {
    for (let l = s.start; l < s.end; l++) {
      count[l]!++;
      throughput[l]! += s.throughput;
    }
  }
  return { count, throughput };
}
