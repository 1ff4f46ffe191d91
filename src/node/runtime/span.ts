/**
 * A node's span: loading one (config, weights, backend, executor, and for a
 * head the tokenizer and the pipeline driver), and swapping spans when the
 * assignment moves.
 *
 *   assign(b) while a serves:   load b beside a ─▶ switch to b ─▶ release a (after its queue)
 *   assign(c) while b loads:    c waits; b is dropped from the queue if c came first
 *
 * Loads run one after another, the newest assignment winning; a span that is
 * already served or already queued is not loaded twice.
 */
import { parseModelConfig, type ModelConfig } from '../../model/config.ts';
import type { ModelTokenizer } from '../../model/tokenizer.ts';
import { MeshError } from '../../protocol/errors.ts';
import { createSpanExecutor, type SpanExecutor } from '../../shard/span-executor.ts';
import { createForwardHandler } from '../hop/forward-handler.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import type { MeshHandler } from '../../net/contract.ts';
import { PipelineDriver, type HeadExecutor, type ReplaceSpan } from '../head/pipeline.ts';
import type { BackendInfo, DeviceLoss, DownloadProgress, RuntimeHost, SpanSpec } from './host.ts';
import { measureLayerMs } from './measure.ts';
import { rebuildingError } from './device-recovery.ts';
import type { NodeActivity } from './stats.ts';

export interface LoadedSpan {
  spec: SpanSpec;
  config: ModelConfig;
  executor: SpanExecutor;
  backend: BackendInfo;
  tokenizer: ModelTokenizer | undefined;
  /** The node's HTTP surface over this span's executor. */
  forward: MeshHandler;
  /** Present when the span starts at layer 0 and the tokenizer loaded: this node heads pipelines. */
  pipeline: PipelineDriver | undefined;
  /** Weight bytes fetched and kept by the host for this span. */
  fetchedBytes: number;
  storedBytes: number;
  /** Resolves with a reason when the backend's GPU device is lost (device-recovery.ts rebuilds the span); absent on the CPU. */
  deviceLost?: Promise<string>;
  /** Set once the device was lost: this span answers 503 until its rebuild swaps in. */
  deviceLostReason?: string;
  /** How long loading this span took, ms (set when it is swapped in): about what a rebuild takes. */
  loadMs?: number;
  /** Built again after a device loss: on what, and its per-layer step time measured before serving. */
  rebuilt?: { loss: DeviceLoss; layerMs: number };
}

/** What loading a span needs from the runtime around it. */
export interface SpanLoadContext {
  host: RuntimeHost;
  activity: NodeActivity;
  transport: HopTransport;
  /** The donor's memory budget, bytes: the executor gives its KV caches what the span's weights leave. */
  memoryBudgetBytes(): number;
  /** Positions one session may reach (capped by the model's context). */
  maxContext: number;
  /** A KV session idle this long may be dropped when room is needed, ms. */
  kvIdleTtlMs?: number;
  /** Most sessions' one-token steps run as one batch; 1 turns batching off. */
  maxBatch?: number;
  version: string;
  isPaused(): boolean;
  /** Fields /info adds to the executor's (peer id, relay address, the host's). */
  extraInfo(span: LoadedSpan): Record<string, unknown>;
  /** Asks the tracker for a replacement of a failed hop; absent without a tracker. */
  replace: ((model: string) => ReplaceSpan) | undefined;
  /** The pipeline's hop mode (PipelineOptions.hopMode). */
  hopMode?: 'chain' | 'star';
  /** The load of `spec` moved on (state and progress for the page). */
  onPhase(phase: 'downloading' | 'loading', spec: SpanSpec, config: ModelConfig, progress?: DownloadProgress): void;
  /** Throws MESH_ERR_CANCELLED when the load was superseded (the node stopped or restarted). */
  checkCurrent(): void;
  /** The node's GPU losses so far, for the host's backend choice (device-recovery.ts); undefined: none. */
  deviceLoss?(): DeviceLoss | undefined;
  /** Every /forward's status (a 507 asks for a smaller span). */
  onForwardStatus?(span: LoadedSpan, status: number): void;
}

/** A model URL as a base that file names append to. */
export function baseUrl(url: string): string {
  return url.endsWith('/') ? url : `${url}/`;
}

export function sameSpec(a: SpanSpec, b: SpanSpec): boolean {
  // A new wire dtype reloads the span too: its handler and pipeline are built for one (a rare change: a tracker restarted with another).
  return a.startLayer === b.startLayer && a.endLayer === b.endLayer && baseUrl(a.modelUrl) === baseUrl(b.modelUrl) && a.wireDtype === b.wireDtype;
}

/** Download (only what is missing), choose the backend, build the executor; the span does not serve until the caller switches to it. */
export async function loadSpan(spec: SpanSpec, ctx: SpanLoadContext): Promise<LoadedSpan> {
  const { host } = ctx;
  const modelUrl = baseUrl(spec.modelUrl);
  const config = parseModelConfig(await host.weights.config(modelUrl), `${modelUrl}config.json`);
  if (!(spec.startLayer >= 0 && spec.startLayer < spec.endLayer && spec.endLayer <= config.numLayers)) {
    throw new MeshError('MESH_ERR_LAYER_RANGE', `layers ${spec.startLayer}-${spec.endLayer} are outside this model's 0-${config.numLayers}`);
  }
  ctx.checkCurrent();
  ctx.onPhase('downloading', spec, config, { loadedBytes: 0, totalBytes: 0 });
  const weights = await host.weights.open(spec, config, (p) => ctx.onPhase('downloading', spec, config, p));
  ctx.checkCurrent();
  ctx.onPhase('loading', spec, config);
  const lost = ctx.deviceLoss?.();
  const chosen = await host.backends.choose(spec, config, weights.loader, lost);
  ctx.checkCurrent();
  const executor = await createSpanExecutor({
    config,
    backend: chosen.backend,
    weights: weights.loader,
    startLayer: spec.startLayer,
    endLayer: spec.endLayer,
    graphs: chosen.graphs ?? { kind: 'plain', dtype: chosen.info.dtype },
    ...(weights.q4Cache ? { q4Cache: weights.q4Cache } : {}),
    maxContext: Math.min(ctx.maxContext, config.maxPositionEmbeddings),
    // The budget means weights + KV, as the tracker sizes spans: the KV caches get what the weights leave.
    memoryBudgetBytes: ctx.memoryBudgetBytes(),
    ...(ctx.kvIdleTtlMs !== undefined ? { kvTtlMs: ctx.kvIdleTtlMs } : {}),
    ...(ctx.maxBatch !== undefined ? { maxBatch: ctx.maxBatch } : {}),
  });
  warnIfKvStarved(executor, spec, ctx);
  try {
    await host.backends.prepare?.(executor, chosen);
  } catch (e) {
    // Serving finds the same fault on its own and answers it per request; preparing only saves time.
    host.log('warn', `preparing layers ${spec.startLayer}-${spec.endLayer - 1} failed: ${(e as Error).message}`);
  }
  // After a loss the new backend is timed before it serves (the tracker's new layer_ms), which also proves it works.
  let rebuilt: LoadedSpan['rebuilt'];
  if (lost) {
    try {
      rebuilt = { loss: lost, layerMs: await measureLayerMs(executor) };
    } catch (e) {
      await executor.release().catch(() => undefined);
      throw e;
    }
  }
  // Only a head needs the tokenizer: the last hop answers token ids, and the head detokenizes.
  let tokenizer: ModelTokenizer | undefined;
  if (spec.startLayer === 0) {
    try {
      tokenizer = await host.weights.tokenizer(modelUrl, config);
    } catch (e) {
      host.log('warn', `no tokenizer for ${modelUrl} (${(e as Error).message}): this node serves layer 0 but cannot head a pipeline`);
    }
  }
  try {
    ctx.checkCurrent();
  } catch (e) {
    await executor.release().catch(() => undefined);
    throw e;
  }
  const span: LoadedSpan = { spec: { ...spec, modelUrl }, config, executor, backend: chosen.info, tokenizer, forward: undefined!, pipeline: undefined, fetchedBytes: weights.fetchedBytes, storedBytes: weights.storedBytes, ...(chosen.backend.device ? { deviceLost: chosen.backend.device.lost } : {}), ...(rebuilt ? { rebuilt } : {}) };
  span.forward = forwardHandlerFor(span, ctx);
  span.pipeline = pipelineFor(span, ctx);
  return span;
}

/** A span whose weights leave too little of the budget for even one short session: say so, or every session is refused with no hint why. */
function warnIfKvStarved(executor: SpanExecutor, spec: SpanSpec, ctx: SpanLoadContext): void {
  const kv = executor.kvStats();
  if (kv.budgetBytes >= kv.bytesPerToken * Math.min(executor.maxContext, 256)) return;
  const mib = (b: number) => `${(b / 2 ** 20).toFixed(2)} MiB`;
  ctx.host.log(
    'warn',
    `layers [${spec.startLayer}, ${spec.endLayer}) hold ${mib(executor.weightBytes)} of weights, leaving ${mib(kv.budgetBytes)} of the ${mib(ctx.memoryBudgetBytes())} budget for KV caches: sessions will be refused (503 MESH_ERR_BUSY); give the node more memory`,
  );
}

function forwardHandlerFor(span: LoadedSpan, ctx: SpanLoadContext): MeshHandler {
  const layers = span.spec.endLayer - span.spec.startLayer;
  const tokenizer = span.tokenizer;
  return createForwardHandler(span.executor, {
    model: span.spec.model,
    backend: span.backend.name,
    version: ctx.version,
    isPaused: ctx.isPaused,
    ...(span.spec.wireDtype ? { wireDtype: span.spec.wireDtype } : {}),
    ...(tokenizer ? { decode: (id: number) => tokenizer.decode([id]) } : {}),
    extraInfo: () => ctx.extraInfo(span),
    onForward: (ev) => {
      if (ev.status === 200) ctx.activity.served(ev.tokens, ev.ms, layers);
      else ctx.onForwardStatus?.(span, ev.status);
    },
    onError: (e) => ctx.host.log('error', `forward: ${(e as Error).stack ?? String(e)}`),
  });
}

function pipelineFor(span: LoadedSpan, ctx: SpanLoadContext): PipelineDriver | undefined {
  if (span.spec.startLayer !== 0 || !span.tokenizer) return undefined;
  const executor = span.executor;
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
      // Our own device was lost: a Retry-After the length of a rebuild (the tracker routes the chat again then).
      if (span.deviceLostReason !== undefined) throw rebuildingError(span);
      const out = await executor.forward(req);
      if (req.tokenIds?.length === 1) ctx.activity.step(performance.now() - t0, layers);
      return out;
    },
  };
  const replace = ctx.replace?.(span.spec.model);
  return new PipelineDriver({
    executor: timed,
    tokenizer: span.tokenizer,
    transport: ctx.transport,
    ...(span.spec.wireDtype ? { wireDtype: span.spec.wireDtype } : {}),
    ...(replace ? { replace } : {}),
    ...(ctx.hopMode ? { hopMode: ctx.hopMode } : {}),
    onLog: (m) => ctx.host.log('warn', `pipeline: ${m}`),
  });
}

/**
 * The span served now and the adoption queue. `assign` returns at once; the
 * load runs after the ones queued before it, and is skipped when a newer
 * assignment came meanwhile.
 */
export class SpanSlot {
  current: LoadedSpan | undefined;
  private wanted: SpanSpec | undefined;
  private chain: Promise<void> = Promise.resolve();
  private closed = false;

  constructor(
    private readonly load: (spec: SpanSpec) => Promise<LoadedSpan>,
    private readonly events: {
      /** `next` serves from now on (`old`, if any, is being released). */
      onSwap(next: LoadedSpan, old: LoadedSpan | undefined, loadMs: number): void;
      onFailure(error: unknown, spec: SpanSpec): void;
    },
  ) {}

  /** True while a load is queued or running. */
  get busy(): boolean {
    return this.wanted !== undefined;
  }

  /** Settles when every load queued so far is done (or failed). */
  idle(): Promise<void> {
    return this.chain;
  }

  isServing(spec: SpanSpec): boolean {
    return this.current !== undefined && sameSpec(this.current.spec, spec);
  }

  /** Queue `spec` (`reload`: even when it serves already, e.g. to apply a new budget). */
  assign(spec: SpanSpec, reload = false): Promise<void> {
    if (this.closed || (!reload && this.isServing(spec)) || (this.wanted && sameSpec(this.wanted, spec))) return this.chain;
    this.wanted = spec;
    this.chain = this.chain.then(async () => {
      if (this.wanted !== spec || this.closed) return; // superseded while queued
      const t0 = Date.now();
      try {
        const next = await this.load(spec);
        if (this.closed) {
          await next.executor.release().catch(() => undefined);
          return;
        }
        const old = this.current;
        this.current = next;
        this.events.onSwap(next, old, Date.now() - t0);
        // release() waits for the old executor's queue, so a forward already running finishes first.
        if (old) void old.executor.release().catch(() => undefined);
      } catch (e) {
        if (!this.closed) this.events.onFailure(e, spec);
      } finally {
        if (this.wanted === spec) this.wanted = undefined;
      }
    });
    return this.chain;
  }

  /** Forget what is queued (a retry asks again). */
  clearQueue(): void {
    this.wanted = undefined;
  }

  /** Stop adopting; release the span served now. */
  async close(): Promise<void> {
    this.closed = true;
    this.wanted = undefined;
    const s = this.current;
    this.current = undefined;
    if (s) await s.executor.release().catch(() => undefined);
  }
}
