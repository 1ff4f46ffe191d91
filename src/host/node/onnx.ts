/**
 * OnnxBackend over onnxruntime-node (CPU execution provider).
 */
import * as ort from 'onnxruntime-node';
import { trace } from '../../protocol/trace.ts';
import { isDeviceTensor, type BackendSessionOptions, type BackendTensor, type OnnxBackend, type OnnxSession, type RunValue } from '../../shard/backend.ts';

export interface NodeBackendOptions {
  /** Default threads per operator for sessions that do not say; ORT picks when absent. */
  intraOpNumThreads?: number;
}

/**
 * Every session owns its intra-op thread pool, and a shard holds one session
 * per layer: with ORT's default spin-waiting, a dozen idle pools burn the
 * cores the running layer needs (measured: 450 ms/token instead of ~10 on
 * two cores). Blocking waits cost a few microseconds per operator instead.
 */
const NO_SPIN = { session: { intra_op: { allow_spinning: '0' }, inter_op: { allow_spinning: '0' } } };

type OrtModule = typeof ort;

/**
 * Shared by the node and wasm adapters: both packages expose the same InferenceSession/Tensor API.
 * `bindsOutputs`: onnxruntime-node writes a preallocated output in place; onnxruntime-web does not
 * (it hands the caller's tensor back unwritten), so there ORT allocates outputs and they are copied.
 */
export function wrapSession(o: Pick<OrtModule, 'Tensor'>, session: ort.InferenceSession, bindsOutputs = true): OnnxSession {
  const host = (name: string, t: RunValue): BackendTensor => {
    if (isDeviceTensor(t)) throw new TypeError(`${name}: a CPU backend has no device tensors`);
    return t;
  };
  const tensor = (t: BackendTensor) => new o.Tensor(t.type, t.data, t.dims);
  const collect = (out: ort.InferenceSession.OnnxValueMapType, given: Readonly<Record<string, RunValue>> = {}) => {
    const result: Record<string, BackendTensor> = {};
    for (const [name, t] of Object.entries(out)) {
      result[name] = (given[name] as BackendTensor | undefined) ?? { type: t.type as BackendTensor['type'], data: t.data as BackendTensor['data'], dims: t.dims };
    }
    return result;
  };
  return {
    inputNames: session.inputNames,
    outputNames: session.outputNames,
    async run(feeds) {
      const input: Record<string, ort.Tensor> = {};
      for (const [name, t] of Object.entries(feeds)) input[name] = tensor(t);
      trace?.('ort');
      const out = await session.run(input);
      trace?.('ort-done');
      return collect(out);
    },
    async runWith(feeds, outputs) {
      const input: Record<string, ort.Tensor> = {};
      for (const [name, t] of Object.entries(feeds)) input[name] = tensor(host(name, t));
      if (!outputs) return collect(await session.run(input));
      // Every output is named: given ones are written in place, the rest allocated by ORT.
      const fetches: Record<string, ort.Tensor | null> = {};
      for (const name of session.outputNames) fetches[name] = outputs[name] && bindsOutputs ? tensor(host(name, outputs[name])) : null;
      const out = await session.run(input, fetches as ort.InferenceSession.FetchesType);
      if (!bindsOutputs) {
        for (const [name, given] of Object.entries(outputs)) {
          const g = host(name, given);
          const t = out[name];
          if (!t || t.data.length !== g.data.length) throw new RangeError(`${name}: ORT's output does not match the ${g.data.length}-value tensor given for it`);
          (g.data as Float32Array).set(t.data as Float32Array);
        }
      }
      return collect(out, outputs);
    },
    release: () => session.release(),
  };
}

export function ortSessionOptions(options: BackendSessionOptions | undefined, fallbackThreads: number | undefined): ort.InferenceSession.SessionOptions {
  const threads = options?.intraOpNumThreads ?? fallbackThreads;
  return {
    graphOptimizationLevel: options?.graphOptimizationLevel ?? 'all',
    ...(threads !== undefined ? { intraOpNumThreads: threads } : {}),
    interOpNumThreads: 1,
    executionMode: 'sequential',
  };
}

export function createNodeBackend(opts: NodeBackendOptions = {}): OnnxBackend {
  return {
    name: 'onnxruntime-node/cpu',
    async createSession(model, options) {
      const session = await ort.InferenceSession.create(model, { ...ortSessionOptions(options, opts.intraOpNumThreads), executionProviders: ['cpu'], extra: NO_SPIN });
      return wrapSession(ort, session);
    },
  };
}
