/**
 * Draining (src/node/runtime/drain.ts) on a fake clock: sessions in flight
 * go on, new ones are refused, the grace ends everything, "done" once the
 * work in flight is over, and stopping the last reason serves again.
 */
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { DrainGate } from '../../../src/node/runtime/drain.ts';

beforeEach(() => {
  vi.useFakeTimers();
});
afterEach(() => {
  vi.useRealTimers();
});

describe('DrainGate', () => {
  it('serving: admits everything and is not draining', () => {
    const g = new DrainGate();
    expect(g.draining).toBe(false);
    expect(g.admitsForward(false)).toBe(true);
    expect(g.admitsForward(true)).toBe(true);
    expect(g.admitsGenerate()).toBe(true);
    expect(g.status()).toEqual({ draining: false, reasons: [], since: undefined, graceLeftMs: 0, done: false });
  });

  it('draining: held sessions go on until the grace ends, new ones and generations are refused', async () => {
    let changes = 0;
    const g = new DrainGate({ graceMs: 10_000, idleDoneMs: 2_000, onChange: () => changes++ });
    g.start('donor');
    expect(changes).toBe(1);
    expect(g.admitsForward(true)).toBe(true);
    expect(g.admitsForward(false)).toBe(false);
    expect(g.admitsGenerate()).toBe(false);
    expect(g.status().graceLeftMs).toBe(10_000);
    // A chat in flight keeps stepping: not done.
    for (let i = 0; i < 8; i++) {
      await g.run(async () => undefined);
      await vi.advanceTimersByTimeAsync(1_000);
    }
    expect(g.status().done).toBe(false);
    expect(g.status().graceLeftMs).toBe(2_000);
    await vi.advanceTimersByTimeAsync(2_000);
    // The grace is over: even held sessions are refused, and it counts as done.
    expect(g.admitsForward(true)).toBe(false);
    expect(g.status()).toMatchObject({ draining: true, done: true, graceLeftMs: 0 });
  });

  it('is done early once nothing ran for idleDoneMs, and tells the runtime once', async () => {
    let changes = 0;
    const g = new DrainGate({ graceMs: 30_000, idleDoneMs: 3_000, onChange: () => changes++ });
    await g.run(async () => undefined);
    g.start('battery');
    expect(changes).toBe(1);
    await vi.advanceTimersByTimeAsync(2_000);
    expect(g.status().done).toBe(false);
    await vi.advanceTimersByTimeAsync(1_500);
    expect(g.status().done).toBe(true);
    expect(changes).toBe(2);
    expect(g.status().graceLeftMs).toBe(26_500);
  });

  it('a generation this head runs keeps the drain open and is aborted when the grace ends', async () => {
    const g = new DrainGate({ graceMs: 5_000, idleDoneMs: 1_000 });
    const client = new AbortController();
    const gen = g.generation(client.signal);
    g.start('donor');
    await vi.advanceTimersByTimeAsync(3_000);
    expect(g.status().done).toBe(false);
    expect(gen.signal.aborted).toBe(false);
    await vi.advanceTimersByTimeAsync(2_000);
    expect(gen.signal.aborted).toBe(true);
    expect(String((gen.signal.reason as Error).message)).toMatch(/grace/);
    gen.end();
    // The client's own cancel still reaches a generation that runs.
    g.stop('donor');
    const other = g.generation(client.signal);
    client.abort(new Error('client gone'));
    expect(other.signal.aborted).toBe(true);
    other.end();
  });

  it('several reasons: serving again only when the last one stops, with a fresh grace next time', async () => {
    let changes = 0;
    const g = new DrainGate({ graceMs: 4_000, onChange: () => changes++ });
    g.start('donor');
    g.start('battery');
    g.start('battery');
    expect(g.status().reasons.sort()).toEqual(['battery', 'donor']);
    await vi.advanceTimersByTimeAsync(1_000);
    g.stop('donor');
    expect(g.draining).toBe(true);
    expect(g.status().graceLeftMs).toBe(3_000);
    g.stop('battery');
    g.stop('battery');
    expect(g.draining).toBe(false);
    expect(g.admitsForward(false)).toBe(true);
    expect(changes).toBe(4);
    await vi.advanceTimersByTimeAsync(10_000);
    g.start('frozen');
    expect(g.status().graceLeftMs).toBe(4_000);
    expect(g.admitsForward(true)).toBe(true);
    g.close();
  });
});
