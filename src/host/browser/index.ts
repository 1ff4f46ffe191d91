/**
 * The browser node: the node runtime (src/node/runtime) in the page's Web
 * Worker, as the NodeEngine the page drives (workers/node.worker.ts exposes
 * it through Comlink).
 *
 *   start(config)   a span from the URL, or the tracker's (config.trackerUrl);
 *                   the same config again reuses what is loaded (a Retry),
 *                   another one starts a new runtime
 *   pause/resume    drains: the sessions in flight finish within a grace,
 *                   no new ones come (heartbeats say `draining`); resume
 *                   serves again with nothing reloaded
 *   setDonor        the duty cycle, "donate only while charging", "keep my shard"
 *   setPower        the page read the battery (the worker has no Battery API)
 *   lifecycle       the page is being frozen or closed (drain), or is back
 *                   (heartbeat at once); onDrainBeacon hands the page a
 *                   draining heartbeat signed in advance, which it sends with
 *                   sendBeacon from its freeze and pagehide handlers
 *   setMemoryBudget kept in IndexedDB; the span serving now is rebuilt with it
 *
 * The donor's settings (memory budget, backend, pause, duty cycle, charging
 * only, keep my shard) persist in IndexedDB; so do the identity (the same
 * peer id after a reload), the span's weights and which span they are (a
 * reload registers with it and gets it back: no download), and what the
 * donor has given (tokens, hours).
 */
import { MeshError } from '../../protocol/errors.ts';
import { NodeRuntime } from '../../node/runtime/runtime.ts';
import { ContributionMeter } from '../../node/runtime/contribution.ts';
import { MIN_DUTY_CYCLE } from '../../node/runtime/duty-cycle.ts';
import { NodeState } from '../../node/runtime/state.ts';
import { DEFAULT_WEIGHT_FORMAT, type BackendChoice, type DonorSettings, type DrainBeacon, type NodeConfig, type NodeEngine, type NodeStatus, type PageLifecycleEvent, type TraceStampRow, type WeightFormat } from './engine.ts';
import { newQ4Counters } from './q4-store.ts';
import type { NodeStorage } from './storage.ts';
import { browserAdapter, workerGlobals, type BrowserGlobals, type StorageCounters } from './adapter.ts';
import { describeError, pageStatus } from './surface.ts';
import type { RtcFactory } from '../../net/rtc-peer.ts';
import { pageRtcFactory } from './rtc-worker.ts';
import { setTrace } from '../../protocol/trace.ts';

/** Stamps a bench may collect between two trace() calls (a few minutes of steps). */
const MAX_TRACE_STAMPS = 500_000;

export { describeError };

export const DEFAULT_MEMORY_BUDGET = 256 * 2 ** 20;

/** How often what the donor gave is counted and saved to IndexedDB, ms (and on freeze and close). */
const CONTRIBUTION_SAVE_MS = 5_000;

function modelNameOf(url: string): string {
  const parts = url.replace(/\/+$/, '').split('/');
  return parts[parts.length - 1] || url;
}

/** What makes two starts the same node: the same key reuses the runtime (and what it loaded). */
function runtimeKey(config: NodeConfig, choice: BackendChoice, weights: WeightFormat): string {
  const where = config.trackerUrl ? `tracker ${config.trackerUrl} ${config.modelName ?? ''}` : `span ${config.modelUrl}|${config.startLayer}-${config.endLayer}`;
  return `${config.relayUrl}|${where}|${choice}|${weights}|${config.threads ?? ''}|${config.hopMode ?? 'chain'}|rtc ${config.rtc ?? ''} ${JSON.stringify(config.iceServers ?? [])} ${config.icePolicy ?? 'all'} ${config.rtcDelayMs ?? 0}`;
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
  private donor: DonorSettings = { paused: false, dutyCycle: 1, chargingOnly: false, keepShard: false };
  /** On the charger, as the page last read it; undefined: not known. */
  private charging: boolean | undefined;
  private beaconSink: ((b: DrainBeacon) => void) | undefined;
  private lastBeacon: DrainBeacon | undefined;
  private meter: ContributionMeter | undefined;
  private meterTimer: ReturnType<typeof setInterval> | undefined;
  private memoryBudget = DEFAULT_MEMORY_BUDGET;
  private readonly counters: StorageCounters = { fetchedBytes: 0, storedBytes: 0 };
  private readonly q4 = newQ4Counters();
  /** Whether onnxruntime-web's WASM module has had its first (long) warm-up in this worker. */
  private readonly warmed = { wasm: false };
  private readonly g: BrowserGlobals;
  /** The page's peer connections (rtc-page.ts), once it handed the port over. */
  private rtc: RtcFactory | undefined;
  /** trace(true): the stamps taken since. */
  private stamps: TraceStampRow[] = [];

  constructor(globals?: BrowserGlobals) {
    this.g = globals ?? workerGlobals();
  }

  async status(): Promise<NodeStatus> {
    return pageStatus({
      runtime: this.runtime,
      config: this.lastConfig,
      startError: this.startError,
      starting: this.starting > 0,
      counters: this.counters,
      q4: this.q4,
      memoryBudgetBytes: this.memoryBudget,
      crossOriginIsolated: this.g.crossOriginIsolated,
      donor: this.donor,
      contribution: this.sampleContribution(),
      ...(this.charging !== undefined ? { onBattery: !this.charging } : {}),
    });
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
    this.donor = { ...this.donor, paused: true };
    this.runtime?.pause();
    await this.storage?.saveSettings({ paused: true });
  }

  async resume(): Promise<void> {
    this.donor = { ...this.donor, paused: false };
    this.runtime?.resume();
    await this.storage?.saveSettings({ paused: false });
  }

  async setDonor(patch: Partial<Omit<DonorSettings, 'paused'>>): Promise<void> {
    if (patch.dutyCycle !== undefined && !(Number.isFinite(patch.dutyCycle) && patch.dutyCycle >= MIN_DUTY_CYCLE && patch.dutyCycle <= 1)) {
      throw new MeshError('MESH_ERR_BAD_REQUEST', `the duty cycle is a share of the device's time in [${MIN_DUTY_CYCLE}, 1], got ${patch.dutyCycle}`);
    }
    const next: DonorSettings = { ...this.donor };
    if (patch.dutyCycle !== undefined) next.dutyCycle = patch.dutyCycle;
    if (patch.chargingOnly !== undefined) next.chargingOnly = patch.chargingOnly === true;
    if (patch.keepShard !== undefined) next.keepShard = patch.keepShard === true;
    this.donor = next;
    if (patch.dutyCycle !== undefined) this.runtime?.setDutyCycle(next.dutyCycle);
    this.applyPower();
    await this.storage?.saveSettings({ dutyCycle: next.dutyCycle, chargingOnly: next.chargingOnly, keepShard: next.keepShard });
  }

  async setPower(charging: boolean): Promise<void> {
    this.charging = charging === true;
    this.applyPower();
  }

  async lifecycle(event: PageLifecycleEvent): Promise<void> {
    this.runtime?.lifecycle(event);
    // The page may not run again (closed, or frozen for long): keep what was counted.
    if (event !== 'resumed') await this.saveContribution();
  }

  async onDrainBeacon(sink: (b: DrainBeacon) => void): Promise<void> {
    this.beaconSink = sink;
    if (this.lastBeacon) void this.handBeacon(this.lastBeacon);
  }

  /**
   * Across the worker boundary the sink is a Comlink proxy: its call is a promise that settles once the
   * page holds the beacon (the runtime's heartbeat waits for it), and fails when the page is gone.
   */
  private async handBeacon(b: DrainBeacon): Promise<void> {
    this.lastBeacon = b;
    const sink = this.beaconSink;
    if (!sink) return;
    try {
      await (sink(b) as unknown);
    } catch {
      if (this.beaconSink === sink) this.beaconSink = undefined;
    }
  }

  /** Off the charger with "charging only" on: drain (the battery reason); otherwise lift it. */
  private applyPower(): void {
    this.runtime?.holdForBattery(this.donor.chargingOnly && this.charging === false);
  }

  private sampleContribution(): NodeStatus['contribution'] {
    const rt = this.runtime;
    const span = rt?.span;
    const layersHeld = span ? span.spec.endLayer - span.spec.startLayer : 0;
    if (!this.meter) return { tokensServed: 0, servingMs: 0, since: undefined, layersHeld };
    const rec = this.meter.sample(rt?.activity.window.tokens ?? 0, rt?.state === NodeState.Serving && !rt.drain.draining);
    return { ...rec, layersHeld };
  }

  private async saveContribution(): Promise<void> {
    if (!this.meter || !this.storage) return;
    const rec = this.sampleContribution();
    await this.storage.saveContribution({ tokensServed: rec.tokensServed, servingMs: rec.servingMs, since: rec.since }).catch(() => undefined);
  }

  async setMemoryBudget(bytes: number): Promise<void> {
    if (!Number.isFinite(bytes) || bytes < 16 * 2 ** 20) throw new MeshError('MESH_ERR_BAD_REQUEST', 'the memory budget must be at least 16 MiB');
    this.memoryBudget = Math.floor(bytes);
    await this.storage?.saveSettings({ memoryBudgetBytes: this.memoryBudget });
    // Applied in place: the KV caches get what the weights leave of it from now on; live sessions keep their room (no rebuild, no 409).
    await this.runtime?.setMemoryBudget(this.memoryBudget);
  }

  async attachPeerConnections(port: MessagePort): Promise<void> {
    this.rtc = pageRtcFactory(port);
  }

  async closeDataChannels(): Promise<void> {
    this.runtime?.closeDataChannels();
  }

  async trace(on: boolean): Promise<TraceStampRow[]> {
    const taken = this.stamps;
    this.stamps = [];
    const origin = performance.timeOrigin;
    setTrace(
      on
        ? (stage, session, position) => {
            if (this.stamps.length < MAX_TRACE_STAMPS) this.stamps.push([origin + performance.now(), stage, session, position]);
          }
        : undefined,
    );
    return taken;
  }

  async stop(): Promise<void> {
    this.startSeq++;
    await this.saveContribution();
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
    this.donor = {
      paused: settings.paused === true,
      dutyCycle: typeof settings.dutyCycle === 'number' && settings.dutyCycle >= MIN_DUTY_CYCLE && settings.dutyCycle <= 1 ? settings.dutyCycle : 1,
      chargingOnly: settings.chargingOnly === true,
      keepShard: settings.keepShard === true,
    };
    if (!this.meter) {
      this.meter = new ContributionMeter(await storage.contribution().catch(() => undefined));
      this.sampleContribution();
      this.meterTimer = setInterval(() => void this.saveContribution(), CONTRIBUTION_SAVE_MS);
    }
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
    const adapter = browserAdapter(this.g, {
      ...(this.rtc && config.rtc !== false ? { rtc: this.rtc } : {}), storage, choice, ...(config.threads !== undefined ? { threads: config.threads } : {}), counters: this.counters, warmed: this.warmed, weights, q4: this.q4, ...(config.testLoseGpuAfterRuns ? { loseGpuAfterRuns: config.testLoseGpuAfterRuns } : {}) });
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
      dutyCycle: this.donor.dutyCycle,
      // The page sends it from its freeze and pagehide handlers (src/app/lifecycle.ts).
      drainBeacons: config.trackerUrl !== undefined && ((b: DrainBeacon) => this.handBeacon(b)),
      ...(settings.lastSpan ? { storedSpan: settings.lastSpan } : {}),
      rtc: { enabled: config.rtc !== false, ...(config.iceServers ? { iceServers: config.iceServers } : {}), ...(config.icePolicy ? { icePolicy: config.icePolicy } : {}), ...(config.rtcDelayMs ? { delayMs: config.rtcDelayMs } : {}) },
    });
    if (seq !== this.startSeq) {
      await runtime.close();
      return undefined;
    }
    runtime.on((e) => {
      if (e.type === 'serving') {
        void storage.saveSettings({ lastSpan: { model: e.span.model, modelUrl: e.span.modelUrl, startLayer: e.span.startLayer, endLayer: e.span.endLayer } }).catch(() => undefined);
      }
    });
    if (this.donor.paused) runtime.pause();
    runtime.holdForBattery(this.donor.chargingOnly && this.charging === false);
    this.runtime = runtime;
    this.key = key;
    return runtime;
  }
}
