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
import { IO } from '../model/graph.ts';
import { DEFAULT_SAMPLER_CANDIDATES } from '../model/sampler-graph.ts';
import { FUSED_IO, HEAD_IO, type FusedWeights } from '../model/fused-graph.ts';
import { hostData, isDeviceTensor, type BackendTensor, type DeviceTensor, type OnnxSession, type RunValue } from './backend.ts';
import { MeshError } from '../protocol/errors.ts';
import { layerRangeError } from './errors.ts';
import type { ForwardRequest, ForwardResult, SpanExecutor } from './contract.ts';
import { checkForwardInput, gatherRows } from './forward-input.ts';
import { BatchQueue, DEFAULT_MAX_BATCH, type BatchStats } from './batch-queue.ts';
import { fusedBatchKey, runFusedBatch } from './fused-batch.ts';
import { BatchScratch } from './batch-scratch.ts';
import type { KvSession, KvStats } from './kv-store.ts';
import { checkSpan, segmentSpan, type Segment } from './segments.ts';
import { SessionKv, type ExecutorKvOptions } from './session-kv.ts';
import { LayerKvStorage, layerKvBytesPerToken, type KvBuffer, type LayerKv } from './layer-kv.ts';
import { CaptureLane, type CaptureStats } from './capture-lane.ts';
import { openFusedSessions, type FusedHoldings, type FusedLoadOptions } from './fused-sessions.ts';
import type { DeviceSamplingStats } from './device-sampler.ts';
import { HeadTokenPicker } from './head-token.ts';
import { validateSampling, type SamplingParams } from './sampling.ts';
import { checkDraft, judgedRows, tokenFromRows, verifyGreedyPicks, type DraftProposal } from './speculative.ts';
import type { SamplerChoice, SamplerPathStats } from './sampler-choice.ts';

// Hosts hand the executor their Q4Cache: it is named where they name the executor.
export type { Q4Cache } from './fused-sessions.ts';

export interface FusedExecutorOptions extends ExecutorKvOptions, FusedLoadOptions {
  /** Positions one session may reach; default min(maxPositionEmbeddings, 2048). */
  maxContext?: number;
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

const STATELESS = '\u0000stateless';

export class FusedShardExecutor implements SpanExecutor {
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
  private readonly kv: SessionKv<LayerKv>;
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
    this.kv = new SessionKv(o, { startLayer: o.startLayer, endLayer: o.endLayer, maxContext, bytesPerToken: layerKvBytesPerToken(shape), heldBytes: weightBytes + laneBytes }, new LayerKvStorage(shape));
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
              reserve: async (session, start, end, position, seq, declared, rollbackFrom) => this.uncaptured((await this.reservation(session, start, end, position, seq, declared, rollbackFrom)).session),
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
    checkSpan(cfg.numLayers, a, b);
    const maxContext = o.maxContext ?? Math.min(cfg.maxPositionEmbeddings, 2048);
    const capture = o.graphCapture === true && o.backend.device !== undefined;
    const held: FusedHoldings = { sessions: [], deviceWeights: [] };
    let lane: CaptureLane | null = null;
    try {
      const { segments, embed, head, weightBytes, laneSegments } = await openFusedSessions(o, maxContext, capture, held);
      let laneBytes = 0;
      let exec: FusedShardExecutor | null = null;
      if (capture) {
        const shape = { startLayer: a, hiddenSize: cfg.hiddenSize, kvHeads: cfg.numKvHeads, headDim: cfg.headDim, maxContext };
        // A session the lane holds may end meanwhile: its rows are then not copied back.
        lane = await CaptureLane.create(o.backend, shape, laneSegments, (s) => exec?.kv.store.peek(s.id) === s);
        laneBytes = CaptureLane.bytes(shape, b - a, laneSegments.length);
      }
      exec = new FusedShardExecutor(o, maxContext, segments, embed, head, weightBytes, laneBytes);
      exec.lane = lane;
      exec.deviceWeights.push(...held.deviceWeights);
      return exec;
    } catch (e) {
      await Promise.allSettled(held.sessions.map((s) => s.release()));
      await lane?.dispose();
      for (const t of held.deviceWeights) t.dispose();
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
    this.kv.setMemoryBudget(bytes);
  }

  /** Decode steps replayed from a captured graph so far; null when graph capture is off. */
  captureStats(): CaptureStats | null {
    return this.lane?.stats() ?? null;
  }


  /** Tokens a session's cache holds at `layer` (default: the first held layer); 0 when unknown. */
  sessionLength(id: string, layer = this.startLayer): number {
    return this.kv.length(id, layer);
  }

  dropSession(id: string): boolean {
    return this.kv.drop(id);
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

  /** The last batch this executor ran was full (speculative decoding backs off: X-Meshnet-Batch-Full). */
  batchFull(): boolean {
    return this.batches.full;
  }

  async release(): Promise<void> {
    await this.batches.idle();
    this.kv.store.clear();
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
    const { first, last } = segmentSpan(this.segments, start, end, held);

    // A verification step's drafts are judged where the LM head runs (other hops pass them on unread).
    const draft = end === cfg.numLayers && this.head ? req.draft : undefined;
    if (draft) checkDraft(draft, seq, cfg.vocabSize);
    const kv = await this.reservation(req.session, start, end, position, seq, req.sessionTokens, req.rollbackFrom);
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

      if (end === cfg.numLayers && this.head && draft) return await this.verify(hidden, seq, position, draft, req.sampling ?? {}, owned);
      if (end === cfg.numLayers && this.head && req.logitRows) {
        // The head graph answers its input's last row: one run per asked row (a check's steps), on the host's copy of the rows.
        const rows = req.logitRows;
        const all = gatherRows((await hostData(hidden)) as Float32Array, seq, cfg.hiddenSize, rows);
        const V = cfg.vocabSize;
        const data = new Float32Array(rows.length * V);
        for (let i = 0; i < rows.length; i++) {
          const out = await this.head.runWith({ [HEAD_IO.hidden]: { type: 'float32', data: all.subarray(i * cfg.hiddenSize, (i + 1) * cfg.hiddenSize), dims: [1, 1, cfg.hiddenSize] } });
          const logits = out[HEAD_IO.logits]!;
          owned.push(logits);
          data.set(((await hostData(logits)) as Float32Array).subarray(0, V), i * V);
        }
        return { kind: 'logits', rows, data };
      }
      if (end === cfg.numLayers && this.head) {
        const out = await this.head.runWith({ [HEAD_IO.hidden]: hidden });
        owned.push(out[HEAD_IO.logits]!);
        return await this.picker!.pick(out, req.sampling ?? {}, position + seq, this.returnLogits);
      }
      const data = (await hostData(hidden)) as Float32Array;
      return { kind: 'activation', data, shape: [1, seq, cfg.hiddenSize] };
    } finally {
      for (const t of owned) if (isDeviceTensor(t)) t.dispose();
      if (kv.stateless) this.kv.drop(STATELESS);
    }
  }

  /** `s` runs without the captured graph: its rows come back from the capture lane first, if it holds them. */
  private uncaptured(s: KvSession<LayerKv>): KvSession<LayerKv> {
    this.lane?.release(s);
    return s;
  }

  /**
   * A verification step's last rows through the LM head as a batch of
   * one-row entries ([rows, 1, hidden], the head graph's last row of each):
   * greedy from the graph's ArgMax per row ((rows) ids and log-probabilities
   * down, the logits stay), otherwise over the downloaded rows of logits.
   */
  private async verify(hidden: RunValue, seq: number, position: number, draft: DraftProposal, sampling: SamplingParams, owned: RunValue[]): Promise<ForwardResult> {
    const h = this.config.hiddenSize;
    const V = this.config.vocabSize;
    const rows = judgedRows(draft);
    let judged: RunValue;
    if (isDeviceTensor(hidden)) {
      const t = await this.o.backend.device!.alloc('float32', [rows, 1, h]);
      owned.push(t);
      this.o.backend.device!.copy([{ src: hidden, srcByte: (seq - rows) * h * 4, dst: t, dstByte: 0, bytes: rows * h * 4 }]);
      judged = t;
    } else judged = { type: 'float32', data: (hidden.data as Float32Array).subarray((seq - rows) * h, seq * h), dims: [rows, 1, h] };
    const out = await this.head!.runWith({ [HEAD_IO.hidden]: judged });
    owned.push(out[HEAD_IO.logits]!);
    if (!((sampling.temperature ?? 0) > 0) && !this.returnLogits) {
      validateSampling(sampling);
      const spec = verifyGreedyPicks((out[HEAD_IO.greedyToken] as BackendTensor).data as BigInt64Array, (out[HEAD_IO.greedyLogprob] as BackendTensor).data as Float32Array, draft, V);
      const last = spec.tokenIds.length - 1;
      return { kind: 'token', tokenId: spec.tokenIds[last]!, logprob: spec.logprobs[last]!, logits: new Float32Array(0), spec };
    }
    const logits = (await hostData(out[HEAD_IO.logits]!)) as Float32Array;
    return { kind: 'token', ...tokenFromRows(logits, V, draft, sampling, position + seq - rows + 1) };
  }

  /**
   * Cuts a session's cache back to `length` positions on every held layer
   * (speculative decoding's rollback; a forward's `rollbackFrom` does the
   * same in order with its queue). The capture lane needs nothing: while it
   * holds the session it reads and hands back only `length` rows. Call it
   * between that session's forwards. False when the session is unknown.
   */
  truncateSession(id: string, length: number): boolean {
    return this.kv.truncate(id, length);
  }

  /**
   * The session's cache (SessionKv.reserve: admitted, checked against
   * `position` after a rollback, grown to hold the call). A stateless call borrows room for
   * its own rows and gives it back after.
   */
  private async reservation(session: string | undefined, start: number, end: number, position: number, seq: number, declared: number | undefined, rollbackFrom?: number): Promise<{ session: KvSession<LayerKv>; stateless: boolean }> {
    if (session === undefined) return { session: await this.kv.store.open(STATELESS, seq), stateless: true };
    if (session === STATELESS) throw layerRangeError('reserved session id', { startLayer: this.startLayer, endLayer: this.endLayer });
    return { session: await this.kv.reserve(session, start, end, position, seq, declared, rollbackFrom), stateless: false };
  }
}
