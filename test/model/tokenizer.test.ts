import { describe, expect, it } from 'vitest';
import fc from 'fast-check';
import { CHATML_TEMPLATE, makeModel } from '../../src/model/fixture.ts';
import { memoryFetch } from '../../src/model/memory-fetch.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { ModelFormatError } from '../../src/model/errors.ts';

const files = makeModel('tiny', 0);
const json = (name: string): unknown => JSON.parse(new TextDecoder().decode(files.get(name)));
const tok = ModelTokenizer.fromJson(json('tokenizer.json'), json('tokenizer_config.json'));

describe('fixture tokenizer (byte-level BPE)', () => {
  it('has the full vocabulary and ChatML specials at 0/1/2', () => {
    expect(tok.vocabSize).toBe(512);
    expect(tok.tokenToId('<|endoftext|>')).toBe(0);
    expect(tok.tokenToId('<|im_start|>')).toBe(1);
    expect(tok.tokenToId('<|im_end|>')).toBe(2);
    expect(tok.eosTokenIds).toEqual([2]);
    expect(tok.bosTokenId).toBe(1);
    expect(tok.isEos(2)).toBe(true);
    expect(tok.isEos(0)).toBe(false);
  });

  it('learned merges compress English', () => {
    const text = 'The weather changed quickly that afternoon, and the model runs on the mesh.';
    const ids = tok.encode(text);
    expect(ids.length).toBeLessThan(new TextEncoder().encode(text).length / 2);
    expect(tok.idToToken(tok.encode(' the')[0]!)).toBe('Ġthe');
  });

  it('round-trips arbitrary unicode text, emoji included (property)', () => {
    fc.assert(
      fc.property(fc.string({ unit: 'grapheme', maxLength: 80 }), (s) => {
        expect(tok.decode(tok.encode(s))).toBe(s);
      }),
      { numRuns: 300 },
    );
    for (const s of ['👩‍👩‍👧‍👦 family', '  leading and trailing  ', 'tabs\tand\nnewlines\r\n', '日本語のテキスト', 'a<|im_end|>b', 'x' + '\u0301'.repeat(5)]) {
      expect(tok.decode(tok.encode(s))).toBe(s);
    }
  });

  it('special tokens in text encode as single ids and can be skipped on decode', () => {
    const ids = tok.encode('hi<|im_end|>');
    expect(ids.at(-1)).toBe(2);
    expect(tok.decode(ids, { skipSpecialTokens: true })).toBe('hi');
  });

  it('decodes one id alone the same whether remembered or not, skipping specials or not (the stream decoder\'s window)', () => {
    const fresh = () => ModelTokenizer.fromJson(json('tokenizer.json'), json('tokenizer_config.json'));
    const a = fresh();
    const vocab = Math.min(a.vocabSize, 2048);
    for (const skipSpecialTokens of [false, true]) {
      const b = fresh();
      for (let id = 0; id < vocab; id++) {
        const first = a.decode([id], { skipSpecialTokens });
        expect(a.decode([id], { skipSpecialTokens })).toBe(first);
        expect(b.decode([id], { skipSpecialTokens })).toBe(first);
      }
    }
    expect(a.decode([2])).toBe('<|im_end|>');
    expect(a.decode([2], { skipSpecialTokens: true })).toBe('');
  });

  it('renders ChatML with a generation prompt', () => {
    const messages = [
      { role: 'system', content: 'Be brief.' },
      { role: 'user', content: 'Hello 👋' },
    ];
    const text = tok.applyChatTemplate(messages, { addGenerationPrompt: true });
    expect(text).toBe('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello 👋<|im_end|>\n<|im_start|>assistant\n');
    expect(tok.applyChatTemplate(messages)).not.toMatch(/assistant/);
    const ids = tok.encodeChat(messages);
    expect(ids[0]).toBe(1);
    expect(ids.filter((i) => i === 1)).toHaveLength(3);
    expect(ids.filter((i) => i === 2)).toHaveLength(2);
    expect(tok.decode(ids)).toBe(text);
  });

  it('streaming decode emits whole characters only and adds up to the full text', () => {
    fc.assert(
      // Inputs without U+FFFD: the check is that the decoder never *makes* one from a split character.
      fc.property(fc.string({ unit: 'grapheme', maxLength: 60 }).filter((x) => !x.includes('\uFFFD')), (s) => {
        const ids = tok.encode(s);
        const sd = tok.streamDecoder();
        let out = '';
        for (const id of ids) {
          const delta = sd.push(id);
          expect(delta).not.toContain('\uFFFD');
          out += delta;
        }
        out += sd.flush();
        expect(out).toBe(s);
      }),
      { numRuns: 200 },
    );
    // An emoji is 4 bytes; with no merge for it, it arrives as several tokens.
    const ids = tok.encode('🎉');
    expect(ids.length).toBeGreaterThan(1);
    const sd = tok.streamDecoder();
    const deltas = ids.map((id) => sd.push(id));
    expect(deltas.slice(0, -1).every((d) => d === '')).toBe(true);
    expect(deltas.at(-1)).toBe('🎉');
  });

  it('loads through an injected fetch, with chat_template.jinja as a fallback', async () => {
    const t = await ModelTokenizer.load(memoryFetch(files), 'mem://tiny');
    expect(t.encode('hello world')).toEqual(tok.encode('hello world'));
    const cfg = json('tokenizer_config.json') as Record<string, unknown>;
    delete cfg.chat_template;
    const alt = new Map(files);
    alt.set('tokenizer_config.json', new TextEncoder().encode(JSON.stringify(cfg)));
    alt.set('chat_template.jinja', new TextEncoder().encode(CHATML_TEMPLATE));
    const t2 = await ModelTokenizer.load(memoryFetch(alt), 'mem://tiny/', { extraEosTokenIds: [0] });
    expect(t2.applyChatTemplate([{ role: 'user', content: 'x' }])).toBe('<|im_start|>user\nx<|im_end|>\n');
    expect(t2.eosTokenIds).toEqual([0, 2]);
    alt.delete('chat_template.jinja');
    const t3 = await ModelTokenizer.load(memoryFetch(alt), 'mem://tiny/');
    expect(t3.hasChatTemplate).toBe(false);
    expect(() => t3.applyChatTemplate([])).toThrow(ModelFormatError);
    await expect(ModelTokenizer.load(memoryFetch(new Map()), 'mem://none/')).rejects.toThrow(/tokenizer/);
  });

  it('qwen2 fixture: null bos, eos im_end', () => {
    const q = makeModel('tiny-qwen2', 0);
    const j = (n: string): unknown => JSON.parse(new TextDecoder().decode(q.get(n)));
    const t = ModelTokenizer.fromJson(j('tokenizer.json'), j('tokenizer_config.json'));
    expect(t.bosTokenId).toBeNull();
    expect(t.eosTokenIds).toEqual([2]);
  });
});
