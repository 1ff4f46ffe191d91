/**
 * The browser node: the node runtime (src/node/runtime) in the page's Web
 * Worker, as the NodeEngine the page drives (workers/node.worker.ts exposes
 * it through Comlink).
 *
 *   start(config)   a span from the URL, or the tracker's (config.trackerUrl);
 *                   the same config again reuses what is loaded (a Retry),
 *                   another one starts a new runtime
 *   pause/resume    /forward answers 503 meanwhile, heartbeats say "nothing served"
 *   setMemoryBudget kept in IndexedDB; the span serving now is rebuilt with it
 *
 * The donor's settings (memory budget, backend) persist in IndexedDB; so do
 * the identity (the same peer id after a reload) and the span's weights.
 */
import { MeshError } from '../../protocol/errors.ts';
import { NodeRuntime } from '../../node/runtime/runtime.ts';
import { DEFAULT_WEIGHT_FORMAT, type BackendChoice, type NodeConfig, type NodeEngine, type NodeStatus, type WeightFormat } from './engine.ts';
import { newQ4Counters } from './q4-store.ts';
import type { NodeStorage } from './storage.ts';
import { browserAdapter, workerGlobals, type BrowserGlobals, type StorageCounters } from './adapter.ts';
import { describeError, pageStatus } from './surface.ts';

export { describeError };

export const DEFAULT_MEMORY_BUDGET = 256 * 2 ** 20;

function modelNameOf(url: string): string {
  const parts = url.replace(/\/+$/, '').split('/');
  return parts[parts.length - 1] || url;
}

/** What makes two starts the same node: the same key reuses the runtime (and what it loaded). */
function runtimeKey(config: NodeConfig, choice: BackendChoice, weights: WeightFormat): string {
  const where = config.trackerUrl ? `tracker ${config.trackerUrl} ${config.modelName ?? ''}` : `span ${config.modelUrl}|${config.startLayer}-${config.endLayer}`;
  return `${config.relayUrl}|${where}|${choice}|${weights}|${config.threads ?? ''}|${config.hopMode ?? 'chain'}`;
}

export class BrowserNode implements NodeEngine {
  private storage: NodeStorage | undefined;
  private runtime: NodeRuntime | undefined;
  private key: string | undefined;
  private lastConfig: NodeConfig | undefined;
  private startError: unknown;
  private startSeq = 0;
  /** Starts under way. */
  private starting = 0;
  private paused = false;
  private memoryBudget = DEFAULT_MEMORY_BUDGET;
  private readonly counters: StorageCounters = { fetchedBytes: 0, storedBytes: 0 };
  private readonly q4 = newQ4Counters();
  /** Whether onnxruntime-web's WASM module has had its first (long) warm-up in this worker. */
  private readonly warmed = { wasm: false };
  private readonly g: BrowserGlobals;

  constructor(globals?: BrowserGlobals) {
    this.g = globals ?? workerGlobals();
  }

  async status(): Promise<NodeStatus> {
    return pageStatus({ runtime: this.runtime, config: this.lastConfig, startError: this.startError, starting: this.starting > 0, counters: this.counters, q4: this.q4, memoryBudgetBytes: this.memoryBudget, crossOriginIsolated: this.g.crossOriginIsolated });
  }

  async start(config: NodeConfig): Promise<NodeStatus> {
    const seq = ++this.startSeq;
    this.lastConfig = config;
    this.startError = undefined;
    this.starting++;
    try {
      const runtime = await this.runtimeFor(config, seq);
      if (runtime) await runtime.start({ waitForSpan: true });
    } catch (e) {
      // The runtime keeps its own failure (its error state); a failure before it took over is ours.
      const cancelled = e instanceof MeshError && e.code === 'MESH_ERR_CANCELLED';
      if (seq === this.startSeq && !cancelled && this.runtime?.error === undefined) this.startError = e;
    } finally {
      this.starting--;
    }
    return this.status();
  }

  async retry(): Promise<NodeStatus> {
    if (!this.lastConfig) throw new MeshError('MESH_ERR_BAD_REQUEST', 'nothing to retry: the node was never started');
    return this.start(this.lastConfig);
  }

  async pause(): Promise<void> {
    this.paused = true;
    this.runtime?.pause();
  }

  async resume(): Promise<void> {
    this.paused = false;
    this.runtime?.resume();
  }

  async setMemoryBudget(bytes: number): Promise<void> {
    if (!Number.isFinite(bytes) || bytes < 16 * 2 ** 20) throw new MeshError('MESH_ERR_BAD_REQUEST', 'the memory budget must be at least 16 MiB');
    this.memoryBudget = Math.floor(bytes);
    await this.storage?.saveSettings({ memoryBudgetBytes: this.memoryBudget });
    // Applied in place: the KV caches get what the weights leave of it from now on; live sessions keep their room (no rebuild, no 409).
    await this.runtime?.setMemoryBudget(this.memoryBudget);
  }

  async stop(): Promise<void> {
    this.startSeq++;
    const rt = this.runtime;
    this.runtime = undefined;
    this.key = undefined;
    await rt?.close();
  }

  /** The runtime for `config`: the current one when nothing that matters changed, else a new one (the old one closed). */
  private async runtimeFor(config: NodeConfig, seq: number): Promise<NodeRuntime | undefined> {
    this.storage ??= await this.g.openStorage();
    const storage = this.storage;
    const settings = await storage.settings();
    this.memoryBudget = config.memoryBudgetBytes ?? settings.memoryBudgetBytes ?? DEFAULT_MEMORY_BUDGET;
    const choice = config.backend ?? settings.backend ?? 'auto';
    const weights = config.weights ?? settings.weights ?? DEFAULT_WEIGHT_FORMAT;
    if (config.backend !== undefined || config.memoryBudgetBytes !== undefined || config.weights !== undefined) {
      await storage.saveSettings({
        ...(config.backend ? { backend: config.backend } : {}),
        ...(config.memoryBudgetBytes ? { memoryBudgetBytes: config.memoryBudgetBytes } : {}),
        ...(config.weights ? { weights: config.weights } : {}),
      });
    }
    if (!config.trackerUrl && (config.modelUrl === undefined || config.startLayer === undefined || config.endLayer === undefined)) {
      throw new MeshError('MESH_ERR_BAD_REQUEST', 'without a tracker the node needs a model URL and a layer range');
    }
    const key = runtimeKey(config, choice, weights);
    if (this.runtime && this.key === key) {
      await this.runtime.setMemoryBudget(this.memoryBudget);
      return seq === this.startSeq ? this.runtime : undefined;
    }
    const old = this.runtime;
    this.runtime = undefined;
    await old?.close();
    const adapter = browserAdapter(this.g, { storage, choice, ...(config.threads !== undefined ? { threads: config.threads } : {}), counters: this.counters, warmed: this.warmed, weights, q4: this.q4, ...(config.testLoseGpuAfterRuns ? { loseGpuAfterRuns: config.testLoseGpuAfterRuns } : {}) });
    const runtime = await NodeRuntime.create(adapter, {
      relayUrl: config.relayUrl,
      ...(config.trackerUrl
        ? { trackerUrl: config.trackerUrl, ...(config.modelName ? { model: config.modelName } : {}) }
        : { span: { model: modelNameOf(config.modelUrl!), modelUrl: config.modelUrl!, startLayer: config.startLayer!, endLayer: config.endLayer! } }),
      memoryBudgetBytes: this.memoryBudget,
      backendKind: choice === 'auto' ? 'wasm' : choice,
      // The tracker sizes the span by it; a span that cannot run it (f16 without shader-f16) announces what it runs once loaded.
      weightFormat: weights === 'f16' ? 'f32' : weights,
      // A span that failed waits for the donor's Retry, with the reason on the page.
      retryFailedLoads: false,
      hopMode: config.hopMode ?? 'chain',
    });
    if (seq !== this.startSeq) {
      await runtime.close();
      return undefined;
    }
    if (this.paused) runtime.pause();
    this.runtime = runtime;
    this.key = key;
    return runtime;
  }
}
