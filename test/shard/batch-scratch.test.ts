/**
 * BatchScratch (src/shard/batch-scratch.ts): the input buffers a batching
 * executor keeps between steps. The executors' use of it is checked end to
 * end by test/shard/batch.test.ts (plain) and test/shard/fused-batch.test.ts
 * (fused, CPU): batches that grow and shrink still equal each session alone.
 */
import { describe, expect, it } from 'vitest';
import { BatchScratch } from '../../src/shard/batch-scratch.ts';

describe('BatchScratch', () => {
  it('hands back the same memory while it fits, grows past it, and lets go of a peak', () => {
    const s = new BatchScratch();
    const a = s.take('k0', 1000, false);
    expect(a).toBeInstanceOf(Float32Array);
    expect(a.length).toBe(1000);
    const b = s.take('k0', 1200, false);
    expect(b.buffer).toBe(a.buffer);
    expect(b.length).toBe(1200);
    const c = s.take('k0', 100_000, false);
    expect(c.buffer).not.toBe(a.buffer);
    expect(c.length).toBe(100_000);
    expect(s.take('k0', 90_000, false).buffer).toBe(c.buffer);
    // Under a quarter of the capacity: a smaller buffer replaces the peak's.
    expect(s.take('k0', 1000, false).buffer).not.toBe(c.buffer);
    expect(s.heldElements).toBeLessThan(10_000);
    // A key holds one dtype: asking for f16 gives 16-bit storage.
    expect(s.take('k0', 1000, true)).toBeInstanceOf(Uint16Array);
    expect(s.take('v0', 10, false).buffer).not.toBe(s.take('k0', 10, true).buffer);
    s.clear();
    expect(s.heldElements).toBe(0);
  });

  it('drops buffers no step asked for within the idle time, and keeps the ones in use', () => {
    let t = 0;
    const s = new BatchScratch(1000, () => t);
    s.take('k0', 5000, false);
    s.take('v0', 5000, false);
    t = 600;
    s.take('k0', 5000, false);
    t = 1000;
    expect(s.sweep()).toBe(1); // v0: unused for 1000 ms
    expect(s.heldElements).toBeGreaterThanOrEqual(5000);
    expect(s.heldElements).toBeLessThan(10_000);
    t = 1600;
    expect(s.sweep()).toBe(1);
    expect(s.heldElements).toBe(0);
    s.clear();
  });
});
