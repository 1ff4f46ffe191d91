import { describe, expect, it } from 'vitest';
import fc from 'fast-check';
import { NORMALIZER_REL_TOL, sampleFromCandidates, type Candidates } from '../../src/shard/candidate-sampling.ts';
import { sampleToken, type SamplingParams } from '../../src/shard/sampling.ts';

/** Seeded xorshift, so a failure replays. */
function rng(seed: number): () => number {
  let s = seed >>> 0 || 1;
  return () => {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    return (s >>> 0) / 4294967296;
  };
}

/** Logits like a trained head's: a few strong tokens over a wide tail, f32. `step` > 0 rounds them (ties). */
function logitsOf(vocab: number, seed: number, spread = 4, step = 0): Float32Array {
  const r = rng(seed);
  const out = new Float32Array(vocab);
  for (let i = 0; i < vocab; i++) {
    const g = Math.sqrt(-2 * Math.log(r() + 1e-12)) * Math.cos(2 * Math.PI * r());
    let v = g * spread + (r() < 0.0005 ? 10 + 6 * r() : 0);
    if (step > 0) v = Math.round(v / step) * step;
    out[i] = v;
  }
  return out;
}

/**
 * What the sampler graph sends back, built on the CPU: the K largest (ties broken toward the
 * HIGHER id on purpose, unlike sampling.ts, so nothing may rely on the device's tie order), and
 * the normalizers rounded to f32 and off by `relErr`.
 */
function candidatesOf(logits: Float32Array, K: number, temperature: number, relErr = 0): Candidates {
  const order = Array.from({ length: logits.length }, (_, i) => i).sort((a, b) => logits[b]! - logits[a]! || b - a).slice(0, K);
  const max = logits[order[0]!]!;
  let sT = 0;
  let s1 = 0;
  for (const l of logits) {
    sT += Math.exp((l - max) / temperature);
    s1 += Math.exp(l - max);
  }
  return {
    values: Float32Array.from(order.map((i) => logits[i]!)),
    ids: BigInt64Array.from(order.map((i) => BigInt(i))),
    logSumExpT: Math.fround(Math.log(sT * (1 + relErr))),
    logSumExp: Math.fround(Math.log(s1)),
    vocabSize: logits.length,
  };
}

const PARAMS: SamplingParams[] = [
  { temperature: 1 },
  { temperature: 0.7, topP: 0.9 },
  { temperature: 0.6, topK: 20, topP: 0.95 },
  { temperature: 1.3, topK: 50 },
  { temperature: 0.3 },
  { temperature: 2, topP: 0.5 },
  { temperature: 1, topK: 300 }, // more than the candidates
];

describe('sampleFromCandidates', () => {
  it('picks exactly what sampleToken picks over the full logits, or falls back', () => {
    const V = 8_000;
    let sampled = 0;
    let fellBack = 0;
    for (let s = 0; s < 6; s++) {
      const logits = logitsOf(V, 11 + s, 2 + s);
      for (const p of PARAMS) {
        const c = candidatesOf(logits, 256, p.temperature!, (s % 3 - 1) * 4e-4);
        for (let pos = 0; pos < 20; pos++) {
          const params = { ...p, seed: 1000 * s + 7 };
          const got = sampleFromCandidates(c, params, pos);
          const want = sampleToken(logits, params, pos);
          if ('fallback' in got) {
            fellBack++;
            continue;
          }
          sampled++;
          expect(got.sampled.tokenId, JSON.stringify({ s, p, pos })).toBe(want.tokenId);
          expect(Math.abs(got.sampled.logprob - want.logprob)).toBeLessThan(1e-5);
        }
      }
    }
    // Most steps decide on the candidates alone; top_k 300 > 256 always falls back.
    expect(sampled).toBeGreaterThan(fellBack);
  }, 600_000);

  it('a top_k the candidates hold never falls back, whatever the normalizer says', () => {
    const logits = logitsOf(5000, 3, 1);
    const c = candidatesOf(logits, 64, 1, 0.5); // a normalizer 50% off is not used with a top-k cut
    for (let pos = 0; pos < 200; pos++) {
      const params = { temperature: 0.8, topK: 40, topP: 0.9, seed: 5 };
      const got = sampleFromCandidates(c, params, pos);
      if (!('sampled' in got)) throw new Error(got.fallback);
      expect(got.sampled.tokenId).toBe(sampleToken(logits, params, pos).tokenId);
    }
  }, 600_000);

  it('never picks a wrong token with a normalizer anywhere inside the tolerance (property)', () => {
    let decided = 0;
    fc.assert(
      fc.property(
        fc.integer({ min: 0, max: 10_000 }),
        fc.constantFrom(0.05, 0.25, 1, 1.5, 3),
        fc.constantFrom(0, 5, 31, 32, 33, 1000),
        fc.constantFrom(1, 0.999, 0.9, 0.5, 0.01),
        fc.double({ min: -NORMALIZER_REL_TOL * 0.99, max: NORMALIZER_REL_TOL * 0.99, noNaN: true }),
        fc.constantFrom(0, 0.25),
        (seed, temperature, topK, topP, relErr, step) => {
          const logits = logitsOf(600, seed, 1 + (seed % 5), step);
          const params = { temperature, topK, topP, seed };
          const c = candidatesOf(logits, 32, temperature, relErr);
          for (let pos = 0; pos < 8; pos++) {
            const got = sampleFromCandidates(c, params, pos);
            if (!('sampled' in got)) continue;
            decided++;
            expect(got.sampled.tokenId).toBe(sampleToken(logits, params, pos).tokenId);
          }
        },
      ),
      { numRuns: 300 },
    );
    expect(decided).toBeGreaterThan(300); // of 2400 draws: the property is not vacuous
  }, 600_000);

  it('ties at the smallest candidate: the tied tokens are not trusted, those above are', () => {
    // 10 distinct values, each on 100 ids: candidates end inside a tie.
    const logits = Float32Array.from({ length: 1000 }, (_, i) => 9 - (i % 10));
    const c = candidatesOf(logits, 150, 1);
    const tied = sampleFromCandidates(c, { temperature: 1, topK: 120, seed: 1 }, 0);
    expect(tied).toEqual({ fallback: expect.stringContaining('top_k 120') });
    for (let pos = 0; pos < 50; pos++) {
      const got = sampleFromCandidates(c, { temperature: 1, topK: 100, seed: 1 }, pos);
      if (!('sampled' in got)) throw new Error(got.fallback);
      expect(got.sampled.tokenId).toBe(sampleToken(logits, { temperature: 1, topK: 100, seed: 1 }, pos).tokenId);
    }
  });

  it('the whole vocabulary as candidates is exact without the normalizer', () => {
    const logits = logitsOf(300, 9, 0.5);
    const c = { ...candidatesOf(logits, 300, 1), logSumExpT: 123 };
    for (let pos = 0; pos < 100; pos++) {
      const got = sampleFromCandidates(c, { temperature: 1, seed: 2 }, pos);
      if (!('sampled' in got)) throw new Error(got.fallback);
      expect(got.sampled.tokenId).toBe(sampleToken(logits, { temperature: 1, seed: 2 }, pos).tokenId);
    }
  });

  it('falls back, never guesses, on NaN, duplicate or foreign ids and a normalizer below the candidates', () => {
    const logits = logitsOf(1000, 4);
    const good = candidatesOf(logits, 16, 1);
    const p = { temperature: 1, seed: 1 };
    expect(sampleFromCandidates({ ...good, values: Float32Array.from(good.values, (v, i) => (i === 3 ? NaN : v)) }, p, 0)).toHaveProperty('fallback');
    expect(sampleFromCandidates({ ...good, ids: Array.from(good.ids, () => 5) }, p, 0)).toHaveProperty('fallback');
    expect(sampleFromCandidates({ ...good, ids: Array.from(good.ids, (id, i) => (i === 0 ? 1000 : Number(id))) }, p, 0)).toHaveProperty('fallback');
    expect(sampleFromCandidates({ ...good, logSumExpT: -5 }, p, 0)).toHaveProperty('fallback');
    expect(sampleFromCandidates({ ...good, logSumExpT: NaN }, p, 0)).toHaveProperty('fallback');
    expect(() => sampleFromCandidates(good, { temperature: 0 }, 0)).toThrow(RangeError);
  });
});
