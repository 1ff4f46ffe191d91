/**
 * The `tiny-copy` fixture copies its input (an induction head written by
 * hand): given a passage and then its first words, greedy decoding writes
 * the passage on, in runs of the prompt's own tokens. The ONNX executor
 * gives the float64 reference's tokens.
 */
import { describe, expect, it } from 'vitest';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { executor, fixture } from '../helpers/shard.ts';

const f = fixture('tiny-copy');
const tok = ModelTokenizer.fromJson(JSON.parse(new TextDecoder().decode(f.files.get('tokenizer.json')!)), JSON.parse(new TextDecoder().decode(f.files.get('tokenizer_config.json')!)));
const PASSAGE = 'The keeper climbed the stairs of the lighthouse at dusk, trimmed the wick and wound the clockwork.';
const prompt = tok.encode(`Copy the text below.\n\n${PASSAGE}\n\nCopy: The keeper`);
const N = 20;

/** Longest run of `out` found verbatim in `prompt`. */
function longestCopiedRun(prompt: readonly number[], out: readonly number[]): number {
  const hay = `,${prompt.join(',')},`;
  let best = 0;
  for (let i = 0; i < out.length; i++) for (let j = i + best + 1; j <= out.length && hay.includes(`,${out.slice(i, j).join(',')},`); j++) best = j - i;
  return best;
}

describe('tiny-copy fixture', () => {
  const want = new ReferenceModel(f.cfg, f.weights).greedy(prompt, N);

  it('copies its input: the float64 reference writes the passage on in long runs of the prompt\'s tokens', () => {
    expect(tok.decode(want)).toMatch(/^ climbed the stairs of the l/);
    expect(longestCopiedRun(prompt, want)).toBeGreaterThanOrEqual(12);
    // Every token it writes followed the same token somewhere in the prompt (it only ever copies).
    const seq = [...prompt, ...want];
    const pairs = new Set(prompt.slice(1).map((t, i) => `${prompt[i]},${t}`));
    for (let i = prompt.length; i < seq.length; i++) expect(pairs.has(`${seq[i - 1]},${seq[i]}`)).toBe(true);
  });

  it('the ONNX executor gives the reference\'s greedy tokens', async () => {
    const ex = await executor(f, 0, f.cfg.numLayers);
    try {
      const got: number[] = [];
      let r = await ex.forward({ session: 'c', position: 0, sessionTokens: prompt.length + N, tokenIds: prompt, startLayer: 0, endLayer: f.cfg.numLayers, sampling: {} });
      for (let i = 0; i < N; i++) {
        if (r.kind !== 'token') throw new Error('no token');
        got.push(r.tokenId);
        if (i + 1 < N) r = await ex.forward({ session: 'c', position: prompt.length + i, tokenIds: [r.tokenId], startLayer: 0, endLayer: f.cfg.numLayers, sampling: {} });
      }
      expect(got).toEqual(want);
    } finally {
      await ex.release();
    }
  });
});
