/**
 * What spot-checks cost a mesh at steady state (docs/verification.md):
 * checks on against checks off, in one run, on one mesh of real processes —
 * a relay, four `meshnet node` processes on fortunes-tiny (a head H [0, 3)
 * and three holders of [3, 6), so every hop has two checkers off its route),
 * and the tracker in this process (so the bench can switch checks on and
 * off between phases, and set the BOINC counters).
 *
 * Warm-up: checks on until every node has passed 10 checks in a row (a new
 * node's every session is checked). Then "steady state": each node's count
 * of consecutive passes is set to `--steady` (default 50: the BOINC odds are
 * then max(2 %, 1/50) = 2 % per session; `--steady 10` gives the 10 % just
 * after warm-up). Then phases of `--phase-s` seconds alternate, off and on,
 * `--rounds` times, with the same load (4 chats at a time, greedy, 24 tokens).
 *
 * Per phase: tokens/s through the tracker, and CPU ms per token of the node
 * processes (the mesh's compute: /proc/<pid>/stat), plus the checks run.
 * Medians per mode; the ratio on/off is the overhead. Signing every step
 * (attestations) is on in both modes — it is not a check; its own cost is
 * measured alone at the end (µs of CPU per step, Attestor).
 *
 *   npx tsx bench/verify-overhead.ts [--quick] [--phase-s 20] [--rounds 3] [--steady 50]
 * Table on stdout, JSON in bench/results/verify-overhead.json.
 */
import { fileURLToPath } from 'node:url';
import { join } from 'node:path';
import { startStaticServer } from '../src/cli/static-server.ts';
import { startTracker } from '../src/tracker/server.ts';
import { Identity } from '../src/net/identity.ts';
import { Attestor } from '../src/verify/attestor.ts';
import { FORTUNES_DIR } from '../test/helpers/fortunes-tiny.ts';
import { startRelayProcess } from '../test/helpers/relay-process.ts';
import { startNode, until, type NodeProc } from '../test/helpers/mesh.ts';
import { cpuMs } from './lib/proc-cpu.ts';
import { median, printTable, writeResult } from './lib/stats.ts';

const argv = process.argv.slice(2);
const arg = (name: string, d: number) => (argv.includes(name) ? Number(argv[argv.indexOf(name) + 1]) : d);
const quick = argv.includes('--quick');
const PHASE_MS = arg('--phase-s', quick ? 8 : 20) * 1000;
const ROUNDS = arg('--rounds', quick ? 2 : 3);
const STEADY = arg('--steady', 50);
const CONCURRENCY = 4;
const MAX_TOKENS = 24;
const TOPICS = ['science', 'cats', 'the sea', 'money', 'love', 'work', 'music', 'time', 'rain', 'dogs', 'coffee', 'luck'];
const here = fileURLToPath(new URL('.', import.meta.url));

const st = await startStaticServer({ root: FORTUNES_DIR, port: 0, host: '127.0.0.1' });
const relay = await startRelayProcess();
const tracker = await startTracker({ port: 0, models: [{ name: 'fortunes-tiny', url: st.url }], relayUrl: relay.url, wireDtype: 'f32', heartbeatIntervalMs: 500, logLevel: 'warn' });
const common = ['--tracker', tracker.url, '--relay', relay.url, '--model-url', st.url, '--wire-dtype', 'f32', '--max-context', '256'];
const nodes: NodeProc[] = [];
for (const layers of ['0-3', '3-6', '3-6', '3-6']) nodes.push(await startNode([...common, '--layers', layers]));
const v = tracker.verification;

let n = 0;
async function chat(): Promise<number> {
  const res = await fetch(`${tracker.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'fortunes-tiny', messages: [{ role: 'user', content: `Tell me a fortune about ${TOPICS[n++ % TOPICS.length]}.` }], max_tokens: MAX_TOKENS, temperature: 0 }),
  });
  const body = (await res.json()) as { usage?: { completion_tokens: number } };
  if (res.status !== 200) throw new Error(`chat answered ${res.status}: ${JSON.stringify(body).slice(0, 200)}`);
  return body.usage?.completion_tokens ?? 0;
}

/** `CONCURRENCY` chats at a time for `ms`: tokens, wall ms, node CPU ms. */
async function phase(ms: number): Promise<{ tokens: number; wallMs: number; cpuMs: number; checks: number }> {
  const cpu0 = nodes.reduce((s, x) => s + cpuMs(x.child.pid).all, 0);
  const checks0 = totalChecks();
  const t0 = performance.now();
  let tokens = 0;
  await Promise.all(
    Array.from({ length: CONCURRENCY }, async () => {
      while (performance.now() - t0 < ms) tokens += await chat();
    }),
  );
  const wallMs = performance.now() - t0;
  return { tokens, wallMs, cpuMs: nodes.reduce((s, x) => s + cpuMs(x.child.pid).all, 0) - cpu0, checks: totalChecks() - checks0 };
}

function totalChecks(): number {
  return nodes.reduce((s, x) => s + (v.trust.peek(x.peerId)?.checks ?? 0), 0);
}

await until(async () => ((await (await fetch(`${tracker.url}/api/route?model=fortunes-tiny`)).ok) ? true : undefined), 30_000, 'a route');
console.log('warm-up: every node passes 10 checks in a row');
const warm0 = performance.now();
await until(
  async () => {
    await Promise.all(Array.from({ length: CONCURRENCY }, () => chat()));
    // The head's own span has no checker here (nobody else holds [0, 3)): only the hops warm up.
    return nodes.slice(1).every((x) => (v.trust.peek(x.peerId)?.consecutive ?? 0) >= 10) ? true : undefined;
  },
  600_000,
  'ten passes per hop',
);
const warmS = (performance.now() - warm0) / 1000;
for (const x of nodes) v.trust.get(x.peerId).consecutive = Math.max(v.trust.get(x.peerId).consecutive, STEADY);
console.log(`warm-up done in ${warmS.toFixed(0)} s; steady state: ${STEADY} passes in a row, P(check) = ${(v.trust.checkProbability(nodes[1]!.peerId) * 100).toFixed(1)} % per session`);

const phases: Array<{ mode: 'off' | 'on'; tokens: number; wallMs: number; cpuMs: number; checks: number }> = [];
for (let r = 0; r < ROUNDS; r++) {
  for (const mode of r % 2 === 0 ? (['off', 'on'] as const) : (['on', 'off'] as const)) {
    v.setEnabled(mode === 'on');
    const p = await phase(PHASE_MS);
    phases.push({ mode, ...p });
    console.log(`round ${r + 1} ${mode}: ${(p.tokens / (p.wallMs / 1000)).toFixed(1)} tokens/s, ${(p.cpuMs / Math.max(1, p.tokens)).toFixed(2)} node CPU ms/token, ${p.checks} checks`);
  }
}
// Checks in flight at the end of an "on" phase finish in the next: let them land before stopping.
await new Promise((r) => setTimeout(r, 2000));

const by = (mode: 'off' | 'on') => phases.filter((p) => p.mode === mode);
const tps = (mode: 'off' | 'on') => median(by(mode).map((p) => p.tokens / (p.wallMs / 1000)));
const cpt = (mode: 'off' | 'on') => median(by(mode).map((p) => p.cpuMs / Math.max(1, p.tokens)));
const checksPerToken = by('on').reduce((s, p) => s + p.checks, 0) / Math.max(1, by('on').reduce((s, p) => s + p.tokens, 0));

// Attestations alone: CPU per step of hashing + signing a step of fortunes-tiny (320 f32 wire values in and out).
const id = await Identity.generate();
const att = new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b) });
const row = new Uint8Array(320 * 4);
const STEPS = 2000;
const c0 = process.cpuUsage();
for (let i = 0; i < STEPS; i++) att.record({ model: 'm', session: 's', startLayer: 3, endLayer: 6, dtype: 'f32' }, i, 1, row, row);
await att.finish('s');
const cu = process.cpuUsage(c0);
const attestUs = (cu.user + cu.system) / STEPS;

const rows = [
  ['checks off', tps('off'), cpt('off'), 0],
  ['checks on', tps('on'), cpt('on'), checksPerToken * 1000],
];
printTable(`spot-check overhead at steady state (P(check) = ${(100 / Math.max(1 / 0.02, STEADY)).toFixed(1)} % per session; ${ROUNDS} rounds of ${PHASE_MS / 1000} s each, medians)`, ['mode', 'tokens/s', 'node CPU ms/token', 'checks per 1000 tokens'], rows);
const tpsRatio = tps('on') / tps('off');
const cpuRatio = cpt('on') / cpt('off');
console.log(`\non/off: tokens/s ×${tpsRatio.toFixed(3)} (${((1 - tpsRatio) * 100).toFixed(1)} % fewer), node CPU per token ×${cpuRatio.toFixed(3)} (${((cpuRatio - 1) * 100).toFixed(1)} % more)`);
console.log(`attestations (on in both modes): ${attestUs.toFixed(0)} µs of CPU per step per hop, off the critical path`);
const outArg = argv.includes('--out') ? argv[argv.indexOf('--out') + 1] : undefined;
writeResult(outArg ?? join(here, 'results', 'verify-overhead.json'), {
  model: 'fortunes-tiny',
  nodes: 4,
  concurrency: CONCURRENCY,
  max_tokens: MAX_TOKENS,
  steady_consecutive: STEADY,
  warmup_s: warmS,
  phases,
  median: { off: { tokens_per_s: tps('off'), cpu_ms_per_token: cpt('off') }, on: { tokens_per_s: tps('on'), cpu_ms_per_token: cpt('on') } },
  ratio: { tokens_per_s: tpsRatio, cpu_per_token: cpuRatio },
  checks_per_1000_tokens: checksPerToken * 1000,
  attest_cpu_us_per_step: attestUs,
});
await Promise.all(nodes.map((x) => x.stop()));
await tracker.close();
await relay.stop();
await st.close();
process.exit(0);
