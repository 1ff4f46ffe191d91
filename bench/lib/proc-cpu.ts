/**
 * CPU time of the mesh's processes from /proc/<pid>/stat (Linux): user +
 * kernel ms, and kernel alone. CPU per token is the figure that holds still
 * on a shared machine where wall time moves with the load (where the
 * time of a token goes outside onnxruntime).
 */
import { readFileSync } from 'node:fs';
import type { Mesh } from './load-mesh.ts';

/** USER_HZ: /proc counts CPU time in ticks of 10 ms. */
const TICK_MS = 10;

export interface CpuSample {
  all: number;
  sys: number;
}

export function cpuMs(pid: number | undefined): CpuSample {
  if (pid === undefined) return { all: NaN, sys: NaN };
  const f = readFileSync(`/proc/${pid}/stat`, 'utf8');
  // Fields after the command name (which may hold spaces): state is [0], utime [11], stime [12].
  const rest = f.slice(f.lastIndexOf(')') + 2).split(' ');
  return { all: (Number(rest[11]) + Number(rest[12])) * TICK_MS, sys: Number(rest[12]) * TICK_MS };
}

/** The mesh's processes by name: relay, tracker, node1.. */
export function meshPids(m: Mesh): Record<string, number | undefined> {
  const out: Record<string, number | undefined> = { relay: m.relay.child.pid, tracker: m.tracker.child.pid };
  m.nodes.forEach((n, i) => (out[`node${i + 1}`] = n.child.pid));
  return out;
}

/** Every process's CPU now. */
export function sampleMesh(pids: Record<string, number | undefined>): Record<string, CpuSample> {
  return Object.fromEntries(Object.entries(pids).map(([k, pid]) => [k, cpuMs(pid)]));
}

/** CPU ms each process spent between two samples, and `all` for their sum. */
export function cpuSpent(before: Record<string, CpuSample>, after: Record<string, CpuSample>): Record<string, number> {
  const out: Record<string, number> = {};
  let sum = 0;
  for (const k of Object.keys(before)) {
    const d = after[k]!.all - before[k]!.all;
    out[k] = d;
    sum += d;
  }
  out.all = sum;
  return out;
}
