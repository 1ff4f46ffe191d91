/**
 * How a span's layers are cut into graphs, for both executors: each
 * segment is one ONNX session over layers [start, end), and a call must
 * start and end on a segment's boundary.
 */
import type { OnnxSession } from './backend.ts';
import { layerRangeError } from './errors.ts';

/** One graph of a span: layers [start, end) in one session. */
export interface Segment {
  start: number;
  end: number;
  session: OnnxSession;
}

/** [a, b) must lie inside the model's `numLayers` layers and hold at least one (RangeError: a caller's mistake, not a request's). */
export function checkSpan(numLayers: number, a: number, b: number): void {
  if (!(Number.isInteger(a) && Number.isInteger(b) && 0 <= a && a < b && b <= numLayers)) {
    throw new RangeError(`layer range [${a}, ${b}) is not inside 0..${numLayers}`);
  }
}

/** The segments' bounds [a, …cuts, b]: the cuts sorted and deduplicated, each strictly inside (a, b). */
export function segmentBounds(a: number, b: number, cuts: readonly number[]): number[] {
  const bounds = [a, ...[...new Set(cuts)].sort((x, y) => x - y), b];
  if (bounds.some((v, i) => i > 0 && v <= bounds[i - 1]!)) throw new RangeError(`segment boundaries ${cuts.join(',')} must lie strictly inside (${a}, ${b})`);
  return bounds;
}

/** The first and last segment a call over [start, end) runs; 400 MESH_ERR_LAYER_RANGE when it does not start and end on boundaries. */
export function segmentSpan(segments: ReadonlyArray<{ start: number; end: number }>, start: number, end: number, held: { startLayer: number; endLayer: number }): { first: number; last: number } {
  const first = segments.findIndex((s) => s.start === start);
  const last = segments.findIndex((s) => s.end === end);
  if (first < 0 || last < 0) throw layerRangeError(`layers [${start}, ${end}) do not start and end on this shard's graph boundaries`, { startLayer: held.startLayer, endLayer: held.endLayer });
  return { first, last };
}
