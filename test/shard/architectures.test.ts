/**
 * The published architectures (Llama 3.1 untied, SmolLM2, Mistral with its
 * sliding window, Qwen3 with q/k norms, Phi-3.5 with packed projections and
 * longrope) as fixture presets: the plain ONNX graphs (onnxruntime-node) and
 * the fused-operator graphs against the float64 reference, logits within
 * the existing suites' tolerances and greedy tokens equal.
 */
import { describe, expect, it } from 'vitest';
import { fusedUnsupportedReason } from '../../src/model/fused-graph.ts';
import { ReferenceModel, newRefCache } from '../../src/model/reference.ts';
import { FusedShardExecutor } from '../../src/shard/fused-executor.ts';
import type { ForwardResult } from '../../src/shard/executor.ts';
import { createWasmBackend } from '../../src/host/node/onnx-wasm.ts';
import { MeshError } from '../../src/protocol/errors.ts';
import { dequantizedWeights, walkAgainstReference } from '../helpers/fused.ts';
import { executor, fixture, maxAbsDiff, nodeBackend, prompts, type Fixture } from '../helpers/shard.ts';

const PRESETS = ['tiny-llama31', 'tiny-smollm2', 'tiny-mistral', 'tiny-qwen3', 'tiny-phi3', 'tiny-phi4mini'] as const;
const PLAIN_TOL = 1e-4; // test/model/graph.test.ts
const FUSED_TOL = 2e-5; // test/shard/fused-executor.test.ts (relative to max(1, scale))
const F16_TOL = 2e-2; // test/model/graph.test.ts
const GREEDY = 24;
const wasm = createWasmBackend({ numThreads: 1 });

interface Runner {
  forward(req: { session: string; position: number; tokenIds: readonly number[] }): Promise<ForwardResult>;
}

/** Greedy decoding through `run`, each step's logits checked against the reference; returns the tokens. */
async function greedyAgainstReference(f: Fixture, run: Runner, prompt: number[], n: number, check: (got: Float32Array, want: Float64Array) => void): Promise<number[]> {
  const ref = new ReferenceModel(f.cfg, f.weights);
  const cache = newRefCache(f.cfg);
  const V = f.cfg.vocabSize;
  let want = ref.forward(prompt, 0, cache).subarray((prompt.length - 1) * V);
  let r = await run.forward({ session: 'g', position: 0, tokenIds: prompt });
  const out: number[] = [];
  for (let i = 0; i < n; i++) {
    if (r.kind !== 'token') throw new Error('expected a token');
    check(r.logits, want);
    out.push(r.tokenId);
    const pos = prompt.length + i;
    want = ref.forward([r.tokenId], pos, cache);
    r = await run.forward({ session: 'g', position: pos, tokenIds: [r.tokenId] });
  }
  return out;
}

describe.each(PRESETS)('%s', (preset) => {
  const f = fixture(preset);
  const prompt = prompts(f.cfg.vocabSize, 3, 11)[2]!;

  it('plain graphs (per layer and one range) match the float64 reference, greedy tokens equal', async () => {
    const want = new ReferenceModel(f.cfg, f.weights).greedy(prompt, GREEDY);
    // A model that repeats one token would hide most errors.
    expect(new Set(want).size).toBeGreaterThan(3);
    for (const segmentBoundaries of [undefined, [] as number[]]) {
      const ex = await executor(f, 0, f.cfg.numLayers, segmentBoundaries ? { segmentBoundaries } : {});
      const got = await greedyAgainstReference(f, ex, prompt, GREEDY, (g, w) => {
        const { err, scale } = maxAbsDiff(g, w);
        expect(err, `max abs error ${err} vs scale ${scale}`).toBeLessThanOrEqual(PLAIN_TOL * scale);
      });
      expect(got).toEqual(want);
      await ex.release();
    }
  });

  it('plain graphs on onnxruntime-web (WASM, what browser nodes run) give the reference tokens; f16 graphs within tolerance', async () => {
    const want = new ReferenceModel(f.cfg, f.weights).greedy(prompt, 8);
    const ex = await executor(f, 0, f.cfg.numLayers, { backend: wasm });
    const got = await greedyAgainstReference(f, ex, prompt, 8, (g, w) => {
      const { err, scale } = maxAbsDiff(g, w);
      expect(err).toBeLessThanOrEqual(PLAIN_TOL * scale);
    });
    expect(got).toEqual(want);
    await ex.release();
    const half = await executor(f, 0, f.cfg.numLayers, { dtype: 'f16' });
    await greedyAgainstReference(f, half, prompt, 2, (g, w) => {
      const { err, scale } = maxAbsDiff(g, w);
      expect(err, `f16 max abs error ${err} vs scale ${scale}`).toBeLessThanOrEqual(F16_TOL * scale);
    });
    await half.release();
  });

  it('fused graphs (f32 and 4-bit projections) match the reference', async () => {
    expect(fusedUnsupportedReason(f.cfg)).toBeNull();
    const ex = await FusedShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 128 });
    const want = new ReferenceModel(f.cfg, f.weights).greedy(prompt, GREEDY);
    const got = await greedyAgainstReference(f, ex, prompt, GREEDY, (g, w) => {
      const { err, scale } = maxAbsDiff(g, w);
      expect(err, `max abs error ${err} vs scale ${scale}`).toBeLessThanOrEqual(FUSED_TOL * Math.max(1, scale));
    });
    expect(got).toEqual(want);
    await ex.release();
    const q4 = await FusedShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'q4', maxContext: 128 });
    await walkAgainstReference(f, dequantizedWeights(f.weights), q4, [prompt, [7], [8, 9, 10], [11]], FUSED_TOL);
    await q4.release();
  });
});

describe('the presets exercise what makes each architecture different', () => {
  // Each feature, turned off in the reference, changes the greedy tokens: the suites above would see a graph that ignored it.
  const differs = (preset: (typeof PRESETS)[number], change: (c: Fixture['cfg']) => Fixture['cfg']) => {
    const f = fixture(preset);
    const prompt = prompts(f.cfg.vocabSize, 3, 11)[2]!;
    const a = new ReferenceModel(f.cfg, f.weights).greedy(prompt, GREEDY);
    const b = new ReferenceModel(change(f.cfg), f.weights).greedy(prompt, GREEDY);
    expect(b).not.toEqual(a);
  };
  it('Mistral: the sliding window (16) is crossed', () => differs('tiny-mistral', (c) => ({ ...c, slidingWindow: null })));
  it('Llama 3.1: llama3 rope scaling', () => differs('tiny-llama31', (c) => ({ ...c, ropeScaling: null })));
  it('Phi-3.5: longrope short factors and attention factor', () => {
    differs('tiny-phi3', (c) => (c.ropeScaling?.type === 'longrope' ? { ...c, ropeScaling: { ...c.ropeScaling, attentionFactor: 1 } } : c));
    differs('tiny-phi3', (c) => (c.ropeScaling?.type === 'longrope' ? { ...c, ropeScaling: { ...c.ropeScaling, shortFactor: c.ropeScaling.shortFactor.map(() => 1) } } : c));
  });
  it('Phi-4-mini: partial rotary (48 of 64 values rotate)', () =>
    differs('tiny-phi4mini', (c) => ({ ...c, rotaryDim: c.headDim, ropeScaling: c.ropeScaling?.type === 'longrope' ? { ...c.ropeScaling, shortFactor: [...c.ropeScaling.shortFactor, 3, 3, 3, 3, 3, 3, 3, 3] } : c.ropeScaling })));
  it('Qwen3: q_norm / k_norm', () => {
    const f = fixture('tiny-qwen3');
    const prompt = prompts(f.cfg.vocabSize, 3, 11)[2]!;
    const ones = (name: string) => (/[qk]_norm/.test(name) ? { shape: [f.cfg.headDim], data: new Float32Array(f.cfg.headDim).fill(1) } : f.weights(name));
    expect(new ReferenceModel(f.cfg, ones).greedy(prompt, GREEDY)).not.toEqual(new ReferenceModel(f.cfg, f.weights).greedy(prompt, GREEDY));
  });
});

describe('longrope context', () => {
  it('tiny-phi3 serves up to original_max_position_embeddings (512) and refuses past it with MESH_ERR_TOO_LARGE', async () => {
    const f = fixture('tiny-phi3');
    expect(f.cfg.maxPositionEmbeddings).toBe(512);
    const ex = await executor(f, 0, f.cfg.numLayers, { maxContext: undefined });
    expect(ex.maxContext).toBe(512);
    const err = await ex.forward({ session: 'long', position: 0, tokenIds: Array.from({ length: 513 }, (_, i) => 3 + (i % 500)) }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(MeshError);
    expect((err as MeshError).code).toBe('MESH_ERR_TOO_LARGE');
    await ex.release();
  });
});

describe('concurrent sessions', () => {
  // Decode steps of several sessions may be batched by the executor (issue 11): whatever packs them must
  // keep each session's sliding window, rotary factor and partial rotary. Interleaved steps, each checked.
  it.each([
    ['tiny-mistral', 'plain'],
    ['tiny-phi4mini', 'plain'],
    ['tiny-mistral', 'fused'],
    ['tiny-phi4mini', 'fused'],
  ] as const)('%s, %s graphs: three sessions decoding at once (past the window for Mistral) each match the reference', async (preset, kind) => {
    const f = fixture(preset);
    const ex =
      kind === 'plain'
        ? await executor(f, 0, f.cfg.numLayers)
        : await FusedShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 128 });
    const tol = kind === 'plain' ? PLAIN_TOL : FUSED_TOL;
    const ref = new ReferenceModel(f.cfg, f.weights);
    const V = f.cfg.vocabSize;
    const sessions = prompts(V, 3, 23).map((p, i) => ({ id: `c${i}`, prompt: p, cache: newRefCache(f.cfg), pos: 0, next: p }));
    for (let step = 0; step < 20; step++) {
      const results = await Promise.all(sessions.map((s) => ex.forward({ session: s.id, position: s.pos, tokenIds: s.next })));
      results.forEach((r, i) => {
        const s = sessions[i]!;
        if (r.kind !== 'token') throw new Error('expected a token');
        const want = ref.forward(s.next, s.pos, s.cache).subarray((s.next.length - 1) * V);
        const { err, scale } = maxAbsDiff(r.logits, want);
        expect(err, `${s.id} step ${step}: ${err} vs ${scale}`).toBeLessThanOrEqual(tol * Math.max(1, scale));
        s.pos += s.next.length;
        s.next = [r.tokenId];
      });
    }
    if (preset === 'tiny-mistral') expect(Math.min(...sessions.map((s) => s.pos))).toBeGreaterThan(f.cfg.slidingWindow!);
    await ex.release();
  });
});
