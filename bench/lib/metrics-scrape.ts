/**
 * A service's Prometheus /metrics read back by a bench: a counter's sum over
 * the label sets asked for, a histogram, and a window of it (after less
 * before) with the bucket bound of a quantile. The text format is parsed
 * here by hand because a bench reads a handful of names and needs no client.
 */

export async function metricValue(url: string, name: string, labels: Record<string, string> = {}): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text();
  let sum = 0;
  for (const line of text.split('\n')) {
    if (!line.startsWith(name)) continue;
    const m = /^([a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$/.exec(line);
    if (!m || m[1] !== name) continue;
    const l = m[2] ?? '';
    if (Object.entries(labels).every(([k, v]) => l.includes(`${k}="${v}"`))) sum += Number(m[3]);
  }
  return sum;
}

export interface Hist {
  /** Upper bounds (s) and cumulative counts. */
  buckets: Array<[number, number]>;
  count: number;
}

export async function histogram(url: string, name: string): Promise<Hist> {
  const text = await (await fetch(`${url}/metrics`)).text().catch(() => '');
  const buckets: Array<[number, number]> = [];
  let count = 0;
  for (const line of text.split('\n')) {
    const b = new RegExp(`^${name}_bucket\\{le="([^"]+)"\\} ([0-9.e+-]+)$`).exec(line);
    if (b) buckets.push([b[1] === '+Inf' ? Infinity : Number(b[1]), Number(b[2])]);
    const c = new RegExp(`^${name}_count ([0-9.e+-]+)$`).exec(line);
    if (c) count = Number(c[1]);
  }
  return { buckets, count };
}

/** The window's histogram: each tracker's after minus before, summed. */
export function mergeHist(after: Hist[], before: Hist[]): Hist {
  const out: Hist = { buckets: (after[0]?.buckets ?? []).map(([le]) => [le, 0]), count: 0 };
  after.forEach((h, i) => {
    const b = before[i]!;
    out.count += h.count - b.count;
    h.buckets.forEach(([, v], k) => (out.buckets[k]![1] += v - (b.buckets[k]?.[1] ?? 0)));
  });
  return out;
}

/** The bucket bound under which fraction q of the observations lie (an upper bound on the quantile). */
export function quantileOfHist(h: Hist, q: number): number {
  if (h.count === 0) return NaN;
  for (const [le, v] of h.buckets) if (v >= q * h.count) return le;
  return Infinity;
}

/** The histogram's buckets with their bounds in ms (JSON has no Infinity: the last bucket's bound is null). */
export function histMs(h: Hist): Array<[number | null, number]> {
  return h.buckets.map(([le, v]) => [Number.isFinite(le) ? Math.round(le * 1e6) / 1e3 : null, v]);
}
