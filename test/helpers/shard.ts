/**
 * Shared setup for shard tests: fixture weights, executors over
 * onnxruntime-node, and comparison helpers.
 */
import { fixtureConfig, makeModel, type FixturePreset } from '../../src/model/fixture.ts';
import type { ModelConfig } from '../../src/model/config.ts';
import type { WeightSource } from '../../src/model/graph.ts';
import { ShardExecutor, type ShardExecutorOptions } from '../../src/shard/executor.ts';
import { createNodeBackend } from '../../src/host/node/onnx.ts';
import { weightsFromFiles } from './weights.ts';
import { fixtureTokenizerFiles } from '../../src/cli/real-tokenizers.ts';

export interface Fixture {
  cfg: ModelConfig;
  files: Map<string, Uint8Array>;
  weights: WeightSource;
}

const fixtures = new Map<string, Fixture>();

export function fixture(preset: FixturePreset, seed = 0): Fixture {
  const key = `${preset}/${seed}`;
  let f = fixtures.get(key);
  if (!f) {
    const tokenizerFiles = fixtureTokenizerFiles(preset);
    const files = makeModel(preset, seed, tokenizerFiles ? { tokenizerFiles } : {});
    f = { cfg: fixtureConfig(preset), files, weights: weightsFromFiles(files) };
    fixtures.set(key, f);
  }
  return f;
}

// One intra-op thread: vitest runs two files at once on two cores.
export const nodeBackend = createNodeBackend({ intraOpNumThreads: 1 });

export function executor(f: Fixture, startLayer: number, endLayer: number, extra: Partial<ShardExecutorOptions> = {}): Promise<ShardExecutor> {
  return ShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer, endLayer, maxContext: 256, ...extra });
}

/** max |a - b| and max |b| (the scale the tolerance is relative to). */
export function maxAbsDiff(a: ArrayLike<number>, b: ArrayLike<number>): { err: number; scale: number } {
  if (a.length !== b.length) throw new Error(`length ${a.length} vs ${b.length}`);
  let err = 0;
  let scale = 0;
  for (let i = 0; i < a.length; i++) {
    err = Math.max(err, Math.abs(a[i]! - b[i]!));
    scale = Math.max(scale, Math.abs(b[i]!));
  }
  return { err, scale };
}

/** Deterministic prompts of token ids (avoiding the specials 0..2). */
export function prompts(vocab: number, count: number, seed = 1): number[][] {
  let s = seed;
  const rand = () => ((s = (Math.imul(s, 1103515245) + 12345) >>> 0) >>> 8) / 16777216;
  return Array.from({ length: count }, (_, i) => Array.from({ length: 3 + ((i * 5) % 11) }, () => 3 + Math.floor(rand() * (vocab - 3))));
}
