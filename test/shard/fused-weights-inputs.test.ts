/**
 * FusedGraphOptions.weightsAsInputs (what graph capture builds on, see
 * src/shard/capture-lane.ts): the same layers with their weights as graph
 * inputs, fed by the caller, compute what the graph with initializers
 * computes — on onnxruntime-node's CPU kernels, f32 and 4-bit, checked apart
 * from any GPU. Shape constants stay initializers.
 */
import { describe, expect, it } from 'vitest';
import { buildFusedLayersGraph, FUSED_IO, type FusedWeights } from '../../src/model/fused-graph.ts';
import { ElemType } from '../../src/model/onnx-builder.ts';
import type { BackendTensor } from '../../src/shard/backend.ts';
import { fixture, maxAbsDiff, nodeBackend } from '../helpers/shard.ts';

const f = fixture('tiny');
const { hiddenSize: h, numKvHeads: KV, headDim: D } = f.cfg;
const CAP = 16;
const SEQ = 5;

/** A host tensor holding one input weight's bytes, as its element type. */
function hostWeight(w: { elemType: number; dims: number[]; fill: (dst: Uint8Array) => void }): BackendTensor {
  const n = w.dims.reduce((a, b) => a * b, 1);
  const bytes = new Uint8Array(n * (w.elemType === ElemType.UINT8 ? 1 : 4));
  w.fill(bytes);
  if (w.elemType === ElemType.UINT8) return { type: 'uint8', data: bytes, dims: w.dims };
  if (w.elemType === ElemType.FLOAT) return { type: 'float32', data: new Float32Array(bytes.buffer), dims: w.dims };
  throw new Error(`unexpected weight type ${w.elemType}`);
}

function feeds(): Record<string, BackendTensor> {
  const out: Record<string, BackendTensor> = {
    [FUSED_IO.hidden]: { type: 'float32', data: Float32Array.from({ length: SEQ * h }, (_, i) => Math.sin(i * 0.37) * 0.5), dims: [1, SEQ, h] },
    [FUSED_IO.seqlensK]: { type: 'int32', data: Int32Array.of(SEQ - 1), dims: [1] },
    [FUSED_IO.totalSeqLen]: { type: 'int32', data: Int32Array.of(SEQ), dims: [1] },
  };
  for (let l = 0; l < 2; l++) {
    out[FUSED_IO.pastKey(l)] = { type: 'float32', data: new Float32Array(KV * CAP * D), dims: [1, KV, CAP, D] };
    out[FUSED_IO.pastValue(l)] = { type: 'float32', data: new Float32Array(KV * CAP * D), dims: [1, KV, CAP, D] };
  }
  return out;
}

describe('fused layer graphs with their weights as inputs', () => {
  for (const weights of ['f32', 'q4'] as FusedWeights[]) {
    it(`${weights}: same outputs as with initializers; only shape constants stay initializers`, async () => {
      const inits = buildFusedLayersGraph(f.cfg, f.weights, 0, 2, { weights, maxContext: CAP });
      const asInputs = buildFusedLayersGraph(f.cfg, f.weights, 0, 2, { weights, maxContext: CAP, weightsAsInputs: true });
      const ext = asInputs.externalWeights ?? [];
      expect(inits.externalWeights).toBeUndefined();
      // Every projection, norm and the rotary tables; and the weight bytes are still counted.
      expect(ext.map((w) => w.name)).toEqual(expect.arrayContaining(['rotary.cos_cache', 'rotary.sin_cache', 'model.layers.1.post_attention_layernorm.weight']));
      expect(asInputs.weightBytes).toBe(inits.weightBytes);
      expect(asInputs.bytes.length).toBeLessThan(inits.bytes.length / 4);

      const a = await nodeBackend.createSession(inits.bytes);
      const b = await nodeBackend.createSession(asInputs.bytes);
      try {
        const want = await a.run(feeds());
        const given = feeds();
        for (const w of ext) given[w.name] = hostWeight(w);
        const got = await b.run(given);
        for (const name of [FUSED_IO.hiddenOut, FUSED_IO.presentKey(1)]) {
          const d = maxAbsDiff(got[name]!.data as Float32Array, want[name]!.data as Float32Array);
          expect(d.err, name).toBeLessThanOrEqual(1e-6 * Math.max(1, d.scale));
        }
        // A missing weight is a clear error from the runtime, not a silent zero.
        const missing = feeds();
        for (const w of ext.slice(1)) missing[w.name] = hostWeight(w);
        await expect(b.run(missing)).rejects.toThrow();
      } finally {
        await a.release();
        await b.release();
      }
    });
  }
});
