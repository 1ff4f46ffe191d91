/**
 * The published architectures' fused graphs on WebGPU (onnxruntime-web's
 * WebGPU EP on Dawn in Node, SwiftShader; what a browser GPU node runs):
 * Qwen3's q/k norms before GroupQueryAttention, Phi-3's packed projections
 * and longrope tables, Phi-4-mini's partial rotary and Mistral's sliding
 * window through the WebGPU kernels, against the float64 reference.
 */
import { beforeAll, describe, expect, it } from 'vitest';
import type { OnnxBackend } from '../../src/shard/backend.ts';
import { walkAgainstReference } from '../helpers/fused.ts';
import { fixture, prompts } from '../helpers/shard.ts';
import { sharedWebGpu } from '../helpers/webgpu-backend.ts';

const { FusedShardExecutor } = await import('../../src/shard/fused-executor.ts');

const TOL = 1e-4; // test/gpu/webgpu-node.test.ts: SwiftShader sums in another order than float64
const PRESETS = ['tiny-mistral', 'tiny-qwen3', 'tiny-phi3', 'tiny-phi4mini'] as const;

let backend: OnnxBackend;
beforeAll(async () => {
  backend = (await sharedWebGpu()).backend;
}, 600_000);

describe('fused graphs of the published architectures on WebGPU', () => {
  it.each(PRESETS)('%s: f32 projections match the reference past the sliding window, on the GPU', async (preset) => {
    const f = fixture(preset);
    const ex = await FusedShardExecutor.create({ config: f.cfg, backend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 64, returnLogits: true });
    const prompt = prompts(f.cfg.vocabSize, 3, 11)[2]!; // 13 tokens, then 8 decode steps: past Mistral's window of 16
    await walkAgainstReference(f, f.weights, ex, [prompt, ...Array.from({ length: 8 }, (_, i) => [20 + i])], TOL, `gpu-${preset}`);
    expect(ex.onDevice).toBe(true);
    await ex.release();
  }, 600_000);
});
