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
 * (attestations) is on in both mesh modes — it is not a check; its own cost
 * is measured side by side at the end, in this process: one hop's real
 * forward handler on fortunes-tiny [3, 6) (onnxruntime-node), the same
 * sessions stepped with and without its Attestor in alternating blocks —
 * the answer's latency per decode step (the critical path) and the process
 * CPU per step, signatures of every session awaited inside the block.
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
import { FORTUNES_DIR, fortunesTiny } from '../test/helpers/fortunes-tiny.ts';
import { readFileSync } from 'node:fs';
import { ShardExecutor } from '../src/shard/executor.ts';
import { createForwardHandler } from '../src/node/hop/forward-handler.ts';
import { encodeTensor } from '../src/protocol/tensor.ts';
import { collectBody } from '../src/protocol/envelopes.ts';
import { nodeBackend } from '../test/helpers/shard.ts';
import { weightsFromFiles } from '../test/helpers/weights.ts';
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

// Signing side by side: one hop's forward handler with and without its Attestor, the same steps.
const f = fortunesTiny();
const H = f.cfg.hiddenSize;
const fw = weightsFromFiles(new Map([['model.safetensors', new Uint8Array(readFileSync(join(FORTUNES_DIR, 'model.safetensors')))]]));
const hopEx = await ShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => fw, startLayer: 3, endLayer: 6, maxContext: 256 });
const id = await Identity.generate();
const attestor = new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b) });
const plain = createForwardHandler(hopEx, { model: 'fortunes-tiny', backend: 'onnxruntime-node/cpu' });
const signing = createForwardHandler(hopEx, { model: 'fortunes-tiny', backend: 'onnxruntime-node/cpu', attestor });
const PROMPT_ROWS = 24;
const DECODE_STEPS = quick ? 32 : 64;
const SESSIONS_PER_BLOCK = 4;
const BLOCKS = quick ? 4 : 8;
const rowsOf = (n: number, seed: number) => encodeTensor(Float32Array.from({ length: n * H }, (_, i) => Math.sin(i * 0.37 + seed)), 'f32');
let sid = 0;
async function block(signed: boolean): Promise<{ stepMs: number[]; cpuUsPerStep: number }> {
  const handle = signed ? signing : plain;
  const stepMs: number[] = [];
  const c0 = process.cpuUsage();
  let steps = 0;
  for (let k = 0; k < SESSIONS_PER_BLOCK; k++) {
    const session = `bench.${sid++}`;
    let pos = 0;
    for (let st = 0; st <= DECODE_STEPS; st++) {
      const n = st === 0 ? PROMPT_ROWS : 1;
      const t0 = performance.now();
      const res = await handle({ method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': `1,${n},${H}`, 'x-meshnet-dtype': 'f32', 'x-meshnet-session': session, 'x-meshnet-position': String(pos), 'x-meshnet-start-layer': '3', 'x-meshnet-end-layer': '6' }, body: rowsOf(n, st) });
      if (res.status !== 200) throw new Error(`forward answered ${res.status}: ${new TextDecoder().decode(await collectBody(res.body))}`);
      if (st > 0) stepMs.push(performance.now() - t0);
      pos += n;
      steps++;
    }
    // The final attestation (what DELETE /sessions answers): every signature of the session is paid inside the block.
    const del = await handle({ method: 'DELETE', path: `/sessions/${session}`, headers: {}, body: new Uint8Array(0) });
    if (del.status !== 204) throw new Error(`DELETE answered ${del.status}`);
    if (signed && del.headers['x-meshnet-attest'] === undefined) throw new Error('no final attestation');
  }
  const cu = process.cpuUsage(c0);
  return { stepMs, cpuUsPerStep: (cu.user + cu.system) / steps };
}
await block(false);
await block(true); // warm both
const sign: Record<'off' | 'on', { stepMs: number[]; cpu: number[] }> = { off: { stepMs: [], cpu: [] }, on: { stepMs: [], cpu: [] } };
for (let b = 0; b < BLOCKS; b++) {
  for (const signed of b % 2 === 0 ? [false, true] : [true, false]) {
    const r = await block(signed);
    const m = sign[signed ? 'on' : 'off'];
    m.stepMs.push(...r.stepMs);
    m.cpu.push(r.cpuUsPerStep);
  }
}
await hopEx.release();
const signRows = (['off', 'on'] as const).map((m) => [`signing ${m}`, median(sign[m].stepMs), median(sign[m].cpu)]);
printTable(`one hop's forward, fortunes-tiny [3, 6), ${SESSIONS_PER_BLOCK * BLOCKS} sessions per mode (${PROMPT_ROWS}-row prompt + ${DECODE_STEPS} steps), alternating blocks, medians`, ['mode', 'decode step answer ms', 'CPU µs per step (signatures included)'], signRows);
const signLatencyRatio = median(sign.on.stepMs) / median(sign.off.stepMs);
const signCpuRatio = median(sign.on.cpu) / median(sign.off.cpu);
const attestUs = median(sign.on.cpu) - median(sign.off.cpu);
console.log(`signing on/off: answer latency ×${signLatencyRatio.toFixed(3)}, CPU per step ×${signCpuRatio.toFixed(3)} (+${attestUs.toFixed(0)} µs)`);

const rows = [
  ['checks off', tps('off'), cpt('off'), 0],
  ['checks on', tps('on'), cpt('on'), checksPerToken * 1000],
];
printTable(`spot-check overhead at steady state (P(check) = ${(100 / Math.max(1 / 0.02, STEADY)).toFixed(1)} % per session; ${ROUNDS} rounds of ${PHASE_MS / 1000} s each, medians)`, ['mode', 'tokens/s', 'node CPU ms/token', 'checks per 1000 tokens'], rows);
const tpsRatio = tps('on') / tps('off');
const cpuRatio = cpt('on') / cpt('off');
console.log(`\non/off: tokens/s ×${tpsRatio.toFixed(3)} (${((1 - tpsRatio) * 100).toFixed(1)} % fewer), node CPU per token ×${cpuRatio.toFixed(3)} (${((cpuRatio - 1) * 100).toFixed(1)} % more)`);

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
  signing: { decode_step_ms: { off: median(sign.off.stepMs), on: median(sign.on.stepMs) }, cpu_us_per_step: { off: median(sign.off.cpu), on: median(sign.on.cpu) }, ratio: { latency: signLatencyRatio, cpu: signCpuRatio } },
});
await Promise.all(nodes.map((x) => x.stop()));
await tracker.close();
await relay.stop();
await st.close();
process.exit(0);
