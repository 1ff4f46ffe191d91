import { describe, expect, it } from 'vitest';
import { SamplerPathChooser } from '../../src/shard/sampler-choice.ts';

/** Drive the chooser for `n` sampled steps where each way costs what `cost` says; returns the ways taken. */
function drive(c: SamplerPathChooser, n: number, cost: (path: 'candidates' | 'logits', step: number) => number): string[] {
  const taken: string[] = [];
  for (let i = 0; i < n; i++) {
    const p = c.next();
    taken.push(p);
    c.record(p, cost(p, i));
  }
  return taken;
}

describe('SamplerPathChooser', () => {
  it('alternates while probing, then serves the faster way, trying the other once every 64 steps', () => {
    const c = new SamplerPathChooser();
    expect(c.stats().chosen).toBe('probing');
    const taken = drive(c, 200, (p) => (p === 'candidates' ? 30 : 2)); // a TopK sort of 155 programs vs one readback
    expect(taken.slice(0, 6)).toEqual(['candidates', 'logits', 'candidates', 'logits', 'candidates', 'logits']);
    const after = taken.slice(6);
    expect(after.filter((p) => p === 'candidates').length).toBeGreaterThanOrEqual(2);
    expect(after.filter((p) => p === 'candidates').length).toBeLessThanOrEqual(4);
    expect(c.stats()).toEqual({ chosen: 'logits', candidatesMs: 30, logitsMs: 2 });
  });

  it('keeps the candidates when they are faster (the ≤ 64 KiB path)', () => {
    const c = new SamplerPathChooser();
    const taken = drive(c, 100, (p) => (p === 'candidates' ? 1 : 5));
    expect(taken.slice(6).filter((p) => p === 'logits').length).toBeLessThanOrEqual(2);
    expect(c.stats().chosen).toBe('candidates');
  });

  it('follows a change: the way that became slower loses at its next timings', () => {
    const c = new SamplerPathChooser();
    drive(c, 20, (p) => (p === 'candidates' ? 1 : 5));
    expect(c.stats().chosen).toBe('candidates');
    // The candidates get slow (say the GPU is shared now): within a window of steps the logits win.
    drive(c, 20, (p) => (p === 'candidates' ? 50 : 5));
    expect(c.stats().chosen).toBe('logits');
  });

  it("'candidates' never probes", () => {
    const c = new SamplerPathChooser('candidates');
    expect(drive(c, 10, () => 1)).toEqual(Array(10).fill('candidates'));
    expect(c.stats().chosen).toBe('candidates');
  });
});
