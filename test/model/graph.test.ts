/**
 * The ONNX graphs against the float64 reference: prompt, decode, and
 * prompt-then-decode vs one shot, per-layer and fused-range graphs, f32 and f16.
 * Tolerance: max |logit error| <= 1e-4 × max |reference logit| for f32,
 * 2e-2 × for f16 (half precision weights, KV cache and matmuls).
 */
import { describe, expect, it } from 'vitest';
import { ReferenceModel, newRefCache } from '../../src/model/reference.ts';
import { buildHeadGraph, buildLayersGraph, IO } from '../../src/model/graph.ts';
import { createWasmBackend } from '../../src/host/node/onnx-wasm.ts';
import { executor, fixture, maxAbsDiff, nodeBackend, prompts } from '../helpers/shard.ts';

const F32_TOL = 1e-4;
const F16_TOL = 2e-2;

function expectClose(got: ArrayLike<number>, want: ArrayLike<number>, tol: number): void {
  const { err, scale } = maxAbsDiff(got, want);
  expect(err, `max abs error ${err} vs scale ${scale}`).toBeLessThanOrEqual(tol * scale);
}

describe.each(['tiny', 'tiny-qwen2', 'small'] as const)('%s graphs vs float64 reference', (preset) => {
  const f = fixture(preset);
  const V = f.cfg.vocabSize;
  const ref = new ReferenceModel(f.cfg, f.weights);
  const prompt = prompts(V, 1, 7)[0]!.concat([5, 9, 11]);
  const decodeSteps = preset === 'small' ? 3 : 6;

  it.each([
    ['per-layer', undefined],
    ['fused range', [] as number[]],
  ])('f32 %s: prompt then decode, each step within tolerance', async (_name, segmentBoundaries) => {
    const ex = await executor(f, 0, f.cfg.numLayers, segmentBoundaries ? { segmentBoundaries } : {});
    const cache = newRefCache(f.cfg);
    const refPrompt = ref.forward(prompt, 0, cache);
    let r = await ex.forward({ session: 's', position: 0, tokenIds: prompt });
    if (r.kind !== 'token') throw new Error('expected a token');
    expectClose(r.logits, refPrompt.subarray((prompt.length - 1) * V), F32_TOL);
    let pos = prompt.length;
    for (let i = 0; i < decodeSteps; i++) {
      const tok = r.tokenId;
      const refLogits = ref.forward([tok], pos, cache);
      r = await ex.forward({ session: 's', position: pos, tokenIds: [tok] });
      if (r.kind !== 'token') throw new Error('expected a token');
      expectClose(r.logits, refLogits, F32_TOL);
      pos++;
    }
    await ex.release();
  });

  it('prompt-then-decode equals one-shot (stateless) over the same tokens', async () => {
    const ex = await executor(f, 0, f.cfg.numLayers);
    const seq = [...prompt];
    let r = await ex.forward({ session: 'a', position: 0, tokenIds: prompt });
    for (let i = 0; i < 3; i++) {
      if (r.kind !== 'token') throw new Error('expected a token');
      seq.push(r.tokenId);
      r = await ex.forward({ session: 'a', position: seq.length - 1, tokenIds: [r.tokenId] });
    }
    const oneShot = await ex.forward({ tokenIds: seq });
    if (r.kind !== 'token' || oneShot.kind !== 'token') throw new Error('expected tokens');
    expectClose(r.logits, oneShot.logits, F32_TOL);
    expect(r.tokenId).toBe(oneShot.tokenId);
    await ex.release();
  });

  it('head graph logits for every prompt position match the reference', async () => {
    const cache = newRefCache(f.cfg);
    const hidden = ref.layers(0, f.cfg.numLayers, ref.embed(prompt), prompt.length, 0, cache);
    const want = ref.head(hidden, prompt.length);
    const s = await nodeBackend.createSession(buildHeadGraph(f.cfg, f.weights).bytes);
    const out = await s.run({ [IO.hidden]: { type: 'float32', data: Float32Array.from(hidden), dims: [1, prompt.length, f.cfg.hiddenSize] } });
    expectClose(out[IO.logits]!.data as Float32Array, want, F32_TOL);
    await s.release();
  });

  // f16 is checked on the tiny presets only: on `small` it adds ~20 s and no new code path.
  if (preset !== 'small') it('f16 variant within its tolerance', async () => {
    const ex = await executor(f, 0, f.cfg.numLayers, { dtype: 'f16' });
    const cache = newRefCache(f.cfg);
    const want = ref.forward(prompt, 0, cache);
    const r = await ex.forward({ session: 'h', position: 0, tokenIds: prompt });
    if (r.kind !== 'token') throw new Error('expected a token');
    expectClose(r.logits, want.subarray((prompt.length - 1) * V), F16_TOL);
    const r2 = await ex.forward({ session: 'h', position: prompt.length, tokenIds: [r.tokenId] });
    if (r2.kind !== 'token') throw new Error('expected a token');
    expectClose(r2.logits, ref.forward([r.tokenId], prompt.length, cache), F16_TOL);
    await ex.release();
  });
});

describe('onnxruntime-web wasm backend', () => {
  it('runs the tiny model to the same logits as the reference', async () => {
    const f = fixture('tiny');
    const ref = new ReferenceModel(f.cfg, f.weights);
    const prompt = [5, 6, 7, 300, 8];
    const ex = await executor(f, 0, f.cfg.numLayers, { backend: createWasmBackend({ numThreads: 1 }) });
    const r = await ex.forward({ session: 'w', position: 0, tokenIds: prompt });
    if (r.kind !== 'token') throw new Error('expected a token');
    const want = ref.forward(prompt, 0, newRefCache(f.cfg));
    expectClose(r.logits, want.subarray((prompt.length - 1) * f.cfg.vocabSize), F32_TOL);
    await ex.release();
  });
});

describe('graph structure', () => {
  it('keeps int64 shape arithmetic off the graph: no Shape, no ConstantOfShape, no Range', () => {
    const f = fixture('tiny');
    const text = new TextDecoder('latin1').decode(buildLayersGraph(f.cfg, f.weights, 0, 2).bytes);
    for (const op of ['Shape', 'ConstantOfShape', 'Range', 'Expand']) expect(text.includes(`\x22${String.fromCharCode(op.length)}${op}`)).toBe(false);
    expect(text).toContain(IO.presentKey(1));
    expect(text).toContain(IO.pastValue(0));
  });

  it('rejects a weight of the wrong shape with its name', () => {
    const f = fixture('tiny');
    const bad = (name: string) => (name.endsWith('layers.0.mlp.up_proj.weight') ? { shape: [1, 2], data: new Float32Array(2) } : f.weights(name));
    expect(() => buildLayersGraph(f.cfg, bad, 0, 1)).toThrow(/up_proj/);
  });
});
