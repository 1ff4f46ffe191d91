/**
 * The browser host as the runtime sees it (src/node/runtime/host.ts), from
 * inside the node's Web Worker: the worker's fetch and WebSocket, the
 * identity and a span's weights in IndexedDB (downloaded by Range once,
 * verified on every load), onnxruntime-web on WebGPU or WASM (calibrated on
 * the span's own first layer when the donor left it to us) with a warm-up
 * before the span serves.
 *
 * Spans run on the fused-operator graphs (src/model/fused-graph.ts: the GPU
 * path, KV and activations kept on the device; on WASM the same graphs with
 * onnxruntime's CPU kernels) in the donor's weight format, f32 or 4-bit,
 * quantized layer by layer as the graphs are built and kept in IndexedDB
 * (q4-store.ts). Plain graphs only where the fused ones cannot serve: a
 * config they do not express, or f16 (an adapter with shader-f16), which
 * only the plain graphs have; the reason is logged and shown on the page.
 */
import type { ModelConfig } from '../../model/config.ts';
import { fusedUnsupportedReason } from '../../model/fused-graph.ts';
import { withGpuTestHooks } from './gpu-test-hooks.ts';
import type { WeightFormat } from '../../model/weight-format.ts';
import type { SpanGraphs } from '../../shard/span-executor.ts';
import { indexedDbQ4Cache, type Q4Counters } from './q4-store.ts';
import { ModelFetchError, ModelFormatError } from '../../model/errors.ts';
import { generationConfigEosIds, ModelTokenizer } from '../../model/tokenizer.ts';
import { MeshError } from '../../protocol/errors.ts';
import type { BackendFactory, ChosenBackend, RuntimeHost, SpanSpec, WeightStore } from '../../node/runtime/host.ts';
import type { WebSocketConstructor } from '../../net/socket.ts';
import type { RtcFactory } from '../../net/rtc-peer.ts';
import type { OnnxBackend } from '../../shard/backend.ts';
import type { WeightLoader } from '../../shard/contract.ts';
import { calibrate, decide, probeWebGpu, type GpuLike } from './backends.ts';
import type { BackendChoice, BackendInfo as PageBackendInfo, BackendKind } from './engine.ts';
import { createOrtWebBackend } from './onnx.ts';
import { SpanWeights } from './span-weights.ts';
import { NodeStorage } from './storage.ts';
import { warmUp } from './warm-up.ts';

/** The worker's globals this host reads; tests give their own. */
export interface BrowserGlobals {
  fetch: typeof fetch;
  WebSocket: WebSocketConstructor;
  gpu: GpuLike | undefined;
  crossOriginIsolated: boolean;
  hardwareConcurrency: number;
  /** Where ORT's runtime files are served (ends with /). */
  ortWasmPaths: string;
  openStorage(): Promise<NodeStorage>;
}

/** The worker's globals; the only place the browser host reads them. */
export function workerGlobals(): BrowserGlobals {
  const g = globalThis as unknown as { navigator: Navigator & { gpu?: GpuLike }; crossOriginIsolated?: boolean; fetch: typeof fetch; WebSocket: WebSocketConstructor };
  return {
    // Bound: an unbound fetch throws "Illegal invocation" when called as a plain function.
    fetch: g.fetch.bind(globalThis),
    WebSocket: g.WebSocket,
    gpu: g.navigator.gpu,
    crossOriginIsolated: g.crossOriginIsolated === true,
    hardwareConcurrency: g.navigator.hardwareConcurrency || 1,
    ortWasmPaths: new URL(/* @vite-ignore */ '../ort/', import.meta.url).href,
    openStorage: () => NodeStorage.open(),
  };
}

/**
 * Warm-up of a new executor (warm-up.ts): the first WASM one in this worker runs until V8 has tiered
 * up onnxruntime's hot WASM functions (~600 layer runs settled them on the `small` fixture); later
 * ones (the module is compiled by then) and WebGPU ones (the compute is on the GPU) only pay their
 * sessions' first runs (buffers, WebGPU pipelines).
 */
const FIRST_WARM_UP = { layerRuns: 600, maxMs: 6_000 };
const NEXT_WARM_UP = { layerRuns: 24, maxMs: 1_000 };

/** Bytes the page shows: fetched from the model server since the worker started, and kept for the span. */
export interface StorageCounters {
  fetchedBytes: number;
  storedBytes: number;
}

export interface BrowserAdapterOptions {
  storage: NodeStorage;
  choice: BackendChoice;
  /** WASM threads asked for; absent: min(4, cores - 1), 1 without cross-origin isolation. */
  threads?: number;
  counters: StorageCounters;
  /** Whether onnxruntime-web's WASM module has had its first warm-up in this worker (kept across runtimes). */
  warmed: { wasm: boolean };
  /** The weight format the donor asked for. */
  weights: WeightFormat;
  /** 4-bit projections quantized / read back from IndexedDB in this worker. */
  q4: Q4Counters;
  /** Test hook: the k-th GPU backend destroys its device before its N-th session run. */
  loseGpuAfterRuns?: number[];
  /** The page's peer connections (rtc-worker.ts): data channels to other pages. */
  rtc?: RtcFactory;
}

export function browserAdapter(g: BrowserGlobals, o: BrowserAdapterOptions): RuntimeHost {
  return {
    name: 'browser',
    fetch: g.fetch,
    WebSocket: g.WebSocket,
    keys: o.storage.keyStore(),
    weights: storedWeights(g, o),
    backends: ortWebBackends(g, o),
    log: (level, message) => (level === 'error' || level === 'warn' ? console.warn : console.info)(`meshnet node: ${message}`),
    ...(o.rtc ? { rtc: o.rtc } : {}),
  };
}

/** WASM threads: one core stays free for the worker's own thread (relay I/O, codecs) and the page. */
export function threadsFor(g: BrowserGlobals, asked: number | undefined): number {
  if (!g.crossOriginIsolated) return 1;
  // On a 2-core machine, 2 ORT threads made a decode step 1.6x slower than 1 (bench/results/browser-node.json).
  return asked ?? Math.max(1, Math.min(4, g.hardwareConcurrency - 1));
}

/** config.json and the tokenizer kept beside the tensors in IndexedDB; tensors fetched once by Range and verified on every load. */
function storedWeights(g: BrowserGlobals, o: BrowserAdapterOptions): WeightStore {
  const { storage, counters } = o;
  const fetchJson = async (base: string, file: string): Promise<unknown> => {
    const url = base + file;
    let res: Response;
    try {
      res = await g.fetch(url);
    } catch (e) {
      throw new ModelFetchError(file, `cannot reach ${url}: ${(e as Error).message}`);
    }
    if (!res.ok) throw new ModelFetchError(file, `HTTP ${res.status} from ${url}`, res.status);
    const text = await res.text();
    counters.fetchedBytes += text.length;
    try {
      return JSON.parse(text) as unknown;
    } catch (e) {
      throw new ModelFormatError(file, `not valid JSON (${(e as Error).message})`);
    }
  };
  const files = async (modelUrl: string, names: string[]): Promise<Record<string, unknown>> => {
    let stored = (await storage.modelFiles(modelUrl)) ?? {};
    const missing = names.filter((n) => stored[n] === undefined);
    if (missing.length === 0) return stored;
    stored = { ...stored };
    for (const n of missing) stored[n] = await fetchJson(modelUrl, n);
    await storage.saveModelFiles(modelUrl, stored);
    return stored;
  };
  return {
    config: async (modelUrl) => (await files(modelUrl, ['config.json']))['config.json'],
    async open(spec: SpanSpec, config: ModelConfig, onProgress) {
      const weights = new SpanWeights(storage, spec.modelUrl, config, spec.startLayer, spec.endLayer);
      // The executor serving now has its weights in memory already: dropping its stored tensors costs nothing.
      await weights.dropOthers();
      const got = await weights.ensure({ fetch: g.fetch, onProgress });
      counters.fetchedBytes += got.fetchedBytes;
      counters.storedBytes = got.storedBytes;
      return { loader: weights.loader(), fetchedBytes: got.fetchedBytes, storedBytes: got.storedBytes, q4Cache: indexedDbQ4Cache(storage, spec.modelUrl, o.q4) };
    },
    async tokenizer(modelUrl, config) {
      const f = await files(modelUrl, ['tokenizer.json', 'tokenizer_config.json']);
      // generation_config.json is optional; its eos ids (Qwen3: <|endoftext|> too) stop generation as on Node.js heads.
      const gen = await files(modelUrl, ['generation_config.json']).catch((e: unknown) => {
        if (e instanceof ModelFetchError && e.status === 404) return {} as Record<string, unknown>;
        throw e;
      });
      const genEos = gen['generation_config.json'] === undefined ? [] : generationConfigEosIds(gen['generation_config.json']);
      return ModelTokenizer.fromJson(f['tokenizer.json'], f['tokenizer_config.json'], { extraEosTokenIds: [...config.eosTokenIds, ...genEos] });
    },
  };
}

function ortWebBackends(g: BrowserGlobals, o: BrowserAdapterOptions): BackendFactory {
  const threads = threadsFor(g, o.threads);
  const cpu = `CPU (WASM, ${threads} thread${threads === 1 ? '' : 's'})`;
  let gpus = 0;
  const backendFor = async (kind: BackendKind): Promise<OnnxBackend> => {
    const b = await createOrtWebBackend(kind, { numThreads: threads, wasmPaths: g.ortWasmPaths });
    return kind === 'webgpu' && o.loseGpuAfterRuns ? withGpuTestHooks(b, o.loseGpuAfterRuns[gpus++], undefined) : b;
  };
  return {
    async choose(spec, config, weights: WeightLoader, lost) {
      const chosen = async (d: { kind: BackendKind; fp16: boolean; reason: string }, adapter: string): Promise<ChosenBackend> => {
        const g = graphsFor(config, d.kind, d.fp16, o.weights);
        console.info(`meshnet node: layers ${spec.startLayer}-${spec.endLayer - 1} on ${d.kind}, ${g.graphs.kind} graphs, ${g.weights} weights; ${g.precision}${g.why ? `; ${g.why}` : ''}`);
        const dtype = g.graphs.kind === 'plain' ? g.graphs.dtype : 'f32';
        const page: PageBackendInfo = { kind: d.kind, fp16: dtype === 'f16', threads: d.kind === 'wasm' ? threads : 1, adapter, reason: d.reason, weights: g.weights, graphs: g.graphs.kind, precision: g.why ? `${g.precision}; ${g.why}` : g.precision };
        return { backend: await backendFor(d.kind), graphs: g.graphs, info: { name: `onnxruntime-web/${d.kind}`, kind: d.kind, dtype, weights: g.weights, details: { ...page } } };
      };
      if (o.choice === 'wasm') return chosen({ kind: 'wasm', fp16: false, reason: 'WASM: forced by setting' }, cpu);
      // After a lost device (device-recovery.ts): a fresh one once, WASM from the second loss on (or when none comes).
      if (lost && lost.losses >= 2) return chosen({ kind: 'wasm', fp16: false, reason: `WASM: the GPU device was lost ${lost.losses} times (last: ${lost.reason})` }, cpu);
      const probe = await probeWebGpu(g.gpu);
      if (lost) {
        if (!probe.usable) return chosen({ kind: 'wasm', fp16: false, reason: `WASM: no fresh GPU device after the last was lost (${probe.reason})` }, cpu);
        return chosen({ kind: 'webgpu', fp16: probe.fp16, reason: `WebGPU: a fresh device after the last was lost (${lost.reason})` }, probe.adapter);
      }
      if (o.choice === 'webgpu') {
        if (!probe.usable) throw new MeshError('MESH_ERR_UNAVAILABLE', `WebGPU was forced but ${probe.reason}`);
        return chosen({ kind: 'webgpu', fp16: probe.fp16, reason: `WebGPU: forced by setting${probe.fp16 ? '' : ' (fp32: no shader-f16)'}` }, probe.adapter);
      }
      if (!probe.usable || probe.fallback) return chosen(decide(probe), cpu);
      const layer = spec.startLayer;
      // Each backend timed on the graphs it would serve with; 4-bit is timed as f32 there (quantizing the layer twice just to time it would cost more than it tells).
      const timed = (g: SpanGraphs): SpanGraphs => (g.kind === 'fused' ? { kind: 'fused', projections: 'f32' } : g);
      const webgpuMs = await calibrate(await backendFor('webgpu'), config, weights, layer, timed(graphsFor(config, 'webgpu', probe.fp16, o.weights).graphs));
      const wasmMs = await calibrate(await backendFor('wasm'), config, weights, layer, timed(graphsFor(config, 'wasm', false, o.weights).graphs));
      const d = decide(probe, { webgpuMs, wasmMs });
      return chosen(d, d.kind === 'webgpu' ? probe.adapter : cpu);
    },
    async prepare(executor, c) {
      const wasm = c.info.kind === 'wasm';
      const first = wasm && !o.warmed.wasm;
      const done = await warmUp(executor, first ? FIRST_WARM_UP : NEXT_WARM_UP);
      if (wasm) o.warmed.wasm = true;
      if (first) console.info(`meshnet node: warmed up layers ${executor.startLayer}-${executor.endLayer - 1} in ${Math.round(done.ms)} ms (${done.steps} steps)`);
    },
  };
}

export interface GraphChoice {
  graphs: SpanGraphs;
  /** The format the span runs on: the one asked for, unless it cannot run here (f16 without shader-f16, q4 on a config the fused graphs refuse). */
  weights: WeightFormat;
  /** Activation precision and why. */
  precision: string;
  /** Why plain graphs, or why not the asked format; absent when neither. */
  why?: string;
}

/** Which graphs run a span on `kind` for the asked weight format, and why (what the page shows). */
export function graphsFor(config: ModelConfig, kind: BackendKind, shaderF16: boolean, asked: WeightFormat): GraphChoice {
  const refused = fusedUnsupportedReason(config);
  if (asked === 'f16') {
    if (kind === 'webgpu' && shaderF16) {
      return { graphs: { kind: 'plain', dtype: 'f16' }, weights: 'f16', precision: 'f16 activations (the adapter has shader-f16)', why: 'plain graphs: the fused graphs are f32 or 4-bit only' };
    }
    const precision = kind === 'webgpu' ? 'f32 activations: f16 was asked but the adapter has no shader-f16' : 'f32 activations: f16 was asked but needs WebGPU with shader-f16';
    return refused ? { graphs: { kind: 'plain', dtype: 'f32' }, weights: 'f32', precision, why: `plain graphs: the fused graphs refuse this model (${refused})` } : { graphs: { kind: 'fused', projections: 'f32' }, weights: 'f32', precision };
  }
  const precision = kind === 'webgpu' ? (shaderF16 ? 'f32 activations (the adapter has shader-f16: ?weights=f16 runs f16)' : 'f32 activations: the adapter has no shader-f16') : 'f32 activations (WASM)';
  if (refused) {
    const why = `plain graphs: the fused graphs refuse this model (${refused})${asked === 'q4' ? ', so f32 weights instead of 4-bit' : ''}`;
    return { graphs: { kind: 'plain', dtype: 'f32' }, weights: 'f32', precision, why };
  }
  // Measured (docs/benchmarks.md): onnxruntime-web's WASM MatMulNBits has no fast kernel, so 4-bit buys memory there, not speed.
  const slow = kind === 'wasm' && asked === 'q4' ? { why: '4-bit on WASM holds ~6x more layers but decodes slower than f32 (onnxruntime-web has no fast WASM MatMulNBits kernel)' } : {};
  return { graphs: { kind: 'fused', projections: asked }, weights: asked, precision, ...slow };
}
