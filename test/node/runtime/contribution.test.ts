import { describe, expect, it } from 'vitest';
import { ContributionMeter } from '../../../src/node/runtime/contribution.ts';

describe('ContributionMeter', () => {
  it('adds token increments and serving time to what was stored, across a runtime restart', () => {
    let t = 10_000;
    const m = new ContributionMeter({ tokensServed: 100, servingMs: 5_000, since: 1 }, () => t);
    // The first reading is a baseline: tokens the runtime counted before it came from this session already.
    expect(m.sample(0, false)).toEqual({ tokensServed: 100, servingMs: 5_000, since: 1 });
    t += 1_000;
    m.sample(10, true);
    t += 2_000;
    expect(m.sample(25, true)).toEqual({ tokensServed: 125, servingMs: 7_000, since: 1 });
    // A new runtime: its counter starts over.
    t += 1_000;
    expect(m.sample(4, false)).toEqual({ tokensServed: 129, servingMs: 8_000, since: 1 });
    // Not serving: no time counted.
    t += 5_000;
    expect(m.sample(4, false).servingMs).toBe(8_000);
  });

  it('starts empty, remembering when the node first served', () => {
    let t = 50;
    const m = new ContributionMeter(undefined, () => t);
    expect(m.sample(0, false)).toEqual({ tokensServed: 0, servingMs: 0, since: undefined });
    t = 60;
    expect(m.sample(1, true).since).toBe(60);
    t = 90;
    expect(m.sample(3, true)).toEqual({ tokensServed: 3, servingMs: 30, since: 60 });
  });
});
