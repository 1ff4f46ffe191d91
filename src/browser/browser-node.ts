/**
 * The browser node: the node core (shard executor, forward handler, relay
 * client) on browser host APIs (onnxruntime-web, WebSocket, IndexedDB,
 * WebCrypto). Runs in the worker; the page sees it only as a NodeEngine.
 *
 *   start(config)
 *     connecting   open storage, load the identity (same peer id after a reload)
 *     downloading  config.json, then the span's tensors by Range into IndexedDB
 *     loading      pick the backend (forced, or calibrated), build the graphs
 *     connecting   register with the relay
 *     serving      answer /forward; a relay drop goes back to connecting,
 *                  and the relay client reconnects on its own
 */
import { parseModelConfig, type ModelConfig } from '../model/config.ts';
import { ModelTokenizer } from '../model/tokenizer.ts';
import { ModelFetchError, ModelFormatError } from '../model/errors.ts';
import { MeshError } from '../protocol/errors.ts';
import { createForwardHandler, type ForwardEvent } from '../node/forward-handler.ts';
import { Identity } from '../node/identity.ts';
import { RelayClient, RelayClientState, type RelayStateEvent } from '../node/relay-client.ts';
import type { WebSocketConstructor } from '../node/socket.ts';
import { ShardExecutor } from '../shard/executor.ts';
import type { OnnxBackend } from '../shard/backend.ts';
import { calibrate, decide, probeWebGpu, type BackendDecision, type GpuLike } from './backend-select.ts';
import type { BackendInfo, NodeConfig, NodeEngine, NodeErrorInfo, NodeState, NodeStatus } from './engine.ts';
import { createOrtWebBackend } from './ort-web.ts';
import { SpanWeights, WeightIntegrityError } from './span-weights.ts';
import { NodeStorage, QuotaError, isQuotaError } from './storage.ts';
import { StatsWindow } from './stats.ts';

export const DEFAULT_MEMORY_BUDGET = 256 * 2 ** 20;
const VERSION = '0.1.0';

export interface BrowserNodeHost {
  fetch: typeof fetch;
  WebSocket: WebSocketConstructor;
  gpu: GpuLike | undefined;
  crossOriginIsolated: boolean;
  hardwareConcurrency: number;
  /** Where ORT's runtime files are served (ends with /). */
  ortWasmPaths: string;
  openStorage(): Promise<NodeStorage>;
}

/** The worker's globals as a host; the only place this module reads them. */
export function workerHost(): BrowserNodeHost {
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

interface Running {
  key: string;
  config: NodeConfig;
  cfg: ModelConfig;
  executor: ShardExecutor;
  backend: BackendInfo;
  budget: number;
  relay?: RelayClient;
}

export class BrowserNode implements NodeEngine {
  private storage: NodeStorage | undefined;
  private identity: Identity | undefined;
  private state: NodeState = 'idle';
  private error: NodeErrorInfo | undefined;
  private download: NodeStatus['download'];
  private running: Running | undefined;
  private lastConfig: NodeConfig | undefined;
  private modelName = '';
  private holdsHead = false;
  private numLayers = 0;
  private storedBytes = 0;
  private fetchedBytes = 0;
  private paused = false;
  private memoryBudget = DEFAULT_MEMORY_BUDGET;
  private readonly stats = new StatsWindow();
  private startSeq = 0;
  private readonly host: BrowserNodeHost;

  constructor(host?: BrowserNodeHost) {
    this.host = host ?? workerHost();
  }

  async status(): Promise<NodeStatus> {
    const r = this.running;
    const kv = r?.executor.kvStats();
    const now = Date.now();
    const s: NodeStatus = {
      state: this.state,
      storedBytes: this.storedBytes,
      fetchedBytes: this.fetchedBytes,
      requestsServed: this.stats.requests,
      tokensServed: this.stats.tokens,
      requestsPerMinute: this.stats.requestsPerMinute(now),
      throughput: this.stats.tokensPerSecond(now),
      recentForwardMs: this.stats.recentForwardMs(),
      sessions: kv?.sessions ?? 0,
      kvBytes: kv?.bytesUsed ?? 0,
      memoryBudgetBytes: this.memoryBudget,
      crossOriginIsolated: this.host.crossOriginIsolated,
    };
    if (this.error) s.error = this.error;
    if (this.identity) s.peerId = this.identity.peerId;
    if (this.lastConfig) s.relayUrl = this.lastConfig.relayUrl;
    if (this.download && this.state === 'downloading') s.download = this.download;
    if (r) s.backend = r.backend;
    if (this.lastConfig && this.numLayers > 0) {
      s.model = { baseUrl: this.lastConfig.modelUrl, name: this.modelName, numLayers: this.numLayers, startLayer: this.lastConfig.startLayer, endLayer: this.lastConfig.endLayer, holdsHead: this.holdsHead };
    }
    return s;
  }

  async start(config: NodeConfig): Promise<NodeStatus> {
    const seq = ++this.startSeq;
    this.lastConfig = config;
    this.error = undefined;
    try {
      await this.run(config, seq);
    } catch (e) {
      if (seq === this.startSeq) this.fail(e);
    }
    return this.status();
  }

  async retry(): Promise<NodeStatus> {
    if (!this.lastConfig) throw new MeshError('MESH_ERR_BAD_REQUEST', 'nothing to retry: the node was never started');
    return this.start(this.lastConfig);
  }

  async pause(): Promise<void> {
    this.paused = true;
    if (this.state === 'serving') this.state = 'paused';
  }

  async resume(): Promise<void> {
    this.paused = false;
    if (this.state === 'paused') this.state = this.running?.relay?.state === RelayClientState.Registered ? 'serving' : 'connecting';
  }

  async setMemoryBudget(bytes: number): Promise<void> {
    if (!Number.isFinite(bytes) || bytes < 16 * 2 ** 20) throw new MeshError('MESH_ERR_BAD_REQUEST', 'the memory budget must be at least 16 MiB');
    this.memoryBudget = Math.floor(bytes);
    await this.storage?.saveSettings({ memoryBudgetBytes: this.memoryBudget });
    // The KV store's budget is fixed when the executor is built: rebuild it (live sessions answer 409 and are replayed by their heads).
    const r = this.running;
    if (r && r.budget !== this.memoryBudget && (this.state === 'serving' || this.state === 'paused')) {
      const next = await this.buildExecutor(r.config, r.cfg, r.backend.kind, r.backend.fp16);
      const old = r.executor;
      r.executor = next;
      r.budget = this.memoryBudget;
      r.relay?.setHandler(this.handlerFor(r));
      await old.release();
    }
  }

  async stop(): Promise<void> {
    this.startSeq++;
    await this.teardown();
    this.state = 'idle';
  }

  // ------------------------------------------------------------------ the start sequence

  private async run(config: NodeConfig, seq: number): Promise<void> {
    const current = () => {
      if (seq !== this.startSeq) throw new MeshError('MESH_ERR_CANCELLED', 'superseded by a newer start');
    };
    this.state = 'connecting';
    this.storage ??= await this.host.openStorage();
    const storage = this.storage;
    const settings = await storage.settings();
    this.memoryBudget = config.memoryBudgetBytes ?? settings.memoryBudgetBytes ?? DEFAULT_MEMORY_BUDGET;
    const choice = config.backend ?? settings.backend ?? 'auto';
    if (config.backend !== undefined || config.memoryBudgetBytes !== undefined) {
      await storage.saveSettings({ ...(config.backend ? { backend: config.backend } : {}), ...(config.memoryBudgetBytes ? { memoryBudgetBytes: config.memoryBudgetBytes } : {}) });
    }
    this.identity ??= await Identity.loadOrCreate(storage.keyStore());
    current();

    // Same span already running: only the relay may need restarting.
    const key = `${config.modelUrl}|${config.startLayer}-${config.endLayer}|${choice}|${config.threads ?? ''}`;
    if (this.running && this.running.key !== key) await this.teardown();

    if (!this.running) {
      const cfgFiles = await this.modelFiles(config, storage);
      const cfg = parseModelConfig(cfgFiles['config.json'], `${config.modelUrl}config.json`);
      if (!(config.endLayer <= cfg.numLayers)) throw new MeshError('MESH_ERR_LAYER_RANGE', `layers ${config.startLayer}-${config.endLayer} are outside this model's 0-${cfg.numLayers}`);
      this.numLayers = cfg.numLayers;
      this.holdsHead = config.endLayer === cfg.numLayers;
      this.modelName = modelNameOf(config.modelUrl);
      current();

      const span = new SpanWeights(storage, config.modelUrl, cfg, config.startLayer, config.endLayer);
      await span.dropOthers();
      this.state = 'downloading';
      this.download = { loadedBytes: 0, totalBytes: 0 };
      const got = await span.ensure({ fetch: this.host.fetch, onProgress: (p) => (this.download = p) });
      this.fetchedBytes += got.fetchedBytes;
      this.storedBytes = got.storedBytes;
      current();

      this.state = 'loading';
      const decision = await this.chooseBackend(choice, config, cfg, span);
      current();
      const executor = await this.buildExecutor(config, cfg, decision.kind, decision.fp16, span);
      const threads = decision.kind === 'wasm' ? this.threadsFor(config) : 1;
      this.running = {
        key,
        config,
        cfg,
        executor,
        budget: this.memoryBudget,
        backend: { kind: decision.kind, fp16: decision.fp16, threads, adapter: decision.adapter, reason: decision.reason },
      };
      if (this.holdsHead) await this.loadTokenizer(config, cfgFiles, cfg);
      current();
    }

    const r = this.running!;
    if (!r.relay) {
      const relay = new RelayClient({
        relayUrl: config.relayUrl,
        WebSocket: this.host.WebSocket,
        identity: this.identity,
        handler: this.handlerFor(r),
        info: { model: config.modelUrl, start_layer: config.startLayer, end_layer: config.endLayer, backend: `onnxruntime-web/${r.backend.kind}`, version: VERSION, host: 'browser' },
      });
      relay.on('state', (e) => this.relayOnState(r, e));
      r.relay = relay;
      this.state = 'connecting';
      relay.start();
    }
    // Wait for the first registration so start() resolves with a meaningful state; later drops are handled by relayOnState.
    await r.relay.ready(15_000).then(
      () => undefined,
      (e: MeshError) => {
        // Still retrying in the background: show why, without stopping.
        if (r === this.running && this.state === 'connecting') this.error = undefined;
        if (e.code === 'MESH_ERR_SHUTTING_DOWN') throw e;
      },
    );
  }

  private relayOnState(r: Running, e: RelayStateEvent): void {
    if (r !== this.running) return;
    if (this.state === 'error') return;
    if (e.state === RelayClientState.Registered) this.state = this.paused ? 'paused' : 'serving';
    else if (e.state === RelayClientState.Connecting || e.state === RelayClientState.Disconnected) {
      if (this.state === 'serving' || this.state === 'paused' || this.state === 'connecting') this.state = 'connecting';
    }
  }

  private handlerFor(r: Running) {
    return createForwardHandler(r.executor, {
      model: r.config.modelUrl,
      backend: `onnxruntime-web/${r.backend.kind}`,
      version: VERSION,
      isPaused: () => this.paused,
      ...(this.tokenizer ? { decode: (id: number) => this.tokenizer!.decode([id]) } : {}),
      extraInfo: () => ({ peer_id: this.identity?.peerId, host: 'browser', adapter: r.backend.adapter, threads: r.backend.threads, fp16: r.backend.fp16 }),
      onForward: (ev: ForwardEvent) => {
        if (ev.status !== 200) return;
        this.stats.record(Date.now(), ev.tokens);
        this.stats.recordLatency(ev.ms);
      },
    });
  }

  private tokenizer: ModelTokenizer | undefined;

  private async loadTokenizer(config: NodeConfig, files: Record<string, unknown>, cfg: ModelConfig): Promise<void> {
    try {
      if (files['tokenizer.json'] === undefined) {
        const tj = await this.fetchJson(config.modelUrl, 'tokenizer.json');
        const tc = await this.fetchJson(config.modelUrl, 'tokenizer_config.json');
        files = { ...files, 'tokenizer.json': tj, 'tokenizer_config.json': tc };
        await this.storage!.saveModelFiles(config.modelUrl, files);
      }
      this.tokenizer = ModelTokenizer.fromJson(files['tokenizer.json'], files['tokenizer_config.json'], { extraEosTokenIds: cfg.eosTokenIds });
    } catch {
      // Without a tokenizer the last hop still answers token ids; `text` is empty.
      this.tokenizer = undefined;
    }
  }

  private async fetchJson(base: string, file: string): Promise<unknown> {
    const url = base + file;
    let res: Response;
    try {
      res = await this.host.fetch(url);
    } catch (e) {
      throw new ModelFetchError(file, `cannot reach ${url}: ${(e as Error).message}`);
    }
    if (!res.ok) throw new ModelFetchError(file, `HTTP ${res.status} from ${url}`, res.status);
    const text = await res.text();
    this.fetchedBytes += text.length;
    try {
      return JSON.parse(text) as unknown;
    } catch (e) {
      throw new ModelFormatError(file, `not valid JSON (${(e as Error).message})`);
    }
  }

  /** config.json from storage, or fetched once and stored. */
  private async modelFiles(config: NodeConfig, storage: NodeStorage): Promise<Record<string, unknown>> {
    const stored = await storage.modelFiles(config.modelUrl);
    if (stored?.['config.json'] !== undefined) return stored;
    const files = { ...(stored ?? {}), 'config.json': await this.fetchJson(config.modelUrl, 'config.json') };
    await storage.saveModelFiles(config.modelUrl, files);
    return files;
  }

  private threadsFor(config: NodeConfig): number {
    if (!this.host.crossOriginIsolated) return 1;
    // One core stays free for the worker's own thread (relay I/O, codecs) and the page: on a 2-core
    // machine, 2 ORT threads made a decode step 1.6x slower than 1 (bench/results/browser-node.json).
    return config.threads ?? Math.max(1, Math.min(4, this.host.hardwareConcurrency - 1));
  }

  private backendFor(kind: 'wasm' | 'webgpu', config: NodeConfig): Promise<OnnxBackend> {
    return createOrtWebBackend(kind, { numThreads: this.threadsFor(config), wasmPaths: this.host.ortWasmPaths });
  }

  private async chooseBackend(choice: 'auto' | 'wasm' | 'webgpu', config: NodeConfig, cfg: ModelConfig, span: SpanWeights): Promise<BackendDecision & { adapter: string }> {
    const threads = this.threadsFor(config);
    const cpu = `CPU (WASM, ${threads} thread${threads === 1 ? '' : 's'})`;
    if (choice === 'wasm') return { kind: 'wasm', fp16: false, reason: 'WASM: forced by setting', adapter: cpu };
    const probe = await probeWebGpu(this.host.gpu);
    if (choice === 'webgpu') {
      if (!probe.usable) throw new MeshError('MESH_ERR_UNAVAILABLE', `WebGPU was forced but ${probe.reason}`);
      return { kind: 'webgpu', fp16: probe.fp16, reason: `WebGPU: forced by setting${probe.fp16 ? '' : ' (fp32: no shader-f16)'}`, adapter: probe.adapter };
    }
    if (!probe.usable || probe.fallback) return { ...decide(probe), adapter: cpu };
    const layer = config.startLayer;
    const [webgpuMs, wasmMs] = [
      await calibrate(await this.backendFor('webgpu', config), cfg, span.loader(), layer, probe.fp16 ? 'f16' : 'f32'),
      await calibrate(await this.backendFor('wasm', config), cfg, span.loader(), layer, 'f32'),
    ];
    const d = decide(probe, { webgpuMs, wasmMs });
    return { ...d, adapter: d.kind === 'webgpu' ? probe.adapter : cpu };
  }

  private async buildExecutor(config: NodeConfig, cfg: ModelConfig, kind: 'wasm' | 'webgpu', fp16: boolean, span?: SpanWeights): Promise<ShardExecutor> {
    const weights = span ?? new SpanWeights(this.storage!, config.modelUrl, cfg, config.startLayer, config.endLayer);
    return ShardExecutor.create({
      config: cfg,
      backend: await this.backendFor(kind, config),
      weights: weights.loader(),
      startLayer: config.startLayer,
      endLayer: config.endLayer,
      dtype: fp16 ? 'f16' : 'f32',
      kvBudgetBytes: this.memoryBudget,
    });
  }

  private async teardown(): Promise<void> {
    const r = this.running;
    this.running = undefined;
    if (!r) return;
    r.relay?.close();
    await r.executor.release().catch(() => undefined);
  }

  private fail(e: unknown): void {
    this.state = 'error';
    this.error = describeError(e);
    // A relay client left running would flip the state back to serving; stop it, keep the executor for a retry.
    if (this.running?.relay) {
      this.running.relay.close();
      delete this.running.relay;
    }
  }
}

function modelNameOf(url: string): string {
  const parts = url.replace(/\/+$/, '').split('/');
  return parts[parts.length - 1] || url;
}

/** Every failure the donor can see, with what to do about it. */
export function describeError(e: unknown): NodeErrorInfo {
  if (e instanceof QuotaError || isQuotaError(e)) {
    return {
      code: 'MESH_ERR_QUOTA',
      message: e instanceof Error ? e.message : 'browser storage is full',
      action: 'Free disk space or clear other sites’ data (browser settings → Privacy → Site data), or open this page with fewer layers; then press Retry. Layers already stored are kept.',
      retryable: true,
    };
  }
  if (e instanceof ModelFetchError) {
    return { code: 'MESH_ERR_MODEL_FETCH', message: `model download failed: ${e.message}`, action: 'Check the connection to the model server, then press Retry: the download resumes where it stopped.', retryable: true };
  }
  if (e instanceof ModelFormatError) {
    return { code: 'MESH_ERR_MODEL_FORMAT', message: e.message, action: 'The model files are not what this node can run; check the model URL.', retryable: true };
  }
  if (e instanceof WeightIntegrityError) {
    return { code: e.code, message: e.message, action: 'Press Retry: the damaged layer is fetched again.', retryable: true };
  }
  if (e instanceof MeshError) {
    return { code: e.code, message: e.message, action: e.code === 'MESH_ERR_LAYER_RANGE' ? 'Open the page with a layer range inside the model.' : 'Press Retry; if it fails again, reload the page.', retryable: true };
  }
  const err = e as { name?: string; message?: string };
  // fetch() rejects with TypeError("Failed to fetch") when the server is gone.
  if (err?.name === 'TypeError' && /fetch|network/i.test(err.message ?? '')) {
    return { code: 'MESH_ERR_MODEL_FETCH', message: `model server unreachable: ${err.message}`, action: 'Check that the model server is up, then press Retry: the download resumes where it stopped.', retryable: true };
  }
  return { code: 'MESH_ERR_INTERNAL', message: err?.message ?? String(e), action: 'Press Retry; if it fails again, reload the page and report this message.', retryable: true };
}
