/**
 * The GPU path on WebGPU, in Node, in CI: onnxruntime-web's native WebGPU EP
 * on Dawn (the `webgpu` npm package) over SwiftShader's Vulkan (correctness
 * only: a CPU pretending to be a GPU, slow). Checks the fused executor
 * against the float64 reference (4-bit on the dequantized weights), counts
 * the GPU programs one decode step runs per layer from onnxruntime's own log,
 * checks that every node was placed on the WebGPU EP, measures the bytes
 * crossing CPU↔GPU per decode step, and checks that GPU KV buffers are
 * exactly what the KV ledger grants (admission by declaration, 503 instead
 * of eviction, buffers freed with their session).
 *
 * vitest.config.ts puts chromium's Vulkan loader and SwiftShader's ICD in
 * the environment of the test processes (src/host/node/webgpu.ts vulkanEnv).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ortLog } from '../helpers/ort-log-tap.ts';
import type { DeviceMemory, OnnxBackend } from '../../src/shard/backend.ts';
import type { MeshError } from '../../src/protocol/errors.ts';
import type { FusedShardExecutor } from '../../src/shard/fused-executor.ts';
import { ReferenceModel, newRefCache } from '../../src/model/reference.ts';
import { dequantizedWeights, walkAgainstReference } from '../helpers/fused.ts';
import { fixture, maxAbsDiff } from '../helpers/shard.ts';
import { sharedWebGpu } from '../helpers/webgpu-backend.ts';


const { FusedShardExecutor: Fused } = await import('../../src/shard/fused-executor.ts');

// SwiftShader's f32 kernels sum in another order than float64.
const TOL = 1e-4;
const f = fixture('tiny');
const CHUNKS = [[5, 9, 33, 100, 7], [44], [12, 13, 14], [200]];

// One backend (one GPUDevice) for every test (test/helpers/webgpu-backend.ts says why); its info
// log (programs counted by two tests) is dropped unless a test taps it.
let backend: OnnxBackend;
let q4: FusedShardExecutor;

beforeAll(async () => {
  const { info, backend: shared } = await sharedWebGpu();
  expect(info.isFallbackAdapter || info.features.length > 0).toBe(true);
  backend = shared;
  ortLog.lines.length = 0; // what a suite before this one in the process left
  ortLog.tapping = true;
  q4 = await Fused.create({ config: f.cfg, backend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'q4', maxContext: 128, returnLogits: true });
  ortLog.tapping = false;
}, 600_000);

afterAll(async () => {
  await q4?.release();
});

describe('fused executor on WebGPU (Dawn in Node, SwiftShader)', () => {
  it('places every node on the WebGPU EP: onnxruntime inserted no host/device copy in any graph', () => {
    // A node on another EP would need MemcpyFromHost/MemcpyToHost around it; the transformer reports each insertion.
    const memcpy = ortLog.lines.filter((l) => l.includes('GraphTransformer MemcpyTransformer'));
    expect(memcpy.length).toBeGreaterThanOrEqual(3); // layers, embedding, head
    for (const l of memcpy) expect(l).toMatch(/modified: 0/);
  });

  it('4-bit: matches the float64 reference on the dequantized weights, sessions kept on the GPU', async () => {
    await walkAgainstReference(f, dequantizedWeights(f.weights), q4, CHUNKS, TOL, 'gpu-walk');
    expect(q4.onDevice).toBe(true);
  }, 600_000);

  it('a decode step runs at most 12 GPU programs per layer and moves under 64 KiB between CPU and GPU', async () => {
    const before = q4.transferStats();
    ortLog.lines.length = 0;
    ortLog.tapping = true;
    const position = CHUNKS.flat().length;
    q4.returnLogits = false;
    const r = await q4.forward({ session: 'gpu-walk', position, tokenIds: [17], sampling: { temperature: 0 } });
    q4.returnLogits = true;
    ortLog.tapping = false;
    if (r.kind !== 'token') throw new Error('expected a token');
    // The token the head's ArgMax picked on the GPU is the reference's greedy token.
    const ref = new ReferenceModel(f.cfg, dequantizedWeights(f.weights));
    const want = ref.forward([...CHUNKS.flat(), 17], 0, newRefCache(f.cfg)).subarray(position * f.cfg.vocabSize);
    expect(r.tokenId).toBe(want.indexOf(Math.max(...want)));
    expect(r.logits.length).toBe(0);
    const programs = ortLog.lines.filter((l) => l.includes('Starting program')).map((l) => /Starting program "([A-Za-z0-9]+)/.exec(l)?.[1] ?? '?');
    // Outside the layers: the embedding Gather, the span's closing Add, the head's Gather, norm and
    // matmul, and its greedy pick (ArgMax, ReduceMax, ReduceLogSumExp, Sub).
    const outside = ['Gather', 'Add', 'Gather', 'LayerNorm', 'MatMul', 'ArgMax', 'ReduceMax', 'ReduceLogSumExp', 'Sub'];
    const layerPrograms = programs.length - outside.length;
    expect(programs.length, programs.join(' ')).toBeGreaterThan(outside.length);
    expect(layerPrograms / f.cfg.numLayers, programs.join(' ')).toBeLessThanOrEqual(12);
    const after = q4.transferStats();
    expect(after.up - before.up + (after.down - before.down)).toBeLessThanOrEqual(64 * 1024);
    // What did cross: the token id and two counters in; the token id and its log-probability out.
    expect(after.up - before.up).toBe(8 + 4 + 4);
    expect(after.down - before.down).toBe(8 + 4);
  }, 600_000);

  it('a greedy decode step at positions 16 and 1024 moves the same 28 bytes: token and counters in, token and log-probability out', async () => {
    const ex = await Fused.create({ config: f.cfg, backend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 1088 });
    try {
      const ids = Array.from({ length: 1024 }, (_, i) => 3 + ((i * 53) % 500));
      const ref = new ReferenceModel(f.cfg, f.weights);
      const cache = newRefCache(f.cfg);
      const V = f.cfg.vocabSize;
      const greedy = (logits: Float64Array) => logits.indexOf(Math.max(...logits.subarray(logits.length - V)), logits.length - V) - (logits.length - V);
      const decode = async (position: number, token: number) => {
        const before = ex.transferStats();
        const r = await ex.forward({ session: 'long', position, tokenIds: [token], sampling: { temperature: 0 } });
        const after = ex.transferStats();
        if (r.kind !== 'token') throw new Error('expected a token');
        expect(r.tokenId, `position ${position}`).toBe(greedy(ref.forward([token], position, cache)));
        return { up: after.up - before.up, down: after.down - before.down };
      };
      await ex.forward({ session: 'long', position: 0, tokenIds: ids.slice(0, 16) });
      ref.forward(ids.slice(0, 16), 0, cache);
      const at16 = await decode(16, ids[16]!);
      await ex.forward({ session: 'long', position: 17, tokenIds: ids.slice(17) });
      ref.forward(ids.slice(17), 17, cache);
      const at1024 = await decode(1024, 42);
      console.log(`bytes per greedy decode step, CPU->GPU / GPU->CPU: position 16 ${at16.up}/${at16.down}, position 1024 ${at1024.up}/${at1024.down}`);
      expect(at16).toEqual({ up: 16, down: 12 });
      expect(at1024).toEqual(at16);
    } finally {
      await ex.release();
    }
  }, 600_000);

  it('f32 projections and a split span: activations stay on the GPU between segments and match the reference', async () => {
    const ex = await Fused.create({ config: f.cfg, backend, weights: () => f.weights, startLayer: 0, endLayer: 2, projections: 'f32', maxContext: 64, segmentBoundaries: [1] });
    try {
      const ref = new ReferenceModel(f.cfg, f.weights);
      const cache = newRefCache(f.cfg);
      let position = 0;
      for (const ids of CHUNKS.slice(0, 2)) {
        const before = ex.transferStats();
        const out = await ex.forward({ session: 's', position, tokenIds: ids });
        if (out.kind !== 'activation') throw new Error('expected an activation');
        const after = ex.transferStats();
        // In: ids and two counters; out: the activation, once (not between the two segments).
        expect(after.down - before.down).toBe(ids.length * f.cfg.hiddenSize * 4);
        const want = ref.layers(0, 2, ref.embed(ids), ids.length, position, cache);
        const d = maxAbsDiff(out.data, want);
        expect(d.err).toBeLessThanOrEqual(TOL * Math.max(1, d.scale));
        position += ids.length;
      }
    } finally {
      await ex.release();
    }
  }, 600_000);

  it('KV buffers on the GPU are what the ledger grants: grown on the device, a session that does not fit refused (503) without evicting, freed with their session', async () => {
    // Count the device memory the executor holds: every KV buffer comes from DeviceMemory.alloc.
    const device = backend.device!;
    let live = 0;
    const counted: DeviceMemory = {
      alloc: async (type, dims) => {
        const t = await device.alloc(type, dims);
        live += t.byteLength;
        const dispose = t.dispose;
        Object.assign(t, {
          dispose: () => {
            live -= t.byteLength;
            dispose();
          },
        });
        return t;
      },
      write: (dst, data, byteOffset) => device.write(dst, data, byteOffset),
      copy: (ops) => device.copy(ops),
      get transfer() {
        return device.transfer;
      },
      get lost() {
        return device.lost;
      },
    };
    const gpu: OnnxBackend = { name: backend.name, createSession: (model, opts) => backend.createSession(model, opts), device: counted };
    const L = f.cfg.numLayers;
    const perToken = 2 * L * f.cfg.numKvHeads * f.cfg.headDim * 4;
    const ex = await Fused.create({ config: f.cfg, backend: gpu, weights: () => f.weights, startLayer: 0, endLayer: L, projections: 'f32', maxContext: 256, kvBudgetBytes: 3 * 64 * perToken, kvBlockTokens: 64, returnLogits: true });
    try {
      // Undeclared, so it grows past its first block: rows copied on the device, logits still the reference's.
      const prompt = Array.from({ length: 60 }, (_, i) => 3 + ((i * 37) % 500));
      await walkAgainstReference(f, f.weights, ex, [prompt.slice(0, 40), prompt.slice(40), [7], [8], [9, 10, 11, 12, 13], [14]], TOL, 'g');
      expect(ex.kvStats().reservedBytes).toBe(2 * 64 * perToken);
      expect(live).toBe(2 * 64 * perToken);
      await ex.forward({ session: 'b', position: 0, sessionTokens: 50, tokenIds: [5, 6] });
      expect(live).toBe(3 * 64 * perToken);
      const err = (await ex.forward({ session: 'c', position: 0, sessionTokens: 10, tokenIds: [5] }).catch((e: unknown) => e)) as MeshError;
      expect([err.code, err.status]).toEqual(['MESH_ERR_BUSY', 503]);
      expect(live).toBe(3 * 64 * perToken);
      expect([ex.sessionLength('g'), ex.sessionLength('b'), ex.kvStats().evictions]).toEqual([68, 2, 0]);
      expect((await ex.forward({ session: 'g', position: 68, tokenIds: [15] })).kind).toBe('token');
      expect(ex.dropSession('g')).toBe(true);
      expect(live).toBe(64 * perToken);
      await ex.forward({ session: 'c', position: 0, sessionTokens: 10, tokenIds: [5] });
      expect(live).toBe(2 * 64 * perToken);
    } finally {
      await ex.release();
    }
    expect(live).toBe(0);
  }, 600_000);
});
