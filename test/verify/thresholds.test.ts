/**
 * The thresholds against the calibration's honest extremes
 * (bench/verify-calibration.ts, docs/verification.md §3): an honest pair's
 * worst measured step is never over its threshold, and the mildest lie a
 * pair can see is.
 */
import { describe, expect, it } from 'vitest';
import { thresholdsFor, tokenDistance } from '../../src/verify/thresholds.ts';

const f32 = { format: 'f32' as const, backend: 'onnxruntime-node' };
const q4 = { format: 'q4' as const, backend: 'wasm' };

describe('thresholds', () => {
  it('never accuse an honest 4-bit last hop checked by full precision at temperature > 0 (its seeded draw may land elsewhere)', () => {
    const t = thresholdsFor(q4, f32);
    // The largest honest gap measured between 4-bit and f32 at T 0.8 was 0.723 of the mass; a gap is at most 1.
    expect(tokenDistance(t, true, { deficit: 1.62, gap: 1, logprob: -2.1 }, -2.1 + 1.84)).toBeLessThanOrEqual(1);
    // The log-probability it answered is still compared: off by more than 2 nats is a lie.
    expect(tokenDistance(t, true, { deficit: 0, gap: 0, logprob: -1 }, -3.5)).toBeGreaterThan(1);
  });

  it('hold the measured honest extremes under 1 and the mildest lies over it', () => {
    const exact = thresholdsFor(f32, { format: 'f32', backend: 'wasm' });
    expect(0.00045 / exact.rowRel).toBeLessThan(1); // largest honest f32 row
    expect(0.0044 / exact.rowRel).toBeGreaterThan(1); // smallest row of a 1 % tampered span
    expect(0.00088 / thresholdsFor(q4, q4).rowRel).toBeLessThan(1); // largest honest 4-bit pair row
    expect(0.13 / thresholdsFor(q4, f32).rowRel).toBeLessThan(1); // 4-bit against f32
    // Greedy last hop: honest f32 pairs have deficit 0 and |Δlogprob| ≤ 1e-5; the second-best liar's smallest deficit was 0.013.
    expect(tokenDistance(exact, false, { deficit: 0, gap: 0, logprob: -1 }, -1 + 1e-5)).toBeLessThan(1);
    expect(tokenDistance(exact, false, { deficit: 0.013, gap: 0, logprob: -1 }, -1)).toBeGreaterThan(1);
  });
});
