/**
 * A step's timeline from trace stamps (src/protocol/trace.ts) taken in
 * several processes or pages on one clock: cut at the head's `step`
 * stamps, each stamp labelled `process:stage`, the median gap between
 * consecutive stamps, and per step the time in onnxruntime, in each process
 * outside it, and between processes. bench/hop-trace.ts (Node.js processes)
 * and bench/wan-browser.ts --trace (pages) read their stamps through it.
 */
import { median, quantile } from './stats.ts';

/** One stamp: when (ms, one clock for all), which process or page (`pid`), and the stage. */
export interface Stamp {
  t: number;
  pid: number;
  stage: string;
}

export interface Gap {
  from: string;
  to: string;
  p50: number;
  p90: number;
}

export interface Analysis {
  steps: number;
  gaps: Gap[];
  grouped: Array<{ group: string; p50: number }>;
  /** Step to step: the median, and the mean (stalls show as mean > median). */
  stepMs: number;
  stepMeanMs: number;
}

/**
 * Cut at the head's `step` stamps and label each stamp `process:stage`
 * (`#n`: the n-th of that stage in that process in the step); consecutive
 * stamps of a step give its gaps, and each pair's median over the steps
 * that have it (a stamp that sometimes comes before and sometimes after
 * another, like a relay's stamps against the sender's uncork, gives two
 * pairs, each with its share of the steps).
 */
export function analyse(stamps: Stamp[], names: Map<number, string>, headPid: number): Analysis {
  const steps: Stamp[][] = [];
  let cur: Stamp[] | undefined;
  for (const s of stamps) {
    if (!names.has(s.pid)) continue;
    if (s.pid === headPid && s.stage === 'step') {
      cur = [];
      steps.push(cur);
    }
    cur?.push(s);
  }
  // The first step is the prompt, the last has no successor to close it: decode steps in between.
  const decode = steps.slice(1, -1).filter((s) => s.length > 0);
  // Per step, its stamps in time order, labelled; each consecutive pair (a → b) is one gap. Pairs seen in at
  // least half the steps, by where `a` falls in a step (median offset), with their median gap.
  const pairs = new Map<string, { from: string; to: string; gaps: number[]; at: number[] }>();
  for (const step of decode) {
    const seen = new Map<string, number>();
    const labels = step.map((s) => {
      const k = `${names.get(s.pid)}:${s.stage}`;
      const n = (seen.get(k) ?? 0) + 1;
      seen.set(k, n);
      return n === 1 ? k : `${k}#${n}`;
    });
    for (let i = 0; i + 1 < step.length; i++) {
      const key = `${labels[i]}\n${labels[i + 1]}`;
      let p = pairs.get(key);
      if (!p) pairs.set(key, (p = { from: labels[i]!, to: labels[i + 1]!, gaps: [], at: [] }));
      p.gaps.push(step[i + 1]!.t - step[i]!.t);
      p.at.push(step[i]!.t - step[0]!.t);
    }
  }
  const gaps: Gap[] = [...pairs.values()]
    .filter((p) => p.gaps.length >= decode.length / 2)
    .map((p) => ({ p, at: median(p.at) }))
    .sort((x, y) => x.at - y.at)
    .map(({ p }) => {
      const g = [...p.gaps].sort((x, y) => x - y);
      return { from: p.from, to: p.to, p50: quantile(g, 0.5), p90: quantile(g, 0.9) };
    });
  const lens = decode.slice(0, -1).map((s, k) => decode[k + 1]![0]!.t - s[0]!.t).sort((a, b) => a - b);
  // Per step, in time order: onnxruntime runs, other work inside a process, and time between processes (legs), summed.
  const groups = new Map<string, number[]>();
  for (const step of decode) {
    const sums = new Map<string, number>();
    for (let i = 0; i + 1 < step.length; i++) {
      const a = step[i]!;
      const b = step[i + 1]!;
      const pa = names.get(a.pid)!;
      const g = a.pid !== b.pid ? 'between processes (legs)' : a.stage === 'ort' && b.stage === 'ort-done' ? `${pa}: onnxruntime` : `${pa}: other`;
      sums.set(g, (sums.get(g) ?? 0) + b.t - a.t);
    }
    for (const [g, v] of sums) groups.set(g, [...(groups.get(g) ?? []), v]);
  }
  const grouped = [...groups.entries()].map(([group, vs]) => ({ group, p50: median(vs) })).sort((a, b) => a.group.localeCompare(b.group));
  return { steps: decode.length, gaps, grouped, stepMs: quantile(lens, 0.5), stepMeanMs: lens.reduce((a, b) => a + b, 0) / Math.max(1, lens.length) };
}

