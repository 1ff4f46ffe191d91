/**
 * Temperature > 0 without the logits, on onnxruntime-node's CPU EP (the same
 * graphs the GPU runs; test/gpu/sampling-webgpu.test.ts runs them on
 * WebGPU): the sampler graph's candidates decide exactly the token
 * sampling.ts draws over the full logits, across seeds, temperatures, top_k
 * and top_p, on a real-size vocabulary (qwen3-real-vocab: 151,936 ids), or
 * fall back to the logits; and the fused executor with `returnLogits: false`
 * returns those tokens.
 */
import { describe, expect, it } from 'vitest';
import { FusedShardExecutor } from '../../src/shard/fused-executor.ts';
import { DeviceSampler } from '../../src/shard/device-sampler.ts';
import { sampleToken } from '../../src/shard/sampling.ts';
import type { OnnxBackend } from '../../src/shard/backend.ts';
import { ReferenceModel, newRefCache } from '../../src/model/reference.ts';
import { fixture, maxAbsDiff, nodeBackend } from '../helpers/shard.ts';
import { peakedLogits, SWEEP, sweepRow } from '../helpers/sampling.ts';

const f = fixture('qwen3-real-vocab');
const V = f.cfg.vocabSize;

describe('sampling from device candidates (onnxruntime-node CPU)', () => {
  it('the sampler graph: every decided (T, seed, top_k, top_p) is sampling.ts\'s token; fallbacks counted', async () => {
    const sampler = new DeviceSampler(nodeBackend, V);
    try {
      const rows = [peakedLogits(V, 1), peakedLogits(V, 2)];
      let decided = 0;
      let fallbacks = 0;
      for (const [i, row] of rows.entries()) {
        const r = await sweepRow(row, 100 + i, async (t) => {
          const c = await sampler.candidates({ type: 'float32', data: row, dims: [1, V] }, t);
          if (typeof c === 'string') throw new Error(c);
          return c;
        });
        expect(r.mismatches).toEqual([]);
        // Well inside candidate-sampling.ts's NORMALIZER_REL_TOL (2e-3): that margin is what makes a decision exact.
        expect(r.worstNormalizerError).toBeLessThan(5e-4);
        // A top_k the 256 candidates hold is always decided; 300 never is.
        for (const k of [20, 50, 256]) expect(r.fallbacksByTopK[k] ?? 0, `top_k ${k}`).toBe(0);
        expect(r.fallbacksByTopK[300]).toBe(r.decided + r.fallbacks === 0 ? 0 : SWEEP.temperatures.length * SWEEP.seeds.length * SWEEP.topPs.length);
        decided += r.decided;
        fallbacks += r.fallbacks;
        console.log(`CPU sampler, peaked row ${i}: ${r.decided} decided, ${r.fallbacks} fell back, worst normalizer error ${r.worstNormalizerError.toExponential(2)}`, r.reasons);
      }
      // Without a top-k cut the draw must land in the candidates' mass: most do on peaked logits.
      expect(decided).toBeGreaterThan(3 * fallbacks);
    } finally {
      await sampler.release();
    }
  }, 600_000);

  it('the fused executor returns sampling.ts\'s tokens at temperature > 0 without its logits', async () => {
    const ex = await FusedShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 64, samplerChoice: 'candidates' });
    try {
      const prompt = [151643, 872, 13, 4320, 25, 9707, 11, 1879, 0];
      const steps = [
        { temperature: 0.05, seed: 3 },
        { temperature: 0.7, topK: 20, topP: 0.95, seed: 4 },
        { temperature: 1, topK: 50, seed: 5 },
        { temperature: 0.6, topP: 0.9, seed: 6 },
        { temperature: 1, seed: 7 },
        { temperature: 1, topK: 400, seed: 8 },
      ];
      // Two sessions in lock step: 'full' returns its logits (the reference draw), 'device' does not.
      ex.returnLogits = true;
      const full0 = await ex.forward({ session: 'full', position: 0, tokenIds: prompt });
      ex.returnLogits = false;
      await ex.forward({ session: 'device', position: 0, tokenIds: prompt });
      if (full0.kind !== 'token') throw new Error('expected a token');
      // The logits the draws are made over are the float64 reference's (f32 tolerance).
      const ref = new ReferenceModel(f.cfg, f.weights);
      const want0 = ref.forward(prompt, 0, newRefCache(f.cfg)).subarray((prompt.length - 1) * V);
      expect(maxAbsDiff(full0.logits, want0).err).toBeLessThan(1e-4);
      let token = full0.tokenId;
      for (const [i, sampling] of steps.entries()) {
        const position = prompt.length + i;
        ex.returnLogits = true;
        const a = await ex.forward({ session: 'full', position, tokenIds: [token], sampling });
        ex.returnLogits = false;
        const b = await ex.forward({ session: 'device', position, tokenIds: [token], sampling });
        if (a.kind !== 'token' || b.kind !== 'token') throw new Error('expected tokens');
        expect(a.tokenId).toBe(sampleToken(a.logits, sampling, position + 1).tokenId);
        expect(b.tokenId, JSON.stringify(sampling)).toBe(a.tokenId);
        // f32 normalizer on the device vs float64 over the logits (the greedy device path's precision).
        expect(Math.abs(b.logprob - a.logprob)).toBeLessThan(1e-3);
        token = a.tokenId;
      }
      const stats = ex.samplingStats();
      console.log('CPU executor sampling', stats);
      expect(stats.onDevice + stats.fallbacks).toBe(steps.length);
      // top_k 400 is past the 256 candidates: that step had to fall back and bring back its logits.
      expect(Object.keys(stats.reasons).some((r) => r.includes('top_k 400'))).toBe(true);
      expect(stats.onDevice).toBeGreaterThan(0);
    } finally {
      await ex.release();
    }
  }, 600_000);

  it('adaptive (the default): times both ways, then serves the faster; tokens are sampling.ts\'s whichever way a step took', async () => {
    const ex = await FusedShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 32, returnLogits: false });
    try {
      const prompt = [151643, 872, 13];
      const sampling = { temperature: 0.7, topK: 20, seed: 11 };
      // The reference draw: the same step with the logits returned, on a second session in lock step.
      ex.returnLogits = true;
      let a = await ex.forward({ session: 'full', position: 0, tokenIds: prompt, sampling });
      ex.returnLogits = false;
      let b = await ex.forward({ session: 'device', position: 0, tokenIds: prompt, sampling });
      expect(ex.samplingStats().path.chosen).toBe('probing');
      for (let i = 0; i < 8; i++) {
        if (a.kind !== 'token' || b.kind !== 'token') throw new Error('expected tokens');
        expect(a.tokenId).toBe(sampleToken(a.logits, sampling, prompt.length + i).tokenId);
        expect(b.tokenId).toBe(a.tokenId);
        ex.returnLogits = true;
        a = await ex.forward({ session: 'full', position: prompt.length + i, tokenIds: [a.tokenId], sampling });
        ex.returnLogits = false;
        b = await ex.forward({ session: 'device', position: prompt.length + i, tokenIds: [b.tokenId], sampling });
      }
      const { path, onDevice } = ex.samplingStats();
      expect(path.chosen).not.toBe('probing');
      expect(path.candidatesMs).toBeGreaterThan(0);
      expect(path.logitsMs).toBeGreaterThan(0);
      // Probing took the candidates on at least 3 of the 9 sampled steps (top_k 20: none falls back).
      expect(onDevice).toBeGreaterThanOrEqual(3);
    } finally {
      await ex.release();
    }
  }, 300_000);

  it('a backend that cannot build the sampler graph: the step samples over its logits, and says why', async () => {
    let refuse = false;
    const backend: OnnxBackend = {
      name: 'refuses-the-sampler',
      createSession: (model, options) => (refuse ? Promise.reject(new Error('no TopK here')) : nodeBackend.createSession(model, options)),
    };
    const ex = await FusedShardExecutor.create({ config: f.cfg, backend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 32, returnLogits: false, samplerChoice: 'candidates' });
    try {
      refuse = true; // the sampler session is made on first use, after the executor's own
      const sampling = { temperature: 0.8, topK: 10, seed: 1 };
      const r = await ex.forward({ session: 's', position: 0, tokenIds: [151643, 872, 13], sampling });
      if (r.kind !== 'token') throw new Error('expected a token');
      expect(r.tokenId).toBe(sampleToken(r.logits, sampling, 3).tokenId);
      expect(ex.samplingStats()).toMatchObject({ onDevice: 0, fallbacks: 1, reasons: { 'no sampler graph: no TopK here': 1 } });
    } finally {
      await ex.release();
    }
  }, 600_000);
});
