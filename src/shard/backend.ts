/**
 * The seam between the shard executor and an ONNX runtime. Hosts implement
 * it: src/cli/onnx-node.ts (onnxruntime-node), src/cli/onnx-wasm.ts
 * (onnxruntime-web's WASM backend), and workers/ for the browser. Tensors
 * cross it as plain typed arrays so src/shard never sees a runtime's classes.
 */

export type TensorType = 'float32' | 'float16' | 'int64';

/** float16 travels as raw IEEE half bits. */
export interface BackendTensor {
  readonly type: TensorType;
  readonly data: Float32Array | Uint16Array | BigInt64Array;
  readonly dims: readonly number[];
}

export interface BackendSessionOptions {
  /** Threads for one operator (CPU backends); the host's default when absent. */
  intraOpNumThreads?: number;
  /** Optimization level; 'all' unless a test needs the graph as written. */
  graphOptimizationLevel?: 'disabled' | 'basic' | 'extended' | 'all';
}

export interface OnnxSession {
  readonly inputNames: readonly string[];
  readonly outputNames: readonly string[];
  /**
   * Runs the graph. Input typed arrays may be views into larger buffers (a
   * KV-cache prefix); the backend must not keep them past the returned promise.
   */
  run(feeds: Readonly<Record<string, BackendTensor>>): Promise<Record<string, BackendTensor>>;
  release(): Promise<void>;
}

export interface OnnxBackend {
  /** e.g. "onnxruntime-node/cpu", "onnxruntime-web/wasm". */
  readonly name: string;
  /** The caller drops `model` after this resolves; the session must not depend on it. */
  createSession(model: Uint8Array, options?: BackendSessionOptions): Promise<OnnxSession>;
}
