/**
 * The GPU path, measured: decode ms/token of Llama-3.2-1B-shaped layers
 * (hidden 2048, ffn 8192, 32/8 heads, random weights) through the fused
 * executor on onnxruntime-web's WebGPU EP (Dawn in Node), f32 and 4-bit,
 * at two positions, beside onnxruntime-web WASM on all CPU threads; and
 * first, correctness on the `small` fixture against the float64 reference.
 * Travels: scripts/pack-gpu-bench.mjs bundles it into a folder that runs on
 * a GPU machine with no Node and no network (see docs/benchmarks.md).
 *
 *   npx tsx bench/gpu.ts                 # here: SwiftShader (correctness), WASM f32 vs 4-bit on `small`
 *   node bench.mjs --dawn dawn.node --wasm-dir ort/ --out results.json   # in the pack
 * Options: --quick, --layers N (default 16), --positions 16,1024, --steps N,
 *   --only correctness|bytes|speed|wasm-small|capture (or a comma list), --threads N.
 * WebGPU rows come in pairs, graph capture off and on (FusedExecutorOptions.graphCapture):
 * `--only capture` runs just those pairs (on a software adapter: `tiny`, correctness and bytes only).
 * Table on stdout, JSON in bench/results/gpu.json (or --out).
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import { availableParallelism } from 'node:os';
import { dirname, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { fixtureConfig, makeModel } from '../src/model/fixture.ts';
import { parseModelConfig, type ModelConfig } from '../src/model/config.ts';
import type { WeightSource } from '../src/model/graph.ts';
import { ReferenceModel, newRefCache } from '../src/model/reference.ts';
import { dequantizeQ4, quantizeQ4 } from '../src/model/quantize.ts';
import { FUSED_Q4_SCHEME, type FusedWeights } from '../src/model/fused-graph.ts';
import { decodeTensor } from '../src/protocol/tensor.ts';
import { FusedShardExecutor } from '../src/shard/fused-executor.ts';
import type { OnnxBackend } from '../src/shard/backend.ts';
import type { SamplingParams } from '../src/shard/sampling.ts';
import { createOrtWebBackend } from '../src/host/browser/onnx.ts';
import { installNodeWebGpu, type NodeGpuInfo } from '../src/host/node/webgpu.ts';
import { createWasmBackend } from '../src/host/node/onnx-wasm.ts';

const argv = process.argv.slice(2);
const arg = (name: string) => (argv.includes(name) ? argv[argv.indexOf(name) + 1] : undefined);
const quick = argv.includes('--quick');
const only = arg('--only');
const want = (part: string) => !only || only.split(',').includes(part);
const here = dirname(fileURLToPath(import.meta.url));
const wasmDir = resolve(arg('--wasm-dir') ?? `${here}/../node_modules/onnxruntime-web/dist`);
const wasmPaths = pathToFileURL(wasmDir).href + '/';
const threads = Number(arg('--threads') ?? availableParallelism());
const outFile = arg('--out') ?? `${here}/results/gpu.json`;

interface Row {
  what: string;
  backend: string;
  projections: FusedWeights;
  /** Decode steps replayed from a captured GPU graph. */
  capture?: boolean;
  position: number;
  msPerToken: number;
  bytesPerStep?: number;
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
}

/** Deterministic weights of any shape, made per tensor on demand (values in ±0.05, bf16-like magnitudes). */
function randomWeights(cfg: ModelConfig): WeightSource {
  const shapes = (name: string): number[] => {
    const h = cfg.hiddenSize;
    if (name.endsWith('layernorm.weight') || name === 'model.norm.weight') return [h];
    if (name.includes('q_proj')) return [cfg.numHeads * cfg.headDim, h];
    if (name.includes('k_proj') || name.includes('v_proj')) return [cfg.numKvHeads * cfg.headDim, h];
    if (name.includes('o_proj')) return [h, cfg.numHeads * cfg.headDim];
    if (name.includes('gate_proj') || name.includes('up_proj')) return [cfg.intermediateSize, h];
    if (name.includes('down_proj')) return [h, cfg.intermediateSize];
    return [cfg.vocabSize, h];
  };
  return (name) => {
    const shape = shapes(name);
    const n = shape.reduce((a, b) => a * b, 1);
    const data = new Float32Array(n);
    if (shape.length === 1) data.fill(1);
    else {
      let s = [...name].reduce((a, c) => (Math.imul(a, 31) + c.charCodeAt(0)) >>> 0, 7);
      for (let i = 0; i < n; i++) {
        s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
        data[i] = ((s >>> 8) / 16777216 - 0.5) * 0.1;
      }
    }
    return { shape, data };
  };
}

const LLAMA_1B = {
  architectures: ['LlamaForCausalLM'], vocab_size: 128256, hidden_size: 2048, intermediate_size: 8192,
  num_attention_heads: 32, num_key_value_heads: 8, head_dim: 64, rms_norm_eps: 1e-5, rope_theta: 500000,
  rope_scaling: { rope_type: 'llama3', factor: 32, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192 },
  max_position_embeddings: 131072, tie_word_embeddings: true,
};

/** How the head picks: greedy (default), or sampled from the device's candidates, or (samplerCandidates 0) over downloaded logits. */
interface Draw {
  sampling?: SamplingParams;
  samplerCandidates?: number;
}

/** Sampling as Qwen3 and Llama 3 ship it (generation_config.json): top_k inside the candidates, so no step falls back. */
const TYPICAL_SAMPLING: SamplingParams = { temperature: 0.6, topK: 20, topP: 0.95 };

/** ms/token of one-token decode steps at `position` through layers [0, layers) (layers only: no embedding, no head). */
async function decodeSpeed(backend: OnnxBackend, cfg: ModelConfig, projections: FusedWeights, positions: number[], steps: number, draw: Draw = {}, capture = false): Promise<Row[]> {
  const ex = await FusedShardExecutor.create({ config: cfg, backend, weights: () => randomWeights(cfg), startLayer: 0, endLayer: cfg.numLayers, projections, maxContext: Math.max(...positions) + steps + 8, kvBudgetBytes: 8 * 2 ** 30, samplerChoice: 'candidates', ...(draw.samplerCandidates !== undefined ? { samplerCandidates: draw.samplerCandidates } : {}), graphCapture: capture });
  const rows: Row[] = [];
  try {
    const h = cfg.hiddenSize;
    for (const position of positions) {
      const session = `p${position}`;
      // Fill the cache in chunks of up to 256 positions.
      let pos = 0;
      while (pos < position) {
        const n = Math.min(256, position - pos);
        const x = new Float32Array(n * h).map((_, i) => Math.sin(i) * 0.1);
        // Declared at the start, as a head declares prompt + max_tokens: the cache is sized once, never grown while timed.
        await ex.forward({ session, position: pos, ...(pos === 0 ? { sessionTokens: position + steps + 2 } : {}), activation: { data: x, shape: [1, n, h] } });
        pos += n;
      }
      const x = new Float32Array(h).map((_, i) => Math.cos(i) * 0.1);
      const drawn0 = ex.samplingStats();
      const times: number[] = [];
      let bytes = 0;
      for (let i = 0; i < steps + 2; i++) {
        const t0 = ex.transferStats();
        const s = performance.now();
        await ex.forward({ session, position: pos, activation: { data: x, shape: [1, 1, h] }, ...(draw.sampling ? { sampling: { ...draw.sampling, seed: i } } : {}) });
        const ms = performance.now() - s;
        const t1 = ex.transferStats();
        if (i >= 2) times.push(ms); // two warm-up steps compile the decode programs (and record the captured graph)
        bytes = t1.up - t0.up + (t1.down - t0.down);
        pos++;
      }
      const drawn = ex.samplingStats();
      const fellBack = drawn.fallbacks - drawn0.fallbacks;
      const how = draw.sampling ? `, sampled ${draw.samplerCandidates === 0 ? 'over downloaded logits' : `from candidates (${fellBack}/${steps + 2} fell back)`}` : '';
      rows.push({ what: `${cfg.numLayers} layers h${h}${how}`, backend: '', projections, ...(ex.onDevice ? { capture } : {}), position, msPerToken: median(times), bytesPerStep: ex.onDevice ? bytes : undefined! });
      ex.dropSession(session);
    }
  } finally {
    await ex.release();
  }
  return rows;
}

/** Greedy tokens and logit error of the fused executor on `small` vs the float64 reference (4-bit: on the dequantized weights). */
async function correctness(backend: OnnxBackend, projections: FusedWeights, n: number, capture = false) {
  const files = makeModel('small', 0);
  const cfg = fixtureConfig('small');
  const tensors = new Map<string, { shape: number[]; data: Float32Array }>();
  for (const [file, bytes] of files) {
    if (!file.endsWith('.safetensors')) continue;
    const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const len = Number(dv.getBigUint64(0, true));
    const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + len))) as Record<string, { shape: number[]; data_offsets: [number, number] }>;
    for (const [name, t] of Object.entries(header)) {
      if (name !== '__metadata__') tensors.set(name, { shape: t.shape, data: decodeTensor(bytes.subarray(8 + len + t.data_offsets[0], 8 + len + t.data_offsets[1]), 'bf16') });
    }
  }
  const src: WeightSource = (name) => tensors.get(name)!;
  const refSrc: WeightSource =
    projections === 'q4'
      ? (name) => {
          const w = src(name);
          return /_proj\.weight$|^lm_head\.weight$/.test(name) ? { shape: w.shape, data: dequantizeQ4(quantizeQ4(w.data, w.shape[0]!, w.shape[1]!, FUSED_Q4_SCHEME)) } : w;
        }
      : src;
  const ex = await FusedShardExecutor.create({ config: cfg, backend, weights: () => src, startLayer: 0, endLayer: cfg.numLayers, projections, maxContext: 128, returnLogits: true, graphCapture: capture });
  try {
    const ref = new ReferenceModel(cfg, refSrc);
    const cache = newRefCache(cfg);
    const prompt = [1, 17, 300, 45, 901, 12];
    let ids = prompt;
    let pos = 0;
    let agree = 0;
    let worst = 0;
    for (let i = 0; i < n; i++) {
      const want = ref.forward(ids, pos, cache).subarray((ids.length - 1) * cfg.vocabSize);
      const got = await ex.forward({ session: 'c', position: pos, tokenIds: ids, sampling: { temperature: 0 } });
      if (got.kind !== 'token') throw new Error('expected a token');
      let best = 0;
      let scale = 0;
      for (let j = 0; j < want.length; j++) {
        if (want[j]! > want[best]!) best = j;
        scale = Math.max(scale, Math.abs(want[j]!));
        worst = Math.max(worst, Math.abs(got.logits[j]! - want[j]!));
      }
      if (got.tokenId === best) agree++;
      pos += ids.length;
      ids = [best]; // teacher-forced on the reference's token
    }
    return { projections, capture, tokens: n, top1Agree: agree, maxLogitErr: worst, capturedSteps: ex.captureStats()?.steps ?? 0 };
  } finally {
    await ex.release();
  }
}

const result: Record<string, unknown> = { date: new Date().toISOString(), node: process.version, threads };
const rows: Row[] = [];
let gpuInfo: NodeGpuInfo | null = null;
let webgpu: OnnxBackend | null = null;
try {
  const dawnPath = arg('--dawn');
  gpuInfo = (await installNodeWebGpu(dawnPath ? { dawnPath: resolve(dawnPath) } : {})).info;
  webgpu = await createOrtWebBackend('webgpu', { numThreads: 1, wasmPaths });
} catch (e) {
  result.webgpuError = (e as Error).message;
}
result.adapter = gpuInfo;
const software = gpuInfo?.isFallbackAdapter ?? true;
console.log(`adapter: ${gpuInfo ? `${gpuInfo.vendor} ${gpuInfo.device} ${gpuInfo.description}`.trim() : 'none'}${software ? ' (software: correctness only)' : ''}; shader-f16: ${gpuInfo?.features.includes('shader-f16') ?? false}`);

if (webgpu && want('correctness')) {
  const checks = [];
  for (const [p, capture] of [['f32', false], ['q4', false], ['q4', true]] as const) {
    const t0 = performance.now();
    const c = await correctness(webgpu, p, quick || software ? 4 : 24, capture);
    checks.push({ ...c, seconds: (performance.now() - t0) / 1000 });
    console.log(`correctness small ${p}${capture ? ` graph capture (${c.capturedSteps} steps replayed)` : ''}: top-1 ${c.top1Agree}/${c.tokens}, max |logit err| ${c.maxLogitErr.toExponential(2)}`);
  }
  result.correctness = checks;
}

// onnxruntime-web's Node build (the same WASM kernels a browser node falls back to).
const wasm = createWasmBackend({ numThreads: threads });
if (want('wasm-small')) {
  // This machine's target: 4-bit WASM decode of `small` >= 1.5x faster than f32.
  const cfg = fixtureConfig('small');
  for (const p of ['f32', 'q4'] as const) {
    for (const r of await decodeSpeed(wasm, cfg, p, [16], quick ? 8 : 24)) rows.push({ ...r, what: 'small (12 layers h512)', backend: `wasm ${threads}t` });
  }
}
if (webgpu && want('bytes')) {
  // Bytes across CPU<->GPU per greedy decode step (the head's ArgMax picks the token on the GPU),
  // on `tiny`'s shape so that a software adapter measures them too; the speed rows repeat them at 1B size.
  const cfg = fixtureConfig('tiny');
  for (const r of await decodeSpeed(webgpu, cfg, 'q4', [16, 1024], 2)) rows.push({ ...r, what: 'tiny (bytes; ms not meaningful)', backend: 'webgpu' });
  // Temperature > 0 on a real vocabulary (128,256 ids): the sampler graph's ~3 KiB of candidates
  // against downloading the 513 KB of logits, same head, side by side (ms meaningful on a real GPU only).
  const real = fixtureConfig('llama3-real-vocab');
  for (const draw of [{}, { sampling: TYPICAL_SAMPLING }, { sampling: TYPICAL_SAMPLING, samplerCandidates: 0 }]) {
    for (const r of await decodeSpeed(webgpu, real, 'f32', [16, 1024], quick || software ? 2 : 16, draw)) rows.push({ ...r, what: `llama3-real-vocab ${r.what}`, backend: 'webgpu' });
  }
}
if (webgpu && only === 'capture' && software) {
  // A software adapter: the captured path runs and moves the same bytes; its ms mean nothing.
  const cfg = fixtureConfig('tiny');
  for (const capture of [false, true]) for (const r of await decodeSpeed(webgpu, cfg, 'q4', [16], 4, {}, capture)) rows.push({ ...r, what: 'tiny (ms not meaningful)', backend: 'webgpu' });
}
if ((want('speed') || only === 'capture') && !software) {
  const layers = Number(arg('--layers') ?? 16);
  const positions = (arg('--positions') ?? '16,1024').split(',').map(Number);
  const cfg = { ...parseModelConfig({ ...LLAMA_1B, num_hidden_layers: layers }) };
  const steps = Number(arg('--steps') ?? (quick ? 8 : 32));
  for (const p of ['q4', 'f32'] as const) {
    for (const capture of [false, true]) for (const r of await decodeSpeed(webgpu!, cfg, p, positions, steps, {}, capture)) rows.push({ ...r, backend: 'webgpu' });
  }
  if (only !== 'capture') {
    // Temperature > 0 at 1B size: candidates (TopK on the GPU) vs the logits downloaded, side by side.
    for (const samplerCandidates of [undefined, 0]) {
      const draw = { sampling: TYPICAL_SAMPLING, ...(samplerCandidates === 0 ? { samplerCandidates } : {}) };
      for (const r of await decodeSpeed(webgpu!, cfg, 'q4', [positions[0]!], steps, draw)) rows.push({ ...r, backend: 'webgpu' });
    }
    for (const r of await decodeSpeed(wasm, cfg, 'q4', [positions[0]!], Math.max(4, steps / 4))) rows.push({ ...r, backend: `wasm ${threads}t` });
  }
}

console.log('\n| what | backend | weights | graph capture | position | ms/token | CPU↔GPU bytes/step |');
console.log('|---|---|---|---|---|---|---|');
for (const r of rows) console.log(`| ${r.what} | ${r.backend} | ${r.projections} | ${r.capture === undefined ? '-' : r.capture ? 'on' : 'off'} | ${r.position} | ${r.msPerToken.toFixed(2)} | ${r.bytesPerStep ?? '-'} |`);
// Side by side, same run: capture on vs off for each WebGPU row.
const captureRatios: { what: string; projections: FusedWeights; position: number; offOverOn: number }[] = [];
for (const on of rows.filter((r) => r.capture === true)) {
  const off = rows.find((r) => r.capture === false && r.what === on.what && r.projections === on.projections && r.position === on.position);
  if (off) captureRatios.push({ what: on.what, projections: on.projections, position: on.position, offOverOn: off.msPerToken / on.msPerToken });
}
for (const c of captureRatios) console.log(`graph capture, ${c.what} ${c.projections} at ${c.position}: ${c.offOverOn.toFixed(2)}x the speed of uncaptured`);
result.captureRatios = captureRatios;
const small = rows.filter((r) => r.what.startsWith('small'));
if (small.length === 2) {
  const ratio = small[0]!.msPerToken / small[1]!.msPerToken;
  result.wasmSmallQ4Speedup = ratio;
  console.log(`\nWASM small: 4-bit is ${ratio.toFixed(2)}x f32 speed (target >= 1.5x)`);
}
result.rows = rows;
mkdirSync(dirname(outFile), { recursive: true });
writeFileSync(outFile, JSON.stringify(result, null, 2));
console.log(`wrote ${outFile}`);
process.exit(0);
