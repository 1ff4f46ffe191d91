/**
 * What bench/swarm.ts reads off its processes by pid: CPU and RSS from /proc,
 * heap snapshots on a signal, and the loop probes' files
 * (bench/lib/loop-probe.mjs). Every reading tolerates a process that is gone:
 * one that died mid-run must not end the bench.
 */
import { mkdirSync, readdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import type { LoopProbe } from './loop-probe.mjs';
import { cpuMs } from './proc-cpu.ts';

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** CPU ms of a process so far; NaN once it is gone. */
export function cpuOf(pid: number | undefined): number {
  try {
    return cpuMs(pid).all;
  } catch {
    return NaN;
  }
}

export function rssKiB(pid: number | undefined): number {
  if (pid === undefined) return NaN;
  try {
    const m = /VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
    return m ? Number(m[1]) : NaN;
  } catch {
    return NaN;
  }
}

/** The node flags that make a process write a CPU profile into `profDir`, and a heap snapshot into `heapDir` on SIGTTIN. */
export function profilingNodeArgs(profDir: string | undefined, heapDir: string | undefined): string[] {
  return [...(profDir ? ['--cpu-prof', `--cpu-prof-dir=${profDir}`] : []), ...(heapDir ? ['--heapsnapshot-signal=SIGTTIN', `--diagnostic-dir=${heapDir}`] : [])];
}

/** Signal each process for a heap snapshot and wait until every file is written (its size stops changing). */
export async function heapSnapshots(heapDir: string | undefined, pids: Array<number | undefined>): Promise<void> {
  if (!heapDir) return;
  mkdirSync(heapDir, { recursive: true });
  const before = new Set(readdirSync(heapDir));
  for (const pid of pids) if (pid !== undefined) process.kill(pid, 'SIGTTIN');
  const size = (f: string) => statSync(join(heapDir, f)).size;
  let last = '';
  for (const t0 = Date.now(); Date.now() - t0 < 120_000; ) {
    await sleep(1000);
    const fresh = readdirSync(heapDir).filter((f) => !before.has(f));
    const now = fresh.map((f) => `${f}:${size(f)}`).join(',');
    if (fresh.length >= pids.length && now === last) return;
    last = now;
  }
}

export interface LoopSummary {
  delay_ms: { p50: number; p99: number; max: number };
  elu: number;
  stalls: number;
  stall_ms: number;
  worst_stalls: Array<{ at: number; ms: number }>;
  gc_pauses: number;
  gc_ms: number;
  gc_max_ms: number;
  heap_used_mib: number;
}

/** Each probed process's window, read from its probe file in `loopDir` (written every 2 s; this process's own, `selfProbe`, at once). */
export async function loopSummary(loopDir: string, selfProbe: LoopProbe | undefined, procs: Array<{ name: string; pid: number | undefined }>): Promise<Record<string, LoopSummary>> {
  selfProbe?.write();
  await sleep(2200);
  const files = readdirSync(loopDir);
  const out: Record<string, LoopSummary> = {};
  for (const p of procs) {
    const f = files.find((x) => x.endsWith(`-${p.pid}.json`));
    if (!f) continue;
    const d = JSON.parse(readFileSync(join(loopDir, f), 'utf8')) as { delay_ms: { p50: number; p99: number; max: number }; elu: number; stalls: Array<{ at: number; ms: number }>; gcs: Array<{ ms: number }>; heap_used_mib: number };
    out[p.name] = {
      delay_ms: { p50: d.delay_ms.p50, p99: d.delay_ms.p99, max: d.delay_ms.max },
      elu: d.elu,
      stalls: d.stalls.length,
      stall_ms: d.stalls.reduce((a, s) => a + s.ms, 0),
      worst_stalls: [...d.stalls].sort((a, b) => b.ms - a.ms).slice(0, 10),
      gc_pauses: d.gcs.length,
      gc_ms: d.gcs.reduce((a, g) => a + g.ms, 0),
      gc_max_ms: Math.max(0, ...d.gcs.map((g) => g.ms)),
      heap_used_mib: d.heap_used_mib,
    };
  }
  return out;
}
