/**
 * The shard executor over fused layer graphs (src/model/fused-graph.ts):
 * the GPU path, and WASM/CPU with 4-bit weights. Same contract as
 * ShardExecutor (executor.ts) — a request names a session, a position, a
 * layer range and its input — so hosts and the forward handler use either.
 *
 * On a device backend (WebGPU) nothing goes back to the CPU between layers:
 * each session's KV cache lives in GPU buffers that GroupQueryAttention
 * reads and writes in place (layer-kv.ts), the activation passes from one
 * graph to the next as a GPU buffer, and per call only the input comes in
 * and the output activation (or the last hop's token: picked by the head
 * graph when greedy, from the sampler graph's candidates otherwise,
 * device-sampler.ts) goes out.
 *
 * KV room is admitted by the same KvLedger as ShardExecutor's (kv-store.ts):
 * a session gets what it declares when it opens (`sessionTokens`), grows by
 * whole blocks past that, and a session that does not fit is refused with
 * 503 MESH_ERR_BUSY before anything runs — a live session is never evicted.
 * The budget is the donor's memory less these weights (`memoryBudgetBytes`).
 *
 * Graphs are cut into segments of at most `maxSegmentBytes` of weights
 * (ONNX protobufs stop at 2 GiB) unless `segmentBoundaries` says where; a
 * request must start and end on a segment boundary.
 */
import type { ModelConfig } from '../model/config.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR, layerTensorNames } from '../model/config.ts';
import { buildEmbedGraph, IO } from '../model/graph.ts';
import { DEFAULT_SAMPLER_CANDIDATES } from '../model/sampler-graph.ts';
import { buildFusedLayersGraph, buildLastRowHeadGraph, FUSED_IO, fusedLayerBytes, fusedProjectionNames, HEAD_IO, quantizingSource, type FusedWeights } from '../model/fused-graph.ts';
import type { Q4Matrix } from '../model/quantize.ts';
import { hostData, isDeviceTensor, type BackendSessionOptions, type BackendTensor, type DeviceTensor, type OnnxBackend, type OnnxSession, type RunValue } from './backend.ts';
import { MeshError } from '../protocol/errors.ts';
import { PositionMismatchError, layerRangeError } from './errors.ts';
import type { ForwardRequest, ForwardResult, WeightLoader } from './executor.ts';
import { checkForwardInput } from './forward-input.ts';
import { BatchQueue, DEFAULT_MAX_BATCH, type BatchStats } from './batch-queue.ts';
import { fusedBatchKey, runFusedBatch } from './fused-batch.ts';
import { BatchScratch } from './batch-scratch.ts';
import { executorKvStore, kvBudgetFor, type ExecutorKvOptions, type KvSession, type KvStats, type KvStore } from './kv-store.ts';
import { LayerKvStorage, layerKvBytesPerToken, type KvBuffer, type LayerKv } from './layer-kv.ts';
import { CaptureLane, uploadWeights, withWeights, type CaptureStats, type LaneSegment } from './capture-lane.ts';
import type { DeviceSamplingStats } from './device-sampler.ts';
import { HeadTokenPicker } from './head-token.ts';
import type { SamplerChoice, SamplerPathStats } from './sampler-choice.ts';

/** Quantized projections kept across loads (IndexedDB in the browser), by HF tensor name. */
export interface Q4Cache {
  get(name: string): Promise<Q4Matrix | undefined>;
  put(name: string, m: Q4Matrix): Promise<void>;
}

export interface FusedExecutorOptions extends ExecutorKvOptions {
  config: ModelConfig;
  backend: OnnxBackend;
  weights: WeightLoader;
  startLayer: number;
  endLayer: number;
  /** Projection weights: f32 MatMul or 4-bit MatMulNBits. */
  projections: FusedWeights;
  q4Cache?: Q4Cache;
  /** Positions one session may reach; default min(maxPositionEmbeddings, 2048). */
  maxContext?: number;
  segmentBoundaries?: number[];
  /** Default 1 GiB. */
  maxSegmentBytes?: number;
  sessionOptions?: BackendSessionOptions;
  /** Most one-token steps of different sessions run as one batch (fused-batch.ts); 1 runs every request alone. @defaultValue 16 */
  maxBatch?: number;
  /**
   * Return the last row's logits with each token. Default: true on a CPU
   * backend (they are on the host anyway); false on a device, where a greedy
   * step then brings back only the token and its log-probability (picked
   * by the head graph on the GPU) and the logits stay there.
   */
  returnLogits?: boolean;
  /**
   * One-token decode steps of a session replay a captured GPU graph
   * (onnxruntime's graph capture, capture-lane.ts); prefill, batched steps
   * and partial spans run uncaptured. The layer weights are then graph
   * inputs held once on the device and shared by both. Device backends only
   * (ignored on CPU). Costs one extra KV buffer of `maxContext` positions
   * per layer (charged to the KV budget). @defaultValue false
   */
  graphCapture?: boolean;
  /**
   * Candidates (largest logits) the sampler graph sends back for a step at
   * temperature > 0 when `returnLogits` is false (device-sampler.ts); 0
   * always downloads the logits instead. @defaultValue 256
   */
  samplerCandidates?: number;
  /**
   * `adaptive` (default): sample from the candidates or over the downloaded
   * logits, whichever is measured faster on this device (sampler-choice.ts);
   * `candidates`: always the candidates. The token is the same either way.
   */
  samplerChoice?: SamplerChoice;
}

interface Segment {
  start: number;
  end: number;
  session: OnnxSession;
}

const STATELESS = '\u0000stateless';

export class FusedShardExecutor {
  readonly config: ModelConfig;
  readonly startLayer: number;
  readonly endLayer: number;
  readonly maxContext: number;
  readonly projections: FusedWeights;
  /** Activations are f32 whatever the projections (what /info reports as the graph dtype). */
  readonly dtype = 'f32' as const;
  readonly weightBytes: number;
  /** Activations and KV stay in device memory between graphs. */
  readonly onDevice: boolean;
  /** See FusedExecutorOptions.returnLogits; may be changed between calls. */
  returnLogits: boolean;
  private readonly kv: KvStore<LayerKv>;
  /** Forwards run one batch at a time: KV positions advance in request order. */
  private readonly batches: BatchQueue<ForwardRequest, ForwardResult>;
  private lostReason: string | null = null;
  /** Temperature > 0 without the logits (null: the head is not here, or candidates are off). */
  /** Picks the token at the last layer (null when the span does not hold the head). */
  private readonly picker: HeadTokenPicker | null;
  private readonly lost: Promise<never>;
  private lane: CaptureLane | null = null;
  private readonly deviceWeights: DeviceTensor[] = [];

  private constructor(
    private readonly o: FusedExecutorOptions,
    maxContext: number,
    private readonly segments: Segment[],
    private readonly embed: OnnxSession | null,
    private readonly head: OnnxSession | null,
    weightBytes: number,
    /** Device bytes held beyond the weights and the sessions' caches (the capture lane). */
    private readonly laneBytes = 0,
  ) {
    this.config = o.config;
    this.startLayer = o.startLayer;
    this.endLayer = o.endLayer;
    this.maxContext = maxContext;
    this.projections = o.projections;
    this.weightBytes = weightBytes;
    this.onDevice = o.backend.device !== undefined;
    this.returnLogits = o.returnLogits ?? !this.onDevice;
    this.picker = head ? new HeadTokenPicker(o.backend, o.config.vocabSize, o.samplerCandidates ?? DEFAULT_SAMPLER_CANDIDATES, o.samplerChoice ?? 'adaptive', o.sessionOptions ?? {}) : null;
    this.lost = new Promise<never>((_, reject) => {
      void o.backend.device?.lost.then((reason) => {
        this.lostReason = reason;
        reject(this.lostError());
      });
    });
    this.lost.catch(() => undefined); // rejected for callers racing it; unobserved otherwise
    const shape = { layers: o.endLayer - o.startLayer, kvHeads: o.config.numKvHeads, headDim: o.config.headDim, ...(o.backend.device ? { device: o.backend.device } : {}) };
    this.kv = executorKvStore(o, { layers: shape.layers, bytesPerToken: layerKvBytesPerToken(shape), maxContext, weightBytes: weightBytes + laneBytes }, new LayerKvStorage(shape));
    const held = { startLayer: o.startLayer, endLayer: o.endLayer };
    const scratch = new BatchScratch();
    this.batches = new BatchQueue<ForwardRequest, ForwardResult>(
      {
        batchKey: (req) => fusedBatchKey(req, held),
        sessionOf: (req) => req.session,
        runOne: (req) => this.forwardNow(req),
        runBatch: (reqs) =>
          runFusedBatch(
            {
              ...held,
              config: this.config,
              maxContext: this.maxContext,
              segments: this.segments,
              embed: this.embed,
              head: this.head,
              device: o.backend.device,
              scratch,
              reserve: async (session, start, end, position, seq, declared) => this.uncaptured((await this.reservation(session, start, end, position, seq, declared)).session),
            },
            reqs,
          ),
      },
      // Under 32 rows on a device backend until a batch of 32 or more is checked on WebGPU (the >= 32-row
      // prefill fault was flash attention on 4-lane subgroups, now kept off: src/host/browser/webgpu.ts).
      Math.min(o.maxBatch ?? DEFAULT_MAX_BATCH, o.backend.device ? 31 : Infinity),
    );
  }

  static async create(o: FusedExecutorOptions): Promise<FusedShardExecutor> {
    const cfg = o.config;
    const { startLayer: a, endLayer: b } = o;
    if (!(Number.isInteger(a) && Number.isInteger(b) && 0 <= a && a < b && b <= cfg.numLayers)) {
      throw new RangeError(`layer range [${a}, ${b}) is not inside 0..${cfg.numLayers}`);
    }
    const maxContext = o.maxContext ?? Math.min(cfg.maxPositionEmbeddings, 2048);
    const bounds = segmentBounds(cfg, a, b, o);
    const device = o.backend.device !== undefined;
    const sessionOptions = (deviceOutputs: string[]): BackendSessionOptions => ({ ...o.sessionOptions, ...(device ? { deviceOutputs } : {}) });

    const capture = o.graphCapture === true && o.backend.device !== undefined;
    const laneSegments: LaneSegment[] = [];
    const opened: OnnxSession[] = [];
    const open = async (bytes: Uint8Array, deviceOutputs: string[]) => {
      const s = await o.backend.createSession(bytes, sessionOptions(deviceOutputs));
      opened.push(s);
      return s;
    };
    const uploaded: DeviceTensor[] = [];
    let lane: CaptureLane | null = null;
    try {
      let weightBytes = 0;
      const segments: Segment[] = [];
      for (let i = 0; i + 1 < bounds.length; i++) {
        const start = bounds[i]!;
        const end = bounds[i + 1]!;
        const names: string[] = [];
        for (let l = start; l < end; l++) names.push(...layerTensorNames(cfg, l));
        const src = await o.weights(names);
        const projNames: string[] = [];
        for (let l = start; l < end; l++) {
          const p = fusedProjectionNames(l, cfg);
          projNames.push(...p.qkv, p.o, ...p.gateUp, p.down);
        }
        const q4 = o.projections === 'q4' ? await quantizedSource(src, projNames, o.q4Cache) : undefined;
        const built = buildFusedLayersGraph(cfg, src, start, end, { weights: o.projections, maxContext, ...(q4 ? { q4 } : {}), ...(capture ? { weightsAsInputs: true } : {}) });
        weightBytes += built.weightBytes;
        let session = await open(built.bytes, [FUSED_IO.hiddenOut]);
        if (capture) {
          // One copy of the weights on the device, fed to this session and to the captured one.
          const weights = await uploadWeights(o.backend.device!, built.externalWeights ?? []);
          uploaded.push(...Object.values(weights));
          session = withWeights(session, weights);
          laneSegments.push({ start, end, bytes: built.bytes, weights });
        }
        segments.push({ start, end, session });
      }
      let embed: OnnxSession | null = null;
      if (a === 0) {
        const built = buildEmbedGraph(cfg, await o.weights([EMBED_TENSOR]));
        weightBytes += built.weightBytes;
        embed = await open(built.bytes, [IO.hiddenOut]);
      }
      let head: OnnxSession | null = null;
      if (b === cfg.numLayers) {
        const headName = cfg.tieWordEmbeddings ? EMBED_TENSOR : LM_HEAD_TENSOR;
        const src = await o.weights([FINAL_NORM_TENSOR, headName]);
        // A tied head is the embedding table, which the embedding reads exactly: it stays f32.
        const headWeights = o.projections === 'q4' && !cfg.tieWordEmbeddings ? 'q4' : 'f32';
        const q4 = headWeights === 'q4' ? await quantizedSource(src, [headName], o.q4Cache) : undefined;
        const built = buildLastRowHeadGraph(cfg, src, { weights: headWeights, ...(q4 ? { q4 } : {}) });
        weightBytes += built.weightBytes;
        head = await open(built.bytes, [HEAD_IO.logits]);
      }
      let laneBytes = 0;
      let exec: FusedShardExecutor | null = null;
      if (capture) {
        const shape = { startLayer: a, hiddenSize: cfg.hiddenSize, kvHeads: cfg.numKvHeads, headDim: cfg.headDim, maxContext };
        // A session the lane holds may end meanwhile: its rows are then not copied back.
        lane = await CaptureLane.create(o.backend, shape, laneSegments, (s) => exec?.kv.peek(s.id) === s);
        laneBytes = CaptureLane.bytes(shape, b - a, laneSegments.length);
      }
      exec = new FusedShardExecutor(o, maxContext, segments, embed, head, weightBytes, laneBytes);
      exec.lane = lane;
      exec.deviceWeights.push(...uploaded);
      return exec;
    } catch (e) {
      await Promise.allSettled(opened.map((s) => s.release()));
      await lane?.dispose();
      for (const t of uploaded) t.dispose();
      throw e;
    }
  }

  get holdsEmbedding(): boolean {
    return this.embed !== null;
  }

  get holdsHead(): boolean {
    return this.head !== null;
  }

  /** Bytes copied between the CPU and the device so far (0/0 on a CPU backend). */
  transferStats(): { up: number; down: number } {
    const t = this.o.backend.device?.transfer;
    return t ? { up: t.up, down: t.down } : { up: 0, down: 0 };
  }

  kvStats(): KvStats {
    return this.kv.stats();
  }

  /** The donor's budget changed: the KV caches get what the weights leave of it. Live sessions keep their room. */
  setMemoryBudget(bytes: number): void {
    this.kv.setBudget(kvBudgetFor(bytes, this.weightBytes + this.laneBytes));
  }

  /** Decode steps replayed from a captured graph so far; null when graph capture is off. */
  captureStats(): CaptureStats | null {
    return this.lane?.stats() ?? null;
  }


  sessionLength(id: string, layer = this.startLayer): number {
    const r = this.kv.get(id);
    return r ? r.lengths[layer - this.startLayer]! : 0;
  }

  dropSession(id: string): boolean {
    return this.kv.delete(id);
  }

  /** Queues the request; one-token session steps queued together run as one batch (fused-batch.ts). */
  forward(req: ForwardRequest): Promise<ForwardResult> {
    // A lost device never answers a call in flight: race each call against the loss, so none hangs.
    if (this.lostReason !== null) return Promise.reject(this.lostError());
    return Promise.race([this.batches.submit(req), this.lost]);
  }

  /** Why the device was lost, once it is: every call then fails at once (MESH_ERR_UNAVAILABLE) and the host rebuilds or falls back. */
  get deviceLost(): string | null {
    return this.lostReason;
  }

  private lostError(): MeshError {
    return new MeshError('MESH_ERR_UNAVAILABLE', `the GPU device was lost (${this.lostReason}); this shard is being rebuilt`, { retry_after_ms: 1000 });
  }

  /** Steps at temperature > 0 decided from the device's candidates, and those that downloaded the logits (see returnLogits). */
  samplingStats(): DeviceSamplingStats & { path: SamplerPathStats } {
    return this.picker?.stats() ?? { onDevice: 0, fallbacks: 0, reasons: {}, path: { chosen: 'probing', candidatesMs: null, logitsMs: null } };
  }

  /** Batch sizes run so far. */
  batchStats(): BatchStats {
    return this.batches.stats();
  }

  async release(): Promise<void> {
    await this.batches.idle();
    this.kv.clear();
    const all = [...this.segments.map((s) => s.session), this.embed, this.head].filter((s): s is OnnxSession => s !== null);
    await Promise.all([...all.map((s) => s.release()), this.picker?.release()]);
    await this.lane?.dispose();
    for (const t of this.deviceWeights) t.dispose();
  }

  private async forwardNow(req: ForwardRequest): Promise<ForwardResult> {
    const cfg = this.config;
    const held = { startLayer: this.startLayer, endLayer: this.endLayer };
    const input = checkForwardInput(cfg, { ...held, holdsEmbedding: this.embed !== null, maxContext: this.maxContext }, req);
    const { start, end, seq, position } = input;
    const first = this.segments.findIndex((s) => s.start === start);
    const last = this.segments.findIndex((s) => s.end === end);
    if (first < 0 || last < 0) throw layerRangeError(`layers [${start}, ${end}) do not start and end on this shard's graph boundaries`, held);

    const kv = await this.reservation(req.session, start, end, position, seq, req.sessionTokens);
    // A one-token step of a session over the whole span replays the captured graph (capture-lane.ts).
    const lane = this.lane !== null && !kv.stateless && seq === 1 && first === 0 && last === this.segments.length - 1 ? this.lane : null;
    if (!lane) this.uncaptured(kv.session);
    const owned: RunValue[] = []; // device outputs of this call, freed at the end
    try {
      let hidden: RunValue;
      if (input.kind === 'tokens') {
        const out = await this.embed!.runWith({ [IO.inputIds]: { type: 'int64', data: input.ids, dims: [1, seq] } });
        hidden = out[IO.hiddenOut]!;
        owned.push(hidden);
      } else hidden = { type: 'float32', data: input.data, dims: [1, seq, cfg.hiddenSize] };
      if (lane) {
        const into = lane.input;
        if (isDeviceTensor(hidden)) this.o.backend.device!.copy([{ src: hidden, srcByte: 0, dst: into, dstByte: 0, bytes: into.byteLength }]);
        else this.o.backend.device!.write(into, hidden.data);
        hidden = await lane.step(kv.session, position);
      }

      const { numKvHeads: KV, headDim: D } = cfg;
      const counters = {
        [FUSED_IO.seqlensK]: { type: 'int32', data: Int32Array.of(position + seq - 1), dims: [1] } as BackendTensor,
        [FUSED_IO.totalSeqLen]: { type: 'int32', data: Int32Array.of(position + seq), dims: [1] } as BackendTensor,
      };
      const asValue = (b: KvBuffer): RunValue => (b instanceof Float32Array ? { type: 'float32', data: b, dims: [1, KV, kv.session.cache.capacity, D] } : b);
      // Uncaptured: segment by segment, each session fed this session's own KV buffers.
      for (let si = first; !lane && si <= last; si++) {
        const seg = this.segments[si]!;
        const feeds: Record<string, RunValue> = { ...counters, [FUSED_IO.hidden]: hidden };
        const outputs: Record<string, RunValue> = {};
        for (let l = seg.start; l < seg.end; l++) {
          const i = l - this.startLayer;
          const k = asValue(kv.session.cache.keys[i]!);
          const v = asValue(kv.session.cache.values[i]!);
          feeds[FUSED_IO.pastKey(l)] = k;
          feeds[FUSED_IO.pastValue(l)] = v;
          outputs[FUSED_IO.presentKey(l)] = k;
          outputs[FUSED_IO.presentValue(l)] = v;
        }
        const out = await seg.session.runWith(feeds, outputs);
        hidden = out[FUSED_IO.hiddenOut]!;
        owned.push(hidden);
      }
      // Lengths move only once every layer of the call has written its rows.
      for (let l = start; l < end; l++) kv.session.lengths[l - this.startLayer] = position + seq;

      if (end === cfg.numLayers && this.head) {
        const out = await this.head.runWith({ [HEAD_IO.hidden]: hidden });
        owned.push(out[HEAD_IO.logits]!);
        return await this.picker!.pick(out, req.sampling ?? {}, position + seq, this.returnLogits);
      }
      const data = (await hostData(hidden)) as Float32Array;
      return { kind: 'activation', data, shape: [1, seq, cfg.hiddenSize] };
    } finally {
      for (const t of owned) if (isDeviceTensor(t)) t.dispose();
      if (kv.stateless) this.kv.delete(STATELESS);
    }
  }

  /** `s` runs without the captured graph: its rows come back from the capture lane first, if it holds them. */
  private uncaptured(s: KvSession<LayerKv>): KvSession<LayerKv> {
    this.lane?.release(s);
    return s;
  }

  /**
   * The session's cache, admitted by the ledger when it opens (room for what
   * it declares, or what this call needs), checked against `position` and
   * grown by whole blocks to hold the call. A stateless call borrows room
   * for its own rows and gives it back after.
   */
  private async reservation(session: string | undefined, start: number, end: number, position: number, seq: number, declared: number | undefined): Promise<{ session: KvSession<LayerKv>; stateless: boolean }> {
    if (session === undefined) return { session: await this.kv.open(STATELESS, seq), stateless: true };
    if (session === STATELESS) throw layerRangeError('reserved session id', { startLayer: this.startLayer, endLayer: this.endLayer });
    let s: KvSession<LayerKv> | undefined;
    if (position === 0) {
      // Admission happens here, before any compute: a refusal costs the caller one round trip.
      s = await this.kv.open(session, Math.min(this.maxContext, Math.max(seq, declared ?? 0)));
      for (let l = start; l < end; l++) s.lengths[l - this.startLayer] = 0;
    } else {
      s = this.kv.get(session);
      if (!s) throw new PositionMismatchError(session, position, 0);
    }
    let actual = Infinity;
    for (let l = start; l < end; l++) actual = Math.min(actual, s.lengths[l - this.startLayer]!);
    for (let l = start; l < end; l++) if (s.lengths[l - this.startLayer] !== position) throw new PositionMismatchError(session, position, actual);
    // Past its room (an undeclared session, or one outgrowing its declaration): whole blocks more, or 503.
    await this.kv.ensure(s, position + seq, Math.max(0, ...s.lengths));
    return { session: s, stateless: false };
  }
}


/** Layer cuts: the caller's, else greedy groups of at most maxSegmentBytes. */
function segmentBounds(cfg: ModelConfig, a: number, b: number, o: FusedExecutorOptions): number[] {
  let cuts = o.segmentBoundaries;
  if (!cuts) {
    const limit = o.maxSegmentBytes ?? 2 ** 30;
    const per = fusedLayerBytes(cfg, o.projections);
    const perSegment = Math.max(1, Math.floor(limit / per));
    cuts = [];
    for (let l = a + perSegment; l < b; l += perSegment) cuts.push(l);
  }
  const bounds = [a, ...[...new Set(cuts)].sort((x, y) => x - y), b];
  if (bounds.some((v, i) => i > 0 && v <= bounds[i - 1]!)) throw new RangeError(`segment boundaries ${cuts.join(',')} must lie strictly inside (${a}, ${b})`);
  return bounds;
}

/** Quantized matrices for `names`, from the cache or quantized now (and stored for the next load). */
async function quantizedSource(src: Parameters<typeof quantizingSource>[0], names: string[], cache: Q4Cache | undefined) {
  const quantize = quantizingSource(src);
  const got = new Map<string, Q4Matrix>();
  for (const name of names) {
    let m = await cache?.get(name);
    if (!m) {
      m = quantize(name);
      await cache?.put(name, m);
    }
    got.set(name, m);
  }
  return (name: string): Q4Matrix => {
    const m = got.get(name);
    if (!m) throw new RangeError(`no quantized matrix for ${name}`);
    return m;
  };
}
