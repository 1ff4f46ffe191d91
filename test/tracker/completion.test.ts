/**
 * A completion's steps on their own, without HTTP: parse (limits and
 * defaults), plan (admission: a lease of KV room, 429 + Retry-After when
 * the queue is full, 503 naming the layers when there is no route), and the
 * parts a client sees (stop strings over the head's token texts).
 */
import { describe, expect, it } from 'vitest';
import { completionParts, parseCompletion, planCompletion, type CompletionPart } from '../../src/tracker/completion.ts';
import { PromptSizer, type GenerationEvent } from '../../src/tracker/head-proxy.ts';
import { HttpError } from '../../src/tracker/http.ts';
import { resolveTrackerOptions } from '../../src/tracker/options.ts';
import { FakeNode, makeTracker } from '../helpers/tracker.ts';

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
      inputs: [{ max_tokens: 33, temperature: 0, top_p: 1, top_k: 0, stop: ['###'], messages: [{ role: 'user', content: 'Say hello' }] }],
    });
    expect(parseCompletion(ctx, 'completion', { model: 'small', prompt: ['once'], seed: 4 }).inputs).toEqual([expect.objectContaining({ prompt: 'once', seed: 4, temperature: 1 })]);
  });

  it('makes one input per prompt of a completions request: text as prompt, token ids as prompt_token_ids', async () => {
    const t = await makeTracker();
    const ctx = { registry: t.registry, options: resolveTrackerOptions({}) };
    const inputs = parseCompletion(ctx, 'completion', { model: 'small', prompt: [[3, 4], [8]], max_tokens: 5 }).inputs;
    expect(inputs.map((i) => i.prompt_token_ids)).toEqual([[3, 4], [8]]);
    expect(inputs.every((i) => i.prompt === undefined && i.max_tokens === 5)).toBe(true);
    expect(parseCompletion(ctx, 'completion', { model: 'small', prompt: ['a', 'b'] }).inputs.map((i) => i.prompt)).toEqual(['a', 'b']);
    expect(parseCompletion(ctx, 'completion', { model: 'small', prompt: [7, 9] }).inputs.map((i) => i.prompt_token_ids)).toEqual([[7, 9]]);
  });

  it('answers a model whose checkpoint is still being retried 503 model_not_loaded, naming the URL and the failure', async () => {
    const t = await makeTracker();
    const pendingModels = new Map([['late', { url: 'http://example.invalid/late', attempts: 3, lastError: 'HTTP 404' }]]);
    const ctx = { registry: t.registry, options: resolveTrackerOptions({}), pendingModels };
    expect(() => parseCompletion(ctx, 'chat', chat({ model: 'late' }))).toThrow(refusal(503, { code: 'model_not_loaded', param: 'model', message: expect.stringContaining('http://example.invalid/late') }));
    expect(() => parseCompletion(ctx, 'chat', chat({ model: 'never' }))).toThrow(refusal(404, { code: 'model_not_found' }));
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
  const input = { max_tokens: 8, temperature: 0, top_p: 1, top_k: 0, stop: [], messages: [{ role: 'user', content: 'hi' }] };
  const ctxOf = (t: Awaited<ReturnType<typeof makeTracker>>) => ({ registry: t.registry, admission: t.admission, generation: { sizer: new PromptSizer() } });

  it('answers 503 naming the missing layers when no node serves the model', async () => {
    const t = await makeTracker();
    await expect(planCompletion(ctxOf(t), 'chat', { model: 'small', inputs: [input] }, new AbortController().signal)).rejects.toEqual(refusal(503, { missing_layers: expect.any(Array) }));
  });

  it('leases KV room on a route with room, and answers OpenAI\'s 429 with Retry-After when none has room and the queue is full', async () => {
    const t = await makeTracker({ queueMaxLength: 0 });
    const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1).withKv({ perToken: 1000, block: 64, budget: 64_000 });
    n.serving = { start_layer: 0, end_layer: 12 };
    await n.register(t);
    const [lease] = await planCompletion(ctxOf(t), 'chat', { model: 'small', inputs: [input] }, new AbortController().signal);
    expect(lease!.plan.hops.map((h) => h.id)).toEqual([n.peerId]);
    expect(t.registry.kvHeldOn(n.peerId)).toBe(64_000);
    const err = (await planCompletion(ctxOf(t), 'chat', { model: 'small', inputs: [input] }, new AbortController().signal).catch((e: unknown) => e)) as HttpError;
    expect(err).toEqual(refusal(429, { type: 'rate_limit_error', code: 'rate_limit_exceeded', reason: 'queue_full' }));
    expect(Number(err.headers['retry-after'])).toBeGreaterThanOrEqual(1);
    expect(Number(err.headers['retry-after-ms'])).toBeGreaterThanOrEqual(1000);
    lease!.release();
    expect(t.registry.kvHeldOn(n.peerId)).toBe(0);
    // Two prompts of one /v1/completions, room for one: all or none, so the one admitted gives its room back.
    const both = await planCompletion(ctxOf(t), 'completion', { model: 'small', inputs: [input, input] }, new AbortController().signal).catch((e: unknown) => e);
    expect(both).toEqual(refusal(429, { code: 'rate_limit_exceeded' }));
    expect(t.registry.kvHeldOn(n.peerId)).toBe(0);
    t.admission.close();
  });
});

describe('completionParts', () => {
  it('holds text back across tokens until a stop string completes or cannot, and finishes with the head\'s counts', async () => {
    let firsts = 0;
    const stopped = { done: false };
    const parts = await collect(completionParts(events(['He', 'llo wor', 'ld!', ' more'], 'length', stopped), ['world'], () => firsts++));
    // Ids ride with the part that releases their text; a stop string's own tokens come with the finish.
    expect(parts).toEqual([
      { text: 'He', tokenIds: [10] },
      { text: 'llo ', tokenIds: [11] },
      { finish: 'stop', promptTokens: 7, completionTokens: 3, tokenIds: [12] },
    ]);
    expect(firsts).toBe(1);
    // A stop string ends the head's generation too.
    expect(stopped.done).toBe(true);
    const all = await collect(completionParts(events(['a <', '/b'], 'length'), ['</s>'], () => {}));
    expect(all).toEqual([
      { text: 'a ', tokenIds: [10] },
      { text: '</b', tokenIds: [11] },
      { finish: 'length', promptTokens: 7, completionTokens: 2, tokenIds: [] },
    ]);
  });
});
