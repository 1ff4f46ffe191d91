/**
 * Where CPU time per token goes in a batched 3-node mesh (docs/architecture.md, "Batching at a hop"): one
 * split mesh (relay, tracker, 3 `meshnet node`, layers 0-4 / 4-8 / 8-12 of
 * `small`, --max-batch 16), N chats at once for a few rounds; per process
 * CPU ms per generated token from /proc/<pid>/stat (user + kernel) over the
 * measured rounds only, and the nodes' batch sizes. CPU time, not wall time:
 * on a shared machine it is the figure that stays put while the load moves.
 *
 * `--cpu-prof DIR`: every process also writes a V8 CPU profile there, and the
 * script prints each one's top self and inclusive times within the measured
 * window. Samples are wall clock: a process preempted inside a syscall
 * (writev to the relay on a busy box) shows that time there, so read the
 * profile next to the /proc figures. `--strace DIR`: `strace -c` of every
 * process over the window (syscall counts per token). `--ort-cpu`: each node
 * also counts the CPU it spends inside onnxruntime's session.run
 * (bench/lib/ort-cpu.mjs), printed per token next to the /proc figures.
 *
 *   npx tsx bench/profile-chats.ts [--chats 8] [--rounds 3] [--cpu-prof DIR] [--strace DIR] [--ort-cpu] [--node-flags '--heap-prof ...']
 *
 * JSON in bench/results/profile-chats.json.
 */
import { chmodSync, mkdtempSync, readFileSync, readdirSync, writeFileSync } from 'node:fs';
import { spawn } from 'node:child_process';
import { loadavg, tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import { aloneTexts, round, startMesh, type RoundSink } from './lib/load-mesh.ts';
import { quantile, writeResult } from './lib/stats.ts';
import { meshPids, sampleMesh } from './lib/proc-cpu.ts';

const argv = process.argv.slice(2);
const opt = (name: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
};
const CHATS = Number(opt('chats') ?? 8);
const ROUNDS = Number(opt('rounds') ?? 3);
const profDir = opt('cpu-prof');
const ortCpuDir = argv.includes('--ort-cpu') ? mkdtempSync(join(tmpdir(), 'ort-cpu-')) : undefined;
if (ortCpuDir) process.env.MESHNET_ORT_CPU_DIR = ortCpuDir;
const nodeFlags = [
  ...(profDir ? [`--cpu-prof`, `--cpu-prof-dir=${resolve(profDir)}`] : []),
  ...(ortCpuDir ? ['--import', fileURLToPath(new URL('./lib/ort-cpu.mjs', import.meta.url))] : []),
  ...(opt('node-flags')?.split(' ').filter(Boolean) ?? []),
];
if (nodeFlags.length > 0) {
  // --cpu-prof is refused in NODE_OPTIONS: the helpers spawn process.execPath, so point it at a wrapper (exec keeps the pid).
  const wrapper = join(resolve(profDir ?? ortCpuDir ?? '.'), 'node-prof.sh');
  writeFileSync(wrapper, `#!/bin/sh\nexec ${process.execPath} ${nodeFlags.join(' ')} "$@"\n`);
  chmodSync(wrapper, 0o755);
  process.execPath = wrapper;
}

const here = fileURLToPath(new URL('.', import.meta.url));
interface ProfileNode { id: number; callFrame: { functionName: string; url: string; lineNumber: number }; children?: number[] }
interface Profile { nodes: ProfileNode[]; startTime: number; samples: number[]; timeDeltas: number[] }

/** Self and inclusive time per function within [fromUs, toUs] (monotonic µs, the clock V8 stamps samples with). */
function topTimes(p: Profile, fromUs: number, toUs: number, n = 25): { self: Array<[string, number]>; inclusive: Array<[string, number]> } {
  const byId = new Map(p.nodes.map((x) => [x.id, x]));
  const parent = new Map<number, number>();
  for (const x of p.nodes) for (const c of x.children ?? []) parent.set(c, x.id);
  const key = (x: ProfileNode) => `${x.callFrame.functionName || '(anon)'} ${x.callFrame.url.replace(/^.*\/(src|node_modules)\//, '$1/').replace(/build-[^/]*\/chunks\//, '')}:${x.callFrame.lineNumber + 1}`;
  const self = new Map<string, number>();
  const incl = new Map<string, number>();
  let t = p.startTime;
  let total = 0;
  for (let i = 0; i < p.samples.length; i++) {
    const dt = p.timeDeltas[i] ?? 0;
    t += dt;
    if (t < fromUs || t > toUs) continue;
    let node = byId.get(p.samples[i]!);
    total += dt;
    self.set(key(node!), (self.get(key(node!)) ?? 0) + dt);
    const seen = new Set<string>();
    while (node) {
      const k = key(node);
      if (!seen.has(k)) incl.set(k, (incl.get(k) ?? 0) + dt);
      seen.add(k);
      node = byId.get(parent.get(node.id) ?? -1);
    }
  }
  const top = (m: Map<string, number>) => [...m.entries()].sort((a, b) => b[1] - a[1]).slice(0, n);
  return { self: [['TOTAL', total], ...top(self)], inclusive: top(incl) };
}

interface OrtCpu { runs: number; cpu_ms: number; wall_ms: number }

/** Each node's counters of CPU inside session.run (bench/lib/ort-cpu.mjs writes them on SIGUSR2). */
async function ortCpu(pids: Array<number | undefined>): Promise<OrtCpu[]> {
  if (!ortCpuDir) return [];
  for (const pid of pids) if (pid !== undefined) process.kill(pid, 'SIGUSR2');
  await new Promise((r) => setTimeout(r, 300));
  return pids.map((pid) => JSON.parse(readFileSync(join(ortCpuDir, `ort-${pid}.json`), 'utf8')) as OrtCpu);
}

async function main(): Promise<void> {
  const st = await startStaticServer({ root: await ensureModel('small') });
  const m = await startMesh('split', `${st.url}/`, { maxBatch: '16', maxTokens: 32 });
  try {
    const alone = await aloneTexts(m);
    await round(m, CHATS, 1, alone, 20_000);
    const ps = meshPids(m);
    const nodePids = m.nodes.map((n) => n.child.pid);
    const batchSizes = () => Promise.all(m.nodes.map(async (n) => ((await (await fetch(`${n.endpoint}/info`)).json()) as { batch?: { sizes: number[] } }).batch?.sizes ?? []));
    const sizesBefore = await batchSizes();
    const ortBefore = await ortCpu(nodePids);
    const before = sampleMesh(ps);
    const straceDir = opt('strace');
    const traces = straceDir
      ? Object.entries(ps).map(([k, pid]) => spawn('strace', ['-c', '-f', '-o', join(resolve(straceDir), `${k}.txt`), '-p', String(pid)], { stdio: 'ignore' }))
      : [];
    if (traces.length > 0) await new Promise((r) => setTimeout(r, 1000));
    const from = Number(process.hrtime.bigint() / 1000n);
    const sink: RoundSink = { gaps: [], busyMs: 0, tokens: 0 };
    const t0 = performance.now();
    const r = await round(m, CHATS, ROUNDS, alone, 20_000, sink);
    const wall = performance.now() - t0;
    const to = Number(process.hrtime.bigint() / 1000n);
    const after = sampleMesh(ps);
    const ortAfter = await ortCpu(nodePids);
    const sizesAfter = await batchSizes();
    for (const t of traces) t.kill('SIGINT');
    sink.gaps.sort((a, b) => a - b);
    console.log(`${CHATS} chats × ${ROUNDS} rounds: ${sink.tokens} tokens in ${wall.toFixed(0)} ms = ${((sink.tokens * 1000) / wall).toFixed(1)} tok/s; ok ${r.ok}/${r.chats}, text ≠ alone ${r.text_mismatches}; TBT p50 ${quantile(sink.gaps, 0.5).toFixed(0)} p95 ${quantile(sink.gaps, 0.95).toFixed(0)} ms`);
    let sum = 0;
    const perProcess: Record<string, { cpu_ms: number; kernel_ms: number; cpu_ms_per_token: number }> = {};
    for (const k of Object.keys(ps)) {
      const d = after[k]!.all - before[k]!.all;
      const sys = after[k]!.sys - before[k]!.sys;
      sum += d;
      perProcess[k] = { cpu_ms: d, kernel_ms: sys, cpu_ms_per_token: d / sink.tokens };
      console.log(`  ${k.padEnd(8)} ${d.toFixed(0).padStart(6)} ms CPU  ${(d / sink.tokens).toFixed(2).padStart(6)} ms/token  (kernel ${(sys / sink.tokens).toFixed(2)})`);
    }
    console.log(`  ${'all'.padEnd(8)} ${sum.toFixed(0).padStart(6)} ms CPU  ${(sum / sink.tokens).toFixed(2).padStart(6)} ms/token (wall ${(wall / sink.tokens).toFixed(2)} ms/token)`);
    const ort = ortAfter.map((a, i) => {
      const b = ortBefore[i]!;
      return { runs: a.runs - b.runs, cpu_ms_per_token: (a.cpu_ms - b.cpu_ms) / sink.tokens, wall_ms_per_token: (a.wall_ms - b.wall_ms) / sink.tokens };
    });
    ort.forEach((o, i) => console.log(`  node${i + 1} inside onnxruntime: ${o.cpu_ms_per_token.toFixed(2)} ms CPU/token (wall ${o.wall_ms_per_token.toFixed(2)}), ${o.runs} runs`));
    // Runs by batch size within the measured rounds (index = sessions), and the mean decode batch there.
    const sizes = sizesAfter.map((a, i) => a.map((n, k) => n - (sizesBefore[i]![k] ?? 0)));
    sizes.forEach((s, i) => {
      const runs = s.reduce((a, b) => a + b, 0);
      const reqs = s.reduce((a, b, k) => a + b * k, 0);
      console.log(`  node${i + 1} runs by batch size in the window (index = sessions): ${JSON.stringify(s)}, mean ${(reqs / Math.max(1, runs)).toFixed(2)}`);
    });
    writeResult(join(here, 'results', 'profile-chats.json'), {
      chats: CHATS, rounds: ROUNDS, tokens: sink.tokens, wall_ms: wall, tokens_per_s: (sink.tokens * 1000) / wall,
      tbt_p50_ms: quantile(sink.gaps, 0.5), tbt_p95_ms: quantile(sink.gaps, 0.95), cpu_ms_per_token: sum / sink.tokens,
      processes: perProcess, node_batch_sizes: sizes, load_average: loadavg(), ...(ortCpuDir ? { node_ort: ort } : {}),
    });
    const pidName = new Map(Object.entries(ps).map(([k, pid]) => [pid, k]));
    await m.stop();
    if (profDir) {
      for (const f of readdirSync(profDir).filter((x) => x.endsWith('.cpuprofile'))) {
        const pid = Number(/^CPU\.\d+\.\d+\.(\d+)\./.exec(f)?.[1]);
        const name = pidName.get(pid);
        if (!name) continue;
        const p = JSON.parse(readFileSync(join(profDir, f), 'utf8')) as Profile;
        console.log(`\n[${name}] ${f}`);
        const tt = topTimes(p, from, to, 40);
        console.log('  self:');
        for (const [k, us] of tt.self) console.log(`  ${(us / 1000).toFixed(0).padStart(7)} ms  ${k}`);
        console.log('  inclusive:');
        for (const [k, us] of tt.inclusive) console.log(`  ${(us / 1000).toFixed(0).padStart(7)} ms  ${k}`);
      }
    }
  } finally {
    await m.stop().catch(() => {});
    await st.close();
  }
}

void main().then(() => process.exit(0), (e) => {
  console.error(e);
  process.exit(1);
});
