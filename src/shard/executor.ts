/**
 * The shard executor: decoder layers [startLayer, endLayer) of one model over
 * an injected OnnxBackend, plus the embedding when it holds layer 0 and the
 * final norm + LM head when it holds the last layer.
 *
 * Graphs are built per segment; by default every layer is its own segment,
 * so a request may start at any held layer (the ADR-0012 overlap protocol)
 * and stop before any. Fewer, longer segments trade that freedom for fewer
 * session.run calls (see bench/shard.ts for what that buys).
 *
 * Forwards run one batch at a time (batch-queue.ts): KV positions must
 * advance in request order, and a CPU backend gains nothing from
 * overlapping two runs; one-token steps of different sessions queued
 * together run as one packed batch (packed-batch.ts).
 */
import type { ModelConfig } from '../model/config.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR, layerTensorNames } from '../model/config.ts';
import { IO, buildEmbedGraph, buildHeadGraph, buildLayersGraph, maskValue, type GraphDtype } from '../model/graph.ts';
import { ropeInvFreq, ropeTables } from '../model/rope.ts';
import type { BackendSessionOptions, BackendTensor, OnnxBackend, OnnxSession } from './backend.ts';
import { BatchQueue, DEFAULT_MAX_BATCH, type BatchStats } from './batch-queue.ts';
import { packedBatchKey, runPackedBatch, type BatchLayoutChoice } from './packed-batch.ts';
import { BatchScratch } from './batch-scratch.ts';
import type { ForwardRequest, ForwardResult, SpanExecutor, WeightLoader } from './contract.ts';
import { checkForwardInput, gatherRows } from './forward-input.ts';
import { CpuKvStorage, kvBytesPerToken, type KvSession, type KvStats } from './kv-store.ts';
import { checkSpan, segmentBounds, segmentSpan, type Segment } from './segments.ts';
import { SessionKv, type ExecutorKvOptions } from './session-kv.ts';
import { checkDraft, judgedRows, tokenFromRows } from './speculative.ts';

export interface ShardExecutorOptions extends ExecutorKvOptions {
  config: ModelConfig;
  backend: OnnxBackend;
  weights: WeightLoader;
  startLayer: number;
  endLayer: number;
  dtype?: GraphDtype;
  /** Positions one session may reach; default min(maxPositionEmbeddings, 2048). */
  maxContext?: number;
  /**
   * Layer indices at which graphs are cut, strictly inside (startLayer, endLayer).
   * Default: every layer, so any start/end layer is servable.
   */
  segmentBoundaries?: number[];
  sessionOptions?: BackendSessionOptions;
  /**
   * Most one-token steps of different sessions run as one batch (docs/architecture.md, "Batching at a hop");
   * 1 runs every request alone. @defaultValue 16 (DEFAULT_MAX_BATCH)
   */
  maxBatch?: number;
  /** How batches lay out their pasts (packed-batch.ts); 'auto' picks per batch. Forced only by benchmarks and tests. */
  batchLayout?: BatchLayoutChoice;
  /**
   * Requests queued while a batch runs join it between segments (batch-queue.ts, packed-batch.ts).
   * @defaultValue true; false only to measure without it.
   */
  batchJoin?: boolean;
}

export class ShardExecutor implements SpanExecutor {
  readonly config: ModelConfig;
  readonly startLayer: number;
  readonly endLayer: number;
  readonly dtype: GraphDtype;
  readonly maxContext: number;
  /** Bytes of weights held by this shard's graphs. */
  readonly weightBytes: number;
  private readonly kv: SessionKv;
  private readonly invFreq: Float64Array;
  /** Forwards run one batch at a time: KV positions advance in request order. */
  private readonly batches: BatchQueue<ForwardRequest, ForwardResult>;

  private constructor(
    o: ShardExecutorOptions,
    maxContext: number,
    private readonly segments: Segment[],
    private readonly embed: OnnxSession | null,
    private readonly head: OnnxSession | null,
    weightBytes: number,
  ) {
    this.config = o.config;
    this.startLayer = o.startLayer;
    this.endLayer = o.endLayer;
    this.dtype = o.dtype ?? 'f32';
    this.maxContext = maxContext;
    this.weightBytes = weightBytes;
    this.invFreq = ropeInvFreq(o.config);
    const shape = { layers: o.endLayer - o.startLayer, kvHeads: o.config.numKvHeads, headDim: o.config.headDim, elem: this.dtype };
    this.kv = new SessionKv(o, { startLayer: o.startLayer, endLayer: o.endLayer, maxContext, bytesPerToken: kvBytesPerToken(shape), heldBytes: weightBytes }, new CpuKvStorage(shape));
    const held = { startLayer: o.startLayer, endLayer: o.endLayer };
    const scratch = new BatchScratch();
    this.batches = new BatchQueue<ForwardRequest, ForwardResult>(
      {
        batchKey: (req) => packedBatchKey(req, held),
        sessionOf: (req) => req.session,
        runOne: (req) => this.forwardNow(req),
        runBatch: (reqs, join) =>
          runPackedBatch(
            { config: this.config, dtype: this.dtype, startLayer: this.startLayer, endLayer: this.endLayer, maxContext: this.maxContext, invFreq: this.invFreq, segments: this.segments, embed: this.embed, head: this.head, kv: this.kv, scratch, layout: o.batchLayout ?? 'auto' },
            reqs,
            o.batchJoin === false ? undefined : join,
          ),
      },
      o.maxBatch ?? DEFAULT_MAX_BATCH,
    );
  }

  /** Builds and loads every graph of the shard, one at a time so only one graph's weights are in flight. */
  static async create(o: ShardExecutorOptions): Promise<ShardExecutor> {
    const cfg = o.config;
    const { startLayer: a, endLayer: b } = o;
    checkSpan(cfg.numLayers, a, b);
    const maxContext = o.maxContext ?? Math.min(cfg.maxPositionEmbeddings, 2048);
    const bounds = segmentBounds(a, b, o.segmentBoundaries ?? Array.from({ length: b - a - 1 }, (_, i) => a + i + 1));
    const graphOpts = { dtype: o.dtype ?? 'f32' } as const;

    const opened: OnnxSession[] = [];
    const open = async (bytes: Uint8Array) => {
      const s = await o.backend.createSession(bytes, o.sessionOptions);
      opened.push(s);
      return s;
    };
    try {
      let weightBytes = 0;
      const segments: Segment[] = [];
      for (let i = 0; i + 1 < bounds.length; i++) {
        const start = bounds[i]!;
        const end = bounds[i + 1]!;
        const names: string[] = [];
        for (let l = start; l < end; l++) names.push(...layerTensorNames(cfg, l));
        const built = buildLayersGraph(cfg, await o.weights(names), start, end, graphOpts);
        weightBytes += built.weightBytes;
        segments.push({ start, end, session: await open(built.bytes) });
      }
      let embed: OnnxSession | null = null;
      if (a === 0) {
        const built = buildEmbedGraph(cfg, await o.weights([EMBED_TENSOR]), graphOpts);
        weightBytes += built.weightBytes;
        embed = await open(built.bytes);
      }
      let head: OnnxSession | null = null;
      if (b === cfg.numLayers) {
        const built = buildHeadGraph(cfg, await o.weights([FINAL_NORM_TENSOR, cfg.tieWordEmbeddings ? EMBED_TENSOR : LM_HEAD_TENSOR]), graphOpts);
        weightBytes += built.weightBytes;
        head = await open(built.bytes);
      }
      return new ShardExecutor(o, maxContext, segments, embed, head, weightBytes);
    } catch (e) {
      await Promise.allSettled(opened.map((s) => s.release()));
      throw e;
    }
  }

  get holdsEmbedding(): boolean {
    return this.embed !== null;
  }

  get holdsHead(): boolean {
    return this.head !== null;
  }

  kvStats(): KvStats {
    return this.kv.stats();
  }

  /** The donor's budget changed: the KV caches get what the weights leave of it. Live sessions keep their room. */
  setMemoryBudget(bytes: number): void {
    this.kv.setMemoryBudget(bytes);
  }

  /** Tokens a session's cache holds at `layer` (default: the first held layer); 0 when unknown. */
  sessionLength(id: string, layer = this.startLayer): number {
    return this.kv.length(id, layer);
  }

  dropSession(id: string): boolean {
    return this.kv.drop(id);
  }

  /** SpanExecutor.truncateSession: every held layer cut to at most `length` (SessionKv.truncate). */
  truncateSession(id: string, length: number): boolean {
    return this.kv.truncate(id, length);
  }

  /** Queues the request; one-token session steps queued together run as one batch (packed-batch.ts). */
  forward(req: ForwardRequest): Promise<ForwardResult> {
    return this.batches.submit(req);
  }

  /** Batch sizes run so far (the node's stats and /info). */
  batchStats(): BatchStats {
    return this.batches.stats();
  }

  /** The last batch this executor ran was full (speculative decoding backs off: X-Meshnet-Batch-Full). */
  batchFull(): boolean {
    return this.batches.full;
  }

  async release(): Promise<void> {
    await this.batches.idle();
    const all = [...this.segments.map((s) => s.session), this.embed, this.head].filter((s): s is OnnxSession => s !== null);
    await Promise.all(all.map((s) => s.release()));
  }

  private async forwardNow(req: ForwardRequest): Promise<ForwardResult> {
    const cfg = this.config;
    const held = { startLayer: this.startLayer, endLayer: this.endLayer };
    const input = checkForwardInput(cfg, { ...held, holdsEmbedding: this.embed !== null, maxContext: this.maxContext }, req);
    const { start, end, seq, position } = input;
    const { first, last } = segmentSpan(this.segments, start, end, held);

    // Input: token ids (embedding) or an activation.
    let hidden: Float32Array;
    if (input.kind === 'tokens') {
      const out = await this.embed!.run({ [IO.inputIds]: { type: 'int64', data: input.ids, dims: [1, seq] } });
      hidden = out[IO.hiddenOut]!.data as Float32Array;
    } else hidden = input.data;

    // A verification step's drafts are judged where the LM head runs (other hops pass them on unread).
    const draft = end === cfg.numLayers && this.head ? req.draft : undefined;
    if (draft) checkDraft(draft, seq, cfg.vocabSize);

    // Cache: the session's buffers (room reserved by the KV ledger), or an empty past for a stateless call.
    const kv: KvSession | null = req.session !== undefined ? await this.kv.reserve(req.session, start, end, position, seq, req.sessionTokens, req.rollbackFrom) : null;

    const { numKvHeads: KV, headDim: D } = cfg;
    const rowElems = KV * D;
    const kvType = this.dtype === 'f16' ? 'float16' : 'float32';
    const emptyPast = this.dtype === 'f16' ? new Uint16Array(0) : new Float32Array(0);
    const { cos, sin } = ropeTables(this.invFreq, position, seq, D);
    const shared: Record<string, BackendTensor> = {
      [IO.ropeCos]: { type: 'float32', data: cos, dims: [1, seq, 1, D] },
      [IO.ropeSin]: { type: 'float32', data: sin, dims: [1, seq, 1, D] },
      [IO.mask]: { type: 'float32', data: this.causalMask(position, seq), dims: [1, 1, (cfg.numHeads / KV) * seq, position + seq] },
    };

    for (let si = first; si <= last; si++) {
      const seg = this.segments[si]!;
      const feeds: Record<string, BackendTensor> = { ...shared, [IO.hidden]: { type: 'float32', data: hidden, dims: [1, seq, cfg.hiddenSize] } };
      for (let l = seg.start; l < seg.end; l++) {
        const i = l - this.startLayer;
        // Zero-copy views of exactly the filled prefix.
        const k = kv ? kv.cache.keys[i]!.subarray(0, position * rowElems) : emptyPast;
        const v = kv ? kv.cache.values[i]!.subarray(0, position * rowElems) : emptyPast;
        feeds[IO.pastKey(l)] = { type: kvType, data: k, dims: [1, position, KV, D] };
        feeds[IO.pastValue(l)] = { type: kvType, data: v, dims: [1, position, KV, D] };
      }
      const out = await seg.session.run(feeds);
      if (kv) {
        for (let l = seg.start; l < seg.end; l++) {
          const i = l - this.startLayer;
          (kv.cache.keys[i] as Float32Array).set(out[IO.presentKey(l)]!.data as Float32Array, position * rowElems);
          (kv.cache.values[i] as Float32Array).set(out[IO.presentValue(l)]!.data as Float32Array, position * rowElems);
        }
      }
      hidden = out[IO.hiddenOut]!.data as Float32Array;
    }
    // Lengths move only once every layer of the call has written its rows.
    if (kv) for (let l = start; l < end; l++) kv.lengths[l - this.startLayer] = position + seq;

    if (end === cfg.numLayers && this.head && req.logitRows) {
      const rows = req.logitRows;
      const out = await this.head.run({ [IO.hidden]: { type: 'float32', data: gatherRows(hidden, seq, cfg.hiddenSize, rows), dims: [1, rows.length, cfg.hiddenSize] } });
      return { kind: 'logits', rows, data: out[IO.logits]!.data as Float32Array };
    }
    if (end === cfg.numLayers && this.head) {
      const h = cfg.hiddenSize;
      // The last row, or a verification's judged rows.
      const rows = judgedRows(draft);
      const judged = hidden.subarray((seq - rows) * h, seq * h);
      const out = await this.head.run({ [IO.hidden]: { type: 'float32', data: judged, dims: [1, rows, h] } });
      const logits = out[IO.logits]!.data as Float32Array;
      return { kind: 'token', ...tokenFromRows(logits, cfg.vocabSize, draft, req.sampling ?? {}, position + seq - rows + 1) };
    }
    return { kind: 'activation', data: hidden, shape: [1, seq, cfg.hiddenSize] };
  }

  /**
   * Additive causal mask [groups*seq, position+seq]; row g*seq+i sees columns <= position+i,
   * and with a sliding window (Mistral, Phi-3) only the last `window` of them.
   */
  private causalMask(position: number, seq: number): Float32Array {
    const groups = this.config.numHeads / this.config.numKvHeads;
    const window = this.config.slidingWindow;
    const total = position + seq;
    const neg = maskValue(this.dtype);
    const mask = new Float32Array(groups * seq * total);
    for (let i = 0; i < seq; i++) {
      const row = mask.subarray(i * total, (i + 1) * total);
      row.fill(neg, position + i + 1);
      if (window !== null) row.fill(neg, 0, Math.max(0, position + i + 1 - window));
    }
    for (let g = 1; g < groups; g++) mask.copyWithin(g * seq * total, 0, seq * total);
    return mask;
  }
}
