/**
 * A completion's steps on their own, without HTTP: parse (limits and
 * defaults), plan (no route: 503 naming the layers), and the parts a
 * client sees (stop strings over the head's token texts).
 */
import { describe, expect, it } from 'vitest';
import { completionParts, parseCompletion, planCompletion, type CompletionPart } from '../../src/tracker/completion.ts';
import type { GenerationEvent } from '../../src/tracker/head-proxy.ts';
import { HttpError } from '../../src/tracker/http.ts';
import { resolveTrackerOptions } from '../../src/tracker/options.ts';
import { makeTracker } from './support.ts';

const chat = (extra: Record<string, unknown> = {}) => ({ model: 'small', messages: [{ role: 'user', content: [{ type: 'text', text: 'Say ' }, { type: 'text', text: 'hello' }] }], ...extra });

async function* events(texts: string[], finish: 'stop' | 'length' = 'length', closed = { done: false }): AsyncGenerator<GenerationEvent> {
  try {
    yield { type: 'start', promptTokens: 7 };
    for (let i = 0; i < texts.length; i++) yield { type: 'token', tokenId: 10 + i, text: texts[i]! };
    yield { type: 'done', finish, promptTokens: 7, completionTokens: texts.length };
  } finally {
    closed.done = true;
  }
}

async function collect(parts: AsyncIterable<CompletionPart>): Promise<CompletionPart[]> {
  const out: CompletionPart[] = [];
  for await (const p of parts) out.push(p);
  return out;
}

/** What `f` throws: OpenAI's error as an HttpError (status, and the body's param and code). */
const refusal = (status: number, error: Record<string, unknown> = {}) => expect.objectContaining({ status, body: expect.objectContaining({ error: expect.objectContaining(error) }) });

describe('parseCompletion', () => {
  it('fills the defaults: max_tokens from the options, top_p 0 as greedy, message parts joined, stop as a list', async () => {
    const t = await makeTracker();
    const ctx = { registry: t.registry, options: resolveTrackerOptions({ defaultMaxTokens: 33 }) };
    const c = parseCompletion(ctx, 'chat', chat({ top_p: 0, temperature: 0.7, stop: '###', stream: true, stream_options: { include_usage: true } }));
    expect(c).toEqual({
      model: 'small',
      stream: true,
      includeUsage: true,
      input: { max_tokens: 33, temperature: 0, top_p: 1, top_k: 0, stop: ['###'], messages: [{ role: 'user', content: 'Say hello' }] },
    });
    expect(parseCompletion(ctx, 'completion', { model: 'small', prompt: ['once'], seed: 4 }).input).toMatchObject({ prompt: 'once', seed: 4, temperature: 1 });
  });

  it('refuses what OpenAI refuses, naming the field: n > 1, max_tokens over the limit or the context, an unknown model', async () => {
    const t = await makeTracker();
    const ctx = { registry: t.registry, options: resolveTrackerOptions({ maxTokensLimit: 100 }) };
    expect(() => parseCompletion(ctx, 'chat', chat({ n: 2 }))).toThrow(refusal(400, { param: 'n', code: 'unsupported_value' }));
    expect(() => parseCompletion(ctx, 'chat', chat({ max_completion_tokens: 101 }))).toThrow(refusal(400, { param: 'max_completion_tokens' }));
    const big = { registry: t.registry, options: resolveTrackerOptions({ maxTokensLimit: 1 << 20 }) };
    expect(() => parseCompletion(big, 'chat', chat({ max_tokens: 1 << 19 }))).toThrow(refusal(400, { code: 'context_length_exceeded' }));
    expect(() => parseCompletion(ctx, 'chat', chat({ model: 'gpt-5' }))).toThrow(HttpError);
    expect(() => parseCompletion(ctx, 'chat', chat({ model: 'gpt-5' }))).toThrow(refusal(404, { code: 'model_not_found' }));
  });
});

describe('planCompletion', () => {
  it('answers 503 naming the missing layers when no node serves the model', async () => {
    const t = await makeTracker();
    expect(() => planCompletion(t, 'small')).toThrow(refusal(503, { missing_layers: expect.any(Array) }));
  });
});

describe('completionParts', () => {
  it('holds text back across tokens until a stop string completes or cannot, and finishes with the head\'s counts', async () => {
    let firsts = 0;
    const stopped = { done: false };
    const parts = await collect(completionParts(events(['He', 'llo wor', 'ld!', ' more'], 'length', stopped), ['world'], () => firsts++));
    expect(parts).toEqual([{ text: 'He' }, { text: 'llo ' }, { finish: 'stop', promptTokens: 7, completionTokens: 3 }]);
    expect(firsts).toBe(1);
    // A stop string ends the head's generation too.
    expect(stopped.done).toBe(true);
    const all = await collect(completionParts(events(['a <', '/b'], 'length'), ['</s>'], () => {}));
    expect(all).toEqual([{ text: 'a ' }, { text: '</b' }, { finish: 'length', promptTokens: 7, completionTokens: 2 }]);
  });
});
