import { describe, expect, it } from 'vitest';
import { AdaptiveK, expectedTokens } from '../../../../src/node/head/speculation/adaptive-k.ts';

/** A seeded uniform (mulberry32). */
function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

interface World {
  alpha: (trip: number) => number;
  baseMs: number;
  perRowMs: number;
  draftMs?: number;
}

/** Tokens per ms the policy reaches in `world` over `trips` trips (times jittered ±10%). */
function simulate(world: World, trips: number, seed = 1, policy = new AdaptiveK()): { rate: number; ks: number[] } {
  const r = rng(seed);
  policy.setDraftCost(world.draftMs ?? 0);
  let tokens = 0;
  let ms = 0;
  const ks: number[] = [];
  for (let t = 0; t < trips; t++) {
    const k = policy.next();
    ks.push(k);
    let accepted = 0;
    while (accepted < k && r() < world.alpha(t)) accepted++;
    const tripMs = (world.baseMs + k * world.perRowMs) * (0.9 + 0.2 * r());
    tokens += accepted + 1;
    ms += tripMs + k * (world.draftMs ?? 0);
    policy.record({ drafted: k, accepted, tripMs });
  }
  return { rate: tokens / ms, ks };
}

/** The best rate any fixed k reaches in a world of constant α. */
function bestFixed(alpha: number, w: World): number {
  let best = 1 / w.baseMs;
  for (let k = 1; k <= 16; k++) best = Math.max(best, expectedTokens(alpha, k) / (w.baseMs + k * (w.perRowMs + (w.draftMs ?? 0))));
  return best;
}

describe('expectedTokens', () => {
  it('is (1 − α^(k+1)) / (1 − α), k + 1 at α = 1, 1 at k = 0', () => {
    expect(expectedTokens(0.5, 3)).toBeCloseTo(1.875, 12);
    expect(expectedTokens(1, 4)).toBe(5);
    expect(expectedTokens(0.7, 0)).toBe(1);
  });
});

describe('AdaptiveK', () => {
  const wan = { baseMs: 62, perRowMs: 0.8 };
  it('a good drafter on a WAN: close to the best fixed k', () => {
    for (const alpha of [0.95, 0.8, 0.6]) {
      const w = { ...wan, alpha: () => alpha };
      const { rate, ks } = simulate(w, 1500);
      expect(rate).toBeGreaterThan(0.9 * bestFixed(alpha, w));
      expect(Math.max(...ks.slice(-100))).toBeGreaterThan(2);
    }
  });

  it('a useless drafter costs at most 3% against plain steps', () => {
    for (const w of [
      { baseMs: 62, perRowMs: 2, alpha: () => 0.02 },
      { baseMs: 10, perRowMs: 9, alpha: () => 0.3 }, // compute-bound: each row costs almost a step
      { baseMs: 62, perRowMs: 0.8, draftMs: 20, alpha: () => 0.3 }, // drafting dearer than it saves
    ]) {
      for (const seed of [1, 2, 3]) expect(simulate(w, 1500, seed).rate).toBeGreaterThan(0.97 / w.baseMs);
    }
  });

  it('follows a change of text: from a copied passage to free writing', () => {
    const w = { ...wan, alpha: (t: number) => (t < 400 ? 0.95 : 0.02) };
    const { ks } = simulate(w, 1200);
    expect(ks.slice(300, 400).reduce((a, b) => a + b, 0) / 100).toBeGreaterThan(4);
    // Afterwards mostly plain steps, with a probe now and then.
    const late = ks.slice(800);
    expect(late.filter((k) => k === 0).length / late.length).toBeGreaterThan(0.85);
    expect(late.some((k) => k > 0)).toBe(true);
  });

  it('turns itself off while a hop reports full batches', () => {
    const p = new AdaptiveK({ fullHoldTrips: 5 });
    for (let i = 0; i < 20; i++) p.record({ drafted: p.next(), accepted: 3, tripMs: 60 });
    expect(p.next()).toBeGreaterThan(0);
    p.batchFull();
    for (let i = 0; i < 5; i++) {
      expect(p.next()).toBe(0);
      p.record({ drafted: 0, accepted: 0, tripMs: 60 });
    }
    expect(p.next()).toBeGreaterThan(0);
  });

  it('a fixed k stays fixed; bad options are refused', () => {
    const p = new AdaptiveK({ fixedK: 4 });
    for (let i = 0; i < 10; i++) {
      expect(p.next()).toBe(4);
      p.record({ drafted: 4, accepted: 0, tripMs: 60 });
    }
    expect(() => new AdaptiveK({ maxK: 17 })).toThrow(RangeError);
    expect(() => new AdaptiveK({ fixedK: -1 })).toThrow(RangeError);
  });

  it('measures the per-row cost once rows vary', () => {
    const p = new AdaptiveK();
    for (let i = 0; i < 200; i++) {
      const k = i % 5;
      p.record({ drafted: k, accepted: 0, tripMs: 50 + 4 * k });
    }
    const c = p.costs();
    expect(c.baseMs).toBeCloseTo(50, 0);
    expect(c.perRowMs).toBeCloseTo(4, 0);
  });
});
