/**
 * bench/idle-wakeups — how often an idle cluster tracker wakes, and its CPU.
 *
 * A nats-server and three trackers of one cluster (no relay, no donors, the
 * `swarm` config of bench/swarm.ts), each started under `strace -f -ttt`
 * tracing only epoll_wait / epoll_pwait, for each --bin in turn. After a
 * 15 s settle, over one window: per tracker, the wakeups of its main loop (calls
 * that could block, i.e. timeout not 0, and returned: by a timer or by I/O)
 * and its CPU from /proc (strace's stops add to it: compare builds, not
 * absolute figures). Needs strace.
 *
 *   npx tsx bench/idle-wakeups.ts --bin PATH [--bin PATH ...] [--window-s 30] [--out FILE]
 */
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { startStaticServer } from '../src/cli/static-server.ts';
import { startNats } from '../test/helpers/cluster.ts';
import { loadAverage1m, writeResult } from './lib/stats.ts';
import { SWARM_CONFIG } from './lib/swarm-shape.ts';

const argv = process.argv.slice(2);
const bins = argv.flatMap((a, i) => (a === '--bin' && argv[i + 1] ? [argv[i + 1]!] : []));
const windowS = Number(argv[argv.indexOf('--window-s') + 1] ?? 30) || 30;
const out = argv.includes('--out') ? argv[argv.indexOf('--out') + 1]! : 'bench/results/idle-wakeups.json';
if (bins.length === 0) throw new Error('give at least one --bin PATH (a checkout\'s bin/meshnet.js)');

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));
/** CPU ms of a process so far (utime + stime at 100 Hz). */
const cpuMs = (pid: number) => {
  const f = readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1]!.split(' ');
  return (Number(f[11]) + Number(f[12])) * 10;
};
/** The tracker's pid: strace's only child. */
const childOf = (pid: number) => Number(readFileSync(`/proc/${pid}/task/${pid}/children`, 'utf8').trim().split(/\s+/)[0]);
/** One traced call: "PID SECONDS.MICROS epoll_pwait(FD, [...], MAX, TIMEOUT, NULL, 8) = N". */
const CALL = /^(\d+)\s+(\d+\.\d+)\s+epoll_p?wait\(\d+, .*, \d+, (-?\d+)(?:, NULL, \d+)?\) = \d+$/;

const load0 = loadavg()[0]!;
const dir = mkdtempSync(join(tmpdir(), 'meshnet-idle-'));
writeFileSync(join(dir, 'config.json'), JSON.stringify(SWARM_CONFIG));
const config = await startStaticServer({ root: dir });
const runs: unknown[] = [];
for (const bin of bins) {
  const nats = await startNats();
  const trackers: Array<{ file: string; pid: number }> = [];
  for (let i = 0; i < 3; i++) {
    const file = join(dir, `strace-${runs.length}-${i}`);
    const s = spawn('strace', ['-f', '--seccomp-bpf', '-e', 'trace=epoll_pwait,epoll_wait', '-ttt', '-o', file, process.execPath, bin, 'tracker', '--port', '0', '--log-level', 'warn', '--model', `swarm=${config.url}`, '--nats', nats.url, '--cluster', 'idle'], { stdio: ['ignore', 'pipe', 'inherit'] });
    await new Promise<void>((resolve) => createInterface({ input: s.stdout! }).on('line', (l) => l.includes('"listening"') && resolve()));
    trackers.push({ file, pid: childOf(s.pid!) });
  }
  await sleep(15_000);
  const loadAt = loadavg()[0]!;
  const cpu0 = trackers.map((t) => cpuMs(t.pid));
  const w0 = Date.now() / 1000;
  await sleep(windowS * 1000);
  const w1 = Date.now() / 1000;
  const cpu = trackers.map((t, i) => (cpuMs(t.pid) - cpu0[i]!) / windowS);
  for (const t of trackers) process.kill(t.pid, 'SIGTERM');
  await sleep(3000);
  const wakeups = trackers.map((t) => {
    let n = 0;
    for (const line of readFileSync(t.file, 'utf8').split('\n')) {
      const m = CALL.exec(line);
      if (m && Number(m[1]) === t.pid && m[3] !== '0' && Number(m[2]) >= w0 && Number(m[2]) <= w1) n++;
    }
    return n / windowS;
  });
  const r = { bin, wakeups_per_s: wakeups.map((x) => +x.toFixed(2)), cpu_ms_per_s: cpu.map((x) => +x.toFixed(2)), load_1m: [loadAt, loadavg()[0]!] };
  console.log(JSON.stringify(r));
  runs.push(r);
  await nats.stop();
}
await config.close();
writeResult(out, { bench: 'idle-wakeups', window_s: windowS, load_average_1m: loadAverage1m(load0), runs });
process.exit(0);
