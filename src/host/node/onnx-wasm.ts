/**
 * OnnxBackend over onnxruntime-web's WASM backend, run inside Node.js: the
 * same kernels the browser node falls back to without WebGPU, measurable
 * next to onnxruntime-node in one process (bench/shard.ts).
 */
import * as ort from 'onnxruntime-web';
import type { OnnxBackend } from '../../shard/backend.ts';
import { ortSessionOptions, wrapSession } from './onnx.ts';

export interface WasmBackendOptions {
  /** WASM worker threads; set once per process, before the first session. */
  numThreads?: number;
}

export function createWasmBackend(opts: WasmBackendOptions = {}): OnnxBackend {
  if (opts.numThreads !== undefined) ort.env.wasm.numThreads = opts.numThreads;
  return {
    name: 'onnxruntime-web/wasm',
    async createSession(model, options) {
      // onnxruntime-web takes threads from env.wasm, not from session options.
      const { intraOpNumThreads: _ignored, ...rest } = ortSessionOptions(options, undefined);
      const session = await ort.InferenceSession.create(model, { ...rest, executionProviders: ['wasm'] });
      return wrapSession(ort as unknown as Parameters<typeof wrapSession>[0], session as unknown as Parameters<typeof wrapSession>[1], false);
    },
  };
}
