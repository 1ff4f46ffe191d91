import { defineConfig } from 'vitest/config';
import { vulkanEnv } from './src/host/node/webgpu.ts';
import { LongestFirst } from './test/helpers/longest-first.ts';

// The WebGPU-in-Node suite (test/gpu) needs a Vulkan loader and driver when dawn.node loads, which
// only the environment of a new process can give: the test processes are forked after this runs.
Object.assign(process.env, vulkanEnv());

export default defineConfig({
  test: {
    include: ['src/**/*.test.ts', 'test/**/*.test.ts'],
    // Integration tests start real relay processes on loopback; they are
    // slower than unit tests but must never be timed: limits are generous.
    testTimeout: 60_000,
    hookTimeout: 60_000,
    pool: 'forks',
    fileParallelism: true,
    maxWorkers: 2,
    // Longest files first: the last files to start are short, so neither worker runs long alone at the end.
    sequence: { sequencer: LongestFirst },
  },
});
