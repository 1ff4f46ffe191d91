/**
 * The browser node: the node core (shard executor, forward handler, relay
 * client) on browser host APIs (onnxruntime-web, WebSocket, IndexedDB,
 * WebCrypto). Runs in the worker; the page sees it only as a NodeEngine.
 *
 *   start(config)                      a span from the URL
 *     connecting   open storage, load the identity (same peer id after a reload)
 *     downloading  config.json, then the span's tensors by Range into IndexedDB
 *     loading      pick the backend (forced, or calibrated), build the graphs
 *     connecting   register with the relay
 *     serving      answer /forward; a relay drop goes back to connecting,
 *                  and the relay client reconnects on its own
 *
 *   start({trackerUrl, …})             the tracker's span
 *     connecting   identity, relay, then register with the tracker (signed
 *                  with the relay key) giving the memory budget
 *     downloading, loading   the assigned span (others dropped from IndexedDB)
 *     serving      heartbeats carry stats and the served span; a new
 *                  assignment is loaded beside the old span, then swapped in
 *
 * A node whose span starts at layer 0 is a head: it answers the tracker's
 * signed POST /generate and drives the pipeline (src/node/pipeline.ts), as
 * the Node.js host does.
 */
import { parseModelConfig, type ModelConfig } from '../model/config.ts';
import { ModelTokenizer } from '../model/tokenizer.ts';
import { ModelFetchError, ModelFormatError } from '../model/errors.ts';
import { MeshError, isMeshErrorCode, type MeshErrorCode } from '../protocol/errors.ts';
import { z } from 'zod';
import { encodeBase64Url } from '../protocol/base64.ts';
import { errorReply, type MeshRequest, type MeshResponse } from '../protocol/envelopes.ts';
import type { Assignment, NodeMessage } from '../protocol/tracker.ts';
import { createForwardHandler, type ForwardEvent } from '../node/forward-handler.ts';
import { createHeadHandler } from '../node/head-handler.ts';
import { HopTransport } from '../node/hop-transport.ts';
import { Identity } from '../node/identity.ts';
import { PipelineDriver, type HeadExecutor } from '../node/pipeline.ts';
import type { MeshHandler } from '../node/mesh-types.ts';
import { RelayClient, RelayClientState, type RelayStateEvent } from '../node/relay-client.ts';
import { RpcConnection } from '../node/relay-hop.ts';
import { TrackerClient } from '../node/tracker-client.ts';
import { TrackerSession } from '../node/tracker-session.ts';
import type { WebSocketConstructor } from '../node/socket.ts';
import { ShardExecutor } from '../shard/executor.ts';
import type { OnnxBackend } from '../shard/backend.ts';
import { calibrate, decide, probeWebGpu, type BackendDecision, type GpuLike } from './backend-select.ts';
import type { BackendChoice, BackendInfo, NodeConfig, NodeEngine, NodeErrorInfo, NodeState, NodeStatus } from './engine.ts';
import { createOrtWebBackend } from './ort-web.ts';
import { SpanWeights } from './span-weights.ts';
import { NodeStorage, isQuotaError } from './storage.ts';
import { StatsWindow } from './stats.ts';
import { warmUp } from './warm-up.ts';

export const DEFAULT_MEMORY_BUDGET = 256 * 2 ** 20;
/**
 * Warm-up of a new executor (warm-up.ts): the first WASM one in this worker runs until V8 has tiered
 * up onnxruntime's hot WASM functions (~600 layer runs settled them on the `small` fixture); later
 * ones (the module is compiled by then) and WebGPU ones (the compute is on the GPU) only pay their
 * sessions' first runs (buffers, WebGPU pipelines).
 */
const FIRST_WARM_UP = { layerRuns: 600, maxMs: 6_000 };
const NEXT_WARM_UP = { layerRuns: 24, maxMs: 1_000 };
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

/** One span of one model: from the URL, or the tracker's assignment. */
interface SpanSpec {
  /** Model id (the tracker's name; the URL's last path segment without a tracker). */
  model: string;
  /** Base URL, ending with /. */
  modelUrl: string;
  startLayer: number;
  endLayer: number;
}

interface Running {
  key: string;
  span: SpanSpec;
  config: NodeConfig;
  cfg: ModelConfig;
  executor: ShardExecutor;
  backend: BackendInfo;
  budget: number;
  tokenizer: ModelTokenizer | undefined;
  /** Present when the span starts at layer 0 and the tokenizer loaded: this node can head a pipeline. */
  pipeline: PipelineDriver | undefined;
  forward: MeshHandler;
}

const utf8 = new TextEncoder();

function jsonReply(status: number, value: unknown): MeshResponse {
  return { status, headers: { 'content-type': 'application/json' }, body: utf8.encode(JSON.stringify(value)) };
}

function spanKey(span: SpanSpec, choice: string, threads: number | undefined): string {
  return `${span.modelUrl}|${span.startLayer}-${span.endLayer}|${choice}|${threads ?? ''}`;
}

export class BrowserNode implements NodeEngine {
  private storage: NodeStorage | undefined;
  private identity: Identity | undefined;
  private state: NodeState = 'idle';
  private error: NodeErrorInfo | undefined;
  private download: NodeStatus['download'];
  private running: Running | undefined;
  /** The span being loaded or served: what the page shows. */
  private shown: { span: SpanSpec; numLayers: number } | undefined;
  private lastConfig: NodeConfig | undefined;
  private storedBytes = 0;
  private fetchedBytes = 0;
  private paused = false;
  private memoryBudget = DEFAULT_MEMORY_BUDGET;
  private readonly stats = new StatsWindow();
  /** Per-layer decode-step times (ms) of recent one-token forwards: the heartbeat's layer_ms. */
  private readonly stepMs: number[] = [];
  private inFlight = 0;
  private startSeq = 0;
  /** Whether onnxruntime's WASM module has had its FIRST_WARM_UP in this worker. */
  private wasmWarmed = false;
  private readonly host: BrowserNodeHost;

  // One relay connection for the node's life: span swaps change the handler's target, not the socket.
  private relay: RelayClient | undefined;
  private transport: HopTransport | undefined;
  private readonly handler: MeshHandler;

  // Tracker mode.
  private trackerClient: TrackerClient | undefined;
  private trackerSession: TrackerSession | undefined;
  private assignment: Assignment | null | undefined;
  private wanted: Assignment | undefined;
  private adoptChain: Promise<void> = Promise.resolve();

  constructor(host?: BrowserNodeHost) {
    this.host = host ?? workerHost();
    const identity = () => this.identity;
    this.handler = createHeadHandler({
      forward: (req) => this.forwardOrUnavailable(req),
      // Read per request: the identity is loaded after construction.
      get peerId() {
        return identity()?.peerId ?? '';
      },
      trackerKey: () => this.trackerClient?.trackerKey,
      pipeline: () => this.running?.pipeline,
      onLog: (m) => console.warn(`meshnet node: ${m}`),
      // A head computes every token it streams (embedding, its layers) without a /forward: count them as served.
      onEvent: (e) => {
        if (e.type === 'token') this.stats.record(Date.now(), 1);
      },
    });
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
    if (this.lastConfig?.trackerUrl) {
      s.tracker = {
        url: this.lastConfig.trackerUrl,
        registered: this.trackerSession?.isRegistered ?? false,
        assignment: this.assignment === undefined ? undefined : this.assignment && { startLayer: this.assignment.start_layer, endLayer: this.assignment.end_layer },
      };
    }
    if (this.download && this.state === 'downloading') s.download = this.download;
    if (r) s.backend = r.backend;
    const shown = this.shown;
    if (shown) {
      const { span, numLayers } = shown;
      s.model = { baseUrl: span.modelUrl, name: span.model, numLayers, startLayer: span.startLayer, endLayer: span.endLayer, holdsHead: span.endLayer === numLayers, pipelineHead: r !== undefined && r.span === span && r.pipeline !== undefined };
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
    if (this.state === 'paused') this.state = this.relay?.state === RelayClientState.Registered ? 'serving' : 'connecting';
  }

  async setMemoryBudget(bytes: number): Promise<void> {
    if (!Number.isFinite(bytes) || bytes < 16 * 2 ** 20) throw new MeshError('MESH_ERR_BAD_REQUEST', 'the memory budget must be at least 16 MiB');
    this.memoryBudget = Math.floor(bytes);
    await this.storage?.saveSettings({ memoryBudgetBytes: this.memoryBudget });
    // The KV store's budget is fixed when the executor is built: rebuild it (live sessions answer 409 and are replayed by their heads).
    const r = this.running;
    if (r && r.budget !== this.memoryBudget && (this.state === 'serving' || this.state === 'paused')) {
      const next = await this.buildExecutor(r.span, r.cfg, r.backend.kind, r.backend.fp16, r.config);
      const old = r.executor;
      r.executor = next;
      r.budget = this.memoryBudget;
      r.forward = this.forwardFor(r);
      r.pipeline = this.pipelineFor(r);
      await old.release();
    }
    // The tracker sizes spans from the budget: a new one may move this node.
    void this.trackerSession?.beatNow();
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
    if (config.trackerUrl) return this.runTracked(config, choice, current);

    if (config.modelUrl === undefined || config.startLayer === undefined || config.endLayer === undefined) {
      throw new MeshError('MESH_ERR_BAD_REQUEST', 'without a tracker the node needs a model URL and a layer range');
    }
    const span: SpanSpec = { model: modelNameOf(config.modelUrl), modelUrl: config.modelUrl, startLayer: config.startLayer, endLayer: config.endLayer };
    // Same span already running: only the relay may need restarting.
    const key = spanKey(span, choice, config.threads);
    if (this.running && this.running.key !== key) await this.teardown();
    if (!this.running) {
      this.running = await this.loadSpan(span, config, choice, current);
      current();
    }
    this.state = this.relay?.state === RelayClientState.Registered ? (this.paused ? 'paused' : 'serving') : 'connecting';
    await this.connectRelay(config);
  }

  /** Registers with the relay (once per node life) and waits for the first registration, so start() resolves with a meaningful state. */
  private async connectRelay(config: NodeConfig): Promise<void> {
    if (!this.relay) {
      const relay = new RelayClient({
        relayUrl: config.relayUrl,
        WebSocket: this.host.WebSocket,
        identity: this.identity!,
        handler: this.handler,
        info: { host: 'browser', version: VERSION, ...(config.trackerUrl ? { tracker: config.trackerUrl } : { model: config.modelUrl, start_layer: config.startLayer, end_layer: config.endLayer }) },
      });
      relay.on('state', (e) => this.relayOnState(relay, e));
      this.relay = relay;
      this.transport = new HopTransport({
        fast: {
          relayUrl: config.relayUrl,
          get isRegistered() {
            return relay.state === RelayClientState.Registered;
          },
          request: (peerId, req, opts) => relay.request(peerId, req, opts),
        },
        rpc: (addr) => new RpcConnection(addr, { WebSocket: this.host.WebSocket }),
        fetch: this.host.fetch,
      });
      relay.start();
    }
    const relay = this.relay;
    await relay.ready(15_000).then(
      () => {
        if (relay === this.relay && this.running && this.state === 'connecting') this.state = this.paused ? 'paused' : 'serving';
      },
      (e: MeshError) => {
        // Still retrying in the background: show why, without stopping.
        if (e.code === 'MESH_ERR_SHUTTING_DOWN') throw e;
      },
    );
  }

  /**
   * Tracker mode: relay first (the registration carries our relay address),
   * then register; every answer's assignment is adopted in order, the newest
   * winning (load the new span, switch, release the old one).
   */
  private async runTracked(config: NodeConfig, choice: BackendChoice, current: () => void): Promise<void> {
    const trackerUrl = config.trackerUrl!;
    if (this.trackerSession && this.trackerClient && this.lastTrackerUrl === trackerUrl && this.relay) {
      // Already registered with this tracker (a retry after a span failed): ask for the assignment again.
      this.wanted = undefined;
      await this.trackerSession.beatNow();
      await this.adoptChain;
      return;
    }
    await this.teardown();
    this.lastTrackerUrl = trackerUrl;
    await this.connectRelay(config);
    current();
    const client = new TrackerClient({ trackerUrl, fetch: this.host.fetch, identity: this.identity! });
    const modelName = config.modelName ?? (await this.firstTrackerModel(trackerUrl));
    current();
    this.trackerClient = client;
    const session = new TrackerSession({
      client,
      message: () => this.nodeMessage(modelName, choice),
      onAssignment: (a) => this.assign(a, config, choice),
      onLog: (level, m) => (level === 'warn' ? console.warn : console.info)(`meshnet node: ${m}`),
    });
    this.trackerSession = session;
    try {
      await session.start();
    } catch (e) {
      throw new MeshError('MESH_ERR_UNAVAILABLE', `the tracker at ${trackerUrl} did not accept this node: ${(e as Error).message}`);
    }
    current();
    // start() resolves once the first span serves (or failed), like a URL span.
    await this.adoptChain;
    if (this.state === 'error') return;
    if (this.assignment === null) {
      this.state = 'connecting';
      this.error = { code: 'MESH_ERR_UNAVAILABLE', message: `the tracker assigned no layers: ${formatMib(this.memoryBudget)} does not hold one layer of ${modelName}`, action: 'Give the mesh more memory (the budget control), or keep the page open: the tracker assigns layers when the picture changes.', retryable: false };
    }
  }

  private lastTrackerUrl: string | undefined;

  private async firstTrackerModel(trackerUrl: string): Promise<string> {
    const url = `${trackerUrl.replace(/\/+$/, '')}/api/tracker`;
    let res: Response;
    try {
      res = await this.host.fetch(url);
    } catch (e) {
      throw new MeshError('MESH_ERR_UNAVAILABLE', `cannot reach the tracker at ${url}: ${(e as Error).message}`);
    }
    const p = trackerInfoSchema.safeParse(await res.json().catch(() => undefined));
    if (!res.ok || !p.success || p.data.models.length === 0) throw new MeshError('MESH_ERR_UNAVAILABLE', `the tracker at ${url} names no model (HTTP ${res.status})`);
    return p.data.models[0]!;
  }

  private nodeMessage(model: string, choice: BackendChoice): NodeMessage {
    const r = this.running;
    const kv = r?.executor.kvStats();
    const relayAddr = this.relay?.relayAddr;
    const sorted = [...this.stepMs].sort((a, b) => a - b);
    return {
      peer_id: this.identity!.peerId,
      public_key: encodeBase64Url(this.identity!.publicKey),
      ...(relayAddr ? { relay_addr: relayAddr } : {}),
      info: { model, backend: r?.backend.kind ?? (choice === 'auto' ? 'wasm' : choice), memory_budget_mb: this.memoryBudget / 2 ** 20, host: 'browser', version: VERSION },
      stats: {
        rpm: this.stats.requestsPerMinute(Date.now()),
        layer_ms: sorted.length ? Math.round(sorted[sorted.length >> 1]! * 1000) / 1000 : 0,
        queue_depth: this.inFlight,
        kv_free_bytes: kv ? Math.max(0, kv.budgetBytes - kv.bytesUsed) : this.memoryBudget,
        tokens_served: this.stats.tokens,
      },
      // While paused the node answers 503: tell the tracker it serves nothing, so routes avoid it.
      serving: r && !this.paused ? { start_layer: r.span.startLayer, end_layer: r.span.endLayer } : null,
      timestamp: Date.now(),
    };
  }

  /** Adoptions run one after another; a newer assignment supersedes one still queued. */
  private assign(a: Assignment | null, config: NodeConfig, choice: BackendChoice): void {
    this.assignment = a;
    if (!a) return;
    const span: SpanSpec = { model: a.model, modelUrl: a.model_url.endsWith('/') ? a.model_url : `${a.model_url}/`, startLayer: a.start_layer, endLayer: a.end_layer };
    const key = spanKey(span, choice, config.threads);
    if (this.running?.key === key || (this.wanted && sameAssignment(this.wanted, a))) return;
    // A span that failed is retried only by the donor's Retry, not on every heartbeat.
    if (this.state === 'error') return;
    this.wanted = a;
    const seq = this.startSeq;
    this.adoptChain = this.adoptChain.then(async () => {
      if (this.wanted !== a || seq !== this.startSeq) return;
      try {
        const next = await this.loadSpan(span, config, choice, () => {
          if (seq !== this.startSeq) throw new MeshError('MESH_ERR_CANCELLED', 'superseded by a newer start');
        });
        const old = this.running;
        this.running = next;
        this.state = this.paused ? 'paused' : this.relay?.state === RelayClientState.Registered ? 'serving' : 'connecting';
        // release() waits for the old executor's queue, so a forward already running finishes first.
        if (old) void old.executor.release().catch(() => undefined);
        void this.trackerSession?.beatNow();
      } catch (e) {
        if (seq === this.startSeq && !(e instanceof MeshError && e.code === 'MESH_ERR_CANCELLED')) this.fail(e);
      } finally {
        if (this.wanted === a) this.wanted = undefined;
      }
    });
  }

  /** Everything but /generate, while a span is loaded; a node between spans answers 503 so heads route around it. */
  private async forwardOrUnavailable(req: MeshRequest): Promise<MeshResponse> {
    const r = this.running;
    const path = req.path.split('?')[0]!;
    if (!r) {
      if (path === '/health') return jsonReply(200, { status: 'loading', sessions: 0 });
      if (path === '/info') return jsonReply(200, { peer_id: this.identity?.peerId, start_layer: null, end_layer: null, host: 'browser' });
      return errorReply(new MeshError('MESH_ERR_UNAVAILABLE', 'this node has no span loaded yet; route around it or retry later'));
    }
    if (path !== '/forward') return r.forward(req);
    this.inFlight++;
    try {
      return await r.forward(req);
    } finally {
      this.inFlight--;
    }
  }

  private relayOnState(relay: RelayClient, e: RelayStateEvent): void {
    if (relay !== this.relay) return;
    if (this.state === 'error' || this.state === 'downloading' || this.state === 'loading') return;
    if (e.state === RelayClientState.Registered) {
      if (this.running) this.state = this.paused ? 'paused' : 'serving';
    } else if (e.state === RelayClientState.Connecting || e.state === RelayClientState.Disconnected) {
      if (this.state === 'serving' || this.state === 'paused') this.state = 'connecting';
    }
  }

  private forwardFor(r: Pick<Running, 'executor' | 'span' | 'backend' | 'tokenizer'>): MeshHandler {
    const layers = r.span.endLayer - r.span.startLayer;
    const tokenizer = r.tokenizer;
    return createForwardHandler(r.executor, {
      model: r.span.model,
      backend: `onnxruntime-web/${r.backend.kind}`,
      version: VERSION,
      isPaused: () => this.paused,
      ...(tokenizer ? { decode: (id: number) => tokenizer.decode([id]) } : {}),
      extraInfo: () => ({ peer_id: this.identity?.peerId, host: 'browser', adapter: r.backend.adapter, threads: r.backend.threads, fp16: r.backend.fp16 }),
      onForward: (ev: ForwardEvent) => {
        if (ev.status !== 200) return;
        this.stats.record(Date.now(), ev.tokens);
        this.stats.recordLatency(ev.ms);
        if (ev.tokens === 1 && layers > 0) this.recordStep(ev.ms / layers);
      },
    });
  }

  private recordStep(msPerLayer: number): void {
    this.stepMs.push(msPerLayer);
    if (this.stepMs.length > 101) this.stepMs.shift();
  }

  private pipelineFor(r: Pick<Running, 'executor' | 'span' | 'tokenizer'>): PipelineDriver | undefined {
    if (r.span.startLayer !== 0 || !r.tokenizer || !this.transport) return undefined;
    const client = this.trackerClient;
    const model = r.span.model;
    const executor = r.executor;
    const layers = executor.endLayer - executor.startLayer;
    // The head runs its layers without a /forward: time its one-token steps here, or the tracker
    // would only ever see a default layer_ms for heads (and rebalance on that guess).
    const timed: HeadExecutor = {
      config: executor.config,
      startLayer: executor.startLayer,
      endLayer: executor.endLayer,
      maxContext: executor.maxContext,
      dropSession: (id) => executor.dropSession(id),
      forward: async (req) => {
        const t0 = performance.now();
        const out = await executor.forward(req);
        if (req.tokenIds?.length === 1 && layers > 0) this.recordStep((performance.now() - t0) / layers);
        return out;
      },
    };
    return new PipelineDriver({
      executor: timed,
      tokenizer: r.tokenizer,
      transport: this.transport,
      ...(client ? { replace: (hop, signal) => client.replace(model, hop, signal) } : {}),
      onLog: (m) => console.warn(`meshnet pipeline: ${m}`),
    });
  }

  /** Download (only what is missing), choose the backend, build the executor; the span is not served until the caller switches to it. */
  private async loadSpan(span: SpanSpec, config: NodeConfig, choice: BackendChoice, current: () => void): Promise<Running> {
    const storage = this.storage!;
    const cfgFiles = await this.modelFiles(span.modelUrl, storage);
    const cfg = parseModelConfig(cfgFiles['config.json'], `${span.modelUrl}config.json`);
    if (!(span.endLayer <= cfg.numLayers)) throw new MeshError('MESH_ERR_LAYER_RANGE', `layers ${span.startLayer}-${span.endLayer} are outside this model's 0-${cfg.numLayers}`);
    this.shown = { span, numLayers: cfg.numLayers };
    current();

    const weights = new SpanWeights(storage, span.modelUrl, cfg, span.startLayer, span.endLayer);
    // The executor serving now has its weights in memory already: dropping its stored tensors costs nothing.
    await weights.dropOthers();
    this.state = 'downloading';
    this.download = { loadedBytes: 0, totalBytes: 0 };
    const got = await weights.ensure({ fetch: this.host.fetch, onProgress: (p) => (this.download = p) });
    this.fetchedBytes += got.fetchedBytes;
    this.storedBytes = got.storedBytes;
    current();

    this.state = 'loading';
    const decision = await this.chooseBackend(choice, config, cfg, span, weights);
    current();
    const executor = await this.buildExecutor(span, cfg, decision.kind, decision.fp16, config, weights);
    const threads = decision.kind === 'wasm' ? this.threadsFor(config) : 1;
    // Only a head needs the tokenizer: the last hop answers token ids, and the head detokenizes.
    const needsTokenizer = span.startLayer === 0;
    const tokenizer = needsTokenizer ? await this.loadTokenizer(span.modelUrl, cfgFiles, cfg) : undefined;
    const backend: BackendInfo = { kind: decision.kind, fp16: decision.fp16, threads, adapter: decision.adapter, reason: decision.reason };
    const base = { span, executor, backend, tokenizer };
    const r: Running = { key: spanKey(span, choice, config.threads), config, cfg, budget: this.memoryBudget, ...base, forward: this.forwardFor(base), pipeline: this.pipelineFor(base) };
    if (seqStale(current)) await executor.release();
    return r;
  }

  private async loadTokenizer(modelUrl: string, files: Record<string, unknown>, cfg: ModelConfig): Promise<ModelTokenizer | undefined> {
    try {
      if (files['tokenizer.json'] === undefined) {
        const tj = await this.fetchJson(modelUrl, 'tokenizer.json');
        const tc = await this.fetchJson(modelUrl, 'tokenizer_config.json');
        files = { ...files, 'tokenizer.json': tj, 'tokenizer_config.json': tc };
        await this.storage!.saveModelFiles(modelUrl, files);
      }
      return ModelTokenizer.fromJson(files['tokenizer.json'], files['tokenizer_config.json'], { extraEosTokenIds: cfg.eosTokenIds });
    } catch {
      // Without a tokenizer the last hop still answers token ids (`text` empty), but the node cannot head a pipeline.
      return undefined;
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
  private async modelFiles(modelUrl: string, storage: NodeStorage): Promise<Record<string, unknown>> {
    const stored = await storage.modelFiles(modelUrl);
    if (stored?.['config.json'] !== undefined) return stored;
    const files = { ...(stored ?? {}), 'config.json': await this.fetchJson(modelUrl, 'config.json') };
    await storage.saveModelFiles(modelUrl, files);
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

  private async chooseBackend(choice: BackendChoice, config: NodeConfig, cfg: ModelConfig, span: SpanSpec, weights: SpanWeights): Promise<BackendDecision & { adapter: string }> {
    const threads = this.threadsFor(config);
    const cpu = `CPU (WASM, ${threads} thread${threads === 1 ? '' : 's'})`;
    if (choice === 'wasm') return { kind: 'wasm', fp16: false, reason: 'WASM: forced by setting', adapter: cpu };
    const probe = await probeWebGpu(this.host.gpu);
    if (choice === 'webgpu') {
      if (!probe.usable) throw new MeshError('MESH_ERR_UNAVAILABLE', `WebGPU was forced but ${probe.reason}`);
      return { kind: 'webgpu', fp16: probe.fp16, reason: `WebGPU: forced by setting${probe.fp16 ? '' : ' (fp32: no shader-f16)'}`, adapter: probe.adapter };
    }
    if (!probe.usable || probe.fallback) return { ...decide(probe), adapter: cpu };
    const layer = span.startLayer;
    const [webgpuMs, wasmMs] = [
      await calibrate(await this.backendFor('webgpu', config), cfg, weights.loader(), layer, probe.fp16 ? 'f16' : 'f32'),
      await calibrate(await this.backendFor('wasm', config), cfg, weights.loader(), layer, 'f32'),
    ];
    const d = decide(probe, { webgpuMs, wasmMs });
    return { ...d, adapter: d.kind === 'webgpu' ? probe.adapter : cpu };
  }

  private async buildExecutor(span: SpanSpec, cfg: ModelConfig, kind: 'wasm' | 'webgpu', fp16: boolean, config: NodeConfig, weights?: SpanWeights): Promise<ShardExecutor> {
    const w = weights ?? new SpanWeights(this.storage!, span.modelUrl, cfg, span.startLayer, span.endLayer);
    const executor = await ShardExecutor.create({
      config: cfg,
      backend: await this.backendFor(kind, config),
      weights: w.loader(),
      startLayer: span.startLayer,
      endLayer: span.endLayer,
      dtype: fp16 ? 'f16' : 'f32',
      kvBudgetBytes: this.memoryBudget,
    });
    const first = kind === 'wasm' && !this.wasmWarmed;
    try {
      const done = await warmUp(executor, first ? FIRST_WARM_UP : NEXT_WARM_UP);
      if (kind === 'wasm') this.wasmWarmed = true;
      if (first) console.info(`meshnet node: warmed up layers ${span.startLayer}-${span.endLayer - 1} in ${Math.round(done.ms)} ms (${done.steps} steps)`);
    } catch (e) {
      // Serving finds the same fault on its own and answers it per request; a warm-up only saves time.
      console.warn(`meshnet node: warm-up failed: ${(e as Error).message}`);
    }
    return executor;
  }

  private async teardown(): Promise<void> {
    this.trackerSession?.close();
    this.trackerSession = undefined;
    this.trackerClient = undefined;
    this.lastTrackerUrl = undefined;
    this.assignment = undefined;
    this.wanted = undefined;
    this.relay?.close();
    this.relay = undefined;
    this.transport?.close();
    this.transport = undefined;
    const r = this.running;
    this.running = undefined;
    if (r) await r.executor.release().catch(() => undefined);
  }

  private fail(e: unknown): void {
    this.state = 'error';
    this.error = describeError(e);
    // A relay client left running would flip the state back to serving, and heartbeats would keep
    // announcing a span: stop both, keep the executor for a retry.
    this.trackerSession?.close();
    this.trackerSession = undefined;
    this.lastTrackerUrl = undefined;
    this.relay?.close();
    this.relay = undefined;
    this.transport?.close();
    this.transport = undefined;
  }
}

/** Calls `current` and says whether it threw (a newer start superseded this load). */
function seqStale(current: () => void): boolean {
  try {
    current();
    return false;
  } catch {
    return true;
  }
}

function sameAssignment(a: Assignment, b: Assignment): boolean {
  return a.start_layer === b.start_layer && a.end_layer === b.end_layer && a.model_url === b.model_url;
}

function formatMib(bytes: number): string {
  return `${Math.round((bytes / 2 ** 20) * 10) / 10} MiB`;
}

const trackerInfoSchema = z.object({ models: z.array(z.string()) }).loose();

function modelNameOf(url: string): string {
  const parts = url.replace(/\/+$/, '').split('/');
  return parts[parts.length - 1] || url;
}

/** What the donor can do about each failure, by code; anything else: Retry. */
const ACTIONS: Partial<Record<MeshErrorCode, string>> = {
  MESH_ERR_QUOTA: 'Free disk space or clear other sites’ data (browser settings → Privacy → Site data), or open this page with fewer layers; then press Retry. Layers already stored are kept.',
  MESH_ERR_MODEL_FETCH: 'Check that the model server is up and reachable, then press Retry: the download resumes where it stopped.',
  MESH_ERR_MODEL_FORMAT: 'The model files are not what this node can run; check the model URL.',
  MESH_ERR_WEIGHTS_CORRUPT: 'Press Retry: the damaged layer is fetched again.',
  MESH_ERR_LAYER_RANGE: 'Open the page with a layer range inside the model.',
};

/** Every failure the donor can see, with its code (docs/protocol.md §6) and what to do about it. */
export function describeError(e: unknown): NodeErrorInfo {
  const err = e as { name?: string; message?: string; code?: unknown };
  let code: MeshErrorCode = isMeshErrorCode(err?.code) ? err.code : 'MESH_ERR_INTERNAL';
  let message = err?.message ?? String(e);
  if (isQuotaError(e)) code = 'MESH_ERR_QUOTA';
  // fetch() rejects with TypeError("Failed to fetch") when the server is gone.
  else if (code === 'MESH_ERR_INTERNAL' && err?.name === 'TypeError' && /fetch|network/i.test(message)) {
    code = 'MESH_ERR_MODEL_FETCH';
    message = `model server unreachable: ${message}`;
  } else if (e instanceof ModelFetchError) message = `model download failed: ${message}`;
  const action = ACTIONS[code] ?? (code === 'MESH_ERR_INTERNAL' ? 'Press Retry; if it fails again, reload the page and report this message.' : 'Press Retry; if it fails again, reload the page.');
  return { code, message: code === 'MESH_ERR_QUOTA' && !(e instanceof Error) ? 'browser storage is full' : message, action, retryable: true };
}
