import { describe, expect, it } from 'vitest';
import type { GenerateEvent } from '../../src/protocol/tracker.ts';
import { verifyRoute } from '../../src/tracker/signing.ts';
import { verifyChainReply } from '../../src/node/tracker-client.ts';
import { decodeBase64 } from '../../src/protocol/base64.ts';
import { FakeNode, makeTracker, scriptedTransport, tokenEvents, type TestTracker } from '../helpers/tracker.ts';

type Script = Parameters<typeof scriptedTransport>[0][string][number];

async function headServing(t: TestTracker, start = 0, end = 12, layerMs = 1): Promise<FakeNode> {
  const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(layerMs);
  n.serving = { start_layer: start, end_layer: end };
  await n.register(t);
  return n;
}

const post = (t: TestTracker, path: string, body: unknown) =>
  t.app.request(path, { method: 'POST', headers: { 'content-type': 'application/json' }, body: typeof body === 'string' ? body : JSON.stringify(body) });

const chat = (extra: Record<string, unknown> = {}) => ({ model: 'small', messages: [{ role: 'user', content: 'Say hello' }], ...extra });

function happy(texts: string[], finish: 'stop' | 'length' = 'stop'): Script {
  return () => [{ type: 'start', prompt_tokens: 7, route: [] } as GenerateEvent, ...tokenEvents(texts), { type: 'done', finish_reason: finish, completion_tokens: texts.length, prompt_tokens: 7 } as GenerateEvent];
}

/** Parse an SSE body, checking the framing on the way: every event is exactly `data: …\n\n`. */
function parseSse(text: string): { events: unknown[]; done: boolean } {
  expect(text.endsWith('\n\n')).toBe(true);
  const blocks = text.slice(0, -2).split('\n\n');
  const events: unknown[] = [];
  let done = false;
  for (const b of blocks) {
    expect(b.startsWith('data: ')).toBe(true);
    expect(b.includes('\n')).toBe(false);
    const payload = b.slice(6);
    if (payload === '[DONE]') {
      expect(done).toBe(false);
      done = true;
    } else {
      expect(done).toBe(false); // nothing after [DONE]
      events.push(JSON.parse(payload));
    }
  }
  return { events, done };
}

describe('OpenAI errors', () => {
  it('answers malformed requests with 400 in the OpenAI error shape', async () => {
    const t = await makeTracker();
    const cases: Array<[unknown, string | null]> = [
      ['{not json', null],
      [{ model: 'small' }, 'messages'],
      [{ model: 'small', messages: 'hi' }, 'messages'],
      [{ model: 'small', messages: [] }, 'messages'],
      [{ model: 'small', messages: [{ role: 'wizard', content: 'x' }] }, 'messages.0.role'],
      [chat({ temperature: 3 }), 'temperature'],
      [chat({ top_p: -1 }), 'top_p'],
      [chat({ max_tokens: 0 }), 'max_tokens'],
      [chat({ max_tokens: 1.5 }), 'max_tokens'],
      [chat({ stop: ['a', 'b', 'c', 'd', 'e'] }), 'stop'],
      [chat({ stream: 'yes' }), 'stream'],
      [chat({ n: 2 }), 'n'],
      [{ messages: [{ role: 'user', content: 'x' }] }, 'model'],
    ];
    for (const [body, param] of cases) {
      const res = await post(t, '/v1/chat/completions', body);
      expect(res.status, JSON.stringify(body)).toBe(400);
      const e = ((await res.json()) as { error: { message: string; type: string; param: string | null; code: string | null } }).error;
      expect(e.type).toBe('invalid_request_error');
      expect(typeof e.message).toBe('string');
      expect(e.message.length).toBeGreaterThan(5);
      if (param !== null) expect(e.param).toBe(param);
      expect('code' in e).toBe(true);
    }
    const bad = await post(t, '/v1/completions', { model: 'small' });
    expect(bad.status).toBe(400);
    expect(((await bad.json()) as { error: { param: string } }).error.param).toBe('prompt');
  });

  it('answers an unknown model with 404 model_not_found', async () => {
    const t = await makeTracker();
    for (const path of ['/v1/chat/completions', '/v1/completions']) {
      const res = await post(t, path, path.endsWith('chat/completions') ? chat({ model: 'gpt-5' }) : { model: 'gpt-5', prompt: 'x' });
      expect(res.status).toBe(404);
      const e = ((await res.json()) as { error: { code: string; param: string; type: string; message: string } }).error;
      expect(e.code).toBe('model_not_found');
      expect(e.param).toBe('model');
      expect(e.message).toMatch(/gpt-5/);
    }
    expect((await t.app.request('/v1/models/gpt-5')).status).toBe(404);
  });

  it('refuses max_tokens beyond the configured limit and beyond the model context', async () => {
    const t = await makeTracker({ maxTokensLimit: 100 });
    const over = await post(t, '/v1/chat/completions', chat({ max_tokens: 101 }));
    expect(over.status).toBe(400);
    const e = ((await over.json()) as { error: { param: string; message: string } }).error;
    expect(e.param).toBe('max_tokens');
    expect(e.message).toMatch(/limit of 100/);
    const overNew = await post(t, '/v1/chat/completions', chat({ max_completion_tokens: 500 }));
    expect(((await overNew.json()) as { error: { param: string } }).error.param).toBe('max_completion_tokens');
    const t2 = await makeTracker({ maxTokensLimit: 100_000 });
    const ctx = await post(t2, '/v1/completions', { model: 'small', prompt: 'x', max_tokens: 4096 });
    expect(ctx.status).toBe(400);
    const e2 = ((await ctx.json()) as { error: { code: string; message: string } }).error;
    expect(e2.code).toBe('context_length_exceeded');
    expect(e2.message).toMatch(/2048/);
  });

  it('lists models at GET /v1/models', async () => {
    const t = await makeTracker();
    const res = await t.app.request('/v1/models');
    const body = (await res.json()) as { object: string; data: Array<{ id: string; object: string; owned_by: string }> };
    expect(body.object).toBe('list');
    expect(body.data.map((m) => [m.id, m.object])).toEqual([['small', 'model']]);
  });

  it('keeps serving after garbage on every route', async () => {
    const t = await makeTracker();
    for (const p of ['/v1/chat/completions', '/v1/completions', '/api/nodes/register', '/api/nodes/heartbeat', '/api/route/replace']) {
      const res = await post(t, p, '\u0000\u0001garbage');
      expect(res.status).toBeGreaterThanOrEqual(400);
      expect(res.status).toBeLessThan(500);
    }
    expect((await t.app.request('/nope')).status).toBe(404);
    expect((await t.app.request('/v1/models', { method: 'DELETE' })).status).toBe(405);
    expect((await t.app.request('/healthz')).status).toBe(200);
  });
});

async function setup(o: Parameters<typeof makeTracker>[0] = {}, heads = 1) {
  const scripts: Record<string, Script[]> = {};
  const st = scriptedTransport(scripts);
  const t = await makeTracker(o, st.transport);
  const hs: FakeNode[] = [];
  for (let i = 0; i < heads; i++) hs.push(await headServing(t, 0, 12, 1 + i));
  return { t, heads: hs, scripts, calls: st.calls };
}

describe('chat completions through a head', () => {
  it('returns a chat.completion with the head\'s text, finish reason and usage', async () => {
    const { t, heads, scripts, calls } = await setup();
    scripts[heads[0]!.peerId] = [happy(['Hel', 'lo', '!'])];
    const res = await post(t, '/v1/chat/completions', chat({ max_tokens: 10, seed: 3, temperature: 0.5, stop: '###' }));
    expect(res.status).toBe(200);
    const body = (await res.json()) as { id: string; object: string; model: string; choices: Array<{ index: number; message: { role: string; content: string }; finish_reason: string }>; usage: Record<string, number> };
    expect(body.object).toBe('chat.completion');
    expect(body.id).toMatch(/^chatcmpl-/);
    expect(body.model).toBe('small');
    expect(body.choices[0]!.message).toMatchObject({ role: 'assistant', content: 'Hello!' });
    expect(body.choices[0]!.finish_reason).toBe('stop');
    expect(body.usage).toEqual({ prompt_tokens: 7, completion_tokens: 3, total_tokens: 10 });
    // What the head got: the generate contract.
    expect(calls[0]!.body).toMatchObject({ messages: [{ role: 'user', content: 'Say hello' }], max_tokens: 10, seed: 3, temperature: 0.5, top_p: 1, stop: ['###'], prefix_token_ids: [] });
    expect(typeof calls[0]!.body.session_id).toBe('string');
  });

  it('sends the head a signed route that verifies for that head only, and its reply address signed for chained hops', async () => {
    const { t, heads, scripts, calls } = await setup();
    heads[0]!.relayAddr = `ws://relay.test/rpc/${heads[0]!.peerId}`;
    await heads[0]!.register(t);
    scripts[heads[0]!.peerId] = [happy(['x'])];
    await post(t, '/v1/chat/completions', chat());
    const h = calls[0]!.headers;
    expect(JSON.parse(h['x-meshnet-route']!)).toEqual([]);
    const signed = { header: h['x-meshnet-route']!, expiresAt: Number(h['x-meshnet-route-expires']), signature: h['x-meshnet-route-signature']! };
    expect(await verifyRoute(t.publicKey, heads[0]!.peerId, signed, t.clock.now)).toBeNull();
    expect(await verifyRoute(t.publicKey, '0'.repeat(32), signed, t.clock.now)).not.toBeNull();
    // The head's reply address, as it registered it, signed for this head and route (chained hops check it).
    const reply = h['x-meshnet-chain-reply']!;
    expect(JSON.parse(reply)).toEqual({ relay_addr: expect.stringContaining(heads[0]!.peerId) as unknown });
    expect(await verifyChainReply(decodeBase64(t.publicKey), heads[0]!.peerId, signed.expiresAt, reply, h['x-meshnet-chain-reply-signature']!)).toBe(true);
    expect(await verifyChainReply(decodeBase64(t.publicKey), '0'.repeat(32), signed.expiresAt, reply, h['x-meshnet-chain-reply-signature']!)).toBe(false);
  });

  it('streams SSE exactly as OpenAI: role chunk, content deltas, finish chunk, usage chunk, data: [DONE]', async () => {
    const { t, heads, scripts } = await setup();
    scripts[heads[0]!.peerId] = [happy(['Hel', 'lo', '!'], 'length')];
    const res = await post(t, '/v1/chat/completions', chat({ stream: true, max_tokens: 3, stream_options: { include_usage: true } }));
    expect(res.status).toBe(200);
    expect(res.headers.get('content-type')).toMatch(/^text\/event-stream/);
    const { events, done } = parseSse(await res.text());
    expect(done).toBe(true);
    const chunks = events as Array<{ id: string; object: string; created: number; model: string; choices: Array<{ index: number; delta: { role?: string; content?: string }; finish_reason: string | null }>; usage?: unknown }>;
    expect(new Set(chunks.map((c) => c.id)).size).toBe(1);
    expect(chunks.every((c) => c.object === 'chat.completion.chunk' && c.model === 'small')).toBe(true);
    expect(chunks[0]!.choices[0]!.delta).toEqual({ role: 'assistant', content: '' });
    const text = chunks.flatMap((c) => c.choices.map((x) => x.delta.content ?? '')).join('');
    expect(text).toBe('Hello!');
    const finish = chunks.filter((c) => c.choices[0]?.finish_reason);
    expect(finish.length).toBe(1);
    expect(finish[0]!.choices[0]!.finish_reason).toBe('length');
    expect(finish[0]!.choices[0]!.delta).toEqual({});
    const last = chunks[chunks.length - 1]!;
    expect(last.choices).toEqual([]);
    expect(last.usage).toEqual({ prompt_tokens: 7, completion_tokens: 3, total_tokens: 10 });
  });

  it('streams /v1/completions as text_completion chunks', async () => {
    const { t, heads, scripts, calls } = await setup();
    scripts[heads[0]!.peerId] = [happy(['a', 'b'])];
    const res = await post(t, '/v1/completions', { model: 'small', prompt: 'Once', stream: true });
    const { events, done } = parseSse(await res.text());
    expect(done).toBe(true);
    const chunks = events as Array<{ object: string; choices: Array<{ text: string; finish_reason: string | null }> }>;
    expect(chunks.every((c) => c.object === 'text_completion')).toBe(true);
    expect(chunks.map((c) => c.choices[0]!.text).join('')).toBe('ab');
    expect(chunks[chunks.length - 1]!.choices[0]!.finish_reason).toBe('stop');
    expect(calls[0]!.body.prompt).toBe('Once');
    expect(calls[0]!.body.max_tokens).toBe(256);
  });

  it('applies stop strings across token boundaries and leaves the stop text out', async () => {
    const { t, heads, scripts } = await setup();
    scripts[heads[0]!.peerId] = [happy(['Hello', ' wo', 'rld', ' and more'])];
    const res = await post(t, '/v1/chat/completions', chat({ stop: ['world'], stream: true }));
    const { events } = parseSse(await res.text());
    const chunks = events as Array<{ choices: Array<{ delta: { content?: string }; finish_reason: string | null }> }>;
    expect(chunks.map((c) => c.choices[0]!.delta.content ?? '').join('')).toBe('Hello ');
    expect(chunks[chunks.length - 1]!.choices[0]!.finish_reason).toBe('stop');
  });

  it('fails over to another head with the tokens so far, and the client stream goes on seamlessly', async () => {
    const { t, heads, scripts, calls } = await setup({}, 2);
    const [a, b] = heads as [FakeNode, FakeNode];
    const first: Script = () => [{ type: 'start', prompt_tokens: 5, route: [] }, ...tokenEvents(['one', ' two', ' three']), 'break'];
    const second: Script = ({ body }) => {
      const prefix = (body as { prefix_token_ids: number[] }).prefix_token_ids;
      return [{ type: 'start', prompt_tokens: 5, route: [] }, ...tokenEvents([' four', ' five'], prefix.length), { type: 'done', finish_reason: 'stop', completion_tokens: 2, prompt_tokens: 5 }];
    };
    // Whichever head is picked first breaks; the other continues.
    let n = 0;
    const either: Script = (req) => (n++ === 0 ? first(req) : second(req));
    scripts[a.peerId] = [either, either];
    scripts[b.peerId] = [either, either];
    const res = await post(t, '/v1/chat/completions', chat({ stream: true, max_tokens: 20, stream_options: { include_usage: true } }));
    const { events, done } = parseSse(await res.text());
    expect(done).toBe(true);
    const chunks = events as Array<{ choices: Array<{ delta: { content?: string }; finish_reason: string | null }>; usage?: { completion_tokens: number; prompt_tokens: number } }>;
    expect(chunks.flatMap((c) => c.choices.map((x) => x.delta.content ?? '')).join('')).toBe('one two three four five');
    expect(chunks[chunks.length - 1]!.usage).toMatchObject({ prompt_tokens: 5, completion_tokens: 5 });
    expect(calls.length).toBe(2);
    expect(calls[1]!.head).not.toBe(calls[0]!.head);
    expect(calls[1]!.body.prefix_token_ids).toEqual([100, 101, 102]);
    expect(calls[1]!.body.max_tokens).toBe(20);
    expect(calls[1]!.body.session_id).not.toBe(calls[0]!.body.session_id);
    const metrics = await (await t.app.request('/metrics')).text();
    expect(metrics).toMatch(/meshnet_tracker_head_failovers_total 1/);
  });

  it('does not fail over when the head refuses the request itself (400 to the client)', async () => {
    const { t, heads, scripts, calls } = await setup({}, 2);
    const refuse: Script = () => [{ type: 'error', code: 'MESH_ERR_BAD_REQUEST', message: 'the prompt encodes to no tokens' }];
    scripts[heads[0]!.peerId] = [refuse];
    scripts[heads[1]!.peerId] = [refuse];
    const res = await post(t, '/v1/chat/completions', chat());
    expect(res.status).toBe(400);
    const e = ((await res.json()) as { error: { type: string; message: string } }).error;
    expect(e.type).toBe('invalid_request_error');
    expect(e.message).toMatch(/no tokens/);
    expect(calls.length).toBe(1);
  });

  it('answers a streamed request the head refuses before any token with a plain HTTP error, not a 200 stream', async () => {
    const { t, heads, scripts } = await setup();
    scripts[heads[0]!.peerId] = [() => [{ type: 'error', code: 'MESH_ERR_TOO_LARGE', message: 'prompt of 3000 tokens does not fit the context of 2048' }]];
    const res = await post(t, '/v1/chat/completions', chat({ stream: true }));
    expect(res.status).toBe(400);
    expect(res.headers.get('content-type')).toMatch(/json/);
    const e = ((await res.json()) as { error: { code: string; param: string; type: string } }).error;
    expect(e).toMatchObject({ code: 'context_length_exceeded', param: 'messages', type: 'invalid_request_error' });
  });

  it('gives up after maxHeadFailovers and reports the error in the stream', async () => {
    const { t, heads, scripts, calls } = await setup({ maxHeadFailovers: 2 }, 1);
    const broken: Script = () => [{ type: 'start', prompt_tokens: 5, route: [] }, ...tokenEvents(['a']), 'break'];
    scripts[heads[0]!.peerId] = [broken, broken, broken, broken];
    const res = await post(t, '/v1/chat/completions', chat({ stream: true }));
    const { events, done } = parseSse(await res.text());
    expect(done).toBe(false);
    const last = events[events.length - 1] as { error: { message: string; type: string } };
    expect(last.error.message).toMatch(/after 3 head/);
    expect(calls.length).toBe(3);
    // Every attempt after the first continues from the one token already streamed.
    expect(calls[2]!.body.prefix_token_ids).toEqual([100]);
  });
});

/** A head that answers each prompt with its own tokens: text "<p>1", "<p>2" and ids 1000·k + i, k the prompt's first char code or first id. */
const echo: Script = ({ body }) => {
  const b = body as { prompt?: string; prompt_token_ids?: number[]; messages?: unknown[] };
  const tag = b.prompt ?? (b.prompt_token_ids ? `#${b.prompt_token_ids.join('.')}` : 'chat');
  const k = b.prompt_token_ids?.[0] ?? tag.charCodeAt(0);
  const tokens: GenerateEvent[] = [1, 2].map((i) => ({ type: 'token', index: i - 1, token_id: 1000 * k + i, text: `${tag}${i} `, logprob: -0.1 }));
  return [{ type: 'start', prompt_tokens: b.prompt_token_ids?.length ?? 3, route: [] } as GenerateEvent, ...tokens, { type: 'done', finish_reason: 'stop', completion_tokens: 2, prompt_tokens: b.prompt_token_ids?.length ?? 3 } as GenerateEvent];
};

interface ChoiceOut {
  index: number;
  text: string;
  finish_reason: string;
  token_ids: number[];
}

describe('/v1/completions prompts as OpenAI takes them', () => {
  it('sends a prompt given as token ids to the head as prompt_token_ids', async () => {
    const { t, heads, scripts, calls } = await setup();
    scripts[heads[0]!.peerId] = [echo];
    const res = await post(t, '/v1/completions', { model: 'small', prompt: [5, 6, 7], max_tokens: 5 });
    expect(res.status).toBe(200);
    const body = (await res.json()) as { choices: ChoiceOut[]; usage: Record<string, number> };
    expect(calls[0]!.body.prompt_token_ids).toEqual([5, 6, 7]);
    expect('prompt' in calls[0]!.body).toBe(false);
    expect(body.choices).toEqual([{ index: 0, text: '#5.6.71 #5.6.72 ', logprobs: null, finish_reason: 'stop', token_ids: [5001, 5002] }]);
    expect(body.usage).toEqual({ prompt_tokens: 3, completion_tokens: 2, total_tokens: 5 });
  });

  it('answers a list of prompts (text or token ids) with one choice per prompt, by index, usage summed', async () => {
    for (const [prompt, heads] of [
      [['a', 'b', 'c'], 1],
      [[[3, 4], [8]], 2],
    ] as const) {
      const { t, heads: hs, scripts, calls } = await setup({}, heads);
      for (const h of hs) scripts[h.peerId] = [echo, echo, echo];
      const res = await post(t, '/v1/completions', { model: 'small', prompt, max_tokens: 5 });
      expect(res.status).toBe(200);
      const body = (await res.json()) as { choices: ChoiceOut[]; usage: Record<string, number> };
      expect(calls.length).toBe(prompt.length);
      expect(body.choices.map((c) => c.index)).toEqual(prompt.map((_, i) => i));
      for (const [i, p] of prompt.entries()) {
        const tag = typeof p === 'string' ? p : `#${p.join('.')}`;
        const k = typeof p === 'string' ? p.charCodeAt(0) : p[0]!;
        expect(body.choices[i]).toMatchObject({ text: `${tag}1 ${tag}2 `, finish_reason: 'stop', token_ids: [1000 * k + 1, 1000 * k + 2] });
      }
      const promptTokens = prompt.reduce((n: number, p) => n + (typeof p === 'string' ? 3 : p.length), 0);
      expect(body.usage).toEqual({ prompt_tokens: promptTokens, completion_tokens: 2 * prompt.length, total_tokens: promptTokens + 2 * prompt.length });
    }
  });

  it('streams a list of prompts as chunks tagged by choice index, one finish each', async () => {
    const { t, heads, scripts } = await setup();
    scripts[heads[0]!.peerId] = [echo, echo];
    const res = await post(t, '/v1/completions', { model: 'small', prompt: [[120], [9]], max_tokens: 5, stream: true, stream_options: { include_usage: true } });
    expect(res.status).toBe(200);
    const { events, done } = parseSse(await res.text());
    expect(done).toBe(true);
    const chunks = events as Array<{ choices: ChoiceOut[]; usage?: Record<string, number> }>;
    const byIndex = (i: number) => chunks.flatMap((c) => c.choices.filter((x) => x.index === i));
    expect(byIndex(0).map((c) => c.text).join('')).toBe('#1201 #1202 ');
    expect(byIndex(1).map((c) => c.text).join('')).toBe('#91 #92 ');
    expect(byIndex(0).flatMap((c) => c.token_ids ?? [])).toEqual([120_001, 120_002]);
    expect(byIndex(1).flatMap((c) => c.token_ids ?? [])).toEqual([9001, 9002]);
    for (const i of [0, 1]) expect(byIndex(i).filter((c) => c.finish_reason).map((c) => c.finish_reason)).toEqual(['stop']);
    expect(chunks[chunks.length - 1]!.usage).toEqual({ prompt_tokens: 2, completion_tokens: 4, total_tokens: 6 });
  });

  it('refuses token ids outside the vocabulary, too many prompts, empty and mixed lists with 400 naming prompt', async () => {
    const { t, calls } = await setup();
    for (const prompt of [[2048], [[1], [2, 4096]], Array.from({ length: 17 }, () => 'p'), [], [[]], [1.5], [-1], ['a', [1]]]) {
      const res = await post(t, '/v1/completions', { model: 'small', prompt, max_tokens: 5 });
      expect(res.status, JSON.stringify(prompt)).toBe(400);
      const e = ((await res.json()) as { error: { param: string; type: string; message: string } }).error;
      expect(e.type).toBe('invalid_request_error');
      expect(e.param).toMatch(/^prompt(\.\d+)?$/);
      expect(e.message).not.toMatch(/Invalid input/);
    }
    expect(calls.length).toBe(0);
  });
});

describe('token ids in the answer (the token_ids extension)', () => {
  it('carries every generated token id in the stream, with its text or a chunk later, and in the non-streamed choice', async () => {
    const { t, heads, scripts } = await setup();
    scripts[heads[0]!.peerId] = [happy(['Hel', 'lo', ' wor', 'ld', '!']), happy(['Hel', 'lo', ' wor', 'ld', '!']), happy(['Hel', 'lo', ' wor', 'ld', '!'])];
    const streamed = parseSse(await (await post(t, '/v1/chat/completions', chat({ stream: true }))).text()).events as Array<{ choices: Array<{ delta: { content?: string }; token_ids?: number[] }> }>;
    expect(streamed.flatMap((c) => c.choices[0]?.token_ids ?? [])).toEqual([100, 101, 102, 103, 104]);
    // With a stop string, text is held back: ids ride on the chunk that releases it; the stop's own tokens come with the finish.
    const stopped = parseSse(await (await post(t, '/v1/chat/completions', chat({ stream: true, stop: ['world'] }))).text()).events as Array<{ choices: Array<{ delta: { content?: string }; token_ids?: number[]; finish_reason: string | null }> }>;
    expect(stopped.map((c) => c.choices[0]!.delta.content ?? '').join('')).toBe('Hello ');
    expect(stopped.flatMap((c) => c.choices[0]?.token_ids ?? [])).toEqual([100, 101, 102, 103]);
    const whole = (await (await post(t, '/v1/chat/completions', chat())).json()) as { choices: Array<{ token_ids: number[] }> };
    expect(whole.choices[0]!.token_ids).toEqual([100, 101, 102, 103, 104]);
  });
});
