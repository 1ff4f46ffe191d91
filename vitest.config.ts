import { relative } from 'node:path';
import { defineConfig } from 'vitest/config';
import { BaseSequencer, type TestSpecification } from 'vitest/node';
import { vulkanEnv } from './src/host/node/webgpu.ts';

// The WebGPU-in-Node suite (test/gpu) needs a Vulkan loader and driver when dawn.node loads, which
// only the environment of a new process can give: the test processes are forked after this runs.
Object.assign(process.env, vulkanEnv());

/**
 * The slowest files, slowest first (seconds in a CI run on 2 cores). A clean clone has no
 * vitest cache of durations, and vitest then orders files by size: a 140 s SwiftShader suite
 * started last left one worker running alone for a minute. Starting these first lets the
 * hundred small files fill the gaps. Order only: every file runs either way.
 */
const SLOWEST = [
  'test/mesh/liars.test.ts', // 157
  'test/gpu/webgpu-batch.test.ts', // 140
  'test/gpu/graph-capture.test.ts', // 127
  'test/gpu/sampling-webgpu.test.ts', // 120
  'test/gpu/webgpu-node.test.ts', // 95
  'test/gpu/architectures-webgpu.test.ts', // 64
  'test/gpu/gqa-prefill.test.ts', // 62
  'test/shard/device-sampler.test.ts', // 59
  'test/gpu/device-loss-mesh.test.ts', // 57
  'test/mesh/real-vocab.test.ts', // 44
  'test/gpu/node-graph-capture.test.ts', // 38
  'test/gpu/speculative-webgpu.test.ts', // 37
  'test/mesh/architectures.test.ts', // 34
  'test/relay/cluster.test.ts', // 32
  'test/shard/split.test.ts', // 28
  'test/cli/failures.test.ts', // 25
];

class SlowestFirst extends BaseSequencer {
  override async sort(files: TestSpecification[]): Promise<TestSpecification[]> {
    const sorted = await super.sort(files);
    const rank = (f: TestSpecification) => {
      const i = SLOWEST.indexOf(relative(import.meta.dirname, f.moduleId).split('\\').join('/'));
      return i < 0 ? SLOWEST.length : i;
    };
    // Array.prototype.sort is stable: the rest keep vitest's own order.
    return sorted.sort((a, b) => rank(a) - rank(b));
  }
}

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
    sequence: { sequencer: SlowestFirst },
  },
});
