/**
 * Calibration of spot-checks (docs/verification.md): how far an honest
 * hop's output is from an honest checker's recomputation of it, for every
 * pair of hosts and weight formats a mesh mixes, and how far each lying mode
 * is. The thresholds a verdict uses must sit far above the first and far
 * below the second.
 *
 * On the shipped fortunes-tiny (learned weights, real prompts): the head
 * runs layers [0, a) step by step (the prompt, then one token a step, every
 * prompt's step batched together as a node batches them), its output goes
 * on the wire (bf16, or f32); the checked hop runs [a, b) the same way with a
 * KV session; the checker runs [a, b) once over every input row (one
 * stateless prefill, as a spot-check does). Per row: relative L2 and the
 * peak deviation over the row's RMS (src/verify/distance.ts). The last hop
 * [b, L) samples a token per step; the checker's logits at that row give
 * the claimed token's deficit (top logit − its logit) and, at temperature
 * 0.8/top-p 0.95, the seeded draw's gap from its interval
 * (src/verify/token-check.ts).
 *
 * Implementations (checked × checker, all pairs):
 *   cpu-f32     onnxruntime-node, plain graphs (a Node.js node)
 *   wasm-f32    onnxruntime-web WASM, fused graphs, f32 (a browser without WebGPU)
 *   wasm-q4     the same, 4-bit projections
 *   webgpu-f32  onnxruntime-web WebGPU EP on Dawn/SwiftShader, fused f32 (a GPU node; a browser's GPU path)
 *   webgpu-q4   the same, 4-bit
 * Lying modes (checked side; checker cpu-f32 and wasm-f32): noise 1 % (σ = 1 % of the row's RMS), zeroed
 * rows, wrong layers (layer l runs layer l+1's weights), tampered weights (every weight of the span
 * with 1 % relative noise; one layer's down projection with 5 %), 4-bit weights announced as f32, and
 * for the last hop the second-best token.
 *
 *   npx tsx bench/verify-calibration.ts [--prompts N] [--tokens N] [--impls cpu-f32,wasm-f32,...] [--quick]
 * Table on stdout, JSON in bench/results/verify-calibration.json.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { SHIPPED_MODELS } from '../src/cli/demo-model.ts';
import { parseModelConfig, type ModelConfig } from '../src/model/config.ts';
import { buildHeadGraph, IO, type WeightSource } from '../src/model/graph.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { decodeTensor, encodeTensor, type Dtype } from '../src/protocol/tensor.ts';
import type { OnnxBackend, OnnxSession } from '../src/shard/backend.ts';
import { ShardExecutor } from '../src/shard/executor.ts';
import type { ForwardRequest, ForwardResult } from '../src/shard/contract.ts';
import { FusedShardExecutor } from '../src/shard/fused-executor.ts';
import { sampleToken, type SamplingParams } from '../src/shard/sampling.ts';
import { createNodeBackend } from '../src/host/node/onnx.ts';
import { createWasmBackend } from '../src/host/node/onnx-wasm.ts';
import { rowDistances } from '../src/verify/distance.ts';
import { argmax, checkToken } from '../src/verify/token-check.ts';
import { thresholdsFor, type NodeClass } from '../src/verify/thresholds.ts';
import { weightsFromFiles } from '../test/helpers/weights.ts';
import { dequantizedWeights } from '../test/helpers/fused.ts';
import { printTable, quantile, writeResult } from './lib/stats.ts';

const argv = process.argv.slice(2);
const arg = (name: string) => (argv.includes(name) ? argv[argv.indexOf(name) + 1] : undefined);
const quick = argv.includes('--quick');
const PROMPTS = Number(arg('--prompts') ?? (quick ? 6 : 40));
const TOKENS = Number(arg('--tokens') ?? (quick ? 12 : 48));
const ALL_IMPLS = ['cpu-f32', 'wasm-f32', 'wasm-q4', 'webgpu-f32', 'webgpu-q4'] as const;
type ImplName = (typeof ALL_IMPLS)[number];
const IMPLS = (arg('--impls')?.split(',') ?? [...ALL_IMPLS]) as ImplName[];
const DTYPES: Dtype[] = (arg('--dtypes')?.split(',') as Dtype[] | undefined) ?? ['bf16', 'f32'];
const here = fileURLToPath(new URL('.', import.meta.url));

// Dawn finds Vulkan through LD_LIBRARY_PATH, read only when a process starts: run again with it set.
if (IMPLS.some((i) => i.startsWith('webgpu'))) {
  const { vulkanEnv } = await import('../src/host/node/webgpu.ts');
  const env = vulkanEnv();
  if (Object.keys(env).length > 0 && process.env.MESHNET_CALIBRATION_CHILD !== '1') {
    const { spawnSync } = await import('node:child_process');
    const r = spawnSync(process.execPath, [...process.execArgv, ...process.argv.slice(1)], { stdio: 'inherit', env: { ...process.env, ...env, MESHNET_CALIBRATION_CHILD: '1' } });
    process.exit(r.status ?? 1);
  }
}
const outFile = arg('--out') ?? join(here, 'results', 'verify-calibration.json');

const TOPICS = [
  'science', 'the sea', 'cats', 'money', 'love', 'work', 'computers', 'the future', 'friends', 'music',
  'coffee', 'mathematics', 'travel', 'sleep', 'politics', 'books', 'rain', 'luck', 'dogs', 'time',
  'teachers', 'cooking', 'the moon', 'old age', 'children', 'war', 'gardens', 'taxes', 'winter', 'fame',
  'truth', 'wine', 'bugs', 'the internet', 'mountains', 'doctors', 'lawyers', 'dreams', 'history', 'silence',
  'trains', 'chess', 'poetry', 'shoes', 'bread', 'patience', 'hope', 'clocks',
];

// ------------------------------------------------------------------ model

const dir = SHIPPED_MODELS['fortunes-tiny'].dir;
const read = (f: string) => readFileSync(join(dir, f));
const cfg = parseModelConfig(JSON.parse(read('config.json').toString('utf8')));
const tok = ModelTokenizer.fromJson(JSON.parse(read('tokenizer.json').toString('utf8')), JSON.parse(read('tokenizer_config.json').toString('utf8')), { extraEosTokenIds: cfg.eosTokenIds });
const weights = weightsFromFiles(new Map([['model.safetensors', new Uint8Array(read('model.safetensors'))]]));
const L = cfg.numLayers;
const H = cfg.hiddenSize;
/** The middle hop and the last hop this calibration checks (fortunes-tiny has 6 layers). */
const MID: [number, number] = [1, 3];
const LAST: [number, number] = [3, L];

// ------------------------------------------------------------------ backends and executors

interface Exec {
  forward(req: ForwardRequest): Promise<ForwardResult>;
  release(): Promise<void>;
}

const cpuBackend = createNodeBackend({ intraOpNumThreads: 1 });
let wasmBackend: OnnxBackend | undefined;
let gpuBackend: OnnxBackend | undefined;

async function backendOf(impl: ImplName): Promise<OnnxBackend> {
  if (impl.startsWith('cpu')) return cpuBackend;
  if (impl.startsWith('wasm')) return (wasmBackend ??= createWasmBackend({ numThreads: 1 }));
  if (!gpuBackend) {
    const { installNodeWebGpu } = await import('../src/host/node/webgpu.ts');
    await installNodeWebGpu();
    const { createOrtWebBackend } = await import('../src/host/browser/onnx.ts');
    gpuBackend = await createOrtWebBackend('webgpu', { numThreads: 1, wasmPaths: pathToFileURL(join(here, '..', 'node_modules', 'onnxruntime-web', 'dist')).href + '/' });
  }
  return gpuBackend;
}

/**
 * An executor of `impl` over [start, end). `noHead`: a span that ends at the last layer but
 * answers its hidden rows (the checker feeds them to its own head graph for every row).
 */
async function makeExec(impl: ImplName, start: number, end: number, src: WeightSource, noHead = false): Promise<Exec> {
  const backend = await backendOf(impl);
  const config: ModelConfig = noHead ? { ...cfg, numLayers: cfg.numLayers + 1 } : cfg;
  const common = { config, backend, weights: () => src, startLayer: start, endLayer: end, maxContext: 512, maxBatch: 16 };
  if (impl === 'cpu-f32') return ShardExecutor.create(common);
  const cuts: number[] = [];
  for (let l = start + 1; l < end; l++) cuts.push(l);
  return FusedShardExecutor.create({ ...common, projections: impl.endsWith('q4') ? 'q4' : 'f32', segmentBoundaries: cuts, returnLogits: true });
}

async function headGraph(impl: ImplName): Promise<OnnxSession> {
  const backend = await backendOf(impl);
  return backend.createSession(buildHeadGraph(cfg, impl.endsWith('q4') ? dequantizedWeights(weights) : weights).bytes);
}

// ------------------------------------------------------------------ lying weights

/** Layer l computed with layer l+1's weights: the right computation on the wrong layers. */
function shiftedLayers(src: WeightSource): WeightSource {
  return (name) => {
    const m = /^model\.layers\.(\d+)\.(.*)$/.exec(name);
    if (!m) return src(name);
    const l = Number(m[1]);
    return src(`model.layers.${Math.min(L - 1, l + 1)}.${m[2]}`);
  };
}

function gaussian(rand: () => number): number {
  return Math.sqrt(-2 * Math.log(1 - rand())) * Math.cos(2 * Math.PI * rand());
}

function mulberry(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Every layer weight of [lo, hi) (or only names matching `only`) with relative Gaussian noise `rel`. */
function tampered(src: WeightSource, rel: number, lo: number, hi: number, only?: RegExp): WeightSource {
  const cache = new Map<string, { shape: readonly number[]; data: Float32Array }>();
  return (name) => {
    const m = /^model\.layers\.(\d+)\./.exec(name);
    if (!m || Number(m[1]) < lo || Number(m[1]) >= hi || (only && !only.test(name))) return src(name);
    let t = cache.get(name);
    if (!t) {
      const w = src(name);
      const rand = mulberry(name.length * 7919 + 17);
      const data = Float32Array.from(w.data, (x) => x * (1 + rel * gaussian(rand)));
      t = { shape: w.shape, data };
      cache.set(name, t);
    }
    return t;
  };
}

// ------------------------------------------------------------------ sequences and inputs

interface Seq {
  ids: number[];
  /** Row counts of the steps: the prompt, then one per generated token. */
  steps: number[];
}

async function greedySequences(): Promise<Seq[]> {
  const full = await ShardExecutor.create({ config: cfg, backend: cpuBackend, weights: () => weights, startLayer: 0, endLayer: L, maxContext: 512 });
  const seqs = TOPICS.slice(0, PROMPTS).map((t, i) => {
    const ids = tok.encodeChat([{ role: 'user', content: `Tell me a fortune about ${t}.` }]);
    return { ids, steps: [ids.length], session: `g${i}`, done: false };
  });
  let last = await Promise.all(seqs.map((s) => full.forward({ session: s.session, position: 0, tokenIds: s.ids, sessionTokens: s.ids.length + TOKENS })));
  for (let k = 0; k < TOKENS; k++) {
    const next = last.map((r) => (r.kind === 'token' ? r.tokenId : 0));
    // An eos is fed like any token: the calibration wants rows, not fortunes that stop.
    const steps = seqs.map((s, i) => {
      s.ids.push(next[i]!);
      s.steps.push(1);
      return full.forward({ session: s.session, position: s.ids.length - 1, tokenIds: [next[i]!] });
    });
    last = await Promise.all(steps);
  }
  // The last token pushed has no step of its own yet: drop it so every row has an output.
  for (const s of seqs) {
    s.ids.pop();
    s.steps.pop();
  }
  await full.release();
  return seqs;
}

/** Runs `exec` over each sequence's steps with a session (all sequences' steps batched together); the steps' outputs. */
async function stepwise(exec: Exec, inputs: Float32Array[], seqs: Seq[], start: number, end: number, sampling?: SamplingParams): Promise<ForwardResult[][]> {
  const out: ForwardResult[][] = seqs.map(() => []);
  const pos = seqs.map(() => 0);
  const maxSteps = Math.max(...seqs.map((s) => s.steps.length));
  for (let k = 0; k < maxSteps; k++) {
    await Promise.all(
      seqs.map(async (s, i) => {
        if (k >= s.steps.length) return;
        const n = s.steps[k]!;
        const p = pos[i]!;
        const req: ForwardRequest = {
          session: `s${i}`,
          position: p,
          startLayer: start,
          endLayer: end,
          ...(p === 0 ? { sessionTokens: s.ids.length } : {}),
          ...(start === 0 ? { tokenIds: s.ids.slice(p, p + n) } : { activation: { data: inputs[i]!.subarray(p * H, (p + n) * H), shape: [1, n, H] } }),
          ...(sampling ? { sampling } : {}),
        };
        out[i]!.push(await exec.forward(req));
        pos[i] = p + n;
      }),
    );
  }
  return out;
}

/** Wire round trip: what the next hop (and the check) sees of f32 rows. */
function wire(rows: Float32Array, dtype: Dtype): Float32Array {
  return decodeTensor(encodeTensor(rows, dtype), dtype);
}

function rowsOf(results: ForwardResult[]): Float32Array {
  const parts = results.map((r) => (r.kind === 'activation' ? r.data : new Float32Array(0)));
  const all = new Float32Array(parts.reduce((n, p) => n + p.length, 0));
  let o = 0;
  for (const p of parts) {
    all.set(p, o);
    o += p.length;
  }
  return all;
}

// ------------------------------------------------------------------ statistics

interface Dist {
  pair: string;
  dtype: Dtype;
  rows: number;
  /** The pair's threshold (src/verify/thresholds.ts) and the rows above it: false accusations for an honest pair, rows caught for a lie. */
  threshold: number;
  over: number;
  rel: { min: number; p01: number; p50: number; p99: number; p999: number; max: number };
  peak: { min: number; p01: number; p50: number; p99: number; p999: number; max: number };
}

function dist(pair: string, dtype: Dtype, rel: number[], peak: number[], threshold: number): Dist {
  const r = [...rel].sort((a, b) => a - b);
  const p = [...peak].sort((a, b) => a - b);
  const q = (s: number[]) => ({ min: s[0] ?? NaN, p01: quantile(s, 0.01), p50: quantile(s, 0.5), p99: quantile(s, 0.99), p999: quantile(s, 0.999), max: s[s.length - 1] ?? NaN });
  return { pair, dtype, rows: r.length, threshold, over: rel.filter((x) => !(x <= threshold)).length, rel: q(r), peak: q(p) };
}

/** What the tracker would know of an implementation from its heartbeats; a lying node announces f32. */
function classOf(name: string): NodeClass {
  const impl = name.startsWith('lie:') ? 'cpu-f32' : name;
  return { format: impl.endsWith('q4') ? 'q4' : 'f32', backend: impl.split('-')[0]! };
}

interface TokenStats {
  pair: string;
  dtype: Dtype;
  steps: number;
  /** Steps over the pair's thresholds: false accusations for an honest last hop, steps caught for a lie. */
  over: { greedy: number; sampled: number };
  /** Greedy: claimed token's deficit under the checker's logits. */
  deficit: { min: number; p01: number; p50: number; p99: number; max: number; nonzero: number };
  /** Temperature 0.8 / top-p 0.95 / seeded: the draw's gap from the claimed token's interval. */
  gap: { p99: number; max: number; nonzero: number };
  /** |claimed log-probability − the checker's for that token| (greedy claims). */
  logprob: { min: number; p01: number; p50: number; p99: number; max: number };
}

// ------------------------------------------------------------------ main

const t0 = performance.now();
console.log(`fortunes-tiny: ${PROMPTS} prompts × ${TOKENS} tokens; checked hop [${MID[0]}, ${MID[1]}), last hop [${LAST[0]}, ${LAST[1]}); impls ${IMPLS.join(', ')}; wire ${DTYPES.join(', ')}`);
const seqs = await greedySequences();
const totalRows = seqs.reduce((n, s) => n + s.ids.length, 0);
console.log(`sequences: ${totalRows} rows in all (${((performance.now() - t0) / 1000).toFixed(1)} s)`);

const dists: Dist[] = [];
const lies: Dist[] = [];
const tokens: TokenStats[] = [];
const lyingTokens: TokenStats[] = [];
const SAMPLING: SamplingParams = { temperature: 0.8, topP: 0.95 };

for (const dtype of DTYPES) {
  // The head's output on the wire: the checked hop's input and the checker's, byte for byte.
  const head = await makeExec('cpu-f32', 0, MID[0], weights);
  const headOut = (await stepwise(head, [], seqs, 0, MID[0])).map((r) => wire(rowsOf(r), dtype));
  await head.release();

  // Checked hops, stepwise, per implementation (and the lying ones).
  const claimsMid = new Map<string, Float32Array[]>();
  const checkedMid: Array<[string, ImplName, WeightSource]> = IMPLS.map((i) => [i, i, weights] as [string, ImplName, WeightSource]);
  checkedMid.push(['lie:wrong-layers', 'cpu-f32', shiftedLayers(weights)]);
  checkedMid.push(['lie:tampered-1%-all', 'cpu-f32', tampered(weights, 0.01, MID[0], MID[1])]);
  checkedMid.push(['lie:tampered-5%-one-matrix', 'cpu-f32', tampered(weights, 0.05, MID[0], MID[0] + 1, /down_proj/)]);
  checkedMid.push(['lie:4-bit-as-f32', 'cpu-f32', dequantizedWeights(weights)]);
  for (const [name, impl, src] of checkedMid) {
    console.log(`  ${dtype}: checked hop ${name} (${((performance.now() - t0) / 1000).toFixed(1)} s)`);
    const ex = await makeExec(impl, MID[0], MID[1], src);
    claimsMid.set(name, (await stepwise(ex, headOut, seqs, MID[0], MID[1])).map((r) => wire(rowsOf(r), dtype)));
    await ex.release();
  }
  const honestCpu = claimsMid.get('cpu-f32') ?? claimsMid.values().next().value!;
  const rand = mulberry(7);
  claimsMid.set('lie:noise-1%', honestCpu.map((rows) => {
    const out = new Float32Array(rows.length);
    for (let r = 0; r < rows.length / H; r++) {
      let ss = 0;
      for (let i = 0; i < H; i++) ss += rows[r * H + i]! ** 2;
      const rms = Math.sqrt(ss / H);
      for (let i = 0; i < H; i++) out[r * H + i] = rows[r * H + i]! + 0.01 * rms * gaussian(rand);
    }
    return wire(out, dtype);
  }));
  claimsMid.set('lie:zeroed', honestCpu.map((rows) => new Float32Array(rows.length)));

  // Checkers: one stateless prefill over all of a sequence's rows.
  for (const checker of IMPLS) {
    console.log(`  ${dtype}: checker ${checker} (${((performance.now() - t0) / 1000).toFixed(1)} s)`);
    const ex = await makeExec(checker, MID[0], MID[1], weights);
    const checks: Float32Array[] = [];
    for (let i = 0; i < seqs.length; i++) {
      const n = seqs[i]!.ids.length;
      const r = await ex.forward({ startLayer: MID[0], endLayer: MID[1], activation: { data: headOut[i]!, shape: [1, n, H] } });
      checks.push(wire(rowsOf([r]), dtype));
    }
    await ex.release();
    for (const [name, claims] of claimsMid) {
      const lying = name.startsWith('lie:');
      if (lying && !(checker === 'cpu-f32' || checker === 'wasm-f32')) continue;
      const rel: number[] = [];
      const peak: number[] = [];
      for (let i = 0; i < seqs.length; i++) {
        const d = rowDistances(claims[i]!, checks[i]!, H);
        rel.push(...d.rel);
        peak.push(...d.peak);
      }
      (lying ? lies : dists).push(dist(`${name} / ${checker}`, dtype, rel, peak, thresholdsFor(classOf(name), classOf(checker)).rowRel));
    }
  }

  // The last hop: claimed tokens (greedy, and what temperature sampling would pick on the claim's logits).
  const lastIn = claimsMid.get('cpu-f32') ?? honestCpu;
  interface Claim {
    greedy: number[][];
    /** The log-probability each greedy claim answered. */
    lp: number[][];
    sampled: number[][];
    second: number[][];
    /** The second-best token's log-probability under the claim's logits (what a liar picking it would answer). */
    secondLp: number[][];
  }
  const claimsLast = new Map<string, Claim>();
  const checkedLast: Array<[string, ImplName, WeightSource]> = IMPLS.map((i) => [i, i, weights] as [string, ImplName, WeightSource]);
  checkedLast.push(['lie:4-bit-as-f32', 'cpu-f32', dequantizedWeights(weights)]);
  for (const [name, impl, src] of checkedLast) {
    const ex = await makeExec(impl, LAST[0], LAST[1], src);
    const res = await stepwise(ex, lastIn, seqs, LAST[0], LAST[1]);
    await ex.release();
    const claim: Claim = { greedy: [], lp: [], sampled: [], second: [], secondLp: [] };
    res.forEach((steps, i) => {
      let pos = 0;
      claim.greedy.push([]);
      claim.lp.push([]);
      claim.sampled.push([]);
      claim.second.push([]);
      claim.secondLp.push([]);
      steps.forEach((r, k) => {
        pos += seqs[i]!.steps[k]!;
        if (r.kind !== 'token') throw new Error('the last hop answered rows');
        claim.greedy[i]!.push(r.tokenId);
        claim.lp[i]!.push(r.logprob);
        const logits = r.logits.length > 0 ? r.logits : undefined;
        claim.sampled[i]!.push(logits ? sampleToken(logits, { ...SAMPLING, seed: i }, pos).tokenId : r.tokenId);
        if (logits) {
          const top = argmax(logits);
          const copy = Float32Array.from(logits);
          copy[top] = -Infinity;
          const second = argmax(copy);
          claim.second[i]!.push(second);
          claim.secondLp[i]!.push(checkToken(logits, second, {}, pos).logprob);
        }
      });
    });
    claimsLast.set(name, claim);
  }

  for (const checker of IMPLS) {
    const ex = await makeExec(checker, LAST[0], LAST[1], weights, true);
    const hg = await headGraph(checker);
    const logitRows: Float32Array[][] = [];
    for (let i = 0; i < seqs.length; i++) {
      const n = seqs[i]!.ids.length;
      const r = await ex.forward({ startLayer: LAST[0], endLayer: LAST[1], activation: { data: lastIn[i]!, shape: [1, n, H] } });
      const hidden = rowsOf([r]);
      const out = await hg.run({ [IO.hidden]: { type: 'float32', data: hidden, dims: [1, n, H] } });
      const logits = out[IO.logits]!.data as Float32Array;
      const V = cfg.vocabSize;
      const per: Float32Array[] = [];
      let pos = 0;
      for (const n of seqs[i]!.steps) {
        pos += n;
        per.push(logits.subarray((pos - 1) * V, pos * V));
      }
      logitRows.push(per);
    }
    await hg.release();
    await ex.release();
    for (const [name, claim] of claimsLast) {
      const variants: Array<[string, number[][], number[][], boolean]> = [[name, claim.greedy, claim.lp, name.startsWith('lie:')]];
      if (name === 'cpu-f32') variants.push(['lie:second-best', claim.second, claim.secondLp, true]);
      for (const [label, picks, lps, lying] of variants) {
        if (lying && !(checker === 'cpu-f32' || checker === 'wasm-f32')) continue;
        const deficits: number[] = [];
        const gaps: number[] = [];
        const dlp: number[] = [];
        const t = thresholdsFor(classOf(label), classOf(checker));
        /** Steps a check would find wrong: greedy (deficit or log-probability) and sampled (the draw's gap). */
        let overGreedy = 0;
        let overSampled = 0;
        for (let i = 0; i < seqs.length; i++) {
          let pos = 0;
          seqs[i]!.steps.forEach((n, k) => {
            pos += n;
            const lg = logitRows[i]![k]!;
            if (picks[i]![k] === undefined) return;
            const tc = checkToken(lg, picks[i]![k]!, {}, pos);
            deficits.push(tc.deficit);
            const dl = lps[i]![k] !== undefined ? Math.abs(lps[i]![k]! - tc.logprob) : 0;
            if (lps[i]![k] !== undefined) dlp.push(dl);
            if (!(tc.deficit <= t.tokenDeficit && dl <= t.tokenLogprob)) overGreedy++;
            let gap: number | undefined;
            if (!lying) gap = checkToken(lg, claim.sampled[i]![k]!, { ...SAMPLING, seed: i }, pos).gap;
            else if (label === 'lie:second-best') gap = checkToken(lg, picks[i]![k]!, { ...SAMPLING, seed: i }, pos).gap;
            if (gap !== undefined) {
              gaps.push(gap);
              if (!(gap <= t.tokenGap)) overSampled++;
            }
          });
        }
        const d = [...deficits].sort((a, b) => a - b);
        const g = [...gaps].sort((a, b) => a - b);
        const l = [...dlp].sort((a, b) => a - b);
        (lying ? lyingTokens : tokens).push({
          pair: `${label} / ${checker}`,
          dtype,
          steps: d.length,
          over: { greedy: overGreedy, sampled: overSampled },
          deficit: { min: d[0] ?? NaN, p01: quantile(d, 0.01), p50: quantile(d, 0.5), p99: quantile(d, 0.99), max: d[d.length - 1] ?? NaN, nonzero: d.filter((x) => x > 0).length },
          gap: { p99: quantile(g, 0.99), max: g[g.length - 1] ?? NaN, nonzero: g.filter((x) => x > 0).length },
          logprob: { min: l[0] ?? NaN, p01: quantile(l, 0.01), p50: quantile(l, 0.5), p99: quantile(l, 0.99), max: l[l.length - 1] ?? NaN },
        });
      }
    }
  }
  console.log(`wire ${dtype} done (${((performance.now() - t0) / 1000).toFixed(1)} s)`);
  // What is measured so far, in case a later wire dtype runs out of time (WebGPU on SwiftShader is slow).
  writeResult(outFile, { model: 'fortunes-tiny', prompts: PROMPTS, tokens: TOKENS, rows: totalRows, mid: MID, last: LAST, impls: IMPLS, dtypes: DTYPES, partial: true, done: DTYPES.slice(0, DTYPES.indexOf(dtype) + 1), honest: dists, lying: lies, last_hop: tokens, last_hop_lying: lyingTokens });
}

const drow = (d: Dist) => [d.pair, d.dtype, d.rows, d.rel.p50, d.rel.p99, d.rel.p999, d.rel.max, d.peak.p99, d.peak.max, d.threshold, d.over];
const dhead = ['checked / checker', 'wire', 'rows', 'rel p50', 'rel p99', 'rel p99.9', 'rel max', 'peak p99', 'peak max', 'threshold', 'over'];
printTable(`honest pairs: hop [${MID[0]}, ${MID[1]}) stepwise vs one prefill`, dhead, dists.map(drow));
printTable('lying modes against honest checkers', ['checked / checker', 'wire', 'rows', 'rel min', 'rel p1', 'rel p50', 'rel max', 'peak min', 'threshold', 'rows caught'], lies.map((d) => [d.pair, d.dtype, d.rows, d.rel.min, d.rel.p01, d.rel.p50, d.rel.max, d.peak.min, d.threshold, d.over]));
const trow = (t: TokenStats) => [t.pair, t.dtype, t.steps, t.deficit.p99, t.deficit.max, t.deficit.nonzero, t.gap.p99, t.gap.max, t.gap.nonzero, t.logprob.p50, t.logprob.p99, t.logprob.max, t.over.greedy, t.over.sampled];
const thead = ['last hop / checker', 'wire', 'steps', 'deficit p99', 'deficit max', 'deficit>0', 'gap p99', 'gap max', 'gap>0', '|Δlogprob| p50', 'p99', 'max', 'over (greedy)', 'over (T 0.8)'];
printTable(`last hop [${LAST[0]}, ${LAST[1]}): the claimed token under the checker's logits`, thead, tokens.map(trow));
printTable('lying last hops', ['last hop / checker', 'wire', 'steps', 'deficit min', 'p1', 'p50', 'gap>0', '|Δlogprob| min', 'p1', 'p50', 'caught (greedy)', 'caught (T 0.8)'], lyingTokens.map((t) => [t.pair, t.dtype, t.steps, t.deficit.min, t.deficit.p01, t.deficit.p50, t.gap.nonzero, t.logprob.min, t.logprob.p01, t.logprob.p50, t.over.greedy, t.over.sampled]));
// The claim the issue makes: honest pairs of different implementations, rows compared and rows a check would call wrong.
const hetero = dists.filter((d) => d.pair.split(' / ')[0] !== d.pair.split(' / ')[1]);
const summary = {
  honest_rows: dists.reduce((n, d) => n + d.rows, 0),
  honest_hetero_rows: hetero.reduce((n, d) => n + d.rows, 0),
  false_accusations_rows: dists.reduce((n, d) => n + d.over, 0),
  honest_last_hop_steps: tokens.reduce((n, t) => n + t.steps, 0),
  false_accusations_last_hop: tokens.reduce((n, t) => n + t.over.greedy + t.over.sampled, 0),
};
console.log(`\nhonest rows compared: ${summary.honest_rows} (${summary.honest_hetero_rows} between different implementations), over their pair's threshold: ${summary.false_accusations_rows}; honest last-hop steps: ${summary.honest_last_hop_steps}, over: ${summary.false_accusations_last_hop}`);
writeResult(outFile, { model: 'fortunes-tiny', prompts: PROMPTS, tokens: TOKENS, rows: totalRows, mid: MID, last: LAST, impls: IMPLS, dtypes: DTYPES, summary, honest: dists, lying: lies, last_hop: tokens, last_hop_lying: lyingTokens });
process.exit(0);
