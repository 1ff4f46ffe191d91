import { describe, expect, it } from 'vitest';
import type { GenerateEvent } from '../../src/protocol/tracker.ts';
import { verifyRoute } from '../../src/tracker/signing.ts';
import { FakeNode, makeTracker, scriptedTransport, tokenEvents, type TestTracker } from './support.ts';

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

  it('sends the head a signed route that verifies for that head only', async () => {
    const { t, heads, scripts, calls } = await setup();
    scripts[heads[0]!.peerId] = [happy(['x'])];
    await post(t, '/v1/chat/completions', chat());
    const h = calls[0]!.headers;
    expect(JSON.parse(h['x-meshnet-route']!)).toEqual([]);
    const signed = { header: h['x-meshnet-route']!, expiresAt: Number(h['x-meshnet-route-expires']), signature: h['x-meshnet-route-signature']! };
    expect(await verifyRoute(t.publicKey, heads[0]!.peerId, signed, t.clock.now)).toBeNull();
    expect(await verifyRoute(t.publicKey, '0'.repeat(32), signed, t.clock.now)).not.toBeNull();
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
