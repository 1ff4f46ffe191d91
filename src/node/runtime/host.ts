/**
 * What a host gives the node runtime: the adapter contract. Everything in
 * src/node/runtime runs on any host; a host (src/host/node, src/host/browser)
 * brings only these.
 *
 *   fetch, WebSocket        the network (model files, tracker; relay, /rpc, links)
 *   keys                    where the Ed25519 identity lives (a file, IndexedDB)
 *   weights                 a span's tensors: read by Range, or downloaded into storage first
 *   backends                the ONNX backend for a span (onnxruntime-node; WebGPU or WASM, calibrated)
 *   log                     the host's logger
 *
 * and, where the host has them, a leaner direct HTTP, direct links and a way
 * to see a refused WebSocket handshake's status.
 */
import type { ModelConfig } from '../../model/config.ts';
import type { ModelTokenizer } from '../../model/tokenizer.ts';
import type { Dtype } from '../../protocol/tensor.ts';
import type { OnnxBackend } from '../../shard/backend.ts';
import type { WeightFormat } from '../../model/weight-format.ts';
import type { WeightLoader } from '../../shard/contract.ts';
import type { Q4Cache } from '../../shard/fused-executor.ts';
import type { SpanGraphs } from '../../shard/span-executor.ts';
import type { SpanExecutor } from '../../shard/contract.ts';
import type { Identity, KeyStore } from '../../net/identity.ts';
import type { DirectRequest, LinkDialer } from '../../net/contract.ts';
import type { HandshakeWatcher } from '../../net/relay-hop.ts';
import type { WebSocketConstructor } from '../../net/socket.ts';
import type { RtcFactory } from '../../net/rtc-peer.ts';

/** One span of one model: the tracker's assignment, or a host's static span. */
export interface SpanSpec {
  /** Model id (the tracker's name). */
  model: string;
  /** Base URL of the checkpoint, ending with `/`. */
  modelUrl: string;
  startLayer: number;
  /** Exclusive. */
  endLayer: number;
  /**
   * Wire dtype of activations between hops (the tracker's assignment, or the
   * node's --wire-dtype for a static span): as a head it sends it, as a hop it
   * accepts only it. Absent: sends bf16, accepts all three.
   */
  wireDtype?: Dtype;
}

export interface DownloadProgress {
  loadedBytes: number;
  totalBytes: number;
}

/** The span's tensors, ready for the executor. */
export interface SpanWeightsHandle {
  loader: WeightLoader;
  /** Bytes received from the model host for this span (0 when all was stored). */
  fetchedBytes: number;
  /** Bytes of the span the host keeps (0 for a host that keeps nothing). */
  storedBytes: number;
  /** Where 4-bit projections are kept across loads (IndexedDB in the browser); absent: quantized on every load. */
  q4Cache?: Q4Cache;
}

export interface WeightStore {
  /** The model's config.json, parsed JSON (a host may keep it). */
  config(modelUrl: string): Promise<unknown>;
  /** The span's weights: fetch what is missing (reporting progress), drop what no span needs. */
  open(span: SpanSpec, config: ModelConfig, onProgress: (p: DownloadProgress) => void): Promise<SpanWeightsHandle>;
  /** The tokenizer of a head (eos ids from the config added); undefined: none (the node then cannot head). */
  tokenizer(modelUrl: string, config: ModelConfig): Promise<ModelTokenizer | undefined>;
}

/** What the host chose to run a span on, as the page and /info show it. */
export interface BackendInfo {
  /** The runtime's name, e.g. "onnxruntime-node/cpu", "onnxruntime-web/webgpu" (/info). */
  name: string;
  /** Short kind for the tracker's registration info: "onnxruntime-node", "webgpu", "wasm". */
  kind: string;
  /** Graph dtype. */
  dtype: 'f32' | 'f16';
  /** The format the span's weights are held in (the tracker sizes spans by it). Absent: f32. */
  weights?: WeightFormat;
  /** Host-specific details (kind, adapter, threads, why this one), shown as they are. */
  details?: Record<string, unknown>;
}

export interface ChosenBackend {
  backend: OnnxBackend;
  info: BackendInfo;
  /** Which graphs run the span; absent: the plain graphs in `info.dtype`. */
  graphs?: SpanGraphs;
}

/**
 * Why a span is being built again on the same layers: the GPU device it ran
 * on was lost (device-recovery.ts). `losses` counts the losses (and failed
 * rebuilds) of this span so far: a host tries a fresh GPU device first, and
 * falls back to the CPU (WASM, onnxruntime-node) after that.
 */
export interface DeviceLoss {
  reason: string;
  losses: number;
}

export interface BackendFactory {
  /** The backend for a span; may calibrate on the span's own weights first. `lost`: a rebuild after the device was lost. */
  choose(span: SpanSpec, config: ModelConfig, weights: WeightLoader, lost?: DeviceLoss): Promise<ChosenBackend>;
  /** After the executor is built, before it serves (a WASM warm-up); a failure here is only logged. */
  prepare?(executor: SpanExecutor, chosen: ChosenBackend): Promise<void>;
}

export type LogLevel = 'debug' | 'info' | 'warn' | 'error';

export interface RuntimeHost {
  /** What the node calls its host in registration info and /info. */
  readonly name: 'node' | 'browser';
  readonly fetch: typeof fetch;
  readonly WebSocket: WebSocketConstructor;
  readonly keys: KeyStore;
  readonly weights: WeightStore;
  readonly backends: BackendFactory;
  log(level: LogLevel, message: string): void;
  /** Direct HTTP to a hop's endpoint; absent: fetch. */
  readonly direct?: DirectRequest;
  /** Direct links to hops' endpoints, dialled with this node's identity. */
  links?(identity: Identity): LinkDialer;
  /** Sees a refused `/rpc` handshake's status (`ws` can, a browser cannot). */
  readonly watchHandshake?: HandshakeWatcher;
  /**
   * Wrappers around what a span is built from and runs on. No host sets them: only test code does,
   * through startNodeHost's programmatic options, to make a node that lies (docs/verification.md).
   */
  readonly spanHooks?: SpanHooks;
  /** WebRTC peer connections (a browser page's): hops between two such nodes go over data channels, signalled over the relay. */
  readonly rtc?: RtcFactory;
}

export interface SpanHooks {
  weights?(loader: WeightLoader, spec: SpanSpec): WeightLoader;
  executor?(executor: SpanExecutor, spec: SpanSpec): SpanExecutor;
}
