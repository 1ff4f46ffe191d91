/**
 * OnnxBackend over onnxruntime-web in a Web Worker: the plain WASM build
 * (CPU EP, threads) or `onnxruntime-web/webgpu`, the native WebGPU EP. The
 * default `onnxruntime-web` import would give the older JSEP WebGPU path,
 * which returns zeros for fp16 graphs on adapters without shader-f16.
 * Each build is imported on demand, so a WASM node never loads the 27 MB
 * WebGPU runtime.
 */
import type * as OrtTypes from 'onnxruntime-web';
import type { BackendTensor, OnnxBackend, OnnxSession } from '../shard/backend.ts';
import type { BackendKind } from './engine.ts';

type Ort = typeof OrtTypes;

export interface OrtWebOptions {
  /** WASM threads; takes effect before the build's first session only (ORT reads it once). */
  numThreads: number;
  /** Where ORT's runtime files (ort-wasm-simd-threaded*.{mjs,wasm}) are served. */
  wasmPaths: string;
}

const loaded = new Map<BackendKind, Promise<Ort>>();

/** Loads (once) the ORT build for `kind`, with its thread count and runtime location set. */
export function loadOrt(kind: BackendKind, opts: OrtWebOptions): Promise<Ort> {
  let p = loaded.get(kind);
  if (!p) {
    p = (kind === 'webgpu' ? import('onnxruntime-web/webgpu') : import('onnxruntime-web/wasm')).then((m) => {
      const ort = ((m as { default?: Ort }).default ?? m) as Ort;
      ort.env.wasm.wasmPaths = opts.wasmPaths;
      ort.env.wasm.numThreads = opts.numThreads;
      // Already in a worker: ORT's own proxy worker would only add a hop.
      ort.env.wasm.proxy = false;
      ort.env.logLevel = 'error';
      return ort;
    });
    loaded.set(kind, p);
    p.catch(() => loaded.delete(kind));
  }
  return p;
}

function wrap(ort: Ort, session: OrtTypes.InferenceSession): OnnxSession {
  return {
    inputNames: session.inputNames,
    outputNames: session.outputNames,
    async run(feeds) {
      const input: Record<string, OrtTypes.Tensor> = {};
      for (const [name, t] of Object.entries(feeds)) {
        // float16 travels as raw bits; ORT-web takes a Uint16Array for it.
        input[name] = new ort.Tensor(t.type, t.data as never, t.dims as number[]);
      }
      const out = await session.run(input);
      const result: Record<string, BackendTensor> = {};
      for (const [name, t] of Object.entries(out)) {
        // getData() downloads GPU-resident outputs; CPU outputs are returned as they are.
        const data = t.location === 'cpu' ? t.data : await t.getData(true);
        result[name] = { type: t.type as BackendTensor['type'], data: data as BackendTensor['data'], dims: t.dims };
      }
      return result;
    },
    release: () => session.release(),
  };
}

export async function createOrtWebBackend(kind: BackendKind, opts: OrtWebOptions): Promise<OnnxBackend> {
  const ort = await loadOrt(kind, opts);
  return {
    name: `onnxruntime-web/${kind}`,
    async createSession(model, options) {
      const session = await ort.InferenceSession.create(model, {
        executionProviders: [kind === 'webgpu' ? 'webgpu' : 'wasm'],
        graphOptimizationLevel: options?.graphOptimizationLevel ?? 'all',
        executionMode: 'sequential',
      });
      return wrap(ort, session);
    },
  };
}
