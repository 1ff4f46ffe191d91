/**
 * The GPUDevice onnxruntime-web's WebGPU EP runs on, created here and handed
 * to every session (`executionProviders: [{ name: 'webgpu', device }]`)
 * rather than left to the EP, for one reason of correctness:
 *
 * onnxruntime 1.30's WebGPU GroupQueryAttention takes its flash-attention
 * path whenever the device has the `subgroups` feature, and that path's
 * prefill kernel assumes subgroups of at least 16 lanes (later onnxruntime
 * sources name the constant: kMinSupportedSubgroupSize = 16). SwiftShader's
 * subgroups are 4 wide: a call of 32 rows or more then gets wrong attention
 * for every row past the first subgroup (rows 4..S-1 of a first prompt, all
 * rows after a past), while 31 rows and decode are exact
 * (test/gpu/webgpu-node.test.ts reproduces it on one GroupQueryAttention
 * node). Without `subgroups` the EP runs its plain attention kernels, which
 * are exact at any length. So the feature is requested only where the
 * adapter's subgroups are wide enough.
 *
 * Everything else the adapter offers is requested (features such as
 * shader-f16, and its largest limits), as the EP does for its own device.
 */

/** Narrowest subgroup onnxruntime's WebGPU flash attention is correct with. */
export const MIN_FLASH_ATTENTION_SUBGROUP = 16;

const SUBGROUP_FEATURES = ['subgroups', 'subgroup-size-control', 'chromium-experimental-subgroups', 'chromium-experimental-subgroup-matrix'];

export interface OrtGpuDevice {
  device: GPUDevice;
  /** Whether `subgroups` was enabled (onnxruntime then uses flash attention). */
  subgroups: boolean;
  /** Why subgroups were left off, for logs; absent when enabled or not offered. */
  subgroupsOffReason?: string;
}

/** Whether onnxruntime's flash attention is safe on `adapter`, or why not. */
export function subgroupVerdict(adapter: Pick<GPUAdapter, 'features' | 'info'> & { isFallbackAdapter?: boolean }): { ok: boolean; reason?: string } {
  if (!adapter.features.has('subgroups')) return { ok: false };
  const info = adapter.info as GPUAdapterInfo & { subgroupMinSize?: number; isFallbackAdapter?: boolean };
  const min = info.subgroupMinSize;
  if (typeof min === 'number') {
    return min >= MIN_FLASH_ATTENTION_SUBGROUP ? { ok: true } : { ok: false, reason: `subgroups are ${min} wide (onnxruntime's flash attention needs ${MIN_FLASH_ATTENTION_SUBGROUP})` };
  }
  // A browser that does not report the width: trust real GPUs (32/64 lanes), not a software adapter.
  const software = adapter.isFallbackAdapter === true || info.isFallbackAdapter === true || /swiftshader/i.test(`${info.vendor} ${info.architecture} ${info.device} ${info.description}`);
  return software ? { ok: false, reason: 'a software adapter that does not report its subgroup width' } : { ok: true };
}

/** Requests the device the EP will use from `gpu` (navigator.gpu). */
export async function requestOrtGpuDevice(gpu: GPU): Promise<OrtGpuDevice> {
  const adapter = await gpu.requestAdapter({ powerPreference: 'high-performance' });
  if (!adapter) throw new Error('WebGPU: no adapter (requestAdapter returned null)');
  const verdict = subgroupVerdict(adapter);
  const features = [...adapter.features].filter((f) => verdict.ok || !SUBGROUP_FEATURES.includes(f)) as GPUFeatureName[];
  const requiredLimits: Record<string, number> = {};
  // GPUSupportedLimits' members are prototype getters: for..in walks them.
  for (const key in adapter.limits) {
    const v = (adapter.limits as unknown as Record<string, unknown>)[key];
    if (typeof v === 'number') requiredLimits[key] = v;
  }
  const device = await adapter.requestDevice({ requiredFeatures: features, requiredLimits });
  // The EP reads the adapter's description through the device (as on devices it creates itself).
  const d = device as GPUDevice & { adapterInfo?: GPUAdapterInfo };
  if (!d.adapterInfo) Object.defineProperty(d, 'adapterInfo', { value: adapter.info, configurable: true });
  return { device, subgroups: verdict.ok, ...(verdict.reason ? { subgroupsOffReason: verdict.reason } : {}) };
}
