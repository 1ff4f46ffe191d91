import { configDefaults, defineConfig } from 'vitest/config';
import { vulkanEnv } from './src/host/node/webgpu.ts';
import { LongestFirst } from './test/helpers/longest-first.ts';

// The WebGPU-in-Node suite (test/gpu) needs a Vulkan loader and driver when dawn.node loads, which
// only the environment of a new process can give: the test processes are forked after this runs.
Object.assign(process.env, vulkanEnv());

// The GPU suites that share one WebGPU device per process (test/helpers/webgpu-backend.ts). SwiftShader
// compiles each GPU program once per device, so they run in shared processes (isolate: false), one after
// another in each worker, instead of each in a new process with a new device. The GPU suites that lose
// their device, or start processes of their own, stay isolated.
const SHARED_GPU = ['architectures-webgpu', 'gqa-prefill', 'graph-capture', 'sampling-webgpu', 'speculative-webgpu', 'webgpu-batch', 'webgpu-node'].map((n) => `test/gpu/${n}.test.ts`);

export default defineConfig({
  test: {
    // Integration tests start real relay processes on loopback; they are
    // slower than unit tests but must never be timed: limits are generous.
    testTimeout: 60_000,
    hookTimeout: 60_000,
    pool: 'forks',
    fileParallelism: true,
    maxWorkers: 2,
    // The shared-process files first (a worker keeps its process only while the next file queued shares it),
    // then the rest, longest first: the last files to start are short, so neither worker runs long alone.
    sequence: { sequencer: LongestFirst },
    projects: [
      { extends: true, test: { name: 'gpu-shared', include: SHARED_GPU, isolate: false } },
      { extends: true, test: { name: 'unit', include: ['src/**/*.test.ts', 'test/**/*.test.ts'], exclude: [...configDefaults.exclude, ...SHARED_GPU] } },
    ],
  },
});
