/**
 * Pearson's chi-square tests for the sampling tests: goodness of fit of
 * observed counts to known probabilities, and homogeneity of two samples.
 * Cells whose expected count is under 5 are pooled into one (the usual
 * validity rule). The p-value is the regularized upper incomplete gamma
 * function Q(df/2, x/2) (series below a + 1, continued fraction above:
 * Numerical Recipes §6.2), accurate to ~1e-12 here.
 */

function logGamma(x: number): number {
  // Lanczos, g = 7, n = 9.
  const c = [0.99999999999980993, 676.5203681218851, -1259.1392167224028, 771.32342877765313, -176.61502916214059, 12.507343278686905, -0.13857109526572012, 9.9843695780195716e-6, 1.5056327351493116e-7];
  if (x < 0.5) return Math.log(Math.PI / Math.sin(Math.PI * x)) - logGamma(1 - x);
  x -= 1;
  let a = c[0]!;
  const t = x + 7.5;
  for (let i = 1; i < 9; i++) a += c[i]! / (x + i);
  return 0.5 * Math.log(2 * Math.PI) + (x + 0.5) * Math.log(t) - t + Math.log(a);
}

/** Q(a, x) = Γ(a, x) / Γ(a). */
export function gammaQ(a: number, x: number): number {
  if (x <= 0) return 1;
  const lg = logGamma(a);
  if (x < a + 1) {
    let sum = 1 / a;
    let term = sum;
    for (let n = 1; n < 10_000; n++) {
      term *= x / (a + n);
      sum += term;
      if (Math.abs(term) < Math.abs(sum) * 1e-15) break;
    }
    return 1 - sum * Math.exp(-x + a * Math.log(x) - lg);
  }
  const tiny = 1e-300;
  let b = x + 1 - a;
  let c = 1 / tiny;
  let d = 1 / b;
  let h = d;
  for (let i = 1; i < 10_000; i++) {
    const an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (Math.abs(d) < tiny) d = tiny;
    c = b + an / c;
    if (Math.abs(c) < tiny) c = tiny;
    d = 1 / d;
    const del = d * c;
    h *= del;
    if (Math.abs(del - 1) < 1e-15) break;
  }
  return Math.exp(-x + a * Math.log(x) - lg) * h;
}

export interface ChiSquare {
  statistic: number;
  df: number;
  pValue: number;
  cells: number;
}

/** Goodness of fit: `counts[i]` observed against probability `probs[i]` (summing to 1). */
export function chiSquareFit(counts: readonly number[], probs: readonly number[]): ChiSquare {
  const n = counts.reduce((a, b) => a + b, 0);
  let stat = 0;
  let cells = 0;
  let poolObs = 0;
  let poolExp = 0;
  counts.forEach((o, i) => {
    const e = probs[i]! * n;
    if (e < 5) {
      poolObs += o;
      poolExp += e;
      return;
    }
    stat += (o - e) ** 2 / e;
    cells++;
  });
  if (poolExp > 0) {
    // A pooled cell whose expectation is ~0 but that was observed is itself evidence: keep it, floored.
    const e = Math.max(poolExp, 1e-9);
    stat += (poolObs - e) ** 2 / e;
    cells++;
  }
  const df = cells - 1;
  return { statistic: stat, df, pValue: gammaQ(df / 2, stat / 2), cells };
}

/** Homogeneity of two samples over the same categories (a 2 × K contingency table). */
export function chiSquareTwoSample(a: readonly number[], b: readonly number[]): ChiSquare {
  const na = a.reduce((x, y) => x + y, 0);
  const nb = b.reduce((x, y) => x + y, 0);
  const n = na + nb;
  // Pool categories whose smaller expected count is under 5.
  const rows: Array<[number, number]> = [];
  let pool: [number, number] = [0, 0];
  a.forEach((x, i) => {
    const y = b[i]!;
    const tot = x + y;
    if (Math.min((tot * na) / n, (tot * nb) / n) < 5) {
      pool = [pool[0] + x, pool[1] + y];
      return;
    }
    rows.push([x, y]);
  });
  if (pool[0] + pool[1] > 0) rows.push(pool);
  let stat = 0;
  for (const [x, y] of rows) {
    const tot = x + y;
    const ea = (tot * na) / n;
    const eb = (tot * nb) / n;
    stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb;
  }
  const df = rows.length - 1;
  return { statistic: stat, df, pValue: gammaQ(df / 2, stat / 2), cells: rows.length };
}
