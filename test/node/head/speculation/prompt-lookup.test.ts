import { describe, expect, it } from 'vitest';
import { PromptLookupDrafter } from '../../../../src/node/head/speculation/prompt-lookup.ts';

describe('PromptLookupDrafter', () => {
  it('continues after the last earlier occurrence of the longest matching suffix', () => {
    const d = new PromptLookupDrafter();
    // "10 11 12" appears twice; its latest earlier occurrence is followed by 40 41.
    const prompt = [1, 10, 11, 12, 30, 31, 2, 10, 11, 12, 40, 41, 3, 11, 12];
    expect(d.propose(prompt, 4).ids).toEqual([40, 41, 3, 11]);
    // A longer suffix wins over a more recent shorter one.
    const d2 = new PromptLookupDrafter();
    const seq = [5, 6, 7, 8, 9, 1, 7, 2, 5, 6, 7];
    expect(d2.propose(seq, 2).ids).toEqual([8, 9]);
  });

  it('grows with the accepted sequence, and proposes nothing without a match', () => {
    const d = new PromptLookupDrafter();
    expect(d.propose([1, 2, 3, 4], 5).ids).toEqual([]);
    expect(d.propose([1, 2, 3, 4, 9, 1, 2], 3).ids).toEqual([3, 4, 9]);
    expect(d.propose([1, 2, 3, 4, 9, 1, 2], 0).ids).toEqual([]);
    expect(() => d.propose([1, 2], 3)).toThrow(/shrank/);
  });

  it('follows a loop round to k tokens', () => {
    const d = new PromptLookupDrafter();
    expect(d.propose([7, 3, 4, 3, 4, 3, 4], 6).ids).toEqual([3, 4, 3, 4, 3, 4]);
  });

  it('minN 1 drafts on a single repeated token; the default does not', () => {
    expect(new PromptLookupDrafter().propose([4, 5, 6, 4], 2).ids).toEqual([]);
    expect(new PromptLookupDrafter({ minN: 1 }).propose([4, 5, 6, 4], 2).ids).toEqual([5, 6]);
    expect(() => new PromptLookupDrafter({ minN: 3, maxN: 2 })).toThrow(RangeError);
  });

  it('a prediction is followed from the start while the output agrees, then looked up by n-gram', () => {
    const prompt = [100, 101];
    const prediction = [1, 2, 3, 4, 5, 6, 7, 8];
    const d = new PromptLookupDrafter({ prediction });
    expect(d.kind).toBe('prediction');
    expect(d.propose(prompt, 3).ids).toEqual([1, 2, 3]);
    expect(d.propose([...prompt, 1, 2], 3).ids).toEqual([3, 4, 5]);
    // Diverged (9 instead of 3), then back on a known bigram: the prediction's continuation.
    expect(d.propose([...prompt, 1, 2, 9, 5, 6], 2).ids).toEqual([7, 8]);
    // At its end nothing more comes from it.
    expect(d.propose([...prompt, 1, 2, 9, 5, 6, 7, 8], 2).ids).toEqual([]);
  });
});
