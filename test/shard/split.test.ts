/**
 * Cutting the model into 2 and 3 shards, with the activation rounded through
 * bf16 at every boundary (what the wire does), keeps the un-split model's
 * greedy 32-token continuation for 5 prompts. Logit tolerance across a split:
 * max |error| <= 2e-2 × max |logit| (bf16 has an 8-bit mantissa: each boundary
 * perturbs the residual stream by up to 2^-9 relative).
 */
import { describe, expect, it } from 'vitest';
import { roundThrough } from '../../src/protocol/tensor.ts';
import type { ShardExecutor } from '../../src/shard/executor.ts';
import { executor, fixture, maxAbsDiff, prompts } from '../helpers/shard.ts';

const TOKENS = 32;
const SPLIT_TOL = 2e-2;

interface Run {
  tokens: number[];
  logits: Float32Array[];
}

/** Greedy continuation through a chain of shards, bf16 between them. */
async function generate(chain: ShardExecutor[], prompt: number[], session: string): Promise<Run> {
  const tokens: number[] = [];
  const logits: Float32Array[] = [];
  let input = prompt;
  let position = 0;
  for (let step = 0; step < TOKENS; step++) {
    let act: Float32Array | null = null;
    for (const ex of chain) {
      const r = await ex.forward(
        act === null
          ? { session, position, tokenIds: input }
          : { session, position, activation: { data: roundThrough(act, 'bf16'), shape: [1, input.length, ex.config.hiddenSize] } },
      );
      if (r.kind === 'token') {
        tokens.push(r.tokenId);
        logits.push(r.logits);
      } else act = r.data;
    }
    position += input.length;
    input = [tokens[tokens.length - 1]!];
  }
  return { tokens, logits };
}

function cutsOf(layers: number, parts: 2 | 3): number[][] {
  const out: number[][] = [];
  for (let a = 1; a < layers; a++) {
    if (parts === 2) out.push([a]);
    else for (let b = a + 1; b < layers; b++) out.push([a, b]);
  }
  return out;
}

// tiny (4 layers) is cut at every place; small (12 layers, untied head, 3 checkpoint files) only where a
// boundary's bf16 rounding has the most layers after it (behind layer 0) or the fewest (before the head).
describe.each([
  { preset: 'tiny' as const, two: null, three: null },
  { preset: 'small' as const, two: [[1], [11]], three: [[10, 11]] },
])('$preset split into shards', ({ preset, two, three }) => {
  const f = fixture(preset);
  const L = f.cfg.numLayers;
  const ps = prompts(f.cfg.vocabSize, 5, 3);
  const shards = new Map<string, Promise<ShardExecutor>>();
  const shard = (a: number, b: number) => {
    const key = `${a}-${b}`;
    if (!shards.has(key)) shards.set(key, executor(f, a, b, { kvBudgetBytes: 2 ** 30 }));
    return shards.get(key)!;
  };
  let baseline: Run[] = [];

  it('un-split baseline', async () => {
    const whole = await shard(0, L);
    baseline = [];
    for (const [i, p] of ps.entries()) baseline.push(await generate([whole], p, `base-${i}`));
    // Greedy output that never changes would make the comparison vacuous.
    expect(new Set(baseline.flatMap((r) => r.tokens)).size).toBeGreaterThan(10);
  });

  const cuts = [...(two ?? cutsOf(L, 2)), ...(three ?? cutsOf(L, 3))];
  it.each(cuts.map((c) => [c.join('|'), c] as const))('cut at %s: same greedy tokens, logits within tolerance', async (_name, cut) => {
    const bounds = [0, ...cut, L];
    const chain = await Promise.all(bounds.slice(1).map((b, i) => shard(bounds[i]!, b)));
    for (const [i, p] of ps.entries()) {
      const run = await generate(chain, p, `cut-${cut.join('_')}-${i}`);
      expect(run.tokens).toEqual(baseline[i]!.tokens);
      for (let t = 0; t < TOKENS; t++) {
        const { err, scale } = maxAbsDiff(run.logits[t]!, baseline[i]!.logits[t]!);
        expect(err).toBeLessThanOrEqual(SPLIT_TOL * scale);
      }
    }
  });

  it('overlapping shards: the second starts inside its range where the first stopped', async () => {
    if (L < 3) return;
    const a = await shard(0, L - 1);
    const b = await shard(1, L);
    const p = ps[0]!;
    let position = 0;
    let input = p;
    const tokens: number[] = [];
    for (let step = 0; step < 8; step++) {
      const r1 = await a.forward({ session: 'ov', position, tokenIds: input, endLayer: 2 });
      if (r1.kind !== 'activation') throw new Error('expected an activation');
      const r2 = await b.forward({ session: 'ov', position, startLayer: 2, activation: { data: roundThrough(r1.data, 'bf16'), shape: r1.shape } });
      if (r2.kind !== 'token') throw new Error('expected a token');
      tokens.push(r2.tokenId);
      position += input.length;
      input = [r2.tokenId];
    }
    expect(tokens).toEqual(baseline[0]!.tokens.slice(0, 8));
  });
});
