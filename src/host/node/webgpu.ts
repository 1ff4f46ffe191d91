/**
 * WebGPU in Node.js through Dawn (the `webgpu` npm package: dawn.node, the
 * engine inside Chrome), so `onnxruntime-web/webgpu` runs outside a browser:
 * the vitest GPU suite on SwiftShader here, bench/gpu.ts on a real GPU.
 *
 * Two gaps between Node 20 and a browser worker are closed here, before
 * onnxruntime-web loads:
 * - Node 20 has no `navigator`; onnxruntime-web reads `navigator.gpu`.
 * - dawn.node rejects (or crashes on) `GPUQueue.writeBuffer` with a view of a
 *   SharedArrayBuffer, which is what onnxruntime's threaded WASM heap hands
 *   it; browsers accept those. Such writes are copied through one reused
 *   ordinary buffer.
 *
 * The Vulkan loader must be found by the dynamic linker when dawn.node loads,
 * which only LD_LIBRARY_PATH set before the process starts can change:
 * `vulkanEnv()` says what to set (Debian's chromium ships a loader and
 * SwiftShader's Vulkan driver in /usr/lib/chromium).
 */
import { existsSync } from 'node:fs';
import { createRequire } from 'node:module';
import { availableParallelism } from 'node:os';

export const CHROMIUM_LIB_DIR = '/usr/lib/chromium';
const SWIFTSHADER_ICD = `${CHROMIUM_LIB_DIR}/vk_swiftshader_icd.json`;
const SYSTEM_LOADERS = ['/usr/lib/x86_64-linux-gnu/libvulkan.so.1', '/usr/lib/aarch64-linux-gnu/libvulkan.so.1', '/usr/lib64/libvulkan.so.1', '/usr/lib/libvulkan.so.1'];

/**
 * Environment a child process needs for Dawn to find Vulkan: the system
 * loader when there is one, else chromium's; SwiftShader as the driver when
 * `software` (or when no other ICD is configured and no GPU driver exists).
 */
export function vulkanEnv(base: NodeJS.ProcessEnv = process.env, opts: { software?: boolean } = {}): Record<string, string> {
  const env: Record<string, string> = {};
  const hasSystemLoader = SYSTEM_LOADERS.some((p) => existsSync(p));
  if (!hasSystemLoader && existsSync(`${CHROMIUM_LIB_DIR}/libvulkan.so.1`)) {
    const cur = base.LD_LIBRARY_PATH ?? '';
    if (!cur.split(':').includes(CHROMIUM_LIB_DIR)) env.LD_LIBRARY_PATH = cur ? `${CHROMIUM_LIB_DIR}:${cur}` : CHROMIUM_LIB_DIR;
  }
  if ((opts.software ?? base.VK_ICD_FILENAMES === undefined) && existsSync(SWIFTSHADER_ICD) && base.VK_ICD_FILENAMES === undefined) {
    env.VK_ICD_FILENAMES = SWIFTSHADER_ICD;
  }
  return env;
}

/** What the adapter said about itself, for logs and result files. */
export interface NodeGpuInfo {
  vendor: string;
  architecture: string;
  device: string;
  description: string;
  isFallbackAdapter: boolean;
  features: string[];
  /** maxBufferSize / maxStorageBufferBindingSize of the adapter, bytes. */
  maxBufferSize: number;
  maxStorageBufferBindingSize: number;
}

interface DawnModule {
  create(flags: string[]): GPU;
  globals: Record<string, unknown>;
}

let installed: { gpu: GPU; info: NodeGpuInfo } | null = null;

/**
 * Installs `navigator.gpu` (and the WebGPU classes as globals) from dawn.node.
 * Idempotent. `dawnPath` loads a dawn.node from elsewhere (the packed GPU
 * bench ships its own); `flags` are Dawn toggles such as
 * `enable-dawn-features=allow_unsafe_apis`.
 */
export async function installNodeWebGpu(opts: { dawnPath?: string; flags?: string[] } = {}): Promise<{ gpu: GPU; info: NodeGpuInfo }> {
  if (installed) return installed;
  let dawn: DawnModule;
  if (opts.dawnPath) {
    const require = createRequire(import.meta.url);
    dawn = require(opts.dawnPath) as DawnModule;
  } else {
    dawn = (await import('webgpu')) as unknown as DawnModule;
  }
  for (const [k, v] of Object.entries(dawn.globals)) {
    if (!(k in globalThis)) Object.defineProperty(globalThis, k, { value: v, writable: true, configurable: true });
  }
  const gpu = dawn.create(opts.flags ?? []);
  const nav = (globalThis as unknown as { navigator?: object }).navigator;
  if (nav && typeof nav === 'object') {
    Object.defineProperty(nav, 'gpu', { value: gpu, configurable: true });
  } else {
    Object.defineProperty(globalThis, 'navigator', {
      value: { gpu, hardwareConcurrency: availableParallelism(), userAgent: `Node.js/${process.version}`, language: 'en-US' },
      configurable: true,
      writable: true,
    });
  }
  patchWriteBuffer(dawn.globals.GPUQueue as { prototype: GPUQueue } | undefined);

  const adapter = await gpu.requestAdapter({ powerPreference: 'high-performance' });
  if (!adapter) throw new Error('dawn.node found no WebGPU adapter (is a Vulkan driver installed? see vulkanEnv())');
  const ai = adapter.info as GPUAdapterInfo & { isFallbackAdapter?: boolean };
  const info: NodeGpuInfo = {
    vendor: ai.vendor ?? '',
    architecture: ai.architecture ?? '',
    device: ai.device ?? '',
    description: ai.description ?? '',
    isFallbackAdapter: ai.isFallbackAdapter === true || /swiftshader/i.test(`${ai.vendor} ${ai.device} ${ai.description}`),
    features: [...adapter.features].map(String).sort(),
    maxBufferSize: adapter.limits.maxBufferSize,
    maxStorageBufferBindingSize: adapter.limits.maxStorageBufferBindingSize,
  };
  installed = { gpu, info };
  return installed;
}

/** Copies writes from SharedArrayBuffer views through one growing ordinary buffer. */
function patchWriteBuffer(queueClass: { prototype: GPUQueue } | undefined): void {
  if (!queueClass) return;
  const proto = queueClass.prototype as GPUQueue & { __meshnetPatched?: boolean };
  if (proto.__meshnetPatched) return;
  const original = proto.writeBuffer;
  let scratch = new ArrayBuffer(1 << 16);
  proto.writeBuffer = function (this: GPUQueue, buffer: GPUBuffer, bufferOffset: number, data: BufferSource | SharedArrayBuffer, dataOffset?: number, size?: number) {
    const view = ArrayBuffer.isView(data) ? data : null;
    const backing = view ? view.buffer : data;
    if (typeof SharedArrayBuffer !== 'undefined' && backing instanceof SharedArrayBuffer) {
      // dataOffset/size count elements of a typed array, bytes otherwise.
      const elem = view && 'BYTES_PER_ELEMENT' in view ? (view as unknown as { BYTES_PER_ELEMENT: number }).BYTES_PER_ELEMENT : 1;
      const start = (view ? view.byteOffset : 0) + (dataOffset ?? 0) * elem;
      const total = view ? view.byteLength : (backing as SharedArrayBuffer).byteLength;
      const len = size !== undefined ? size * elem : total - (dataOffset ?? 0) * elem;
      if (scratch.byteLength < len) scratch = new ArrayBuffer(Math.max(len, scratch.byteLength * 2));
      const copy = new Uint8Array(scratch, 0, len);
      copy.set(new Uint8Array(backing as SharedArrayBuffer, start, len));
      return original.call(this, buffer, bufferOffset, copy, 0, len);
    }
    return original.call(this, buffer, bufferOffset, data as BufferSource, dataOffset, size);
  } as GPUQueue['writeBuffer'];
  proto.__meshnetPatched = true;
}
