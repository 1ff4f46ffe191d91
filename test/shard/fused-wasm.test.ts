/**
 * The fused graphs on onnxruntime-web's WASM kernels, as the browser node
 * runs them on a CPU (one graph per layer, src/shard/span-executor.ts):
 * prefill then decode steps, each checked against the float64 reference —
 * on the checkpoint for f32 projections, on the dequantized weights for
 * 4-bit ones. Decode is what catches a KV cache that is not kept:
 * onnxruntime-web does not write preallocated CPU outputs back, so the
 * backend copies the caches GroupQueryAttention returns.
 */
import { describe, it } from 'vitest';
import { createWasmBackend } from '../../src/host/node/onnx-wasm.ts';
import { createSpanExecutor } from '../../src/shard/span-executor.ts';
import { dequantizedWeights, walkAgainstReference } from '../helpers/fused.ts';
import { fixture } from '../helpers/shard.ts';

const TOL = 1e-4;
const CHUNKS = [[5, 9, 33, 100, 7], [44], [12, 13, 14], [200], [201]];
const backend = createWasmBackend({ numThreads: 1 });

describe('fused graphs on onnxruntime-web WASM', () => {
  for (const projections of ['f32', 'q4'] as const) {
    it(`${projections} projections, one graph per layer: prefill and decode equal the reference${projections === 'q4' ? ' on the dequantized weights' : ''}`, async () => {
      const f = fixture('tiny');
      const ex = await createSpanExecutor({ config: f.cfg, backend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, graphs: { kind: 'fused', projections }, maxContext: 256, memoryBudgetBytes: 64 * 2 ** 20 });
      try {
        await walkAgainstReference(f, projections === 'q4' ? dequantizedWeights(f.weights) : f.weights, ex, CHUNKS, TOL);
      } finally {
        await ex.release();
      }
    }, 60_000);
  }
});
