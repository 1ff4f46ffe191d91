/**
 * The output distribution of speculative sampling through a real executor:
 * the `tiny` fixture (vocabulary 512) as the target; as the draft, the same
 * model sampled at temperature 1.4 (q ≠ p, overlapping enough that drafts
 * are accepted about half the time: both the acceptance and the residual
 * draw carry weight; another `tiny` checkpoint overlaps p by ~1 % only).
 * For 10,000 seeds at temperature 0.8 the draft samples two proposals from
 * its q (sent along, src/shard/speculative.ts) and the target executor
 * verifies them in one step; the first token must be distributed as the
 * float64 reference's softmax at 0.8 (chi-square), like speculation off's
 * draws.
 */
import { describe, expect, it } from 'vitest';
import { ReferenceModel, newRefCache } from '../../src/model/reference.ts';
import { proposeFromLogits, targetDistribution } from '../../src/shard/speculative.ts';
import { sampleToken, type SamplingParams } from '../../src/shard/sampling.ts';
import { chiSquareFit, chiSquareTwoSample } from '../helpers/chi-square.ts';
import { executor, fixture, prompts } from '../helpers/shard.ts';

const N = 10_000;

describe('speculative sampling through the executor', () => {
  it('first step at T = 0.8: 10,000 draws fit the target distribution (chi-square) and match speculation off', async () => {
    const target = fixture('tiny');
    const V = target.cfg.vocabSize;
    const prompt = prompts(V, 2, 5)[1]!;
    const P = prompt.length;
    const t = await executor(target, 0, target.cfg.numLayers);
    const d = t;
    try {
      const params: SamplingParams = { temperature: 0.8 };
      const draftT = 1.4;
      // The draft's logits after the prompt, and after the prompt and each first proposal (cached by it).
      const draftLogits = new Map<string, Float32Array>();
      const logitsOf = async (ids: number[]) => {
        const key = ids.join(',');
        let l = draftLogits.get(key);
        if (!l) {
          const r = await d.forward({ tokenIds: ids, sampling: {} });
          if (r.kind !== 'token') throw new Error('expected a token');
          l = r.logits.slice();
          draftLogits.set(key, l);
        }
        return l;
      };
      const spec = new Array<number>(V).fill(0);
      const off = new Array<number>(V).fill(0);
      let accepted = 0;
      for (let seed = 0; seed < N; seed++) {
        const p = { ...params, seed };
        const first = proposeFromLogits(await logitsOf(prompt), { ...p, temperature: draftT }, P);
        const second = proposeFromLogits(await logitsOf([...prompt, first.id]), { ...p, temperature: draftT }, P + 1);
        // One verification step: the prompt's last token's row judges the first proposal; the fed draft's row the second.
        const r = await t.forward({ tokenIds: [...prompt, first.id], sampling: p, draft: { ids: [first.id], next: second.id, q: [first.q, second.q] } });
        if (r.kind !== 'token' || !r.spec) throw new Error('expected a verification');
        spec[r.spec.tokenIds[0]!]!++;
        accepted += r.spec.accepted;
        if (seed === 0) {
          // Speculation off's own logits after the prompt, for its draws below.
          const o = await t.forward({ tokenIds: prompt, sampling: {} });
          if (o.kind !== 'token') throw new Error('expected a token');
          for (let s = 0; s < N; s++) off[sampleToken(o.logits, { ...params, seed: N + s }, P).tokenId]!++;
        }
      }
      // The float64 reference's distribution after the prompt at T = 0.8.
      const ref = new ReferenceModel(target.cfg, target.weights);
      const refLogits = Float32Array.from(ref.forward(prompt, 0, newRefCache(target.cfg)).subarray((P - 1) * V));
      const { order, weights, total } = targetDistribution(refLogits, params);
      const exact = new Array<number>(V).fill(0);
      order.forEach((id, i) => (exact[id] = weights[i]! / total));
      const fit = chiSquareFit(spec, exact);
      expect(fit.cells).toBeGreaterThan(10);
      expect(fit.pValue).toBeGreaterThan(1e-3);
      expect(chiSquareTwoSample(spec, off).pValue).toBeGreaterThan(1e-3);
      // Drafts are accepted often, but far from always (rejections and residual draws matter).
      expect(accepted / N).toBeGreaterThan(0.2);
      expect(accepted / N).toBeLessThan(0.95);
    } finally {
      await t.release();
    }
  }, 120_000);
});
