/**
 * `meshnet node --backend webgpu --graph-capture` reaches the executor: the
 * Node host's backend factory (src/host/node/backends.ts) hands out fused
 * graphs with graph capture on, and a span built from its choice decodes
 * through the captured graph (captureStats counts replayed steps) with the
 * float64 reference's greedy tokens. Without the option nothing is captured.
 * Dawn over SwiftShader: correctness only.
 */
import { describe, expect, it } from 'vitest';
import { nodeBackends } from '../../src/host/node/backends.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { createSpanExecutor } from '../../src/shard/span-executor.ts';
import type { FusedShardExecutor } from '../../src/shard/fused-executor.ts';
import { fixture } from '../helpers/shard.ts';

const f = fixture('tiny');
const PROMPT = [1, 15, 27, 3];
const STEPS = 6;

async function decode(graphCapture: boolean): Promise<{ tokens: number[]; captured: number }> {
  const backends = nodeBackends({ choice: 'webgpu', graphCapture, log: () => undefined });
  try {
    const span = { model: 'tiny', modelUrl: 'mem://tiny/', startLayer: 0, endLayer: f.cfg.numLayers };
    const chosen = await backends.choose(span as Parameters<typeof backends.choose>[0], f.cfg, () => f.weights);
    expect(chosen.graphs).toMatchObject({ kind: 'fused', ...(graphCapture ? { graphCapture: true } : {}) });
    const ex = await createSpanExecutor({ config: f.cfg, backend: chosen.backend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, graphs: chosen.graphs!, maxContext: 32, memoryBudgetBytes: 2 ** 28 });
    try {
      const tokens: number[] = [];
      let r = await ex.forward({ session: 's', position: 0, tokenIds: PROMPT });
      for (let i = 0; ; i++) {
        if (r.kind !== 'token') throw new Error('expected a token');
        tokens.push(r.tokenId);
        if (i === STEPS) break;
        r = await ex.forward({ session: 's', position: PROMPT.length + i, tokenIds: [r.tokenId] });
      }
      return { tokens, captured: (ex as unknown as FusedShardExecutor).captureStats()?.steps ?? 0 };
    } finally {
      await ex.release();
    }
  } finally {
    backends.close();
  }
}

describe('the Node host on WebGPU with --graph-capture', () => {
  it('decodes through the captured graph with the reference greedy tokens; without the option nothing is captured', async () => {
    const want = new ReferenceModel(f.cfg, f.weights).greedy(PROMPT, STEPS + 1);
    const on = await decode(true);
    expect(on.tokens).toEqual(want);
    expect(on.captured).toBe(STEPS);
    const off = await decode(false);
    expect(off.tokens).toEqual(want);
    expect(off.captured).toBe(0);
  }, 600_000);
});
