/**
 * The seam between the shard executor and an ONNX runtime. Hosts implement
 * it: src/host/node/onnx.ts (onnxruntime-node), src/host/node/onnx-wasm.ts
 * (onnxruntime-web's WASM backend), and workers/ for the browser. Tensors
 * cross it as plain typed arrays so src/shard never sees a runtime's classes.
 */

/** uint8: 4-bit weights packed two to a byte (MatMulNBits), fed from device memory. */
export type TensorType = 'float32' | 'float16' | 'int64' | 'int32' | 'uint8';

/** float16 travels as raw IEEE half bits. */
export interface BackendTensor {
  readonly type: TensorType;
  readonly data: Float32Array | Uint16Array | BigInt64Array | Int32Array | Uint8Array;
  readonly dims: readonly number[];
}

/**
 * A tensor in the backend's device memory (a GPU buffer), opaque to
 * src/shard: fed to and written by sessions without crossing to the CPU.
 */
export interface DeviceTensor {
  readonly location: 'device';
  readonly type: TensorType;
  readonly dims: readonly number[];
  readonly byteLength: number;
  /** Copies it to the CPU (counted in `DeviceMemory.transfer.down`). */
  download(): Promise<BackendTensor['data']>;
  /** Frees the device memory; the tensor must not be used afterwards. */
  dispose(): void;
}

/** What a session takes and gives: host arrays or device tensors. */
export type RunValue = BackendTensor | DeviceTensor;

export function isDeviceTensor(v: RunValue): v is DeviceTensor {
  return (v as DeviceTensor).location === 'device';
}

/** A run value's elements on the host (downloaded from the device when they are there). */
export async function hostData(v: RunValue): Promise<BackendTensor['data']> {
  return isDeviceTensor(v) ? v.download() : v.data;
}

/** A backend's device memory (WebGPU buffers), for KV caches and activations kept off the CPU. */
export interface DeviceMemory {
  /**
   * Zero-filled device memory for a tensor. Rejects with a clear error when
   * the device cannot allocate it (callers then ask for less).
   */
  alloc(type: TensorType, dims: readonly number[]): Promise<DeviceTensor>;
  /** Uploads `data` at `byteOffset` of `dst` (counted in `transfer.up`). */
  write(dst: DeviceTensor, data: ArrayBufferView, byteOffset?: number): void;
  /** Device-side copies, submitted together, in order. */
  copy(ops: readonly { src: DeviceTensor; srcByte: number; dst: DeviceTensor; dstByte: number; bytes: number }[]): void;
  /** Bytes moved host→device and device→host through this seam so far (session feeds and outputs included). */
  readonly transfer: { up: number; down: number };
  /** Resolves with a reason when the device is lost; the backend is unusable afterwards. */
  readonly lost: Promise<string>;
}

export interface BackendSessionOptions {
  /** Threads for one operator (CPU backends); the host's default when absent. */
  intraOpNumThreads?: number;
  /** Optimization level; 'all' unless a test needs the graph as written. */
  graphOptimizationLevel?: 'disabled' | 'basic' | 'extended' | 'all';
  /** Outputs a device backend leaves in device memory instead of copying them to the CPU. */
  deviceOutputs?: readonly string[];
  /**
   * Record the session's GPU commands on its second run and replay them
   * afterwards (onnxruntime's graph capture): every input and output must
   * then be a device tensor, the same ones on every run, with fixed shapes.
   */
  graphCapture?: boolean;
}

export interface OnnxSession {
  readonly inputNames: readonly string[];
  readonly outputNames: readonly string[];
  /**
   * Runs the graph. Input typed arrays may be views into larger buffers (a
   * KV-cache prefix); the backend must not keep them past the returned promise.
   */
  run(feeds: Readonly<Record<string, BackendTensor>>): Promise<Record<string, BackendTensor>>;
  /**
   * `run` with device tensors and preallocated outputs: `outputs` names
   * tensors to write outputs into (the same objects come back); other
   * outputs are new, on the device when listed in `deviceOutputs`. One
   * tensor may be both a feed and an output (a KV cache written in place).
   */
  runWith(feeds: Readonly<Record<string, RunValue>>, outputs?: Readonly<Record<string, RunValue>>): Promise<Record<string, RunValue>>;
  release(): Promise<void>;
}

export interface OnnxBackend {
  /** e.g. "onnxruntime-node/cpu", "onnxruntime-web/wasm". */
  readonly name: string;
  /** The caller drops `model` after this resolves; the session must not depend on it. */
  createSession(model: Uint8Array, options?: BackendSessionOptions): Promise<OnnxSession>;
  /** Present on device backends (WebGPU). */
  readonly device?: DeviceMemory;
}
