/**
 * Event-loop probe for bench processes, loaded with
 * `NODE_OPTIONS=--import file:///…/bench/lib/loop-probe.mjs` and
 * `MESHNET_LOOP_PROBE_DIR=DIR` (or imported by the bench itself).
 *
 * It records what makes a latency tail: how late a 20 ms timer fires (its
 * histogram: `delay_ms`), each stall (that timer firing late by more than
 * 40 ms, with its wall-clock time, so stalls can be lined up with periodic
 * work), and each GC pause of 5 ms or more. It writes DIR/<role>-<pid>.json
 * every 2 s and at exit; `reset` (SIGUSR2) starts the measured window afresh.
 *
 * One timer, not also perf_hooks.monitorEventLoopDelay: on this 2-core VM
 * each wakeup of an idle process costs ~70-150 µs of CPU, and the probe
 * with a 5 ms delay histogram beside its 20 ms timer cost an idle process
 * ~18 ms of CPU a second (~7.6 with the timer alone), which a tracker's CPU
 * figure then counted as its own (docs/benchmarks.md, session 10). CPU
 * figures are still best read from runs without the probe.
 */
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { createHistogram, PerformanceObserver, performance } from 'node:perf_hooks';

const dir = process.env.MESHNET_LOOP_PROBE_DIR;

export function startLoopProbe(role = process.argv[2] ?? 'proc', outDir = dir) {
  if (!outDir) return undefined;
  // How late each tick fired, in ns (a histogram records integers >= 1).
  const hist = createHistogram();
  let stalls = [];
  let gcs = [];
  let since = Date.now();
  let elu0 = performance.eventLoopUtilization();
  const TICK = 20;
  let last = performance.now();
  const t = setInterval(() => {
    const now = performance.now();
    const late = now - last - TICK;
    last = now;
    hist.record(Math.max(1, Math.round(late * 1e6)));
    if (late > 40) stalls.push({ at: Date.now(), ms: Math.round(late) });
  }, TICK);
  t.unref();
  const obs = new PerformanceObserver((list) => {
    for (const e of list.getEntries()) if (e.duration >= 5) gcs.push({ at: Math.round(performance.timeOrigin + e.startTime), ms: +e.duration.toFixed(1), kind: e.detail?.kind });
  });
  obs.observe({ entryTypes: ['gc'] });
  const file = join(outDir, `${role}-${process.pid}.json`);
  const q = (p) => +(hist.percentile(p) / 1e6).toFixed(2);
  const write = () => {
    const elu = performance.eventLoopUtilization(elu0).utilization;
    const mem = process.memoryUsage();
    try {
      writeFileSync(file, JSON.stringify({ role, pid: process.pid, mono_offset_ms: Date.now() - Number(process.hrtime.bigint()) / 1e6, since, until: Date.now(), elu, delay_ms: { p50: q(50), p90: q(90), p99: q(99), p999: q(99.9), max: +(hist.max / 1e6).toFixed(2), count: hist.count }, stalls, gcs, heap_used_mib: mem.heapUsed / 2 ** 20, rss_mib: mem.rss / 2 ** 20, external_mib: mem.external / 2 ** 20, array_buffers_mib: mem.arrayBuffers / 2 ** 20 }));
    } catch {
      // A bench probe never takes its process down.
    }
  };
  const w = setInterval(write, 2000);
  w.unref();
  const reset = () => {
    hist.reset();
    stalls = [];
    gcs = [];
    since = Date.now();
    elu0 = performance.eventLoopUtilization();
  };
  process.on('SIGUSR2', reset);
  process.on('exit', write);
  return { reset, write };
}

if (dir && process.env.MESHNET_LOOP_PROBE_SELF !== '0') startLoopProbe();
