/**
 * Which way a device samples at temperature > 0: from the sampler graph's
 * candidates (~3 KiB down, but onnxruntime 1.30's WebGPU TopK is a full
 * bitonic sort of the row, ~155 programs for a 128k vocabulary) or over the
 * downloaded logits (one ~0.5 MiB readback). Both give sampling.ts's token,
 * so the choice is speed alone, and which wins depends on the GPU's
 * per-program cost against its readback cost: measured, not guessed. The
 * first sampled steps alternate until each way has PROBE_STEPS timings;
 * then the faster median serves, and the slower is tried again every
 * REPROBE_EVERY sampled steps in case the load changed.
 */

/** `adaptive`: the faster way, as measured; `candidates`: always the sampler graph (tests, benches). */
export type SamplerChoice = 'adaptive' | 'candidates';
export type SamplerPath = 'candidates' | 'logits';

const PROBE_STEPS = 3;
const REPROBE_EVERY = 64;
/** Timings kept per way (the median of these decides). */
const WINDOW = 8;

export interface SamplerPathStats {
  /** What serves now: `probing` while either way has fewer than PROBE_STEPS timings. */
  chosen: SamplerPath | 'probing';
  /** Median ms of a sampled step's token pick each way (null before it was timed). */
  candidatesMs: number | null;
  logitsMs: number | null;
}

function median(xs: readonly number[]): number | null {
  if (xs.length === 0) return null;
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2;
}

export class SamplerPathChooser {
  private readonly times: Record<SamplerPath, number[]> = { candidates: [], logits: [] };
  private steps = 0;

  constructor(private readonly mode: SamplerChoice = 'adaptive') {}

  /** The way the next sampled step should take. */
  next(): SamplerPath {
    if (this.mode === 'candidates') return 'candidates';
    const c = this.times.candidates.length;
    const l = this.times.logits.length;
    if (c < PROBE_STEPS || l < PROBE_STEPS) return c <= l ? 'candidates' : 'logits';
    const best = this.best();
    const other: SamplerPath = best === 'candidates' ? 'logits' : 'candidates';
    return this.steps % REPROBE_EVERY === REPROBE_EVERY - 1 ? other : best;
  }

  /** How long a sampled step's pick took the way it went (a candidates step that fell back counts its download too). */
  record(path: SamplerPath, ms: number): void {
    this.steps++;
    const t = this.times[path];
    t.push(ms);
    if (t.length > WINDOW) t.shift();
  }

  stats(): SamplerPathStats {
    const probing = this.mode === 'adaptive' && (this.times.candidates.length < PROBE_STEPS || this.times.logits.length < PROBE_STEPS);
    return { chosen: this.mode === 'candidates' ? 'candidates' : probing ? 'probing' : this.best(), candidatesMs: median(this.times.candidates), logitsMs: median(this.times.logits) };
  }

  private best(): SamplerPath {
    return median(this.times.candidates)! <= median(this.times.logits)! ? 'candidates' : 'logits';
  }
}
