/**
 * What one leg between two processes costs at minimum on this machine, and
 * how much more when the receiver has been idle, as every hop of a one-chat
 * pipeline is (it waits ~2/3 of a step for its turn): a TCP ping-pong of
 * 1.1 KB (a bf16 activation and its frame) between this process and a child
 * echo process on loopback, back to back, then with a gap between pings
 * (this side busy for 3 or 10 ms, like a span running, or asleep for 10 ms).
 * No WebSocket, no frames, no JSON: the kernel, the scheduler and the event
 * loop only. bench/hop-trace.ts shows the legs of the real thing.
 *
 *   npx tsx bench/wake-latency.ts [--pings 200]
 */
import { fork } from 'node:child_process';
import { connect, createServer, type Socket } from 'node:net';
import { cpus, loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import { median, printTable, quantile, writeResult } from './lib/stats.ts';

if (process.argv[2] === '--echo') {
  const srv = createServer((s) => {
    s.setNoDelay(true);
    s.on('data', (d) => s.write(d));
  });
  srv.listen(0, '127.0.0.1', () => process.send!((srv.address() as { port: number }).port));
} else {
  const i = process.argv.indexOf('--pings');
  const PINGS = i > 0 ? Number(process.argv[i + 1]) : 200;
  const child = fork(fileURLToPath(import.meta.url), ['--echo'], { execArgv: process.execArgv });
  const port = await new Promise<number>((r) => child.once('message', (m) => r(m as number)));
  const s: Socket = connect(port, '127.0.0.1');
  s.setNoDelay(true);
  await new Promise((r) => s.once('connect', r));
  const buf = Buffer.alloc(1100, 7);
  const rtt = () =>
    new Promise<number>((r) => {
      const t0 = performance.now();
      s.once('data', () => r(performance.now() - t0));
      s.write(buf);
    });
  const busy = (ms: number) => {
    const t = performance.now();
    let x = 0;
    while (performance.now() - t < ms) x++;
    return x;
  };
  const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
  const gaps: Array<[string, () => unknown]> = [
    ['back to back', () => undefined],
    ['this side busy 3 ms between pings', () => busy(3)],
    ['this side busy 10 ms between pings', () => busy(10)],
    ['both asleep 10 ms between pings', () => sleep(10)],
  ];
  const rows: Array<Record<string, unknown>> = [];
  const load = loadavg()[0]!;
  for (const [name, gap] of gaps) {
    const xs: number[] = [];
    for (let k = 0; k < PINGS; k++) {
      await gap();
      xs.push(await rtt());
    }
    xs.sort((a, b) => a - b);
    rows.push({ gap: name, rtt_p50_ms: +median(xs).toFixed(3), rtt_p90_ms: +quantile(xs, 0.9).toFixed(3) });
  }
  printTable(`loopback TCP round trip, 1.1 KB, ${PINGS} pings each; load ${load.toFixed(1)} → ${loadavg()[0]!.toFixed(1)} on ${cpus().length} cores`, ['between pings', 'RTT p50 ms', 'p90 ms'], rows.map((r) => [String(r.gap), Number(r.rtt_p50_ms), Number(r.rtt_p90_ms)]));
  writeResult(fileURLToPath(new URL('./results/wake-latency.json', import.meta.url)), { bench: 'wake-latency', pings: PINGS, load: [load, loadavg()[0]], rows });
  s.destroy();
  child.kill();
}
