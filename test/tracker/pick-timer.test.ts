import { describe, expect, it } from 'vitest';
import { createTrackerMetrics } from '../../src/tracker/metrics.ts';

/** Sum and count of one histogram, read off the text Prometheus scrapes. */
async function sumOf(m: ReturnType<typeof createTrackerMetrics>, name: string): Promise<{ sum: number; count: number }> {
  const text = await m.registry.getSingleMetricAsString(name);
  const read = (s: string) => Number(new RegExp(`^${name}_${s} (\\S+)$`, 'm').exec(text)![1]);
  return { sum: read('sum'), count: read('count') };
}

describe('route pick timer', () => {
  it('tells a pick that waits (no CPU) from one that computes', async () => {
    const waits = createTrackerMetrics();
    // A synchronous 30 ms wait that uses no CPU: what a preempted thread looks like from inside.
    const out = waits.routePick.time(() => {
      Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 30);
      return 'plan';
    });
    expect(out).toBe('plan');
    const wall = await sumOf(waits, 'meshnet_tracker_route_pick_seconds');
    const cpu = await sumOf(waits, 'meshnet_tracker_route_pick_cpu_seconds');
    expect(wall.count).toBe(1);
    expect(cpu.count).toBe(1);
    expect(wall.sum).toBeGreaterThanOrEqual(0.029);
    expect(cpu.sum).toBeLessThan(0.015);

    const computes = createTrackerMetrics();
    computes.routePick.time(() => {
      // Spin until 30 ms of CPU are used (not 30 ms of clock: on a loaded machine the loop is preempted); capped at 2 s.
      const c0 = process.cpuUsage();
      const t0 = performance.now();
      for (;;) {
        const c = process.cpuUsage(c0);
        if (c.user + c.system >= 30_000 || performance.now() - t0 > 2000) break;
      }
    });
    expect((await sumOf(computes, 'meshnet_tracker_route_pick_cpu_seconds')).sum).toBeGreaterThan(0.015);
  });

  it('records a pick that throws (a 503), and passes the error on', async () => {
    const m = createTrackerMetrics();
    expect(() =>
      m.routePick.time(() => {
        throw new Error('no route');
      }),
    ).toThrow('no route');
    expect((await sumOf(m, 'meshnet_tracker_route_pick_cpu_seconds')).count).toBe(1);
  });
});
