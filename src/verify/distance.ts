/**
 * How far a hop's claimed output rows are from a checker's recomputation of
 * them: the metric a check's verdict rests on (docs/verification.md). Pure
 * arithmetic, shared by the node that runs a check and the tracker that
 * decides on it, so both compute the same number from the same rows.
 *
 * Per row (one position's hidden state):
 *   rel  = ‖claim − check‖₂ / ‖check‖₂         (relative L2)
 *   peak = max |claim − check| / rms(check)     (the largest single deviation, in units of the row's scale)
 * A step's distance is the worst row of the step. Both are scale-free, so
 * one threshold holds at every layer depth, whatever the hidden state's
 * magnitude there.
 */

export interface RowDistances {
  /** Relative L2 per row. */
  rel: Float64Array;
  /** Largest absolute deviation per row over the checker row's RMS. */
  peak: Float64Array;
}

/** Smallest norm a denominator takes: a checker row of zeros would otherwise divide by zero. */
const TINY = 1e-30;

/** Distances of `rows` rows of `hidden` values each (claim and check row-major, same shape). */
export function rowDistances(claim: ArrayLike<number>, check: ArrayLike<number>, hidden: number): RowDistances {
  if (claim.length !== check.length) throw new RangeError(`claim has ${claim.length} values, check ${check.length}`);
  if (hidden <= 0 || claim.length % hidden !== 0) throw new RangeError(`${claim.length} values are not whole rows of ${hidden}`);
  const rows = claim.length / hidden;
  const rel = new Float64Array(rows);
  const peak = new Float64Array(rows);
  for (let r = 0; r < rows; r++) {
    let diff2 = 0;
    let ref2 = 0;
    let max = 0;
    const o = r * hidden;
    for (let i = 0; i < hidden; i++) {
      const b = check[o + i]!;
      const d = claim[o + i]! - b;
      diff2 += d * d;
      ref2 += b * b;
      const ad = Math.abs(d);
      if (ad > max || Number.isNaN(ad)) max = ad;
    }
    const norm = Math.sqrt(Math.max(ref2, TINY));
    rel[r] = Math.sqrt(diff2) / norm;
    peak[r] = max / (norm / Math.sqrt(hidden));
  }
  return { rel, peak };
}

/** The worst row: NaN counts as infinitely far (a claim with a NaN where the checker has a number lied). */
export function worst(values: ArrayLike<number>): number {
  let m = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i]!;
    if (Number.isNaN(v)) return Infinity;
    if (v > m) m = v;
  }
  return m;
}
