import { describe, expect, it } from 'vitest';
import { AdaptiveK } from '../../../../src/node/head/speculation/adaptive-k.ts';
import type { Draft, Drafter } from '../../../../src/node/head/speculation/drafter.ts';
import { Speculator } from '../../../../src/node/head/speculation/speculator.ts';
import { MeshError } from '../../../../src/protocol/errors.ts';

/** Proposes `k` tokens 100, 101, … (and a q'd next when `stochastic`). */
class Counting implements Drafter {
  readonly kind = 'prompt-lookup' as const;
  asked: number[] = [];
  constructor(private readonly stochastic = false) {}
  propose(_accepted: readonly number[], k: number): Draft {
    this.asked.push(k);
    const ids = Array.from({ length: k }, (_, i) => 100 + i);
    if (!this.stochastic) return { ids };
    const q = [...ids, 999].map((id) => ({ ids: [id], probs: [1] }));
    return { ids, next: 999, q };
  }
  costPerToken(): number {
    return 0;
  }
  release(): void {}
}

const spec = (o: { k?: number; maxTokens?: number; declared?: number; stochastic?: boolean } = {}) => {
  const drafter = new Counting(o.stochastic);
  return { drafter, s: new Speculator({ drafter, policy: new AdaptiveK({ fixedK: o.k ?? 4 }), maxTokens: o.maxTokens ?? 100, declared: o.declared ?? 1000 }) };
};

describe('Speculator', () => {
  it('feeds the unfed tokens then the drafts; asks the hops to cut back what the last step wrote past the next position', async () => {
    const { s } = spec();
    const p1 = await s.plan([1, 2, 3], [3], 2, 0);
    expect(p1.tokens).toEqual([3, 100, 101, 102, 103]);
    expect(p1.draft).toEqual({ ids: [100, 101, 102, 103] });
    // Its own rows: a repeat of this step (a chain step retried as a star) is cut back and run again.
    expect(p1.rollbackFrom).toBe(7);
    s.settle(p1, { tokens: [100, 7], logprobs: [-1, -2], accepted: 1 });
    // Accepted 3, 100 (positions 2, 3); the hops hold up to 7.
    const p2 = await s.plan([1, 2, 3, 100, 7], [7], 4, 2);
    expect(p2.rollbackFrom).toBe(9);
    expect(s.counters).toEqual({ drafted: 4, accepted: 1, trips: 1, tokens: 2 });
  });

  it('cuts the draft at max_tokens (the step\'s last token counts) and at the declared length', async () => {
    const a = spec({ k: 8, maxTokens: 10 });
    expect((await a.s.plan([1, 2], [2], 1, 6)).draft!.ids).toHaveLength(3);
    expect((await a.s.plan([1, 2], [2], 1, 9)).draft).toBeUndefined();
    const b = spec({ k: 8, declared: 20 });
    // Position 15 + 1 unfed: room for 4 more rows.
    expect((await b.s.plan([1], [1], 15, 0)).draft!.ids).toHaveLength(4);
    // Plain step, nothing written past it: no rollback.
    const c = spec({ k: 0 });
    expect(await c.s.plan([1], [1], 3, 0)).toEqual({ tokens: [1], draftMs: expect.any(Number) });
  });

  it('a stochastic draft keeps its last-row proposal and one q per proposal, also when cut', async () => {
    const { s } = spec({ k: 3, stochastic: true, maxTokens: 3 });
    const p = await s.plan([1], [1], 1, 0);
    expect(p.draft!.ids).toEqual([100, 101]);
    expect(p.draft!.next).toBe(999);
    expect(p.draft!.q).toHaveLength(3);
  });

  it('refuses an answer that does not fit its draft', async () => {
    const { s } = spec({ k: 2 });
    const p = await s.plan([1], [1], 1, 0);
    expect(() => s.settle(p, { tokens: [100, 101, 5], logprobs: [], accepted: 3 })).toThrow(MeshError);
    expect(() => s.settle(p, { tokens: [9, 5], logprobs: [], accepted: 1 })).toThrow(/draft was 100/);
    expect(() => s.settle(p, { tokens: [5], logprobs: [], accepted: 1 })).toThrow(/emitted 1/);
  });
});
