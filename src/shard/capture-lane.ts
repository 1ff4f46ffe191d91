/**
 * GPU graph capture for one-token decode steps of the fused executor
 * (onnxruntime's `enableGraphCapture` on its WebGPU EP): the step's GPU
 * commands are recorded once and replayed, so a decode step costs one
 * submission instead of ~10 dispatches per layer, each with its CPU-side
 * bookkeeping.
 *
 * What onnxruntime-web 1.30 allows decides the shape of this module:
 * - A captured session binds its inputs and outputs on its first run and
 *   never again (lib/wasm/wasm-core-impl.ts: `inputOutputBound`; it rebinds
 *   only without capture), and it holds ONE recorded graph (the EP keeps one
 *   command list; `gpu_graph_id` only selects capture/replay vs a plain run).
 *   So every run feeds the same GPU buffers: a fixed lane of buffers — the
 *   hidden state in and out, the two position counters, and a KV buffer per
 *   layer of `maxContext` positions — and new values are written INTO them.
 * - Prefill (many rows) cannot go through that session (its shapes are
 *   frozen at one row), so it runs in a second, uncaptured session. To keep
 *   that from doubling the weights, the layer graphs take their weights as
 *   inputs (FusedGraphOptions.weightsAsInputs): they are uploaded once into
 *   device buffers here and fed to both sessions (`withWeights`).
 * - KV caches stay per session (the ledger's, layer-kv.ts). The lane holds
 *   one session's rows at a time: when a decode step belongs to another
 *   session, the owner's rows are copied back to its own buffers and the
 *   newcomer's rows into the lane, device to device (copyBufferToBuffer),
 *   only when the session changes. While a session owns the lane, the lane
 *   is the truth for its rows; any uncaptured call for it (prefill, a
 *   batched step, a partial span) first takes its rows back (`release`).
 */
import type { Initializer } from '../model/onnx-builder.ts';
import { FUSED_IO } from '../model/fused-graph.ts';
import type { DeviceMemory, DeviceTensor, OnnxBackend, OnnxSession, RunValue, TensorType } from './backend.ts';
import type { KvSession } from './kv-store.ts';
import type { LayerKv } from './layer-kv.ts';

/** ONNX element types of the weights a fused graph takes as inputs. */
const WEIGHT_TYPES: Record<number, TensorType> = { 1: 'float32', 2: 'uint8', 6: 'int32', 7: 'int64', 10: 'float16' };

/** Uploads a graph's input weights once; the tensors are fed to every session built from that graph. */
export async function uploadWeights(device: DeviceMemory, weights: readonly Initializer[]): Promise<Record<string, DeviceTensor>> {
  const out: Record<string, DeviceTensor> = {};
  try {
    for (const w of weights) {
      const type = WEIGHT_TYPES[w.elemType];
      if (!type) throw new TypeError(`weight ${w.name}: ONNX element type ${w.elemType} has no device tensor type`);
      const t = await device.alloc(type, w.dims);
      // writeBuffer takes whole 4-byte words; the buffer is rounded up the same way.
      const bytes = new Uint8Array(Math.ceil(t.byteLength / 4) * 4);
      w.fill(bytes.subarray(0, t.byteLength));
      device.write(t, bytes);
      out[w.name] = t;
    }
  } catch (e) {
    for (const t of Object.values(out)) t.dispose();
    throw e;
  }
  return out;
}

/** `session` with `weights` added to the feeds of every run (a graph built with weightsAsInputs). */
export function withWeights(session: OnnxSession, weights: Readonly<Record<string, DeviceTensor>>): OnnxSession {
  return {
    inputNames: session.inputNames.filter((n) => !(n in weights)),
    outputNames: session.outputNames,
    run: () => Promise.reject(new TypeError('a session fed device weights runs through runWith')),
    runWith: (feeds, outputs) => session.runWith({ ...feeds, ...weights }, outputs),
    release: () => session.release(),
  };
}

export interface LaneSegment {
  start: number;
  end: number;
  /** The segment's graph bytes (built with weightsAsInputs) and its uploaded weights. */
  bytes: Uint8Array;
  weights: Readonly<Record<string, DeviceTensor>>;
}

export interface LaneShape {
  /** First layer the executor holds: KV index 0. */
  startLayer: number;
  hiddenSize: number;
  kvHeads: number;
  headDim: number;
  maxContext: number;
}

/** What the lane did so far (tests and /info). */
export interface CaptureStats {
  /** Decode steps run through the captured sessions (the first one of each session records the graph). */
  steps: number;
  /** Times the lane changed hands (rows copied in). */
  swaps: number;
  /** Times an owner's rows were copied back to its own buffers. */
  flushes: number;
}

export class CaptureLane {
  private owner: KvSession<LayerKv> | null = null;
  private readonly counters = { steps: 0, swaps: 0, flushes: 0 };

  private constructor(
    private readonly device: DeviceMemory,
    private readonly shape: LaneShape,
    private readonly sessions: OnnxSession[],
    /** hidden[i] feeds segment i; hidden[i + 1] is what it writes. */
    private readonly hidden: DeviceTensor[],
    private readonly seqlensK: DeviceTensor,
    private readonly totalLen: DeviceTensor,
    private readonly keys: DeviceTensor[],
    private readonly values: DeviceTensor[],
    private readonly segments: readonly LaneSegment[],
    /** Whether this lane may serve a session: false while `alive` says it ended. */
    private readonly alive: (s: KvSession<LayerKv>) => boolean,
  ) {}

  /** Device bytes the lane holds beyond the weights (its KV rows and small buffers): charged to the KV budget. */
  static bytes(shape: LaneShape, layers: number, segments: number): number {
    return 2 * layers * shape.kvHeads * shape.maxContext * shape.headDim * 4 + (segments + 1) * shape.hiddenSize * 4 + 8;
  }

  static async create(backend: OnnxBackend, shape: LaneShape, segments: readonly LaneSegment[], alive: (s: KvSession<LayerKv>) => boolean): Promise<CaptureLane> {
    const device = backend.device;
    if (!device) throw new TypeError('graph capture needs a device backend (WebGPU)');
    const made: DeviceTensor[] = [];
    const alloc = async (type: TensorType, dims: number[]) => {
      const t = await device.alloc(type, dims);
      made.push(t);
      return t;
    };
    const opened: OnnxSession[] = [];
    try {
      const { hiddenSize: h, kvHeads: KV, headDim: D, maxContext: C } = shape;
      const hidden: DeviceTensor[] = [];
      for (let i = 0; i <= segments.length; i++) hidden.push(await alloc('float32', [1, 1, h]));
      const seqlensK = await alloc('int32', [1]);
      const totalLen = await alloc('int32', [1]);
      const layers = segments[segments.length - 1]!.end - segments[0]!.start;
      const keys: DeviceTensor[] = [];
      const values: DeviceTensor[] = [];
      for (let i = 0; i < layers; i++) {
        keys.push(await alloc('float32', [1, KV, C, D]));
        values.push(await alloc('float32', [1, KV, C, D]));
      }
      for (const seg of segments) {
        const s = await backend.createSession(seg.bytes, { graphCapture: true, deviceOutputs: [FUSED_IO.hiddenOut] });
        opened.push(s);
      }
      return new CaptureLane(device, shape, opened, hidden, seqlensK, totalLen, keys, values, segments, alive);
    } catch (e) {
      await Promise.allSettled(opened.map((s) => s.release()));
      for (const t of made) t.dispose();
      throw e;
    }
  }

  stats(): CaptureStats {
    return { ...this.counters };
  }

  /** The device tensor a step's input hidden state goes into ([1, 1, hiddenSize]). */
  get input(): DeviceTensor {
    return this.hidden[0]!;
  }

  /**
   * One decode step of session `s` at `position` over every segment: the
   * input must already be in `input`. Returns the output hidden state
   * ([1, 1, hiddenSize]), a lane buffer: read it before the next step and
   * never dispose it.
   */
  async step(s: KvSession<LayerKv>, position: number): Promise<DeviceTensor> {
    if (position + 1 > this.shape.maxContext) throw new RangeError(`position ${position} is past the lane's ${this.shape.maxContext} positions`);
    this.take(s);
    this.device.write(this.seqlensK, Int32Array.of(position));
    this.device.write(this.totalLen, Int32Array.of(position + 1));
    for (let i = 0; i < this.sessions.length; i++) {
      const seg = this.segments[i]!;
      const feeds: Record<string, RunValue> = { [FUSED_IO.hidden]: this.hidden[i]!, [FUSED_IO.seqlensK]: this.seqlensK, [FUSED_IO.totalSeqLen]: this.totalLen, ...seg.weights };
      const outputs: Record<string, RunValue> = { [FUSED_IO.hiddenOut]: this.hidden[i + 1]! };
      for (let l = seg.start; l < seg.end; l++) {
        const k = this.keys[l - this.shape.startLayer]!;
        const v = this.values[l - this.shape.startLayer]!;
        feeds[FUSED_IO.pastKey(l)] = k;
        feeds[FUSED_IO.pastValue(l)] = v;
        outputs[FUSED_IO.presentKey(l)] = k;
        outputs[FUSED_IO.presentValue(l)] = v;
      }
      // The same tensors every run: onnxruntime bound them on the first and replays against them.
      await this.sessions[i]!.runWith(feeds, outputs);
    }
    this.counters.steps++;
    return this.hidden[this.sessions.length]!;
  }

  /** Session `s` is about to run uncaptured: if the lane holds its rows, they go back to its own buffers first. */
  release(s: KvSession<LayerKv>): void {
    if (this.owner === s) this.flush();
  }

  async dispose(): Promise<void> {
    this.owner = null;
    await Promise.all(this.sessions.map((s) => s.release()));
    for (const t of [...this.hidden, this.seqlensK, this.totalLen, ...this.keys, ...this.values]) t.dispose();
  }

  /** Makes `s` the lane's owner: the old owner's rows go home, `s`'s rows come in (device copies). */
  private take(s: KvSession<LayerKv>): void {
    if (this.owner === s) return;
    this.flush();
    this.copy(s, 'in');
    this.owner = s;
    this.counters.swaps++;
  }

  private flush(): void {
    const o = this.owner;
    this.owner = null;
    if (!o || !this.alive(o)) return; // ended or evicted: its buffers are gone, its rows with them
    this.copy(o, 'out');
    this.counters.flushes++;
  }

  /** Each layer's filled rows, head by head (the row stride differs: lane maxContext, session capacity). */
  private copy(s: KvSession<LayerKv>, dir: 'in' | 'out'): void {
    const { kvHeads: KV, headDim: D, maxContext: C } = this.shape;
    const cap = s.cache.capacity;
    const ops: { src: DeviceTensor; srcByte: number; dst: DeviceTensor; dstByte: number; bytes: number }[] = [];
    for (let i = 0; i < this.keys.length; i++) {
      const rows = Math.min(s.lengths[i]!, cap, C);
      if (rows <= 0) continue;
      for (const [lane, own] of [
        [this.keys[i]!, s.cache.keys[i] as DeviceTensor],
        [this.values[i]!, s.cache.values[i] as DeviceTensor],
      ] as const) {
        for (let h = 0; h < KV; h++) {
          const laneByte = h * C * D * 4;
          const ownByte = h * cap * D * 4;
          ops.push(dir === 'in' ? { src: own, srcByte: ownByte, dst: lane, dstByte: laneByte, bytes: rows * D * 4 } : { src: lane, srcByte: laneByte, dst: own, dstByte: ownByte, bytes: rows * D * 4 });
        }
      }
    }
    this.device.copy(ops);
  }
}
