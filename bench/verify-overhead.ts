/**
 * What trust costs a mesh (docs/verification.md): spot-checks and signing.
 *
 * Spot-checks (`--part checks`), in one run, on one mesh of real processes —
 * a relay, four `meshnet node` processes on fortunes-tiny (a head H [0, 3)
 * and three holders of [3, 6), so every hop has two checkers off its route),
 * and the tracker in this process (so the bench can set the BOINC counters
 * between phases). Warm-up: every hop passes 10 checks in a row. Then rounds
 * of three phases of `--phase-s` seconds each, in a rotating order, with the
 * same load (4 chats at a time, greedy, 24 tokens):
 *   off     checks off;
 *   steady  each node's run of passes set to `--steady` (default 50: the
 *           BOINC odds are max(2 %, 1/50) = 2 % per session);
 *   all     every session checked (the run of passes reset before each chat).
 * Per phase: tokens/s through the tracker (the traffic's wall time), CPU ms
 * per token of the node processes (the mesh's compute: /proc/<pid>/stat)
 * and the checks judged, both read once the phase's checks have landed.
 * Ratios are taken per round against that round's "off" (phases next to each
 * other share the machine's load), medians over the rounds. At 2 % a check
 * is rare, so its cost hides in the noise of a few phases: "all" measures
 * the CPU one check costs, and the steady-state overhead is that cost times
 * the checks per token at steady state, over "off"'s CPU per token.
 *
 * Signing (`--part sign`), side by side in this process: one hop's real
 * forward handler on fortunes-tiny [3, 6) (onnxruntime-node), the same
 * sessions stepped in alternating blocks without an Attestor, with one that
 * signs every step (as first built), and with the default one (a signature
 * every 32 steps over the chain head); both hash with the node core's pure-JS
 * SHA-256 (bench/attest-hash.ts compares it with node:crypto and WebCrypto)
 * — the answer's latency per decode step (the critical path) and
 * the process CPU per step, every signature of a session awaited inside its
 * block (the DELETE that ends it answers the final attestation).
 *
 *   npx tsx bench/verify-overhead.ts [--quick] [--part all|checks|sign] [--phase-s 6] [--rounds 6] [--steady 50]
 * Table on stdout, JSON in bench/results/verify-overhead.json (one part:
 * merged into the file's other part).
 */
import { fileURLToPath } from 'node:url';
import { join } from 'node:path';
import { startStaticServer } from '../src/cli/static-server.ts';
import { startTracker } from '../src/tracker/server.ts';
import { Identity } from '../src/net/identity.ts';
import { Attestor } from '../src/verify/attestor.ts';
import { parseAttestations, tokenBytes } from '../src/verify/attest.ts';
import { FORTUNES_DIR, fortunesTiny } from '../test/helpers/fortunes-tiny.ts';
import { existsSync, readFileSync } from 'node:fs';
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
const part = argv.includes('--part') ? argv[argv.indexOf('--part') + 1]! : 'all';
if (!['all', 'checks', 'sign'].includes(part)) throw new Error(`--part all|checks|sign, not ${part}`);
const PHASE_MS = arg('--phase-s', quick ? 5 : 6) * 1000;
const ROUNDS = arg('--rounds', quick ? 3 : 6);
const STEADY = arg('--steady', 50);
const CONCURRENCY = 4;
const MAX_TOKENS = 24;
const TOPICS = ['science', 'cats', 'the sea', 'money', 'love', 'work', 'music', 'time', 'rain', 'dogs', 'coffee', 'luck'];
const here = fileURLToPath(new URL('.', import.meta.url));
const outFile = (argv.includes('--out') ? argv[argv.indexOf('--out') + 1] : undefined) ?? join(here, 'results', 'verify-overhead.json');
const result: Record<string, unknown> = { model: 'fortunes-tiny' };
if (part !== 'all' && existsSync(outFile)) {
  // One part: keep the other part's figures (and say when they were taken).
  const old = JSON.parse(readFileSync(outFile, 'utf8')) as Record<string, unknown>;
  const keep = part === 'sign' ? 'checks' : 'signing';
  if (old[keep] !== undefined) result[keep] = { ...(old[keep] as object), date: (old[keep] as { date?: string }).date ?? old.date };
}

type Mode = 'off' | 'steady' | 'all';
const MODES: Mode[] = ['off', 'steady', 'all'];

async function checksPart(): Promise<void> {
  const st = await startStaticServer({ root: FORTUNES_DIR, port: 0, host: '127.0.0.1' });
  const relay = await startRelayProcess();
  const tracker = await startTracker({ port: 0, models: [{ name: 'fortunes-tiny', url: st.url }], relayUrl: relay.url, wireDtype: 'f32', heartbeatIntervalMs: 500, logLevel: 'warn' });
  const common = ['--tracker', tracker.url, '--relay', relay.url, '--model-url', st.url, '--wire-dtype', 'f32', '--max-context', '256'];
  const nodes: NodeProc[] = [];
  for (const layers of ['0-3', '3-6', '3-6', '3-6']) nodes.push(await startNode([...common, '--layers', layers]));
  const v = tracker.verification;
  let mode: Mode = 'off';

  let n = 0;
  async function chat(): Promise<number> {
    // "all": every session checked (a node with fewer than 10 passes in a row is checked every time).
    if (mode === 'all') for (const x of nodes) v.trust.get(x.peerId).consecutive = 0;
    const res = await fetch(`${tracker.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'fortunes-tiny', messages: [{ role: 'user', content: `Tell me a fortune about ${TOPICS[n++ % TOPICS.length]}.` }], max_tokens: MAX_TOKENS, temperature: 0 }),
    });
    const body = (await res.json()) as { usage?: { completion_tokens: number } };
    if (res.status !== 200) throw new Error(`chat answered ${res.status}: ${JSON.stringify(body).slice(0, 200)}`);
    return body.usage?.completion_tokens ?? 0;
  }
  const totalChecks = () => nodes.reduce((s, x) => s + (v.trust.peek(x.peerId)?.checks ?? 0), 0);

  /** `CONCURRENCY` chats at a time for `ms`: tokens, wall ms, node CPU ms, checks judged. */
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
    // The phase's checks run after its generations: let them land (no new verdict for 1.5 s) before the CPU is read,
    // so each phase pays for its own checks and none leaks into the next.
    let last = totalChecks();
    for (let quiet = 0, waited = 0; quiet < 3 && waited < 20_000; waited += 500) {
      await new Promise((r) => setTimeout(r, 500));
      const now = totalChecks();
      quiet = now === last ? quiet + 1 : 0;
      last = now;
    }
    return { tokens, wallMs, cpuMs: nodes.reduce((s, x) => s + cpuMs(x.child.pid).all, 0) - cpu0, checks: totalChecks() - checks0 };
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
  console.log(`warm-up done in ${warmS.toFixed(0)} s; steady state: ${STEADY} passes in a row, P(check) = ${(100 / Math.max(1 / 0.02, STEADY)).toFixed(1)} % per session`);

  const phases: Array<{ round: number; mode: Mode; tokens: number; wallMs: number; cpuMs: number; checks: number }> = [];
  for (let r = 0; r < ROUNDS; r++) {
    for (let k = 0; k < MODES.length; k++) {
      mode = MODES[(r + k) % MODES.length]!;
      v.setEnabled(mode !== 'off');
      if (mode === 'steady') for (const x of nodes) v.trust.get(x.peerId).consecutive = STEADY;
      const p = await phase(PHASE_MS);
      phases.push({ round: r, mode, ...p });
      console.log(`round ${r + 1} ${mode.padEnd(6)}: ${(p.tokens / (p.wallMs / 1000)).toFixed(1)} tokens/s, ${(p.cpuMs / Math.max(1, p.tokens)).toFixed(2)} node CPU ms/token, ${p.checks} checks`);
    }
  }
  mode = 'off';
  await Promise.all(nodes.map((x) => x.stop()));
  await tracker.close();
  await relay.stop();
  await st.close();

  const of = (r: number, m: Mode) => phases.find((p) => p.round === r && p.mode === m)!;
  const tps = (p: { tokens: number; wallMs: number }) => p.tokens / (p.wallMs / 1000);
  const cpt = (p: { tokens: number; cpuMs: number }) => p.cpuMs / Math.max(1, p.tokens);
  const rounds = [...Array(ROUNDS).keys()];
  const by = (m: Mode) => phases.filter((p) => p.mode === m);
  const checksPerToken = (m: Mode) => by(m).reduce((s, p) => s + p.checks, 0) / Math.max(1, by(m).reduce((s, p) => s + p.tokens, 0));
  const ratio = (m: Mode, f: (p: (typeof phases)[number]) => number) => median(rounds.map((r) => f(of(r, m)) / f(of(r, 'off'))));
  const rows = MODES.map((m) => [m, median(by(m).map(tps)), median(by(m).map(cpt)), checksPerToken(m) * 1000, ratio(m, tps), ratio(m, cpt)]);
  printTable(`spot-checks: ${ROUNDS} rounds of ${PHASE_MS / 1000} s per mode, medians (ratios: per round against that round's "off")`, ['mode', 'tokens/s', 'node CPU ms/token', 'checks / 1000 tokens', 'tokens/s ÷ off', 'CPU/token ÷ off'], rows);
  // One check's CPU from "all" (where checks are many), per round: extra CPU per token over checks per token.
  const perCheck = median(rounds.map((r) => (cpt(of(r, 'all')) - cpt(of(r, 'off'))) / Math.max(1e-9, of(r, 'all').checks / Math.max(1, of(r, 'all').tokens))));
  const cptOff = median(by('off').map(cpt));
  const steadyEstimate = (perCheck * checksPerToken('steady')) / cptOff;
  console.log(`\none check costs the mesh ${perCheck.toFixed(1)} ms of CPU (from "all"); at steady state (${(checksPerToken('steady') * 1000).toFixed(2)} checks / 1000 tokens) that is ${(steadyEstimate * 100).toFixed(2)} % of the mesh's compute`);
  console.log(`measured directly at steady state: tokens/s ×${ratio('steady', tps).toFixed(3)}, CPU per token ×${ratio('steady', cpt).toFixed(3)} (per-round ratios: ${rounds.map((r) => (tps(of(r, 'steady')) / tps(of(r, 'off'))).toFixed(2)).join(' ')})`);
  result.checks = {
    date: new Date().toISOString(),
    nodes: 4,
    concurrency: CONCURRENCY,
    max_tokens: MAX_TOKENS,
    steady_consecutive: STEADY,
    phase_s: PHASE_MS / 1000,
    rounds: ROUNDS,
    warmup_s: warmS,
    phases,
    median: Object.fromEntries(MODES.map((m) => [m, { tokens_per_s: median(by(m).map(tps)), cpu_ms_per_token: median(by(m).map(cpt)), checks_per_1000_tokens: checksPerToken(m) * 1000 }])),
    ratio_vs_off: Object.fromEntries((['steady', 'all'] as const).map((m) => [m, { tokens_per_s: ratio(m, tps), cpu_per_token: ratio(m, cpt) }])),
    cpu_ms_per_check: perCheck,
    steady_compute_overhead_estimate: steadyEstimate,
  };
}

async function signPart(): Promise<void> {
  // Signing side by side: one hop's forward handler without an Attestor, with one signing every step
  // (as first built), and with the default one; the same steps.
  const f = fortunesTiny();
  const H = f.cfg.hiddenSize;
  const fw = weightsFromFiles(new Map([['model.safetensors', new Uint8Array(readFileSync(join(FORTUNES_DIR, 'model.safetensors')))]]));
  const hopEx = await ShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => fw, startLayer: 3, endLayer: 6, maxContext: 256 });
  const id = await Identity.generate();
  const info = { model: 'fortunes-tiny', backend: 'onnxruntime-node/cpu' };
  type SignMode = 'off' | 'every step' | 'default';
  const SIGN_MODES: SignMode[] = ['off', 'every step', 'default'];
  const handlers: Record<SignMode, ReturnType<typeof createForwardHandler>> = {
    off: createForwardHandler(hopEx, info),
    'every step': createForwardHandler(hopEx, { ...info, attestor: new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b), signEvery: 1 }) }),
    default: createForwardHandler(hopEx, { ...info, attestor: new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b) }) }),
  };
  const PROMPT_ROWS = 24;
  const DECODE_STEPS = quick ? 32 : 64;
  const SESSIONS_PER_BLOCK = 4;
  const BLOCKS = quick ? 6 : 12;
  const rowsOf = (n: number, seed: number) => encodeTensor(Float32Array.from({ length: n * H }, (_, i) => Math.sin(i * 0.37 + seed)), 'f32');
  let sid = 0;
  async function block(m: SignMode): Promise<{ stepMs: number[]; cpuUsPerStep: number }> {
    const handle = handlers[m];
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
      const final = parseAttestations(del.headers['x-meshnet-attest']);
      if (m !== 'off' && final[0]?.rows !== pos) throw new Error(`the final attestation covers ${final[0]?.rows} rows, not ${pos}`);
    }
    const cu = process.cpuUsage(c0);
    return { stepMs, cpuUsPerStep: (cu.user + cu.system) / steps };
  }
  for (const m of SIGN_MODES) await block(m); // warm every mode
  const got = Object.fromEntries(SIGN_MODES.map((m) => [m, { stepMs: [] as number[], cpu: [] as number[] }])) as Record<SignMode, { stepMs: number[]; cpu: number[] }>;
  /** Per block round, each mode's CPU over that round's "off". */
  const cpuRatios: Record<SignMode, number[]> = { off: [], 'every step': [], default: [] };
  for (let b = 0; b < BLOCKS; b++) {
    const round: Partial<Record<SignMode, number>> = {};
    for (let k = 0; k < SIGN_MODES.length; k++) {
      const m = SIGN_MODES[(b + k) % SIGN_MODES.length]!;
      const r = await block(m);
      got[m].stepMs.push(...r.stepMs);
      got[m].cpu.push(r.cpuUsPerStep);
      round[m] = r.cpuUsPerStep;
    }
    for (const m of SIGN_MODES) cpuRatios[m].push(round[m]! / round.off!);
  }
  await hopEx.release();
  // The attestor alone, on the same steps' bytes (a 24-row f32 prompt, then one row; the last hop's token out):
  // onnxruntime's threads make a step's CPU vary by more than signing costs, so this isolates what signing adds.
  const alone = async (m: SignMode): Promise<number> => {
    const a = m === 'every step' ? new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b), signEvery: 1 }) : new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b) });
    const c0 = process.cpuUsage();
    let steps = 0;
    for (let k = 0; k < 16; k++) {
      const scope = { model: 'fortunes-tiny', session: `alone.${sid++}`, startLayer: 3, endLayer: 6, dtype: 'f32', sampling: '' };
      let pos = 0;
      for (let st = 0; st <= DECODE_STEPS; st++) {
        const n = st === 0 ? PROMPT_ROWS : 1;
        a.record(scope, pos, n, rowsOf(n, st), tokenBytes(st, -0.5));
        // As in a hop: the next step comes after this one's answer, a turn of the event loop later.
        await new Promise((r) => setImmediate(r));
        pos += n;
        steps++;
      }
      await a.finish(scope.session);
    }
    const cu = process.cpuUsage(c0);
    return (cu.user + cu.system) / steps;
  };
  const aloneUs: Record<'every step' | 'default', number[]> = { 'every step': [], default: [] };
  const baseUs: number[] = [];
  for (let b = 0; b < BLOCKS; b++) {
    // The loop's own cost (the rows made, the turns waited) without an attestor, subtracted below.
    const c0 = process.cpuUsage();
    for (let k = 0; k < 16; k++) for (let st = 0; st <= DECODE_STEPS; st++) {
      rowsOf(st === 0 ? PROMPT_ROWS : 1, st);
      tokenBytes(st, -0.5);
      await new Promise((r) => setImmediate(r));
    }
    const cu = process.cpuUsage(c0);
    baseUs.push((cu.user + cu.system) / (16 * (DECODE_STEPS + 1)));
    for (const m of ['every step', 'default'] as const) aloneUs[m].push(await alone(m));
  }
  const attestUs = (m: 'every step' | 'default') => Math.max(0, median(aloneUs[m]) - median(baseUs));
  const offMs = median(got.off.stepMs);
  const rows = SIGN_MODES.map((m) => [m, median(got[m].stepMs), median(got[m].stepMs) / offMs, median(got[m].cpu), median(cpuRatios[m])]);
  printTable('signing alone: the attestor on the same steps\' bytes, CPU per step (the loop\'s own cost subtracted), medians', ['mode', 'attestation CPU µs per step', '÷ a step\'s CPU with signing off'], (['every step', 'default'] as const).map((m) => [m, attestUs(m), attestUs(m) / median(got.off.cpu)]));
  printTable(`signing: one hop's forward, fortunes-tiny [3, 6), ${SESSIONS_PER_BLOCK * BLOCKS} sessions per mode (${PROMPT_ROWS}-row prompt + ${DECODE_STEPS} steps), rotating blocks, medians`, ['mode', 'decode answer ms', 'latency ÷ off', 'CPU µs per step', 'CPU ÷ off (per round)'], rows);
  result.signing = {
    date: new Date().toISOString(),
    sessions_per_mode: SESSIONS_PER_BLOCK * BLOCKS,
    prompt_rows: PROMPT_ROWS,
    decode_steps: DECODE_STEPS,
    modes: Object.fromEntries(SIGN_MODES.map((m) => [m, { decode_step_ms: median(got[m].stepMs), cpu_us_per_step: median(got[m].cpu), latency_ratio: median(got[m].stepMs) / offMs, cpu_ratio: median(cpuRatios[m]), ...(m !== 'off' ? { attestor_alone_cpu_us_per_step: attestUs(m), attestor_alone_vs_step_cpu: attestUs(m) / median(got.off.cpu) } : {}) }])),
  };
}

if (part !== 'sign') await checksPart();
if (part !== 'checks') await signPart();
writeResult(outFile, result);
process.exit(0);
