import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { PingSweep, type Pingable } from '../../src/relay/ping-sweep.ts';

class FakeSocket implements Pingable {
  alive = true;
  isOpen = true;
  pings: number[] = [];
  terminated = false;
  answers = true;
  readonly ws = {
    ping: () => {
      this.pings.push(Date.now());
      if (this.answers) this.alive = true; // the pong, at once
    },
    terminate: () => {
      this.terminated = true;
    },
  };
}

describe('PingSweep', () => {
  beforeEach(() => vi.useFakeTimers({ now: 0 }));
  afterEach(() => vi.useRealTimers());

  it('pings each socket once per interval, spread over it, and terminates one that did not answer', () => {
    const sweep = new PingSweep<FakeSocket>(15_000);
    const sockets = Array.from({ length: 300 }, () => new FakeSocket());
    for (const s of sockets) sweep.add(s);
    const silent = sockets[7]!;
    silent.answers = false;
    const gone = sockets[8]!;
    sweep.delete(gone);

    vi.advanceTimersByTime(15_000);
    for (const s of sockets) expect(s.pings.length, 'one ping per interval').toBe(s === gone ? 0 : 1);
    // Spread: the 299 pings fell in 15 ticks a second apart, at most 20 in any one (one loop over all is what stalled).
    const perTick = new Map<number, number>();
    for (const s of sockets) for (const t of s.pings) perTick.set(t, (perTick.get(t) ?? 0) + 1);
    expect(perTick.size).toBe(15);
    expect(Math.max(...perTick.values())).toBeLessThanOrEqual(20);

    vi.advanceTimersByTime(15_000);
    expect(silent.terminated, 'no pong for a whole interval').toBe(true);
    expect(sockets.filter((s) => s.terminated)).toEqual([silent]);
    expect(sockets[0]!.pings.length).toBe(2);
    sweep.stop();
    vi.advanceTimersByTime(60_000);
    expect(sockets[0]!.pings.length, 'stopped').toBe(2);
  });

  it('a short interval (tests) keeps ticks at least 10 ms apart', () => {
    const sweep = new PingSweep<FakeSocket>(30);
    const s = new FakeSocket();
    sweep.add(s);
    vi.advanceTimersByTime(30);
    expect(s.pings.length).toBe(1);
    sweep.stop();
  });
});
