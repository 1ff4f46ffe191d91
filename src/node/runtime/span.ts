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
import { createSpanExecutor } from '../../shard/span-executor.ts';
import type { SpanExecutor } from '../../shard/contract.ts';
import { createForwardHandler } from '../hop/forward-handler.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import type { MeshHandler } from '../../net/contract.ts';
import { PipelineDriver, type DrafterFactory, type HeadExecutor, type ReplaceSpan } from '../head/pipeline.ts';
import { DraftModelDrafter, checkDraftVocabulary } from '../head/speculation/draft-model.ts';
import { promptLookupFor } from '../head/speculation/prompt-lookup.ts';
import type { BackendInfo, DeviceLoss, DownloadProgress, RuntimeHost, SpanSpec } from './host.ts';
import { measureLayerMs } from './measure.ts';
import type { DutyCycle } from './duty-cycle.ts';
import type { Attestor } from '../../verify/attestor.ts';
import type { HeadVerify } from '../verify/head-verify.ts';
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
  /** A head's draft model (--draft): a whole model on the span's backend, released with the span. */
  draft?: { name: string; executor: SpanExecutor; /** The target's own first layers (self-speculation). */ self?: boolean };
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
  /** The donor's cap on the device's busy time: the head's own steps pass it too (the forward gate's pass it there). */
  duty?: DutyCycle;
  /** Fields /info adds to the executor's (peer id, relay address, the host's). */
  extraInfo(span: LoadedSpan): Record<string, unknown>;
  /** Asks the tracker for a replacement of a failed hop; absent without a tracker. */
  replace: ((model: string) => ReplaceSpan) | undefined;
  /** The pipeline's hop mode (PipelineOptions.hopMode). */
  hopMode?: 'chain' | 'star';
  /** A head's draft model checkpoint (loaded whole beside a span that starts at layer 0). */
  draftModelUrl?: string;
  /** False: a head never drafts. */
  speculation?: boolean;
  /** Signs what this node's span answers (docs/protocol.md §11). */
  attestor?: Attestor;
  /** A head's spot-checks for a model (docs/verification.md). */
  headVerify?(model: string): HeadVerify;
  /** The load of `spec` moved on (state and progress for the page). */
  onPhase(phase: 'downloading' | 'loading', spec: SpanSpec, config: ModelConfig, progress?: DownloadProgress): void;
  /** Throws MESH_ERR_CANCELLED when the load was superseded (the node stopped or restarted). */
  checkCurrent(): void;
  /** The node's GPU losses so far, for the host's backend choice (device-recovery.ts); undefined: none. */
  deviceLoss?(): DeviceLoss | undefined;
  /** Every /forward's status (a 507 asks for a smaller span). */
  onForwardStatus?(span: LoadedSpan, status: number): void;
}

/**
 * The answer while `span`'s lost device is being replaced: 503 with a
 * Retry-After of about one load of the span (what the rebuild takes; 1-15 s),
 * so that the tracker does not spend its re-routes on a node still rebuilding.
 */
export function rebuildingError(span: LoadedSpan): MeshError {
  const retry = Math.min(15_000, Math.max(1_000, Math.round(span.loadMs ?? 0)));
  return new MeshError('MESH_ERR_UNAVAILABLE', `the GPU device was lost (${span.deviceLostReason}); this span is being rebuilt`, { retry_after_ms: retry });
}

/** A model URL as a base that file names append to. */
export function baseUrl(url: string): string {
  return url.endsWith('/') ? url : `${url}/`;
}

export function sameSpec(a: SpanSpec, b: SpanSpec): boolean {
  // A new wire dtype reloads the span too: its handler and pipeline are built for one (a rare change: a tracker restarted with another).
  return a.startLayer === b.startLayer && a.endLayer === b.endLayer && baseUrl(a.modelUrl) === baseUrl(b.modelUrl) && a.wireDtype === b.wireDtype;
}

/**
 * A head's drafter per generation: its draft model (by default, or when the
 * request names it), else prompt lookup (a request naming "prompt-lookup",
 * or a draft model this head does not hold).
 */
function drafterFor(span: LoadedSpan): DrafterFactory {
  const lookup = promptLookupFor(span.tokenizer!);
  return (req, c) => {
    const d = span.draft;
    if (!d || (req.draft_model !== undefined && req.draft_model !== d.name)) return lookup(req);
    return new DraftModelDrafter(d.executor, { session: `${c.session}.draft`, sampling: { temperature: req.temperature, topP: req.top_p, topK: req.top_k, ...(req.seed !== undefined ? { seed: req.seed } : {}) }, declared: c.declared, name: d.name, ...(d.self ? { kind: 'self' as const } : {}) });
  };
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
  const loader = host.spanHooks?.weights ? host.spanHooks.weights(weights.loader, spec) : weights.loader;
  const built = await createSpanExecutor({
    config,
    backend: chosen.backend,
    weights: loader,
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
  const executor = host.spanHooks?.executor ? host.spanHooks.executor(built, spec) : built;
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
  let draft: LoadedSpan['draft'];
  if (tokenizer && ctx.draftModelUrl && ctx.speculation !== false) {
    try {
      draft = await loadDraftModel(ctx.draftModelUrl, { url: modelUrl, config }, tokenizer, ctx, lost);
    } catch (e) {
      // Refused (another vocabulary) or unloadable: the head serves without it, drafting by prompt lookup.
      host.log('error', `draft model ${ctx.draftModelUrl} refused: ${(e as Error).message}`);
    }
  }
  const span: LoadedSpan = { spec: { ...spec, modelUrl }, config, executor, backend: chosen.info, tokenizer, forward: undefined!, pipeline: undefined, fetchedBytes: weights.fetchedBytes, storedBytes: weights.storedBytes, ...(chosen.backend.device ? { deviceLost: chosen.backend.device.lost } : {}), ...(rebuilt ? { rebuilt } : {}), ...(draft ? { draft } : {}) };
  span.forward = forwardHandlerFor(span, ctx);
  span.pipeline = pipelineFor(span, ctx);
  return span;
}

/** `--draft self:N`: the target's first N layers with its final norm and LM head as the draft model. */
export const SELF_DRAFT_RE = /^self:(\d+)$/;

/**
 * A head's draft model: the whole checkpoint on a backend the host chooses
 * as for a span (the head's engine, so the numerics agree as far as the
 * models do), with KV room of its own; refused when its vocabulary is not
 * the target's. Its memory is outside the announced budget.
 */
async function loadDraftModel(url: string, targetModel: { url: string; config: ModelConfig }, tokenizer: ModelTokenizer, ctx: SpanLoadContext, lost: DeviceLoss | undefined): Promise<NonNullable<LoadedSpan['draft']>> {
  const { host } = ctx;
  const target = targetModel.config;
  const self = SELF_DRAFT_RE.exec(url);
  let modelUrl: string;
  let config: ModelConfig;
  if (self) {
    // Self-speculation: the target's own first N layers, then its final norm and LM head (an early exit).
    const n = Number(self[1]);
    if (!(n >= 1 && n < target.numLayers)) throw new MeshError('MESH_ERR_BAD_REQUEST', `self-speculation takes 1 to ${target.numLayers - 1} of this model's ${target.numLayers} layers, not ${n}`);
    modelUrl = targetModel.url;
    config = { ...target, numLayers: n };
  } else {
    modelUrl = baseUrl(url);
    config = parseModelConfig(await host.weights.config(modelUrl), `${modelUrl}config.json`);
    const draftTok = await host.weights.tokenizer(modelUrl, config);
    checkDraftVocabulary(url, { vocabSize: config.vocabSize, ...(draftTok ? { idToToken: (id: number) => draftTok.idToToken(id) } : {}) }, { vocabSize: target.vocabSize, idToToken: (id) => tokenizer.idToToken(id) });
  }
  const spec: SpanSpec = { model: `draft:${url}`, modelUrl, startLayer: 0, endLayer: config.numLayers };
  const weights = await host.weights.open(spec, config, () => undefined);
  const chosen = await host.backends.choose(spec, config, weights.loader, lost);
  const executor = await createSpanExecutor({
    config,
    backend: chosen.backend,
    weights: weights.loader,
    startLayer: 0,
    endLayer: config.numLayers,
    graphs: chosen.graphs ?? { kind: 'plain', dtype: chosen.info.dtype },
    maxContext: Math.min(ctx.maxContext, config.maxPositionEmbeddings),
    // Its weights plus 256 MiB of KV: a few drafting sessions at full context on small drafts.
    memoryBudgetBytes: weightBytesOf(config) + 256 * 2 ** 20,
  });
  // Sampled drafts need the draft's logits on the host (a device keeps them otherwise).
  if ('returnLogits' in executor) (executor as { returnLogits: boolean }).returnLogits = true;
  host.log('info', `draft model ${url}: ${config.numLayers} layers on ${chosen.info.name}`);
  return { name: url, executor, ...(self ? { self: true } : {}) };
}

/** A span's executors (its draft model's too), after their queues. */
async function releaseSpan(span: LoadedSpan): Promise<void> {
  await Promise.all([span.executor.release().catch(() => undefined), span.draft?.executor.release().catch(() => undefined)]);
}

/** f32 bytes of a whole model's weights (what the plain and fused f32 graphs hold), for the draft's budget. */
function weightBytesOf(cfg: ModelConfig): number {
  const { hiddenSize: h, numHeads: nh, numKvHeads: kv, headDim: hd, intermediateSize: m, vocabSize: v, numLayers: l } = cfg;
  const layer = h * nh * hd * 2 + 2 * h * kv * hd + 3 * h * m + 2 * h;
  return 4 * (l * layer + v * h * (cfg.tieWordEmbeddings ? 1 : 2) + h);
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
    ...(ctx.attestor ? { attestor: ctx.attestor } : {}),
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
      const run = async () => {
        const t0 = performance.now();
        // Our own device was lost: a Retry-After the length of a rebuild (the tracker routes the chat again then).
        if (span.deviceLostReason !== undefined) throw rebuildingError(span);
        const out = await executor.forward(req);
        if (req.tokenIds?.length === 1) ctx.activity.step(performance.now() - t0, layers);
        return out;
      };
      // The duty cycle's rest is not the step's time: it is timed inside.
      return ctx.duty ? ctx.duty.run(run) : run();
    },
  };
  const replace = ctx.replace?.(span.spec.model);
  const verify = ctx.headVerify?.(span.spec.model);
  return new PipelineDriver({
    ...(verify ? { verify } : {}),
    executor: timed,
    tokenizer: span.tokenizer,
    transport: ctx.transport,
    ...(span.spec.wireDtype ? { wireDtype: span.spec.wireDtype } : {}),
    ...(replace ? { replace } : {}),
    ...(ctx.hopMode ? { hopMode: ctx.hopMode } : {}),
    ...(ctx.speculation === false ? { speculation: false } : {}),
    drafter: drafterFor(span),
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
          await releaseSpan(next);
          return;
        }
        const old = this.current;
        this.current = next;
        this.events.onSwap(next, old, Date.now() - t0);
        // release() waits for the old executor's queue, so a forward already running finishes first.
        if (old) void releaseSpan(old);
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
    if (s) await releaseSpan(s);
  }
}
