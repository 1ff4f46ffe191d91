/**
 * The WebGPU backend the GPU suites (test/gpu) share: onnxruntime-web's
 * WebGPU EP on one Dawn device (SwiftShader here), made once per process.
 *
 * SwiftShader compiles every GPU program a graph needs the first time a
 * device runs it: tens of seconds for a first prefill or decode step, paid
 * again on every new device (`createOrtWebBackend` requests one each time)
 * but not for a second executor on the same one. vitest.config.ts runs the
 * suites that use this in shared processes (isolate: false), so a suite
 * after the first in a process finds the programs it shares with them
 * compiled. A suite that loses or destroys its device makes its own.
 *
 * Its info log (one line per GPU program run, node placements) goes to
 * ort-log-tap.ts, imported here before onnxruntime-web loads: dropped unless
 * a test taps it (and a test that taps clears what an earlier suite left).
 */
import { ortLog } from './ort-log-tap.ts';
import type { OnnxBackend } from '../../src/shard/backend.ts';
import type { NodeGpuInfo } from '../../src/host/node/webgpu.ts';

export const ORT_WASM_PATHS = new URL('../../node_modules/onnxruntime-web/dist/', import.meta.url).href;

let shared: Promise<{ backend: OnnxBackend; info: NodeGpuInfo }> | undefined;

/** The process's WebGPU backend (info log on) and what the adapter said about itself. */
export function sharedWebGpu(): Promise<{ backend: OnnxBackend; info: NodeGpuInfo }> {
  shared ??= (async () => {
    const { installNodeWebGpu } = await import('../../src/host/node/webgpu.ts');
    const { createOrtWebBackend } = await import('../../src/host/browser/onnx.ts');
    const { info } = await installNodeWebGpu();
    return { backend: await createOrtWebBackend('webgpu', { numThreads: 1, wasmPaths: ORT_WASM_PATHS, infoLog: true }), info };
  })();
  return shared;
}

export { ortLog };
