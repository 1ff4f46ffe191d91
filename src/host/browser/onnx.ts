/**
 * OnnxBackend over onnxruntime-web in a Web Worker: the plain WASM build
 * (CPU EP, threads) or `onnxruntime-web/webgpu`, the native WebGPU EP. The
 * default `onnxruntime-web` import would give the older JSEP WebGPU path,
 * which returns zeros for fp16 graphs on adapters without shader-f16.
 * Each build is imported on demand, so a WASM node never loads the 27 MB
 * WebGPU runtime.
 */
import type * as OrtTypes from 'onnxruntime-web';
import { isDeviceTensor, type BackendTensor, type DeviceMemory, type DeviceTensor, type OnnxBackend, type OnnxSession, type RunValue, type TensorType } from '../../shard/backend.ts';
import { MeshError } from '../../protocol/errors.ts';
import { trace } from '../../protocol/trace.ts';
import { requestOrtGpuDevice } from './webgpu.ts';
import { bufferRegistrySymbol, pinBuffer } from './onnx-capture.ts';
import type { BackendKind } from './engine.ts';

type Ort = typeof OrtTypes;

export interface OrtWebOptions {
  /** WASM threads; takes effect before the build's first session only (ORT reads it once). */
  numThreads: number;
  /** Where ORT's runtime files (ort-wasm-simd-threaded*.{mjs,wasm}) are served. */
  wasmPaths: string;
  /**
   * ORT's info-level log (one "Starting program" line per GPU program run,
   * node placements at session creation), to the console; tests count
   * programs with it.
   */
  infoLog?: boolean;
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

type OrtTensor = OrtTypes.Tensor;

/** A GPU buffer we own, seen by ORT as a `gpu-buffer` tensor. */
interface GpuDeviceTensor extends DeviceTensor {
  readonly buffer: GPUBuffer;
  readonly tensor: OrtTensor;
}

const BYTES: Record<TensorType, number> = { float32: 4, float16: 2, int64: 8, int32: 4, uint8: 1 };

/**
 * Thrown when the GPU cannot allocate a buffer (a KV cache growing, a span's
 * buffers): a MeshError, so the request it happens in is answered 507 with
 * this message instead of failing as an internal error.
 */
export class DeviceAllocationError extends MeshError {
  constructor(
    readonly bytes: number,
    reason: string,
  ) {
    super('MESH_ERR_DEVICE_MEMORY', `the GPU could not allocate ${bytes} bytes: ${reason}`, { bytes });
  }
}

/** Device memory on the GPUDevice onnxruntime's WebGPU EP uses, counting every byte that crosses to or from it. */
class WebGpuMemory implements DeviceMemory {
  readonly transfer = { up: 0, down: 0 };
  readonly lost: Promise<string>;

  constructor(
    private readonly ort: Ort,
    readonly device: GPUDevice,
  ) {
    this.lost = device.lost.then((info) => `${info.reason ?? 'unknown'}: ${info.message}`);
  }

  async alloc(type: TensorType, dims: readonly number[]): Promise<GpuDeviceTensor> {
    const byteLength = dims.reduce((a, b) => a * b, 1) * BYTES[type];
    // WebGPU sizes are multiples of 4; zero-size buffers are valid but ORT wants a real binding.
    const size = Math.max(4, Math.ceil(byteLength / 4) * 4);
    if (size > this.device.limits.maxBufferSize) throw new DeviceAllocationError(size, `over the adapter's maxBufferSize of ${this.device.limits.maxBufferSize}`);
    this.device.pushErrorScope('out-of-memory');
    this.device.pushErrorScope('validation');
    const buffer = this.device.createBuffer({ size, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST });
    const invalid = await this.device.popErrorScope();
    const oom = await this.device.popErrorScope();
    if (oom || invalid) {
      buffer.destroy();
      throw new DeviceAllocationError(size, (oom ?? invalid)!.message);
    }
    return this.wrapBuffer(buffer, type, dims, byteLength, true);
  }

  wrapBuffer(buffer: GPUBuffer, type: TensorType, dims: readonly number[], byteLength: number, owned: boolean, ortTensor?: OrtTensor): GpuDeviceTensor {
    const tensor = ortTensor ?? this.ort.Tensor.fromGpuBuffer(buffer, { dataType: type as 'float32', dims: dims as number[] });
    return {
      location: 'device',
      type,
      dims,
      byteLength,
      buffer,
      tensor,
      download: () => this.download(buffer, type, byteLength),
      dispose: () => {
        if (owned) buffer.destroy();
        else tensor.dispose();
      },
    };
  }

  write(dst: DeviceTensor, data: ArrayBufferView, byteOffset = 0): void {
    // As bytes: writeBuffer counts a typed array's offset and size in its elements.
    const bytes = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
    this.device.queue.writeBuffer((dst as GpuDeviceTensor).buffer, byteOffset, bytes, 0, bytes.byteLength);
    this.transfer.up += data.byteLength;
  }

  copy(ops: readonly { src: DeviceTensor; srcByte: number; dst: DeviceTensor; dstByte: number; bytes: number }[]): void {
    if (ops.length === 0) return;
    const enc = this.device.createCommandEncoder();
    for (const o of ops) enc.copyBufferToBuffer((o.src as GpuDeviceTensor).buffer, o.srcByte, (o.dst as GpuDeviceTensor).buffer, o.dstByte, o.bytes);
    this.device.queue.submit([enc.finish()]);
  }

  private async download(buffer: GPUBuffer, type: TensorType, byteLength: number): Promise<BackendTensor['data']> {
    const size = Math.max(4, Math.ceil(byteLength / 4) * 4);
    const staging = this.device.createBuffer({ size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    try {
      const enc = this.device.createCommandEncoder();
      enc.copyBufferToBuffer(buffer, 0, staging, 0, size);
      this.device.queue.submit([enc.finish()]);
      await staging.mapAsync(GPUMapMode.READ);
      const bytes = staging.getMappedRange().slice(0, byteLength);
      this.transfer.down += byteLength;
      return typedArray(type, bytes);
    } finally {
      staging.destroy();
    }
  }
}

function typedArray(type: TensorType, bytes: ArrayBuffer): BackendTensor['data'] {
  switch (type) {
    case 'float32':
      return new Float32Array(bytes);
    case 'float16':
      return new Uint16Array(bytes);
    case 'int64':
      return new BigInt64Array(bytes);
    case 'int32':
      return new Int32Array(bytes);
    case 'uint8':
      return new Uint8Array(bytes);
  }
}

function hostBytes(t: BackendTensor): number {
  return t.data.byteLength;
}

/** `captureSymbol`: the session records its graph; its device buffers are pinned (onnx-capture.ts). */
function wrap(ort: Ort, session: OrtTypes.InferenceSession, memory: WebGpuMemory | null, captureSymbol: symbol | null = null): OnnxSession {
  const toOrt = (t: RunValue): OrtTensor => {
    if (isDeviceTensor(t)) {
      if (!memory) throw new TypeError('a WASM session has no device tensors');
      if (captureSymbol) pinBuffer((t as GpuDeviceTensor).buffer, captureSymbol);
      return (t as GpuDeviceTensor).tensor;
    }
    // float16 travels as raw bits; ORT-web takes a Uint16Array for it.
    if (memory) memory.transfer.up += hostBytes(t);
    return new ort.Tensor(t.type, t.data as never, t.dims as number[]);
  };
  const fromOrt = async (t: OrtTensor): Promise<RunValue> => {
    if (t.location === 'gpu-buffer' && memory) {
      const dims = t.dims;
      const bytes = dims.reduce((a, b) => a * b, 1) * BYTES[t.type as TensorType];
      return memory.wrapBuffer(t.gpuBuffer as GPUBuffer, t.type as TensorType, dims, bytes, false, t);
    }
    // getData() downloads GPU-resident outputs; CPU outputs are returned as they are.
    const data = t.location === 'cpu' ? t.data : await t.getData(true);
    if (memory) memory.transfer.down += (data as ArrayBufferView).byteLength;
    return { type: t.type as TensorType, data: data as BackendTensor['data'], dims: t.dims };
  };
  const runWith = async (feeds: Readonly<Record<string, RunValue>>, outputs?: Readonly<Record<string, RunValue>>): Promise<Record<string, RunValue>> => {
    const input: Record<string, OrtTensor> = {};
    for (const [name, t] of Object.entries(feeds)) input[name] = toOrt(t);
    let out: OrtTypes.InferenceSession.OnnxValueMapType;
    if (outputs) {
      const fetches: Record<string, OrtTensor | null> = {};
      // Only device outputs are bound: onnxruntime-web never writes a preallocated CPU output back
      // (it returns the caller's tensor untouched, so a KV cache written "in place" kept nothing),
      // so host ones are allocated by ORT and copied into the caller's array below.
      for (const name of session.outputNames) {
        const given = outputs[name];
        fetches[name] = given && isDeviceTensor(given) ? toOrt(given) : null;
      }
      trace?.('ort');
      out = await session.run(input, fetches as OrtTypes.InferenceSession.FetchesType);
    } else {
      trace?.('ort');
      out = await session.run(input);
    }
    trace?.('ort-done');
    const result: Record<string, RunValue> = {};
    for (const [name, t] of Object.entries(out)) {
      const given = outputs?.[name];
      if (given) {
        // A host tensor given as output: ORT allocated it; bring the values into the caller's array.
        if (!isDeviceTensor(given) && t.data !== given.data) {
          const data = (t.location === 'cpu' ? t.data : await t.getData(true)) as Float32Array;
          if (data.length !== given.data.length) throw new RangeError(`${name}: ${data.length} values for a ${given.data.length}-value output`);
          (given.data as Float32Array).set(data);
          if (memory) memory.transfer.down += given.data.byteLength;
        }
        // A captured session answers with a new tensor over the bound buffer: free that wrapper, not the buffer.
        if (isDeviceTensor(given) && t !== (given as GpuDeviceTensor).tensor && t.location === 'gpu-buffer') t.dispose();
        result[name] = given;
      } else result[name] = await fromOrt(t);
    }
    return result;
  };
  return {
    inputNames: session.inputNames,
    outputNames: session.outputNames,
    async run(feeds) {
      const out = await runWith(feeds);
      for (const [name, t] of Object.entries(out)) {
        if (isDeviceTensor(t)) {
          out[name] = { type: t.type, data: await t.download(), dims: t.dims };
          t.dispose();
        }
      }
      return out as Record<string, BackendTensor>;
    },
    runWith,
    release: () => session.release(),
  };
}

export async function createOrtWebBackend(kind: BackendKind, opts: OrtWebOptions): Promise<OnnxBackend> {
  const ort = await loadOrt(kind, opts);
  // Our own device (webgpu.ts says why), shared by every session; the EP never drops it.
  const gpu = kind === 'webgpu' ? await requestOrtGpuDevice(navigator.gpu) : null;
  const memory = gpu ? new WebGpuMemory(ort, gpu.device) : null;
  let captureSymbol: Promise<symbol> | null = null;
  const backend: { -readonly [K in keyof OnnxBackend]: OnnxBackend[K] } = {
    name: `onnxruntime-web/${kind}`,
    async createSession(model, options) {
      const device = options?.deviceOutputs ?? [];
      const session = await ort.InferenceSession.create(model, {
        // The object form: the EP reads enableGraphCapture only when its options are an object.
        executionProviders: [gpu ? ({ name: 'webgpu', device: gpu.device } as OrtTypes.InferenceSession.ExecutionProviderConfig) : 'wasm'],
        graphOptimizationLevel: options?.graphOptimizationLevel ?? 'all',
        executionMode: 'sequential',
        ...(opts.infoLog ? { logSeverityLevel: 1 as const, logVerbosityLevel: 0 } : {}),
        // A captured session keeps every output on the GPU (onnxruntime-web refuses anything else).
        ...(kind === 'webgpu' && options?.graphCapture ? { preferredOutputLocation: 'gpu-buffer' as const } : kind === 'webgpu' && device.length > 0 ? { preferredOutputLocation: Object.fromEntries(device.map((n) => [n, 'gpu-buffer' as const])) } : {}),
        ...(kind === 'webgpu' && options?.graphCapture ? { enableGraphCapture: true } : {}),
      });
      if (gpu && options?.graphCapture) captureSymbol ??= bufferRegistrySymbol(ort, gpu.device);
      return wrap(ort, session, memory, gpu && options?.graphCapture ? await captureSymbol : null);
    },
  };
  if (memory) backend.device = memory;
  return backend;
}
