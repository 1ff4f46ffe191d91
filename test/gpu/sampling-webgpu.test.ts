/**
 * Temperature > 0 on WebGPU (Dawn in Node, SwiftShader) without bringing the
 * logits back (≤ 64 KiB across CPU↔GPU per decode step: docs/architecture.md):
 * the sampler graph (src/model/sampler-graph.ts) runs on the head's logits
 * on the GPU, its TopK included; the candidates it sends back decide the
 * token sampling.ts draws over the full logits, bit for bit, for seeds ×
 * temperatures × top_k × top_p on a 128,256-id vocabulary
 * (llama3-real-vocab), or the step falls back to the logits (counted).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ortLog } from '../helpers/ort-log-tap.ts';
import type { OnnxBackend } from '../../src/shard/backend.ts';
import type { FusedShardExecutor } from '../../src/shard/fused-executor.ts';
import { DeviceSampler } from '../../src/shard/device-sampler.ts';
import { sampleToken, type SamplingParams } from '../../src/shard/sampling.ts';
import { fixture } from '../helpers/shard.ts';
import { peakedLogits, SWEEP, sweepRow } from '../helpers/sampling.ts';
import { sharedWebGpu } from '../helpers/webgpu-backend.ts';


const { FusedShardExecutor: Fused } = await import('../../src/shard/fused-executor.ts');

const f = fixture('llama3-real-vocab');
const V = f.cfg.vocabSize;

let backend: OnnxBackend;
let sampler: DeviceSampler;

beforeAll(async () => {
  backend = (await sharedWebGpu()).backend;
  sampler = new DeviceSampler(backend, V);
}, 600_000);

afterAll(async () => {
  await sampler?.release();
});

async function onGpu(row: Float32Array, temperature: number) {
  const c = await sampler.candidates({ type: 'float32', data: row, dims: [1, V] }, temperature);
  if (typeof c === 'string') throw new Error(c);
  return c;
}

describe('sampling at temperature > 0 on WebGPU (Dawn in Node, SwiftShader)', () => {
  it('the sampler graph runs on the WebGPU EP, TopK included: no host copies inserted', async () => {
    ortLog.lines.length = 0; // what a suite before this one in the process left
    ortLog.tapping = true;
    const row = peakedLogits(V, 5);
    const c = await onGpu(row, 1);
    ortLog.tapping = false;
    // A node on another EP would need MemcpyFromHost/MemcpyToHost around it; the transformer reports each insertion.
    const memcpy = ortLog.lines.filter((l) => l.includes('GraphTransformer MemcpyTransformer'));
    expect(memcpy.length).toBeGreaterThanOrEqual(1);
    for (const l of memcpy) expect(l).toMatch(/modified: 0/);
    const programs = ortLog.lines.filter((l) => l.includes('Starting program')).map((l) => /Starting program "([A-Za-z]+)/.exec(l)?.[1] ?? '?');
    const topk = programs.filter((p) => p.startsWith('TopK')).length;
    // onnxruntime's WebGPU TopK is a bitonic sort of the row padded to 2^17: init, 153 steps, output.
    console.log(`sampler graph on WebGPU, vocab ${V}: ${programs.length} GPU programs, ${topk} of them TopK`);
    expect(topk).toBeGreaterThan(2);
    // The K largest, largest first, exactly the logits' own values.
    const sorted = Float32Array.from(row).sort().reverse();
    expect(Array.from(c.values).slice(0, 257)).toEqual(Array.from(sorted.subarray(0, 257)));
    for (let i = 0; i < c.values.length; i++) expect(row[Number(c.ids[i])]).toBe(c.values[i]);
  }, 600_000);

  it('every token decided from the GPU candidates is sampling.ts\'s over the full logits (seeds × T × top_k × top_p)', async () => {
    const row = peakedLogits(V, 6);
    const r = await sweepRow(row, 77, (t) => onGpu(row, t));
    const combos = SWEEP.temperatures.length * SWEEP.seeds.length * SWEEP.topKs.length * SWEEP.topPs.length;
    console.log(`WebGPU sampler sweep: ${r.decided} of ${combos} decided on the candidates, ${r.fallbacks} fell back; worst f32 normalizer error ${r.worstNormalizerError.toExponential(2)}`, r.reasons);
    expect(r.mismatches).toEqual([]);
    expect(r.worstNormalizerError).toBeLessThan(5e-4); // NORMALIZER_REL_TOL is 2e-3
    for (const k of [20, 50, 256]) expect(r.fallbacksByTopK[k] ?? 0, `top_k ${k}`).toBe(0);
    expect(r.decided).toBeGreaterThan(3 * r.fallbacks);
  }, 600_000);

  it('a sampled decode step moves ≤ 64 KiB at positions 16 and 1024 and returns sampling.ts\'s token', async () => {
    const ex: FusedShardExecutor = await Fused.create({ config: f.cfg, backend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 1088, samplerChoice: 'candidates' });
    try {
      const ids = Array.from({ length: 1024 }, (_, i) => 1000 + ((i * 7919) % 120000));
      const typical: SamplingParams = { temperature: 0.6, topK: 20, topP: 0.95 };
      const openai: SamplingParams = { temperature: 1 }; // what an OpenAI client sends by default
      // Two sessions in lock step: 'full' returns its logits (the reference draw), 'gpu' returns only its token.
      const step = async (position: number, token: number, sampling: SamplingParams) => {
        ex.returnLogits = true;
        const a = await ex.forward({ session: 'full', position, tokenIds: [token], sampling });
        ex.returnLogits = false;
        const before = ex.transferStats();
        const fellBack = ex.samplingStats().fallbacks;
        const b = await ex.forward({ session: 'gpu', position, tokenIds: [token], sampling });
        const after = ex.transferStats();
        if (a.kind !== 'token' || b.kind !== 'token') throw new Error('expected tokens');
        expect(b.tokenId, `${JSON.stringify(sampling)} at ${position}`).toBe(sampleToken(a.logits, sampling, position + 1).tokenId);
        expect(Math.abs(b.logprob - a.logprob)).toBeLessThan(1e-3);
        return { up: after.up - before.up, down: after.down - before.down, fellBack: ex.samplingStats().fallbacks > fellBack };
      };
      const prefill = async (from: number, to: number) => {
        ex.returnLogits = true;
        for (const session of ['full', 'gpu']) await ex.forward({ session, position: from, tokenIds: ids.slice(from, to) });
      };
      await prefill(0, 16);
      const at16 = await step(16, ids[16]!, { ...typical, seed: 16 });
      const plain16 = await step(17, ids[17]!, { ...openai, seed: 17 });
      await prefill(18, 1024);
      const at1024 = await step(1024, 42, { ...typical, seed: 1024 });
      const plain1024 = await step(1025, 43, { ...openai, seed: 1025 });
      console.log(
        `bytes per sampled decode step (T 0.6, top_k 20, top_p 0.95), CPU->GPU / GPU->CPU: position 16 ${at16.up}/${at16.down}, position 1024 ${at1024.up}/${at1024.down}; ` +
          `T 1 without cuts: ${plain16.up}/${plain16.down} (fell back: ${plain16.fellBack}), ${plain1024.up}/${plain1024.down} (fell back: ${plain1024.fellBack})`,
        ex.samplingStats(),
      );
      for (const s of [at16, at1024]) {
        expect(s.fellBack).toBe(false);
        expect(s.up + s.down).toBeLessThanOrEqual(64 * 1024);
      }
      // Token, two counters and the temperature in; 257 candidates (f32 + int64) and two normalizers out,
      // and the head graph's greedy pick (12 B), which comes down with every head run.
      expect(at16).toEqual({ up: 8 + 4 + 4 + 4, down: 257 * 12 + 8 + 12, fellBack: false });
      expect(at1024).toEqual(at16);
      // A step that cannot decide on the candidates still answers right, with the logits' bytes on top.
      for (const s of [plain16, plain1024]) if (s.fellBack) expect(s.down).toBeGreaterThanOrEqual(V * 4);
    } finally {
      await ex.release();
    }
  }, 900_000);
});
