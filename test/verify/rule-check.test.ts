/**
 * Judging a token that Leviathan's rule drew (src/verify/token-check.ts
 * checkRuleToken against src/shard/speculative.ts verifyDraft): for random
 * target rows and a sampling drafter's drafts (proposeFromLogits on other
 * rows, at T > 0 with top-k/top-p), every token the rule emits is judged
 * exactly right (gap 0, the checker's own pick is it), and every other claim
 * — another residual token, a rejected proposal claimed accepted, an accepted
 * one claimed rejected — is judged wrong (gap > 0, mostly far above the 0.01
 * threshold).
 */
import { describe, expect, it } from 'vitest';
import { mulberry32 } from '../../src/model/fixture.ts';
import { draftProposals, proposeFromLogits, verifyDraft, type DraftProposal } from '../../src/shard/speculative.ts';
import type { SamplingParams } from '../../src/shard/sampling.ts';
import { checkRuleToken } from '../../src/verify/token-check.ts';

const V = 40;
const K = 3;

function rows(r: () => number, n: number, scale: number): Float32Array[] {
  return Array.from({ length: n }, () => Float32Array.from({ length: V }, () => (r() - 0.5) * scale));
}

describe('a token drawn by the speculative acceptance rule', () => {
  it('is judged right when it is the rule\'s, wrong otherwise, over 400 random steps', () => {
    const r = mulberry32(7);
    const lieGaps: number[] = [];
    let honestTokens = 0;
    for (let trial = 0; trial < 400; trial++) {
      const params: SamplingParams = { temperature: 0.5 + r(), seed: trial, ...(trial % 3 === 1 ? { topK: 12 } : {}), ...(trial % 3 === 2 ? { topP: 0.9 } : {}) };
      const P = 10 + trial;
      const target = rows(r, K + 1, 6);
      // The drafter's rows: the target's plus noise, so proposals are accepted often but not always.
      const draftRows = target.map((t) => t.map((x) => x + (r() - 0.5) * 3));
      const q = draftRows.map((d, i) => proposeFromLogits(d, params, P + i));
      const draft: DraftProposal = { ids: q.slice(0, K).map((x) => x.id), next: q[K]!.id, q: q.map((x) => x.q) };
      const v = verifyDraft((i) => target[i]!, draft, params, P, V);
      const props = draftProposals(draft);
      const m = v.tokenIds.length;
      for (let j = 0; j < m; j++) {
        const claimed = v.tokenIds[j]!;
        const accepted = j < m - 1 || (j === K && claimed === draft.next);
        const t = checkRuleToken(target[j]!, claimed, props[j]!, draft.q![j]!, params, P + j, accepted);
        expect(t.gap).toBe(0);
        expect(t.sampled).toBe(claimed);
        honestTokens++;
      }
      // Lies at the step's last token: another token as the residual draw, or the proposal claimed accepted.
      const j = m - 1;
      const other = (v.tokenIds[j]! + 1 + Math.floor(r() * (V - 1))) % V;
      const acceptedHere = j === K && v.tokenIds[j] === draft.next;
      if (other !== props[j]) lieGaps.push(checkRuleToken(target[j]!, other, props[j]!, draft.q![j]!, params, P + j, false).gap);
      if (!acceptedHere) lieGaps.push(checkRuleToken(target[j]!, props[j]!, props[j]!, draft.q![j]!, params, P + j, true).gap);
      // An accepted draft claimed rejected (the residual draw in its place).
      if (m > 1) lieGaps.push(checkRuleToken(target[0]!, other === props[0] ? (other + 1) % V : other, props[0]!, draft.q![0]!, params, P, false).gap);
    }
    expect(honestTokens).toBeGreaterThan(800);
    expect(lieGaps.length).toBeGreaterThan(600);
    for (const g of lieGaps) expect(g).toBeGreaterThan(0);
    // Most lies are far from the honest draw (threshold 0.01).
    expect(lieGaps.filter((g) => g > 0.01).length / lieGaps.length).toBeGreaterThan(0.8);
  });
});
