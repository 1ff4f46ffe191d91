import { describe, expect, it } from 'vitest';
import { AdaptiveK, expectedTokens } from '../../../../src/node/head/speculation/adaptive-k.ts';
import { mulberry32 } from '../../../../src/model/fixture.ts';


interface World {
  alpha: (trip: number) => number;
  baseMs: number;
  perRowMs: number;
  draftMs?: number;
}

/** Tokens per ms the policy reaches in `world` over `trips` trips (times jittered ±10%). */
function simulate(world: World, trips: number, seed = 1, policy = new AdaptiveK()): { rate: number; ks: number[] } {
  const r = mulberry32(seed);
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

  it('carried across generations, a losing draft model backs off at once and probes rarely; a winning one is found again', () => {
    // 48-token generations on a WAN, a draft model that never agrees and costs 10 ms a draft.
    const losing = { baseMs: 130, perRowMs: 3, draftMs: 10, alpha: () => 0 };
    const drafting = (carry: boolean): number[] => {
      let prior: ReturnType<AdaptiveK['carry']> | undefined;
      const perGeneration: number[] = [];
      for (let g = 0; g < 12; g++) {
        const p = new AdaptiveK(carry && prior ? { prior } : {});
        perGeneration.push(simulate(losing, 47, g + 1, p).ks.reduce((a, b) => a + b, 0));
        prior = p.carry();
      }
      return perGeneration;
    };
    const fresh = drafting(false);
    const carried = drafting(true);
    // Drafted tokens per generation: each fresh one pays its moderate start (k = 4) and a losing trip or
    // two before α̂ falls; carried, only the first does.
    expect(Math.min(...fresh)).toBeGreaterThanOrEqual(5);
    expect(carried[0]).toBe(fresh[0]);
    const later = carried.slice(2).reduce((a, b) => a + b, 0);
    expect(later).toBeGreaterThan(0); // it still probes…
    expect(later).toBeLessThanOrEqual(6); // …one token a probe, the waits doubling to 128 trips (10 generations × 47 trips)

    // The same head, its draft model now agreeing (another kind of text): drafting again within a few probes.
    const p = new AdaptiveK({ prior: (() => {
      let q = new AdaptiveK();
      for (let g = 0; g < 6; g++) {
        simulate(losing, 47, g + 1, q);
        q = new AdaptiveK({ prior: q.carry() });
      }
      return q.carry();
    })() });
    const { ks } = simulate({ ...losing, alpha: () => 0.9 }, 300, 7, p);
    expect(ks.slice(0, 8).every((k) => k === 0)).toBe(true);
    expect(ks.slice(-50).reduce((a, b) => a + b, 0) / 50).toBeGreaterThan(2);
  });

  /**
   * A head's first generation with a draft model: the prompt's step (its drafts judged, not timed), then
   * decode trips until 48 tokens; the draft's cost is measured from its first draft on, as a drafter does.
   */
  function firstGeneration(world: World & { alpha: () => number }, policy: AdaptiveK, seed: number): { rate: number; ks: number[]; drafted: number } {
    const r = mulberry32(seed);
    const ks: number[] = [];
    let tokens = 0;
    let ms = 0;
    let drafted = 0;
    for (let trip = 0; tokens < 48; trip++) {
      const k = Math.min(policy.next(), 47 - tokens);
      ks.push(k);
      let accepted = 0;
      while (accepted < k && r() < world.alpha()) accepted++;
      const tripMs = (world.baseMs + k * world.perRowMs) * (0.9 + 0.2 * r());
      tokens += accepted + 1;
      drafted += k;
      if (trip > 0) ms += tripMs + k * (world.draftMs ?? 0);
      policy.record({ drafted: k, accepted, tripMs: trip === 0 ? Number.NaN : tripMs });
      if (drafted > 0) policy.setDraftCost(world.draftMs ?? 0);
    }
    return { rate: (tokens - 1) / ms, ks, drafted };
  }

  it('a draft model new to the head probes first: a losing one costs a probe, a winning one ramps up from the first generation', () => {
    const p = new AdaptiveK({ probeFirst: true });
    // The prompt's step drafts nothing, and the drafter catches up beside it; the first decode trip probes one token.
    expect(p.next()).toBe(0);
    expect(p.probeComesNext()).toBe(true);
    p.record({ drafted: 0, accepted: 0, tripMs: Number.NaN });
    expect(p.next()).toBe(1);

    const wan = { baseMs: 80, perRowMs: 2, draftMs: 7 };
    for (const seed of [1, 2, 3, 4, 5]) {
      // Never agrees: one probe at the start and one 32 trips on (the wait doubled), ≤ 3 % of plain steps.
      const losing = firstGeneration({ ...wan, alpha: () => 0 }, new AdaptiveK({ probeFirst: true }), seed);
      expect(losing.drafted).toBeLessThanOrEqual(2);
      expect(losing.rate).toBeGreaterThan(0.97 / wan.baseMs);
      // Started at k = 4 instead, it pays two trips of four losing drafts first.
      expect(firstGeneration({ ...wan, alpha: () => 0 }, new AdaptiveK(), seed).drafted).toBeGreaterThanOrEqual(8);
      // Always agrees: the probe, then four times as many while every draft is accepted (α̂ alone would draft
      // 2 after one accepted probe), up to what a plain trip's time pays for (80 / (2 + 7) → 8).
      const winning = firstGeneration({ ...wan, alpha: () => 1 }, new AdaptiveK({ probeFirst: true }), seed);
      expect(winning.ks.slice(0, 3)).toEqual([0, 1, 4]);
      expect(winning.ks[3]).toBeGreaterThanOrEqual(5);
      expect(winning.rate).toBeGreaterThan(3.5 / wan.baseMs);
      // Against a k = 4 start (whose prompt's step yields five tokens untimed here): not much less.
      expect(winning.rate).toBeGreaterThan(0.75 * firstGeneration({ ...wan, alpha: () => 1 }, new AdaptiveK(), seed).rate);
    }
    // A prior (what earlier generations learnt) or a fixed k overrides the probe-first start.
    expect(new AdaptiveK({ probeFirst: true, fixedK: 3 }).next()).toBe(3);
    const carried = new AdaptiveK({ probeFirst: true, prior: { accepted: 6, rejected: 1, sums: { s0: 4, sx: 4, sy: 320, sxx: 4, sxy: 320 }, draftMs: 1 } });
    expect(carried.next()).toBeGreaterThan(1);
  });

  it('a carried prior is bounded: it weighs at most a few trips, and nonsense is ignored', () => {
    const p = new AdaptiveK({ prior: { accepted: 0, rejected: 1e6, sums: { s0: 1e6, sx: 0, sy: 1e8, sxx: 0, sxy: 0 }, draftMs: 5, probe: { wait: 1e9, since: 0 } } });
    expect(p.alpha).toBe(0);
    expect(p.costs().baseMs).toBeCloseTo(100, 6);
    const c = p.carry();
    expect(c.accepted + c.rejected).toBeCloseTo(8, 6);
    expect(c.probe!.wait).toBe(128);
    const q = new AdaptiveK({ prior: { accepted: Number.NaN, rejected: -1, sums: { s0: Number.NaN, sx: 0, sy: 0, sxx: 0, sxy: 0 }, draftMs: -3 } });
    expect(q.alpha).toBe(0.2);
    expect(q.next()).toBe(4); // nothing measured: the moderate start
    expect(q.stats().draftMsPerToken).toBe(0);
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
