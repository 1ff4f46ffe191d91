import { readdirSync } from 'node:fs';
import { sep } from 'node:path';
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

// In-process suites that share their processes too: each saves a process start, the imports and the
// fixtures it shares with the suites before it (test/helpers/shard.ts keeps them per process). A suite
// there must leave the process as it found it: one that fakes timers, patches a global or a module, sets
// the environment, or starts processes of its own goes in OWN_PROCESS.
const SHARED_UNIT_DIRS = ['layout', 'model', 'node', 'protocol', 'shard', 'tracker', 'verify'].map((d) => `test/${d}/`);
const SHARED_UNIT_FILES = ['cli/app-stale', 'cli/browser-mesh', 'cli/demo-budget', 'cli/static-server', 'cli/trace-file', 'host/browser/warm-up', 'host/node/socket'].map((n) => `test/${n}.test.ts`);
const OWN_PROCESS = [
  'model/fixture',
  'node/runtime/drain',
  'node/runtime/duty-cycle',
  'shard/device-sampler',
  ...['cluster-outage', 'cluster', 'many-chats', 'model-load', 'process', 'real-nodes', 'relay-beat', 'scale', 'watch-hub'].map((n) => `tracker/${n}`),
].map((n) => `test/${n}.test.ts`);
const SHARED_UNIT = readdirSync('test', { recursive: true, encoding: 'utf8' })
  .map((p) => `test/${p.split(sep).join('/')}`)
  .filter((p) => p.endsWith('.test.ts') && (SHARED_UNIT_DIRS.some((d) => p.startsWith(d)) || SHARED_UNIT_FILES.includes(p)) && !OWN_PROCESS.includes(p));

export default defineConfig({
  test: {
    // Integration tests start real relay processes on loopback; they are
    // slower than unit tests but must never be timed: limits are generous.
    testTimeout: 60_000,
    hookTimeout: 60_000,
    pool: 'forks',
    fileParallelism: true,
    maxWorkers: 2,
    // Project by project, in this order, the longest files first: the GPU suites start at once, and the
    // last files to start are short, so neither worker runs long alone at the end.
    sequence: { sequencer: LongestFirst },
    projects: [
      { extends: true, test: { name: 'gpu-shared', include: SHARED_GPU, isolate: false } },
      { extends: true, test: { name: 'unit', include: ['src/**/*.test.ts', 'test/**/*.test.ts'], exclude: [...configDefaults.exclude, ...SHARED_GPU, ...SHARED_UNIT] } },
      { extends: true, test: { name: 'unit-shared', include: SHARED_UNIT, isolate: false } },
    ],
  },
});
