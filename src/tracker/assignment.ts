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

/** Candidate spans per model, weight format and budget: donors share a few budgets, and each set costs O(L^2) to find. */
const candidateCache = new WeakMap<ModelSpec, Map<string, readonly Span[]>>();
const CANDIDATE_CACHE_MAX = 4096;

/** {@link candidateSpans} of `model` sized for `format`, cached. */
export function cachedCandidates(model: ModelSpec, budgetBytes: number, format?: WeightFormat): readonly Span[] {
  let byKey = candidateCache.get(model);
  if (!byKey) candidateCache.set(model, (byKey = new Map()));
  const key = `${format ?? 'f32'}:${budgetBytes}`;
  let c = byKey.get(key);
  if (!c) {
    if (byKey.size >= CANDIDATE_CACHE_MAX) byKey.clear();
    c = candidateSpans(sizedFor(model, format), budgetBytes);
    byKey.set(key, c);
  }
  return c;
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

/** {@link chooseSpan} against a coverage already summed (the registry keeps it up to date). */
export function chooseSpanIn(model: ModelSpec, budgetBytes: number, others: Coverage, format?: WeightFormat): Span | null {
  return chooseRanked(cachedCandidates(model, budgetBytes, format), others);
}

/**
 * Dense ranks of the layers' (count, throughput) keys: equal keys get equal
 * ranks, a smaller key a smaller rank. Comparing two windows' sorted ranks
 * is comparing their sorted keys (compareWindows), without a tuple per layer.
 */
function denseRanks(cov: Coverage): Int32Array {
  const n = cov.count.length;
  const order = Array.from({ length: n }, (_, i) => i).sort((a, b) => cov.count[a]! - cov.count[b]! || cov.throughput[a]! - cov.throughput[b]!);
  const rank = new Int32Array(n);
  let r = 0;
  for (let i = 0; i < n; i++) {
    const l = order[i]!;
    if (i > 0) {
      const p = order[i - 1]!;
      if (cov.count[p] !== cov.count[l] || cov.throughput[p] !== cov.throughput[l]) r++;
    }
    rank[l] = r;
  }
  return rank;
}

/** chooseAmong by dense ranks: the same choice, ties included (the lowest start among equals). */
function chooseRanked(candidates: readonly Span[], cov: Coverage): Span | null {
  if (candidates.length === 0) return null;
  const rank = denseRanks(cov);
  const L = cov.count.length;
  let free = new Int32Array(L);
  let held = new Int32Array(L);
  let best: Span | null = null;
  let bestKeys = held.subarray(0, 0);
  for (const c of candidates) {
    const keys = free.subarray(0, c.end - c.start);
    for (let l = c.start; l < c.end; l++) keys[l - c.start] = rank[l]!;
    keys.sort();
    if (best === null || compareRanked(keys, bestKeys) < 0) {
      best = c;
      bestKeys = keys;
      // The best window's keys stay where they are; the next window is written into the other buffer.
      [free, held] = [held, free];
    }
  }
  return best;
}

function compareRanked(a: Int32Array, b: Int32Array): number {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return a[i]! - b[i]!;
  return b.length - a.length;
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

/**
 * The one move {@link rebalance} would make first, against the placement's
 * summed coverage of assignments (`assigned`, every node of `nodes`
 * included): each movable node is judged on the coverage without its own
 * span, so a rebalance costs O(nodes × layers²) instead of
 * O(nodes² × layers) per round, and only one round is computed (the
 * registry applies one move at a time and waits for it to load).
 *
 * `absent`: the spans of nodes away for now but expected back (their
 * rejoin grace): judged as held, so no move is made to cover them, but never
 * counted as another holder of a layer a mover alone holds.
 */
export function bestMove(model: ModelSpec, assigned: Coverage, nodes: Iterable<RebalanceNode>, balanceQuality: number, absent?: Coverage): Move | null {
  const L = model.numLayers;
  const held = absent ? { count: assigned.count.map((c, l) => c + absent.count[l]!), throughput: assigned.throughput.map((t, l) => t + absent.throughput[l]!) } : assigned;
  const cur = balanceOf(held);
  const others: Coverage = { count: new Array<number>(L), throughput: new Array<number>(L) };
  let best: { n: RebalanceNode; to: Span; balance: Balance } | null = null;
  for (const n of nodes) {
    if (!n.movable) continue;
    for (let l = 0; l < L; l++) {
      const mine = l >= n.start && l < n.end;
      others.count[l] = held.count[l]! - (mine ? 1 : 0);
      others.throughput[l] = held.throughput[l]! - (mine ? n.throughput : 0);
    }
    // As rebalance: never bare a layer the mover alone holds.
    const allowed = cachedCandidates(model, n.budgetBytes, n.format).filter((c) => !baresALayer(n, c, assigned.count));
    const to = chooseRanked(allowed, others);
    if (to === null || (to.start === n.start && to.end === n.end)) continue;
    for (let l = to.start; l < to.end; l++) {
      others.count[l]!++;
      others.throughput[l]! += n.throughput;
    }
    const next = balanceOf(others);
    if (!betterBalance(next, cur, balanceQuality)) continue;
    if (best === null || betterBalance(next, best.balance, 1)) best = { n, to, balance: next };
  }
  return best && { id: best.n.id, from: { start: best.n.start, end: best.n.end }, to: best.to };
}
