/**
 * bench/cli-start — what starting a command costs: wall time of a cold
 * `meshnet relay --help` (a fresh process each time; the bundle cache warm,
 * and once with an empty cache: the rebuild), time to the relay's listening
 * line, and an idle relay's RSS right after it listens and after 30 s idle
 * (V8's memory reducer has run by then). Targets: help < 0.5 s, idle relay
 * ≤ 60 MB RSS.
 *
 * Side by side in one run: the bundled CLI (default), the same sources under
 * tsx (MESHNET_TSX=1), and with `--before DIR` another checkout's CLI (e.g.
 * main extracted with `git archive`, node_modules linked in).
 *
 *   npx tsx bench/cli-start.ts [--quick] [--before DIR]
 */
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { printTable, summarize, writeResult } from './lib/stats.ts';

const root = fileURLToPath(new URL('..', import.meta.url));
const quick = process.argv.includes('--quick');
const beforeArg = process.argv.indexOf('--before');
const before = beforeArg > 0 ? process.argv[beforeArg + 1] : undefined;
const HELP_RUNS = quick ? 3 : 7;
const IDLE_MS = quick ? 25_000 : 30_000;

interface Variant {
  name: string;
  bin: string;
  env: Record<string, string>;
}
const variants: Variant[] = [
  { name: 'bundle', bin: join(root, 'bin/meshnet.js'), env: {} },
  { name: 'tsx', bin: join(root, 'bin/meshnet.js'), env: { MESHNET_TSX: '1' } },
  ...(before ? [{ name: 'before', bin: join(before, 'bin/meshnet.js'), env: {} }] : []),
];

function rssMiB(pid: number): number {
  const m = /VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
  return m ? Number(m[1]) / 1024 : NaN;
}
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function helpMs(v: Variant, extraEnv: Record<string, string> = {}): number {
  const t0 = performance.now();
  const r = spawnSync(process.execPath, [v.bin, 'relay', '--help'], { env: { ...process.env, ...v.env, ...extraEnv }, stdio: ['ignore', 'pipe', 'pipe'] });
  if (r.status !== 0) throw new Error(`${v.name}: relay --help exited ${r.status}: ${r.stderr}`);
  return performance.now() - t0;
}

async function idleRelay(v: Variant): Promise<{ listenMs: number; rssAtListen: number; rssIdle: number }> {
  const t0 = performance.now();
  const child = spawn(process.execPath, [v.bin, 'relay', '--port', '0', '--log-level', 'warn'], { env: { ...process.env, ...v.env }, stdio: ['ignore', 'pipe', 'inherit'] });
  await new Promise<string>((resolve, reject) => {
    createInterface({ input: child.stdout! }).once('line', resolve);
    child.once('exit', (code) => reject(new Error(`${v.name}: relay exited ${code}`)));
  });
  const listenMs = performance.now() - t0;
  const rssAtListen = rssMiB(child.pid!);
  await sleep(IDLE_MS);
  const rssIdle = rssMiB(child.pid!);
  child.kill('SIGTERM');
  await new Promise((r) => child.once('exit', r));
  return { listenMs, rssAtListen, rssIdle };
}

const rows: Array<Array<string | number>> = [];
const results: Record<string, unknown> = {};
for (const v of variants) {
  helpMs(v); // the bundle cache is warm from here on
  const help = summarize(Array.from({ length: HELP_RUNS }, () => helpMs(v)));
  let rebuildMs: number | undefined;
  if (v.name === 'bundle') {
    const cache = mkdtempSync(join(tmpdir(), 'meshnet-cli-cache-'));
    rebuildMs = helpMs(v, { MESHNET_CLI_CACHE: cache });
    rmSync(cache, { recursive: true, force: true });
  }
  const relay = await idleRelay(v);
  rows.push([v.name, help.p50, rebuildMs ?? '-', relay.listenMs, relay.rssAtListen, relay.rssIdle]);
  results[v.name] = { relay_help_ms_p50: help.p50, relay_help_runs: help.n, rebuild_help_ms: rebuildMs ?? null, relay_listen_ms: relay.listenMs, relay_rss_mib_at_listen: relay.rssAtListen, relay_rss_mib_idle: relay.rssIdle };
}
printTable(`meshnet relay: cold --help and an idle relay (idle = ${IDLE_MS / 1000} s after listening)`, ['CLI', '--help ms (p50)', '--help ms, empty cache', 'listening ms', 'RSS MiB at listen', 'RSS MiB idle'], rows);
console.log('\ntargets: --help < 500 ms, idle relay ≤ 60 MB');
writeResult(`${root}bench/results/cli-start.json`, { bench: 'cli-start', idle_ms: IDLE_MS, variants: results });
