/**
 * The donor page's view of a browser node: one interface whether the node
 * runs in a Web Worker (workers/node.worker.ts, reached through Comlink) or
 * in the page itself (tests). src/app depends on this and nothing else, so
 * the page never touches `Worker` (web-llm's MLCEngineInterface pattern).
 */
import type { MeshErrorCode } from '../../protocol/errors.ts';

/** Where the node is in its life (one state machine on every host); the page shows one badge per state. */
export { NodeState } from '../../node/runtime/state.ts';
import type { NodeState } from '../../node/runtime/state.ts';

export type BackendKind = 'wasm' | 'webgpu';
export type BackendChoice = BackendKind | 'auto';
export type { WeightFormat } from '../../model/weight-format.ts';
import type { WeightFormat } from '../../model/weight-format.ts';

/**
 * The weight format when the page does not say: f32. Every node of a mesh
 * then computes the same function as the float64 reference and as the
 * Node.js nodes (onnxruntime-node, f32): a route's answer does not depend on
 * which nodes it crossed. 4-bit (`?weights=q4`) holds ~6.4x more layers in
 * the same budget and decodes faster on WASM, at a measured fidelity cost
 * (docs/benchmarks.md): the operator's choice, per mesh.
 */
export const DEFAULT_WEIGHT_FORMAT: WeightFormat = 'f32';

/**
 * What the page asks the node to serve: a fixed span from the URL, or, with
 * `trackerUrl`, whatever span the tracker assigns (then modelUrl and the
 * layers are not needed: the assignment carries them).
 */
export interface NodeConfig {
  /** ws(s)://RELAY/ws — or the relay's base URL; `/ws` is appended when missing. */
  relayUrl: string;
  /** Tracker base URL: register (signed with the relay identity), heartbeat, serve the assigned span. */
  trackerUrl?: string;
  /** The model's id at the tracker. Absent: the tracker's first model. */
  modelName?: string;
  /** Base URL of a Hugging Face layout model (config.json, *.safetensors). Required without a tracker. */
  modelUrl?: string;
  /** First layer held. Required without a tracker. */
  startLayer?: number;
  /** Layer to stop before (exclusive). Required without a tracker. */
  endLayer?: number;
  /** 'auto' calibrates WebGPU against WASM; the others force one. Absent: the stored setting, else 'auto'. */
  backend?: BackendChoice;
  /** WASM threads; default min(4, hardwareConcurrency - 1), 1 without cross-origin isolation. */
  threads?: number;
  /** KV-cache memory budget in bytes. Absent: the stored setting, else 256 MiB. */
  memoryBudgetBytes?: number;
  /** How the span's weights are held: f32, f16 (WebGPU with shader-f16) or q4 (4-bit). Absent: the stored setting, else DEFAULT_WEIGHT_FORMAT. */
  weights?: WeightFormat;
  /** As a head: chain (each hop pushes to the next, the last answers the head) or star (every hop answers the head). Absent: chain. Not stored: a URL setting for tests and benchmarks. */
  hopMode?: 'chain' | 'star';
  /** Test hook: the k-th GPU backend destroys its device before its N-th session run (gpu-test-hooks.ts). Not stored. */
  testLoseGpuAfterRuns?: number[];
  /** Hops to other pages over WebRTC data channels (signalled over the relay). Absent: on, where the page gave the worker its peer connections. */
  rtc?: boolean;
  /** STUN/TURN servers for the data channels (pages behind NATs). Absent: none (host candidates only). */
  iceServers?: Array<{ urls: string }>;
  /** 'relay': ICE through TURN servers only (the page's addresses are never offered). Absent: 'all'. */
  icePolicy?: 'relay';
  /** Benches: every message a data channel receives is held this long (a WAN leg's one-way delay), ms. */
  rtcDelayMs?: number;
}

export interface NodeErrorInfo {
  /** Stable code (docs/protocol.md §6): the page's own (MESH_ERR_QUOTA, MESH_ERR_MODEL_FETCH, …) are there too. */
  code: MeshErrorCode;
  message: string;
  /** What the donor can do about it, in one sentence. */
  action: string;
  /** True when pressing Retry may help (the node keeps its stored weights). */
  retryable: boolean;
}

export interface BackendInfo {
  kind: BackendKind;
  /** Adapter description (vendor / architecture) or "CPU (WASM)". */
  adapter: string;
  /** WASM threads in use (1 for WebGPU's CPU fallback ops). */
  threads: number;
  fp16: boolean;
  /** Why this backend: forced, calibration numbers, or why WebGPU was not usable. */
  reason: string;
  /** The weight format the span runs on (what was asked, unless `precision` says why not). */
  weights: WeightFormat;
  /** The graphs: fused operators (the GPU path; 4-bit on WASM) or plain operators, and why plain when they are. */
  graphs: 'fused' | 'plain';
  /** Activation precision and why: "f16 (shader-f16)", or "f32: the adapter has no shader-f16", … */
  precision: string;
}

export interface NodeStatus {
  state: NodeState;
  error?: NodeErrorInfo;
  peerId?: string;
  relayUrl?: string;
  /** With a tracker: its URL, whether it accepted this node, and the span it assigned (null: nothing fits the budget). */
  tracker?: { url: string; registered: boolean; assignment: { startLayer: number; endLayer: number } | null | undefined };
  /** Downloading: bytes of the span's weights present (stored + this session) / needed. */
  download?: { loadedBytes: number; totalBytes: number };
  backend?: BackendInfo;
  /** `holdsHead`: holds the last layer and the LM head; `pipelineHead`: holds layer 0 and the tokenizer, so it serves POST /generate. */
  model?: { baseUrl: string; name: string; numLayers: number; startLayer: number; endLayer: number; holdsHead: boolean; pipelineHead?: boolean };
  /** Weight bytes kept in IndexedDB for the span. */
  storedBytes: number;
  /** Weight bytes fetched from the model server since the worker started (0 after a reload that found everything stored). */
  fetchedBytes: number;
  /** 4-bit projections quantized in this worker, and read back from IndexedDB instead (0 quantized after a reload). */
  quantization: { quantized: number; loaded: number; quantizeMs: number };
  requestsServed: number;
  tokensServed: number;
  requestsPerMinute: number;
  /** Tokens per second, one value per second, oldest first (the sparkline). */
  throughput: number[];
  /** Time in the node of the last 64 served /forward calls, ms, oldest first (no network). */
  recentForwardMs: number[];
  /** Live inference sessions (KV caches) and the bytes of KV room they hold. */
  sessions: number;
  kvBytes: number;
  /** The KV caches' share of the budget: what the span's weights leave of it (the whole budget before a span loads). */
  kvBudgetBytes: number;
  /** The donor's memory budget: the span's weights plus the KV caches. */
  memoryBudgetBytes: number;
  /** Whether the page is cross-origin isolated (WASM threads need it). */
  crossOriginIsolated: boolean;
  /** The donor's choices, as stored in IndexedDB. */
  donor: DonorSettings;
  /** Draining: no new sessions (paused, off the charger, the page frozen or closing); the ones in flight finish within the grace. */
  drain?: { reasons: Array<'donor' | 'battery' | 'frozen' | 'leaving'>; graceLeftMs: number; done: boolean };
  /** What this browser has given, all time (kept in IndexedDB across reloads), and the layers it holds now. */
  contribution: { tokensServed: number; servingMs: number; since: number | undefined; layersHeld: number };
  /** Last known power source (the page reads the battery; the worker cannot). undefined: not known (no Battery Status API). */
  onBattery?: boolean;
}

/** Choices the donor makes on the page; the node keeps them in IndexedDB. */
export interface DonorSettings {
  /** Paused by the donor (kept across reloads: a paused tab stays paused). */
  paused: boolean;
  /** The share of the device's time given, 0.05..1. */
  dutyCycle: number;
  /** Donate only while the device is charging (off by default). */
  chargingOnly: boolean;
  /** The donor asked the browser to keep the shard (navigator.storage.persist()). */
  keepShard: boolean;
}

/** The page's lifecycle (src/app/lifecycle.ts): the page is being frozen or closed, or is back. */
export type PageLifecycleEvent = 'frozen' | 'resumed' | 'leaving';

/** A draining heartbeat the worker signed in advance; the page sends it with sendBeacon when it is frozen or closed. */
export interface DrainBeacon {
  url: string;
  body: string;
}

/** Every call may reject with an Error carrying `code` (kept across the worker boundary). */
export interface NodeEngine {
  /** Start (or restart with a new config): storage, backend, weights, relay. Resolves once the attempt settled (serving or error). */
  start(config: NodeConfig): Promise<NodeStatus>;
  /** Retry after an error with the last config; stored weights are kept. */
  retry(): Promise<NodeStatus>;
  pause(): Promise<void>;
  resume(): Promise<void>;
  setMemoryBudget(bytes: number): Promise<void>;
  /** The donor's choices (each kept in IndexedDB): a duty cycle applies at once, charging only drains while on battery. */
  setDonor(patch: Partial<Omit<DonorSettings, 'paused'>>): Promise<void>;
  /** The page read the battery: on the charger or not. */
  setPower(charging: boolean): Promise<void>;
  /** The page's lifecycle: drain when frozen or closing, heartbeat at once and serve when back. */
  lifecycle(event: PageLifecycleEvent): Promise<void>;
  /** `sink` gets every new signed drain beacon (a Comlink proxy across the worker boundary). */
  onDrainBeacon(sink: (b: DrainBeacon) => void): Promise<void>;
  status(): Promise<NodeStatus>;
  /** Close the relay connection and release sessions; the node can be started again. */
  stop(): Promise<void>;
  /**
   * The page's end of the peer connections (rtc-page.ts serves it): before
   * start(), so the node can open data channels to other pages. Without it
   * every hop goes by the relay.
   */
  attachPeerConnections(port: MessagePort): Promise<void>;
  /** Tests: close the node's data channels now (its hops go by the relay until they are dialled again). */
  closeDataChannels(): Promise<void>;
  /**
   * Benches: `true` starts stamping each stage of every step in this worker
   * (src/protocol/trace.ts; off by default), `false` stops; either hands over
   * the stamps taken since the last call, on the clock every page shares
   * (`performance.timeOrigin + performance.now()`, ms).
   */
  trace(on: boolean): Promise<TraceStampRow[]>;
}

/** One stamp: when (ms since the epoch), the stage, and the step's session and position when known there. */
export type TraceStampRow = [t: number, stage: string, session?: string, position?: string | number];
