/**
 * What onnxruntime-web 1.30 needs from us for a graph-capture session whose
 * inputs and outputs are our own GPU buffers (src/shard/capture-lane.ts).
 *
 * onnxruntime-web hands a `gpu-buffer` tensor to the WASM side by
 * registering the GPUBuffer before each run (a handle, reference-counted
 * under a private symbol on the buffer object) and unregistering it after;
 * at a count of zero the handle is released. A captured session binds its
 * inputs and outputs on its first run only and keeps the handles of that
 * run. On later runs onnxruntime-web looks its bound outputs up by those
 * handles, which by then are released: "Cannot set properties of undefined"
 * as soon as the heap hands the handle's memory to another buffer (two
 * segments sharing a buffer were enough).
 *
 * So a buffer fed to a captured session is registered once for good: the
 * count is kept at NaN, the mark onnxruntime-web itself gives the outputs it
 * allocates (never unregistered). The handle then stays valid and the same
 * for every session and run. Those buffers (lane buffers and weights) live
 * as long as the executor.
 */
import type * as OrtTypes from 'onnxruntime-web';
import { ElemType, GraphBuilder } from '../../model/onnx-builder.ts';

type Ort = typeof OrtTypes;

const METADATA = 'gpuBufferMetadata';

/**
 * The private symbol onnxruntime-web registers GPU buffers under, read off
 * the output of a one-node session (outputs it allocates keep theirs).
 */
export async function bufferRegistrySymbol(ort: Ort, device: GPUDevice): Promise<symbol> {
  const g = new GraphBuilder('probe');
  g.input('x', ElemType.FLOAT, [4]);
  g.op1('Identity', ['x'], {}, 'y');
  g.output('y', ElemType.FLOAT, [4]);
  const session = await ort.InferenceSession.create(g.encode(), {
    executionProviders: [{ name: 'webgpu', device } as OrtTypes.InferenceSession.ExecutionProviderConfig],
    preferredOutputLocation: 'gpu-buffer',
  });
  try {
    const out = (await session.run({ x: new ort.Tensor('float32', new Float32Array(4), [4]) })).y!;
    const buffer = out.gpuBuffer as object;
    const sym = Object.getOwnPropertySymbols(buffer).find((s) => s.description === METADATA);
    out.dispose();
    if (!sym) throw new Error(`graph capture: this onnxruntime-web build registers GPU buffers differently from 1.30 (no ${METADATA} mark); leave graphCapture off`);
    return sym;
  } finally {
    await session.release();
  }
}

/** Keeps `buffer` registered with onnxruntime-web from its next registration on, under the same handle (see above). */
export function pinBuffer(buffer: GPUBuffer, sym: symbol): void {
  const holder = buffer as unknown as Record<symbol, unknown>;
  const desc = Object.getOwnPropertyDescriptor(holder, sym);
  if (desc?.get) return; // pinned already
  const current = desc?.value as [number, number] | undefined;
  let held: [number, number] | undefined = current ? [current[0], NaN] : undefined;
  Object.defineProperty(holder, sym, {
    configurable: true,
    get: () => held,
    // onnxruntime-web writes [handle, 1]; a NaN count never reaches zero, so it never unregisters.
    set: (v: [number, number]) => {
      held = [v[0], NaN];
    },
  });
}
