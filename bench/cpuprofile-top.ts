/**
 * bench/cpuprofile-top — where a V8 CPU profile (`node --cpu-prof`, e.g. the
 * tracker's from `bench/swarm.ts --prof DIR`) spends its time: the top
 * functions by self time, and the same summed by source file, as shares of
 * the samples taken while the process was busy ((idle) left out).
 *
 *   npx tsx bench/cpuprofile-top.ts FILE.cpuprofile [--top 30] [--from-s S] [--to-s S] [--json OUT]
 *
 * `--from-s` / `--to-s` keep only the samples in that span of the profile
 * (seconds from its start): the measured window rather than the ramp.
 */
import { readFileSync, writeFileSync } from 'node:fs';

interface CallFrame {
  functionName: string;
  url: string;
  lineNumber: number;
}
interface ProfileNode {
  id: number;
  callFrame: CallFrame;
  children?: number[];
}
interface Profile {
  nodes: ProfileNode[];
  startTime: number;
  endTime: number;
  samples: number[];
  timeDeltas: number[];
}

const argv = process.argv.slice(2);
const opt = (name: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
};
const file = argv.find((a, i) => !a.startsWith('--') && !argv[i - 1]?.startsWith('--'));
if (!file) {
  console.error('usage: npx tsx bench/cpuprofile-top.ts FILE.cpuprofile [--top 30] [--from-s S] [--to-s S] [--json OUT]');
  process.exit(2);
}
const TOP = Number(opt('top') ?? 30);
const FROM_US = opt('from-s') === undefined ? -Infinity : Number(opt('from-s')) * 1e6;
const TO_US = opt('to-s') === undefined ? Infinity : Number(opt('to-s')) * 1e6;

const p = JSON.parse(readFileSync(file, 'utf8')) as Profile;
const byId = new Map(p.nodes.map((n) => [n.id, n]));
const parent = new Map<number, number>();
for (const n of p.nodes) for (const c of n.children ?? []) parent.set(c, n.id);
const shortUrl = (u: string) => u.replace(/^file:\/\//, '').replace(/^.*\/(src|node_modules|bench)\//, '$1/') || '(native)';
const key = (f: CallFrame) => `${f.functionName || '(anonymous)'} ${shortUrl(f.url)}${f.url ? `:${f.lineNumber + 1}` : ''}`;

// Each sample's time is the delta to the next sample (V8's own reading).
const selfUs = new Map<string, number>();
const fileUs = new Map<string, number>();
/** Inclusive: the sample's time goes to every function on its stack, once each. */
const totalUs = new Map<string, number>();
let t = p.startTime;
let busy = 0;
let idle = 0;
for (let i = 0; i < p.samples.length; i++) {
  t += p.timeDeltas[i] ?? 0;
  const dt = p.timeDeltas[i + 1] ?? 0;
  const rel = t - p.startTime;
  if (rel < FROM_US || rel > TO_US) continue;
  const n = byId.get(p.samples[i]!)!;
  const name = n.callFrame.functionName;
  if (name === '(idle)') {
    idle += dt;
    continue;
  }
  busy += dt;
  const k = key(n.callFrame);
  selfUs.set(k, (selfUs.get(k) ?? 0) + dt);
  const seen = new Set<string>();
  for (let id: number | undefined = n.id; id !== undefined; id = parent.get(id)) {
    const kk = key(byId.get(id)!.callFrame);
    if (seen.has(kk)) continue;
    seen.add(kk);
    totalUs.set(kk, (totalUs.get(kk) ?? 0) + dt);
  }
  const fk = name.startsWith('(') ? name : shortUrl(n.callFrame.url);
  fileUs.set(fk, (fileUs.get(fk) ?? 0) + dt);
}

const pct = (us: number) => ((us / busy) * 100).toFixed(1).padStart(5);
const rows = (m: Map<string, number>) => [...m].sort((a, b) => b[1] - a[1]).slice(0, TOP);
console.log(`${file}: ${(busy / 1e6).toFixed(2)} s busy, ${(idle / 1e6).toFixed(2)} s idle in the span`);
console.log('\nself time by function (% of busy):');
for (const [k, us] of rows(selfUs)) console.log(`${pct(us)} %  ${(us / 1000).toFixed(0).padStart(7)} ms  ${k}`);
console.log('\ntotal (inclusive) time by function (% of busy):');
for (const [k, us] of rows(totalUs)) console.log(`${pct(us)} %  ${(us / 1000).toFixed(0).padStart(7)} ms  ${k}`);
console.log('\nself time by file (% of busy):');
for (const [k, us] of rows(fileUs)) console.log(`${pct(us)} %  ${(us / 1000).toFixed(0).padStart(7)} ms  ${k}`);
const out = opt('json');
if (out) writeFileSync(out, `${JSON.stringify({ file, busy_ms: busy / 1000, idle_ms: idle / 1000, total: rows(totalUs).map(([k, us]) => ({ name: k, ms: us / 1000, pct: (us / busy) * 100 })), functions: rows(selfUs).map(([k, us]) => ({ name: k, ms: us / 1000, pct: (us / busy) * 100 })), files: rows(fileUs).map(([k, us]) => ({ name: k, ms: us / 1000, pct: (us / busy) * 100 })) }, null, 2)}\n`);
