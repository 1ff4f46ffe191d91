/**
 * Which backend a browser node runs on. WebGPU only when the adapter is a
 * real one (not the software fallback) and a short calibration on the
 * node's own first layer beats WASM; fp16 graphs only with `shader-f16`.
 */
import type { ModelConfig } from '../../model/config.ts';
import type { OnnxBackend } from '../../shard/backend.ts';
import type { WeightLoader } from '../../shard/executor.ts';
import { createSpanExecutor, type SpanGraphs } from '../../shard/span-executor.ts';
import type { BackendKind } from './engine.ts';

/** The bits of WebGPU this module reads (the DOM lib has no WebGPU types). */
interface GpuAdapterLike {
  readonly features: { has(name: string): boolean };
  readonly info?: { vendor?: string; architecture?: string; device?: string; description?: string; isFallbackAdapter?: boolean };
  /** Older Chromium put it on the adapter itself. */
  readonly isFallbackAdapter?: boolean;
}
export interface GpuLike {
  requestAdapter(opts?: { powerPreference?: string }): Promise<GpuAdapterLike | null>;
}

export interface GpuProbe {
  usable: boolean;
  fallback: boolean;
  fp16: boolean;
  adapter: string;
  /** Why WebGPU is not usable (when it is not). */
  reason?: string;
}

export async function probeWebGpu(gpu: GpuLike | undefined): Promise<GpuProbe> {
  if (!gpu) return { usable: false, fallback: false, fp16: false, adapter: 'none', reason: 'this browser has no WebGPU' };
  let adapter: GpuAdapterLike | null;
  try {
    adapter = await gpu.requestAdapter({ powerPreference: 'high-performance' });
  } catch (e) {
    return { usable: false, fallback: false, fp16: false, adapter: 'none', reason: `requestAdapter failed: ${(e as Error).message}` };
  }
  if (!adapter) return { usable: false, fallback: false, fp16: false, adapter: 'none', reason: 'no WebGPU adapter (blocklisted GPU or disabled)' };
  const info = adapter.info ?? {};
  const name = [info.vendor, info.architecture, info.device, info.description].filter((s) => s && s.length > 0).join(' / ') || 'unknown adapter';
  const fallback = info.isFallbackAdapter === true || adapter.isFallbackAdapter === true;
  return { usable: true, fallback, fp16: adapter.features.has('shader-f16'), adapter: name };
}

/**
 * Median ms of `steps` one-token decode steps through a one-layer executor on
 * `backend`, on the graphs that would serve there (`graphs`: fused or plain),
 * after one warm-up (which pays for shader compilation).
 */
export async function calibrate(backend: OnnxBackend, cfg: ModelConfig, weights: WeightLoader, layer: number, graphs: SpanGraphs, steps = 3): Promise<number> {
  const ex = await createSpanExecutor({ config: cfg, backend, weights, startLayer: layer, endLayer: layer + 1, graphs, maxContext: 16, memoryBudgetBytes: 2 ** 30 });
  try {
    const x = new Float32Array(cfg.hiddenSize);
    for (let i = 0; i < x.length; i++) x[i] = Math.sin(i) * 0.5;
    const times: number[] = [];
    for (let i = 0; i <= steps; i++) {
      const t0 = performance.now();
      await ex.forward({ session: 'calibration', position: i, activation: { data: x, shape: [1, 1, cfg.hiddenSize] }, endLayer: layer + 1 });
      if (i > 0) times.push(performance.now() - t0);
    }
    times.sort((a, b) => a - b);
    return times[Math.floor(times.length / 2)]!;
  } finally {
    await ex.release();
  }
}

export interface BackendDecision {
  kind: BackendKind;
  fp16: boolean;
  reason: string;
}

/** The decision for 'auto', given the probe and (when WebGPU is usable) both calibration times. */
export function decide(probe: GpuProbe, times?: { webgpuMs: number; wasmMs: number }): BackendDecision {
  if (!probe.usable) return { kind: 'wasm', fp16: false, reason: `WASM: ${probe.reason ?? 'WebGPU unavailable'}` };
  if (probe.fallback) return { kind: 'wasm', fp16: false, reason: 'WASM: the WebGPU adapter is a software fallback' };
  if (!times) return { kind: 'wasm', fp16: false, reason: 'WASM: not calibrated' };
  const cmp = `WebGPU ${times.webgpuMs.toFixed(1)} ms vs WASM ${times.wasmMs.toFixed(1)} ms per layer step`;
  return times.webgpuMs < times.wasmMs ? { kind: 'webgpu', fp16: probe.fp16, reason: `WebGPU: ${cmp}` } : { kind: 'wasm', fp16: false, reason: `WASM: ${cmp}` };
}
