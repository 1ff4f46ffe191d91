/**
 * Which layers a node holds (ADR-0011), after Petals' block selection
 * (petals/server/block_selection.py), decided centrally by the tracker:
 *
 * - how many: the longest span whose weights (in the node's announced weight
 *   format: f32, f16 or q4, ~6.4x smaller) + KV reserve fit the node's
 *   `memory_budget_mb` (the head also holds the embedding, the
 *   last node the LM head, so a span's length depends on where it lies);
 * - where: the span whose layers are the least covered, then the lowest in
 *   throughput (Petals' `_choose_best_start`: compare each window's sorted
 *   per-layer keys, smallest first);
 * - rebalancing: when coverage is uneven (a node left and layers lie bare),
 *   move the node whose move best improves the worst layer (Petals'
 *   `should_choose_other_blocks`, but one tracker deciding instead of every
 *   server racing), and only when it improves: no layer may lose its last
 *   holder, and a throughput-only move must beat `balanceQuality`.
 *
 * Pure functions over plain data: tested without a tracker.
 */
import type { WeightFormat } from '../model/weight-format.ts';
import { sizedFor, spanBytes, type ModelSpec } from './model-registry.ts';

export interface Span {
  start: number;
  /** Exclusive. */
  end: number;
}

export interface Holder extends Span {
  id: string;
  /** Layer-steps per second this node sustains (1000 / layer_ms). */
  throughput: number;
}

/** Per-layer coverage: how many holders, and their summed throughput. */
export interface Coverage {
  count: number[];
  throughput: number[];
}

export function coverage(numLayers: number, holders: Iterable<Holder>): Coverage {
  const count = new Array<number>(numLayers).fill(0);
  const throughput = new Array<number>(numLayers).fill(0);
  for (const h of holders) {
    for (let l = Math.max(0, h.start); l < Math.min(numLayers, h.end); l++) {
      count[l]!++;
      throughput[l]! += h.throughput;
    }
  }
  return { count, throughput };
}

/** The spans a budget allows: for each start, the longest fitting span (none when even one layer does not fit there). */
export function candidateSpans(model: ModelSpec, budgetBytes: number): Span[] {
  const out: Span[] = [];
  for (let s = 0; s < model.numLayers; s++) {
    let e = s;
    while (e < model.numLayers && spanBytes(model, s, e + 1) <= budgetBytes) e++;
    if (e > s) out.push({ start: s, end: e });
  }
  return out;
}

/** Most layers any placement allows; 0 when the node cannot hold a single layer anywhere. */
export function layersThatFit(model: ModelSpec, budgetBytes: number): number {
  return candidateSpans(model, budgetBytes).reduce((m, s) => Math.max(m, s.end - s.start), 0);
}

type Key = [count: number, throughput: number];

function windowKeys(cov: Coverage, span: Span): Key[] {
  const keys: Key[] = [];
  for (let l = span.start; l < span.end; l++) keys.push([cov.count[l]!, cov.throughput[l]!]);
  return keys.sort(compareKey);
}

function compareKey(a: Key, b: Key): number {
  return a[0] - b[0] || a[1] - b[1];
}

/**
 * Negative when window `a` is the better place for a new holder: its sorted
 * keys are smaller at the first difference (it covers a less-covered, then
 * slower, layer); when one is a prefix of the other the longer one covers
 * more and wins.
 */
function compareWindows(a: Key[], b: Key[]): number {
  for (let i = 0; i < Math.min(a.length, b.length); i++) {
    const c = compareKey(a[i]!, b[i]!);
    if (c !== 0) return c;
  }
  return b.length - a.length;
}

/** The best span for a node with `budgetBytes` holding `format` (absent: f32), given everyone else's holdings; null when nothing fits. */
export function chooseSpan(model: ModelSpec, budgetBytes: number, others: Iterable<Holder>, format?: WeightFormat): Span | null {
  return chooseAmong(candidateSpans(sizedFor(model, format), budgetBytes), coverage(model.numLayers, others));
}

function chooseAmong(candidates: Span[], cov: Coverage): Span | null {
  let best: Span | null = null;
  let bestKeys: Key[] = [];
  for (const c of candidates) {
    const keys = windowKeys(cov, c);
    // Strictly better only: ties keep the lowest start (deterministic).
    if (best === null || compareWindows(keys, bestKeys) < 0) {
      best = c;
      bestKeys = keys;
    }
  }
  return best;
}

/** How good a whole placement is; compared by {@link betterBalance}. */
export interface Balance {
  /** Layers nobody holds. */
  uncovered: number;
  /** Fewest holders of any layer. */
  minCount: number;
  /** Lowest summed throughput of any layer. */
  minThroughput: number;
}

export function balanceOf(cov: Coverage): Balance {
  return {
    uncovered: cov.count.filter((c) => c === 0).length,
    minCount: Math.min(...cov.count),
    minThroughput: Math.min(...cov.throughput),
  };
}

/** True when `next` improves on `cur` enough to move a node for it. */
export function betterBalance(next: Balance, cur: Balance, balanceQuality: number): boolean {
  if (next.uncovered !== cur.uncovered) return next.uncovered < cur.uncovered;
  if (next.minCount !== cur.minCount) return next.minCount > cur.minCount;
  if (next.minThroughput <= cur.minThroughput || next.minThroughput <= 0) return false;
  // Petals' balance_quality: moving costs a reload, so only a clear gain is worth it.
  return cur.minThroughput / next.minThroughput < balanceQuality;
}

export interface RebalanceNode extends Holder {
  budgetBytes: number;
  /** The weight format the node holds its span in (absent: f32). */
  format?: WeightFormat;
  /** False while the node loads its current assignment: moving it again would only thrash. */
  movable: boolean;
}

export interface Move {
  id: string;
  from: Span;
  to: Span;
}

/**
 * Moves that improve the placement, applied one at a time (each move sees the
 * previous ones) until no single move helps; at most one move per node.
 */
export function rebalance(model: ModelSpec, nodes: readonly RebalanceNode[], balanceQuality: number): Move[] {
  const state = nodes.map((n) => ({ ...n }));
  const moves: Move[] = [];
  const moved = new Set<string>();
  for (let round = 0; round < state.length; round++) {
    const cov = coverage(model.numLayers, state);
    const cur = balanceOf(cov);
    let best: { i: number; to: Span; balance: Balance } | null = null;
    for (let i = 0; i < state.length; i++) {
      const n = state[i]!;
      if (!n.movable || moved.has(n.id)) continue;
      const others = state.filter((_, j) => j !== i);
      // Never bare a layer to cover another: a node keeps every layer it alone holds (it may grow around
      // them). Moving it off them would only shift the gap, at the cost of a download, while the node
      // that left may well come back.
      const allowed = candidateSpans(sizedFor(model, n.format), n.budgetBytes).filter((c) => !baresALayer(n, c, cov.count));
      const to = chooseAmong(allowed, coverage(model.numLayers, others));
      if (to === null || (to.start === n.start && to.end === n.end)) continue; // already at its best place
      const next = balanceOf(coverage(model.numLayers, [...others, { ...n, ...to }]));
      if (!betterBalance(next, cur, balanceQuality)) continue;
      if (best === null || betterBalance(next, best.balance, 1)) best = { i, to, balance: next };
    }
    if (best === null) break;
    const n = state[best.i]!;
    moves.push({ id: n.id, from: { start: n.start, end: n.end }, to: best.to });
    moved.add(n.id);
    n.start = best.to.start;
    n.end = best.to.end;
  }
  return moves;
}

/** True when moving `n` from its span to `to` leaves a layer it alone holds (per `count`) without a holder. */
function baresALayer(n: Span, to: Span, count: readonly number[]): boolean {
  for (let l = n.start; l < n.end; l++) if ((l < to.start || l >= to.end) && count[l] === 1) return true;
  return false;
}
