/**
 * The donor's duty cycle (src/node/runtime/duty-cycle.ts) on a fake clock:
 * the share of wall time the guarded work is busy stays at the cap, for
 * one-at-a-time steps and for overlapping ones, and a lifted cap releases
 * waiting work at once.
 */
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { DutyCycle } from '../../../src/node/runtime/duty-cycle.ts';

beforeEach(() => {
  vi.useFakeTimers();
});
afterEach(() => {
  vi.useRealTimers();
});

const now = () => Date.now();

/** Work that keeps the "device" busy `ms`, recording its busy interval. */
function work(ms: number, busy: Array<[number, number]>): () => Promise<void> {
  return () => {
    const t0 = now();
    return new Promise<void>((r) =>
      setTimeout(() => {
        busy.push([t0, now()]);
        r();
      }, ms),
    );
  };
}

/** Wall time covered by at least one interval. */
function union(intervals: Array<[number, number]>): number {
  const s = [...intervals].sort((a, b) => a[0] - b[0]);
  let total = 0;
  let end = -Infinity;
  for (const [a, b] of s) {
    if (b <= end) continue;
    total += b - Math.max(a, end);
    end = b;
  }
  return total;
}

describe('DutyCycle', () => {
  it('at 100 % lets work through without waiting', async () => {
    const d = new DutyCycle({ now });
    const busy: Array<[number, number]> = [];
    const t0 = now();
    for (let i = 0; i < 5; i++) {
      const p = d.run(work(10, busy));
      await vi.advanceTimersByTimeAsync(10);
      await p;
    }
    expect(now() - t0).toBe(50);
    expect(d.waitedMs).toBe(0);
  });

  it('at 50 % one-at-a-time steps take twice the wall time (busy half of it)', async () => {
    const d = new DutyCycle({ now });
    d.set(0.5);
    const busy: Array<[number, number]> = [];
    const t0 = now();
    const all = (async () => {
      for (let i = 0; i < 20; i++) await d.run(work(10, busy));
    })();
    await vi.advanceTimersByTimeAsync(1000);
    await all;
    const last = busy[busy.length - 1]![1];
    // 20 steps of 10 ms with a 10 ms rest between each: 390 ms of wall time, 200 of them busy.
    expect(last - t0).toBe(390);
    expect(union(busy) / (last - t0)).toBeCloseTo(200 / 390, 5);
  });

  it('at 25 % overlapping requests cannot keep the device busy past the cap', async () => {
    const d = new DutyCycle({ now });
    d.set(0.25);
    const busy: Array<[number, number]> = [];
    const t0 = now();
    const runs: Array<Promise<void>> = [];
    // A request every 3 ms, each 8 ms of work: left alone they would overlap and keep it busy all the time.
    for (let i = 0; i < 100; i++) {
      runs.push(d.run(work(8, busy)));
      await vi.advanceTimersByTimeAsync(3);
    }
    await vi.advanceTimersByTimeAsync(5000);
    await Promise.all(runs);
    const span = Math.max(...busy.map((b) => b[1])) - t0;
    const share = union(busy) / span;
    expect(share).toBeLessThanOrEqual(0.25 + 0.02);
    expect(share).toBeGreaterThan(0.2);
    // Whoever waited at the door went through together with the others waiting (a batch), not one by one.
    const starts = new Set(busy.map((b) => b[0]));
    expect(starts.size).toBeLessThan(busy.length / 2);
  });

  it('lifting the cap releases waiting work at once; bad fractions are refused', async () => {
    const d = new DutyCycle({ now });
    d.set(0.1);
    const busy: Array<[number, number]> = [];
    const first = d.run(work(100, busy));
    await vi.advanceTimersByTimeAsync(100);
    await first;
    // Owed: 900 ms of rest.
    let started = false;
    const second = d.run(() => {
      started = true;
      return Promise.resolve();
    });
    await vi.advanceTimersByTimeAsync(10);
    expect(started).toBe(false);
    d.set(1);
    await vi.advanceTimersByTimeAsync(0);
    expect(started).toBe(true);
    await second;
    for (const bad of [0, 0.01, 1.5, Number.NaN, -1]) expect(() => d.set(bad)).toThrow(RangeError);
  });

  it('a failing piece of work still counts as busy and does not jam the door', async () => {
    const d = new DutyCycle({ now });
    d.set(0.5);
    const failing = d.run(
      () =>
        new Promise<void>((_, reject) =>
          setTimeout(() => reject(new Error('boom')), 20),
        ),
    );
    const caught = failing.catch((e: Error) => e.message);
    await vi.advanceTimersByTimeAsync(20);
    expect(await caught).toBe('boom');
    const t1 = now();
    let at = 0;
    const next = d.run(async () => {
      at = now();
    });
    await vi.advanceTimersByTimeAsync(50);
    await next;
    expect(at - t1).toBe(20);
  });
});
