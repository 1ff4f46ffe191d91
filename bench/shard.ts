/**
 * Shard executor benchmark on the `small` fixture (12 layers, hidden 512):
 *   - decode ms/token and prefill tokens/s, onnxruntime-node vs
 *     onnxruntime-web's WASM backend in this same Node.js process;
 *   - decode at position 1024 vs 16 (target <= 1.3x);
 *   - per-layer graphs vs one fused graph for the whole range;
 *   - peak RSS per layer held vs the layer's weight bytes (target <= 1.5x),
 *     measured in child processes that load only their layers.
 * Medians throughout. Table on stdout, JSON in bench/results/shard.json.
 *
 *   npx tsx bench/shard.ts [--quick] [--only speed|rss]
 */
import { spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, openSync, readSync, closeSync, fstatSync, readFileSync, writeFileSync, rmSync } from 'node:fs';
import { tmpdir, cpus } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { fixtureConfig, makeModel } from '../src/model/fixture.ts';
import { layerTensorNames } from '../src/model/config.ts';
import { SafetensorsReader } from '../src/model/safetensors.ts';
import { ShardExecutor, type WeightLoader } from '../src/shard/executor.ts';
import { readerWeightLoader } from '../src/shard/weights.ts';
import type { OnnxBackend } from '../src/shard/backend.ts';
import { createNodeBackend } from '../src/host/node/onnx.ts';
import { createWasmBackend } from '../src/host/node/onnx-wasm.ts';
import { median } from './lib/stats.ts';

const PRESET = 'small';
const here = fileURLToPath(new URL('.', import.meta.url));
const quick = process.argv.includes('--quick');
const only = process.argv.includes('--only') ? process.argv[process.argv.indexOf('--only') + 1] : null;
const threads = Math.max(1, Math.min(4, cpus().length));

/** fetch over files on disk with single-range support: the child loads only its layers' bytes. */
function fileFetch(dir: string): typeof fetch {
  return (async (input: string | URL | Request, init?: RequestInit) => {
    const url = typeof input === 'string' ? input : input instanceof URL ? input.href : input.url;
    const name = decodeURIComponent(url.split('/').pop() ?? '');
    let fd: number;
    try {
      fd = openSync(join(dir, name), 'r');
    } catch {
      return new Response('not found', { status: 404 });
    }
    try {
      const size = fstatSync(fd).size;
      const m = /^bytes=(\d+)-(\d*)$/.exec(new Headers(init?.headers).get('range') ?? '');
      const start = m ? Number(m[1]) : 0;
      const end = m && m[2] !== '' ? Math.min(Number(m[2]), size - 1) : size - 1;
      const buf = new Uint8Array(end + 1 - start);
      readSync(fd, buf, 0, buf.byteLength, start);
      return new Response(buf, m ? { status: 206, headers: { 'content-range': `bytes ${start}-${end}/${size}` } } : { status: 200 });
    } finally {
      closeSync(fd);
    }
  }) as typeof fetch;
}

function backendOf(name: string): OnnxBackend {
  return name === 'wasm' ? createWasmBackend({ numThreads: threads }) : createNodeBackend({ intraOpNumThreads: threads });
}

// ---------------------------------------------------------------- child: RSS

/** Peak RSS since the last reset (Linux VmHWM); falls back to the process-lifetime maxRSS elsewhere. */
function peakRss(): number {
  try {
    const m = /VmHWM:\s+(\d+) kB/.exec(readFileSync('/proc/self/status', 'utf8'));
    if (m) return Number(m[1]) * 1024;
  } catch {
    // not Linux
  }
  return process.resourceUsage().maxRSS * 1024;
}

/** Resets VmHWM to the current RSS, so start-up (tsx, module loading) does not mask the load's peak. */
function resetPeakRss(): void {
  try {
    writeFileSync('/proc/self/clear_refs', '5');
  } catch {
    // not Linux: peaks include start-up
  }
}

async function childRss(dir: string, backendName: string, layers: number): Promise<void> {
  const gc = (globalThis as { gc?: () => void }).gc;
  const cfg = fixtureConfig(PRESET);
  const reader = await SafetensorsReader.open(fileFetch(dir), 'file://fixture/');
  const backend = backendOf(backendName);
  // Baseline: ORT imported, reader open, nothing loaded.
  gc?.();
  const baseline = process.memoryUsage().rss;
  resetPeakRss();
  const baselinePeak = peakRss();
  let ex: ShardExecutor | null = null;
  if (layers > 0) {
    // A collection before each graph's load, as a host with --expose-gc may do:
    // otherwise V8 frees the previous layer's garbage (decoded weights, model
    // bytes) only when it gets round to it, and the peak measures V8's pacing.
    const load = readerWeightLoader(reader);
    const weights = (names: readonly string[]) => {
      gc?.();
      return load(names);
    };
    ex = await ShardExecutor.create({ config: cfg, backend, weights, startLayer: 1, endLayer: 1 + layers, maxContext: 64 });
    // One forward so lazily allocated kernels state (prepacked weights, arenas) is counted.
    await ex.forward({ activation: { data: new Float32Array(cfg.hiddenSize).fill(0.1), shape: [1, 1, cfg.hiddenSize] } });
  }
  gc?.();
  const after = process.memoryUsage().rss;
  const peak = peakRss();
  const checkpointBytes = layers > 0 ? reader.tensorBytes(Array.from({ length: layers }, (_, i) => layerTensorNames(cfg, 1 + i)).flat()) : 0;
  process.stdout.write(JSON.stringify({ baseline, baselinePeak, after, peak, weightBytes: ex?.weightBytes ?? 0, checkpointBytes }) + '\n');
}

// ---------------------------------------------------------------- parent

interface SpeedResult {
  backend: string;
  graphs: 'per-layer' | 'fused';
  decodeMsAt16: number;
  decodeMsAt1024: number;
  ratio1024vs16: number;
  prefillTokensPerS: number;
}

async function speed(backendName: string, graphs: 'per-layer' | 'fused', weights: WeightLoader): Promise<SpeedResult> {
  const cfg = fixtureConfig(PRESET);
  const ex = await ShardExecutor.create({
    config: cfg,
    backend: backendOf(backendName),
    weights,
    startLayer: 0,
    endLayer: cfg.numLayers,
    maxContext: 2048,
    ...(graphs === 'fused' ? { segmentBoundaries: [] } : {}),
  });
  const steps = quick ? 8 : 24;
  const tokens = (n: number, off = 0) => Array.from({ length: n }, (_, i) => 3 + ((i * 37 + off) % (cfg.vocabSize - 3)));

  const decodeAt = async (position: number, session: string): Promise<number> => {
    // Prefill in chunks so the long context does not need one huge attention matrix.
    for (let p = 0; p < position; p += 256) await ex.forward({ session, position: p, tokenIds: tokens(Math.min(256, position - p), p) });
    await ex.forward({ session, position, tokenIds: [7] }); // warm-up step
    const times: number[] = [];
    for (let i = 1; i <= steps; i++) {
      const t0 = performance.now();
      await ex.forward({ session, position: position + i, tokenIds: [8 + i] });
      times.push(performance.now() - t0);
    }
    ex.dropSession(session);
    return median(times);
  };
  const at16 = await decodeAt(16, 'd16');
  const at1024 = await decodeAt(1024, 'd1024');

  const prefillLen = 128;
  await ex.forward({ tokenIds: tokens(prefillLen) });
  const pre: number[] = [];
  for (let i = 0; i < (quick ? 2 : 5); i++) {
    const t0 = performance.now();
    await ex.forward({ tokenIds: tokens(prefillLen, i) });
    pre.push(performance.now() - t0);
  }
  await ex.release();
  return { backend: backendName, graphs, decodeMsAt16: at16, decodeMsAt1024: at1024, ratio1024vs16: at1024 / at16, prefillTokensPerS: prefillLen / (median(pre) / 1000) };
}

interface RssResult {
  backend: string;
  layersHeld: number;
  peakBytesPerLayer: number;
  steadyBytesPerLayer: number;
  f32WeightBytesPerLayer: number;
  checkpointBytesPerLayer: number;
  peakVsWeights: number;
}

function runChild(dir: string, backendName: string, layers: number): { baseline: number; baselinePeak: number; after: number; peak: number; weightBytes: number; checkpointBytes: number } {
  const r = spawnSync(process.execPath, ['--expose-gc', '--import', 'tsx', fileURLToPath(import.meta.url), '--child-rss', dir, backendName, String(layers)], {
    encoding: 'utf8',
    maxBuffer: 1 << 20,
    // glibc raises its mmap threshold after the first big free, and later
    // weight-sized buffers then stay in the heap after they are freed: RSS
    // would count every transient copy. A Node.js node is started this way too.
    env: { ...process.env, MALLOC_MMAP_THRESHOLD_: '131072' },
  });
  if (r.status !== 0) throw new Error(`RSS child failed: ${r.stderr}`);
  return JSON.parse(r.stdout.trim().split('\n').pop()!);
}

function rss(dir: string, backendName: string): RssResult {
  // Peak-over-baseline for N layers, minus the same for 1 layer: the per-layer
  // cost without the fixed price of starting a runtime's first session.
  const few = 1;
  const many = quick ? 4 : 8;
  const a = runChild(dir, backendName, few);
  const b = runChild(dir, backendName, many);
  const n = many - few;
  const peakPer = (b.peak - b.baselinePeak - (a.peak - a.baselinePeak)) / n;
  const steadyPer = (b.after - b.baseline - (a.after - a.baseline)) / n;
  const wPer = (b.weightBytes - a.weightBytes) / n;
  return {
    backend: backendName,
    layersHeld: many,
    peakBytesPerLayer: peakPer,
    steadyBytesPerLayer: steadyPer,
    f32WeightBytesPerLayer: wPer,
    checkpointBytesPerLayer: (b.checkpointBytes - a.checkpointBytes) / n,
    peakVsWeights: peakPer / wPer,
  };
}

async function main(): Promise<void> {
  const cfg = fixtureConfig(PRESET);
  const files = makeModel(PRESET, 0);
  const dir = mkdtempSync(join(tmpdir(), 'meshnet-bench-'));
  try {
    for (const [name, bytes] of files) writeFileSync(join(dir, name), bytes);
    const reader = await SafetensorsReader.open(fileFetch(dir), 'file://fixture/');
    const weights = readerWeightLoader(reader);

    const speeds: SpeedResult[] = [];
    for (const [b, g] of only === 'rss' ? [] : ([['node', 'per-layer'], ['node', 'fused'], ['wasm', 'per-layer'], ['wasm', 'fused']] as const)) {
      process.stderr.write(`speed: ${b} ${g}...\n`);
      speeds.push(await speed(b, g, weights));
    }
    const mems: RssResult[] = [];
    for (const b of only === 'speed' ? [] : ['node', 'wasm']) {
      process.stderr.write(`rss: ${b}...\n`);
      mems.push(rss(dir, b));
    }

    const mb = (x: number) => (x / 2 ** 20).toFixed(1);
    console.log(`\nshard bench: ${PRESET} (${cfg.numLayers} layers, hidden ${cfg.hiddenSize}, ffn ${cfg.intermediateSize}, ${cfg.numHeads}/${cfg.numKvHeads} heads), f32, ${threads} threads, medians`);
    console.log('backend   graphs      decode@16 ms  decode@1024 ms  1024/16  prefill tok/s');
    for (const s of speeds) {
      console.log(
        `${s.backend.padEnd(9)} ${s.graphs.padEnd(11)} ${s.decodeMsAt16.toFixed(2).padStart(12)}  ${s.decodeMsAt1024.toFixed(2).padStart(14)}  ${s.ratio1024vs16.toFixed(2).padStart(7)}  ${s.prefillTokensPerS.toFixed(0).padStart(13)}`,
      );
    }
    console.log('\nbackend   peak MiB/layer  steady MiB/layer  f32 weights MiB/layer  bf16 ckpt MiB/layer  peak/weights');
    for (const m of mems) {
      console.log(
        `${m.backend.padEnd(9)} ${mb(m.peakBytesPerLayer).padStart(14)}  ${mb(m.steadyBytesPerLayer).padStart(16)}  ${mb(m.f32WeightBytesPerLayer).padStart(21)}  ${mb(m.checkpointBytesPerLayer).padStart(19)}  ${m.peakVsWeights.toFixed(2).padStart(12)}`,
      );
    }
    mkdirSync(join(here, 'results'), { recursive: true });
    const out = { bench: 'shard', preset: PRESET, threads, quick, date: new Date().toISOString(), node: process.version, speed: speeds, memory: mems, targets: { ratio1024vs16: 1.3, peakVsWeights: 1.5 } };
    writeFileSync(join(here, 'results', 'shard.json'), JSON.stringify(out, null, 2) + '\n');
    console.log(`\nwrote bench/results/shard.json`);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

const ci = process.argv.indexOf('--child-rss');
if (ci >= 0) await childRss(process.argv[ci + 1]!, process.argv[ci + 2]!, Number(process.argv[ci + 3]));
else await main();
