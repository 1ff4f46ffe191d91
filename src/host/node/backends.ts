/**
 * The Node.js host's backends (`meshnet node --backend`):
 *
 *   cpu      onnxruntime-node, plain graphs (the default)
 *   webgpu   onnxruntime-web's WebGPU EP on Dawn (src/host/node/webgpu.ts), the
 *            fused graphs: a Node.js node on a GPU, with no browser
 *
 * After the GPU device is lost (device-recovery.ts) the span is built again:
 * on a fresh GPUDevice the first time, on onnxruntime-node's CPU after that
 * (or when no fresh device can be had), and it stays on the CPU from then on.
 *
 * Test hooks, read from the environment by the `meshnet node` command only
 * (they make failures that a software GPU never has):
 *   MESHNET_TEST_LOSE_GPU_AFTER_RUNS=N[,M…]  the k-th GPU backend destroys its
 *       device (GPUDevice.destroy(), as a driver reset would lose it) right
 *       before its N-th session run
 *   MESHNET_TEST_GPU_MEMORY_BYTES=B  a GPU backend refuses (DeviceAllocationError,
 *       507) a session whose weights would take its graphs past B bytes
 */
import { createRequire } from 'node:module';
import { dirname } from 'node:path';
import { pathToFileURL } from 'node:url';
import { setFlagsFromString } from 'node:v8';
import { fusedUnsupportedReason } from '../../model/fused-graph.ts';
import type { ModelConfig } from '../../model/config.ts';
import { MeshError } from '../../protocol/errors.ts';
import type { BackendFactory, ChosenBackend, DeviceLoss, LogLevel } from '../../node/runtime/host.ts';
import type { OnnxBackend } from '../../shard/backend.ts';
import { createNodeBackend } from './onnx.ts';
import { deviceOf, withGpuTestHooks } from '../browser/gpu-test-hooks.ts';

export type NodeBackendChoice = 'cpu' | 'webgpu';

export interface NodeTestHooks {
  /** Per GPU backend created (in order): destroy its device before this session run (1-based); absent: never. */
  loseGpuAfterRuns?: number[];
  /** Bytes of graph weights a GPU backend accepts before it refuses a session as out of memory. */
  gpuMemoryBytes?: number;
}

/** The test hooks from the environment (see the module comment); empty when none is set. */
export function testHooksFromEnv(env: NodeJS.ProcessEnv): NodeTestHooks {
  const hooks: NodeTestHooks = {};
  const lose = env.MESHNET_TEST_LOSE_GPU_AFTER_RUNS;
  if (lose) hooks.loseGpuAfterRuns = lose.split(',').map((x) => Number(x.trim()));
  const mem = Number(env.MESHNET_TEST_GPU_MEMORY_BYTES);
  if (env.MESHNET_TEST_GPU_MEMORY_BYTES && Number.isFinite(mem) && mem > 0) hooks.gpuMemoryBytes = mem;
  return hooks;
}

export interface NodeBackendOptions {
  choice: NodeBackendChoice;
  threads?: number;
  hooks?: NodeTestHooks;
  /** Decode steps on the GPU replay a captured graph (FusedExecutorOptions.graphCapture); opt-in until measured on real GPUs. */
  graphCapture?: boolean;
  log(level: LogLevel, message: string): void;
}

/** Where onnxruntime-web's runtime files are (its WASM, which the WebGPU build runs on too). */
function ortWebDist(): string {
  const require = createRequire(import.meta.url);
  return pathToFileURL(`${dirname(require.resolve('onnxruntime-web'))}/`).href;
}

export function nodeBackends(o: NodeBackendOptions): BackendFactory & { close(): void } {
  let cpuBackend: OnnxBackend | undefined;
  let gpusCreated = 0;
  /** GPU backends made so far: one serves every span until its device is lost; all are destroyed on close. */
  const gpus: Array<{ backend: OnnxBackend; adapter: string; lost: boolean }> = [];
  const cpu = (why?: string): ChosenBackend => {
    cpuBackend ??= createNodeBackend(o.threads !== undefined ? { intraOpNumThreads: o.threads } : {});
    return { backend: cpuBackend, info: { name: cpuBackend.name, kind: 'onnxruntime-node', dtype: 'f32', ...(why ? { details: { backend_reason: why } } : {}) } };
  };
  const gpuBackend = async (): Promise<{ backend: OnnxBackend; adapter: string }> => {
    const live = gpus.find((g) => !g.lost);
    if (live) return live;
    // V8 tiers onnxruntime-web's 27 MB of WASM up to optimized code on background threads, which
    // process.exit joins: on a busy 2-core machine that took 1.5-2 minutes at every stop, and starved
    // heartbeats meanwhile. Here that WASM only dispatches GPU work, so baseline code is kept (Liftoff):
    // the stop takes 0.1 s. MESHNET_WASM_TIER_UP=1 leaves V8's default (measure it on a real GPU).
    if (process.env.MESHNET_WASM_TIER_UP !== '1') setFlagsFromString('--liftoff-only');
    const { installNodeWebGpu } = await import('./webgpu.ts');
    const { createOrtWebBackend } = await import('../browser/onnx.ts');
    const { info } = await installNodeWebGpu();
    const backend = withGpuTestHooks(await createOrtWebBackend('webgpu', { numThreads: 1, wasmPaths: ortWebDist() }), o.hooks?.loseGpuAfterRuns?.[gpusCreated], o.hooks?.gpuMemoryBytes);
    gpusCreated++;
    const g = { backend, adapter: [info.vendor, info.architecture, info.description].filter(Boolean).join(' ') || 'unknown adapter', lost: false };
    void backend.device?.lost.then(() => (g.lost = true));
    gpus.push(g);
    return g;
  };
  const gpu = async (config: ModelConfig, lost: DeviceLoss | undefined): Promise<ChosenBackend> => {
    const { backend, adapter } = await gpuBackend();
    const refused = fusedUnsupportedReason(config);
    return {
      backend,
      graphs: refused ? { kind: 'plain', dtype: 'f32' } : { kind: 'fused', projections: 'f32', ...(o.graphCapture ? { graphCapture: true } : {}) },
      info: {
        name: backend.name,
        kind: 'webgpu',
        dtype: 'f32',
        weights: 'f32',
        details: { adapter, ...(refused ? { graphs_reason: `plain graphs: ${refused}` } : {}), ...(lost ? { backend_reason: `a fresh GPU device after the last was lost (${lost.reason})` } : {}) },
      },
    };
  };
  // Dawn holds the process at exit until every device it made is gone.
  const close = () => {
    for (const g of gpus.splice(0)) deviceOf(g.backend)?.destroy();
  };
  return {
    async choose(span, config, _weights, lost) {
      if (o.choice === 'cpu') return cpu();
      if (lost && lost.losses >= 2) {
        const why = `the GPU device was lost ${lost.losses} times (last: ${lost.reason}): the CPU from now on`;
        o.log('warn', `layers [${span.startLayer}, ${span.endLayer}): ${why}`);
        return cpu(why);
      }
      try {
        return await gpu(config, lost);
      } catch (e) {
        if (!lost) throw new MeshError('MESH_ERR_UNAVAILABLE', `--backend webgpu: ${(e as Error).message}`);
        const why = `no fresh GPU device after the last was lost (${(e as Error).message}): the CPU instead`;
        o.log('warn', `layers [${span.startLayer}, ${span.endLayer}): ${why}`);
        return cpu(why);
      }
    },
    close,
  };
}
