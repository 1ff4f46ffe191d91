/**
 * A span's fused graphs built from its weights and opened as sessions on the
 * backend (fused-executor.ts runs them): the layers cut into segments, the
 * embedding when the span starts at layer 0, the LM head when it ends at the
 * last layer. Apart from the executor because loading is a job of its own,
 * done once, with its own failure: whatever it opened must be freed when it,
 * or the executor's set-up after it, fails.
 */
import type { ModelConfig } from '../model/config.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR, layerTensorNames } from '../model/config.ts';
import { buildEmbedGraph, IO } from '../model/graph.ts';
import { buildFusedLayersGraph, buildLastRowHeadGraph, FUSED_IO, fusedLayerBytes, fusedProjectionNames, HEAD_IO, quantizingSource, type FusedWeights } from '../model/fused-graph.ts';
import type { Q4Matrix } from '../model/quantize.ts';
import type { BackendSessionOptions, DeviceTensor, OnnxBackend, OnnxSession } from './backend.ts';
import type { WeightLoader } from './contract.ts';
import { segmentBounds, type Segment } from './segments.ts';
import { uploadWeights, withWeights, type LaneSegment } from './capture-lane.ts';

/** Quantized projections kept across loads (IndexedDB in the browser), by HF tensor name. */
export interface Q4Cache {
  get(name: string): Promise<Q4Matrix | undefined>;
  put(name: string, m: Q4Matrix): Promise<void>;
}

/** What loading a span's graphs takes (FusedExecutorOptions carries these). */
export interface FusedLoadOptions {
  config: ModelConfig;
  backend: OnnxBackend;
  weights: WeightLoader;
  startLayer: number;
  endLayer: number;
  /** Projection weights: f32 MatMul or 4-bit MatMulNBits. */
  projections: FusedWeights;
  q4Cache?: Q4Cache;
  segmentBoundaries?: number[];
  /** Default 1 GiB. */
  maxSegmentBytes?: number;
  sessionOptions?: BackendSessionOptions;
}

export interface FusedSessions {
  segments: Segment[];
  embed: OnnxSession | null;
  head: OnnxSession | null;
  weightBytes: number;
  /** With graph capture: each segment as the capture lane records it, its weights already on the device. */
  laneSegments: LaneSegment[];
}

/**
 * What a load has put on the backend so far. The caller owns it, so that one
 * clean-up frees it whether the load fails or what the caller builds on it does.
 */
export interface FusedHoldings {
  sessions: OnnxSession[];
  deviceWeights: DeviceTensor[];
}

export async function openFusedSessions(o: FusedLoadOptions, maxContext: number, capture: boolean, held: FusedHoldings): Promise<FusedSessions> {
  const cfg = o.config;
  const { startLayer: a, endLayer: b } = o;
  const bounds = fusedSegmentBounds(cfg, a, b, o);
  const device = o.backend.device !== undefined;
  const sessionOptions = (deviceOutputs: string[]): BackendSessionOptions => ({ ...o.sessionOptions, ...(device ? { deviceOutputs } : {}) });
  const open = async (bytes: Uint8Array, deviceOutputs: string[]) => {
    const s = await o.backend.createSession(bytes, sessionOptions(deviceOutputs));
    held.sessions.push(s);
    return s;
  };
  const laneSegments: LaneSegment[] = [];
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
      held.deviceWeights.push(...Object.values(weights));
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
  return { segments, embed, head, weightBytes, laneSegments };
}

/** Layer cuts: the caller's, else greedy groups of at most maxSegmentBytes. */
function fusedSegmentBounds(cfg: ModelConfig, a: number, b: number, o: FusedLoadOptions): number[] {
  let cuts = o.segmentBoundaries;
  if (!cuts) {
    const limit = o.maxSegmentBytes ?? 2 ** 30;
    const per = fusedLayerBytes(cfg, o.projections);
    const perSegment = Math.max(1, Math.floor(limit / per));
    cuts = [];
    for (let l = a + perSegment; l < b; l += perSegment) cuts.push(l);
  }
  return segmentBounds(a, b, cuts);
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
