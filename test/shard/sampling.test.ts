import { describe, expect, it } from 'vitest';
import fc from 'fast-check';
import { drawUniform, sampleToken } from '../../src/shard/sampling.ts';
import { MeshError } from '../../src/protocol/errors.ts';

const logits = Float32Array.from([0.1, 2.0, 1.9, -1, 0.5, 2.0, -3, 0.7]);

describe('sampleToken', () => {
  it('greedy picks the argmax, lowest id on ties, with its model logprob', () => {
    const r = sampleToken(logits, {}, 10);
    expect(r.tokenId).toBe(1);
    const lse = Math.log(Array.from(logits).reduce((s, v) => s + Math.exp(v), 0));
    expect(r.logprob).toBeCloseTo(2.0 - lse, 5);
  });

  it('is a pure function of (logits, params, seed, position)', () => {
    fc.assert(
      fc.property(fc.integer({ min: 0, max: 2 ** 40 }), fc.integer({ min: 0, max: 100_000 }), (seed, position) => {
        const p = { temperature: 0.9, topK: 5, topP: 0.9, seed };
        expect(sampleToken(logits, p, position)).toEqual(sampleToken(logits, p, position));
      }),
    );
  });

  it('top-k 1 and a tiny top-p are greedy', () => {
    for (let pos = 0; pos < 50; pos++) {
      expect(sampleToken(logits, { temperature: 1, topK: 1, seed: 3 }, pos).tokenId).toBe(1);
      expect(sampleToken(logits, { temperature: 1, topP: 1e-6, seed: 3 }, pos).tokenId).toBe(1);
    }
  });

  it('stays inside the top-k set and follows the softmax roughly', () => {
    const counts = new Map<number, number>();
    for (let pos = 0; pos < 4000; pos++) {
      const t = sampleToken(logits, { temperature: 1, topK: 3, seed: 99 }, pos).tokenId;
      counts.set(t, (counts.get(t) ?? 0) + 1);
    }
    expect([...counts.keys()].sort()).toEqual([1, 2, 5]);
    // e^2 : e^1.9 : e^2 → 0.345 : 0.312 : 0.345
    expect(counts.get(2)! / 4000).toBeGreaterThan(0.27);
    expect(counts.get(2)! / 4000).toBeLessThan(0.36);
  });

  it('draws differ across seeds and positions, and look uniform', () => {
    const xs = Array.from({ length: 10000 }, (_, i) => drawUniform(7, i));
    expect(Math.min(...xs)).toBeGreaterThanOrEqual(0);
    expect(Math.max(...xs)).toBeLessThan(1);
    expect(Math.abs(xs.reduce((a, b) => a + b, 0) / xs.length - 0.5)).toBeLessThan(0.02);
    expect(drawUniform(7, 5)).not.toBe(drawUniform(8, 5));
    expect(drawUniform(2 ** 33, 5)).not.toBe(drawUniform(0, 5));
  });

  it('rejects bad parameters with MESH_ERR_BAD_REQUEST', () => {
    for (const p of [{ temperature: -1 }, { temperature: NaN }, { topK: 1.5 }, { topP: 0 }, { topP: 1.5 }, { seed: -1 }]) {
      expect(() => sampleToken(logits, p, 0)).toThrow(MeshError);
    }
  });
});
