/**
 * The chat proxy end to end over a real relay: OpenAI client → tracker (real
 * HTTP) → relay fast path → in-test heads that speak the /generate NDJSON
 * contract and check the tracker's route signature.
 */
import { afterEach, describe, expect, it } from 'vitest';
import { WebSocket } from 'ws';
import { Identity } from '../../src/net/identity.ts';
import { RelayClient } from '../../src/net/relay-client.ts';
import type { WebSocketConstructor } from '../../src/net/socket.ts';
import type { TrackerOptions } from '../../src/tracker/options.ts';
import { startHead as startHeadIn, startMesh, WORDS, type Cleanups, type HeadBehaviour } from '../helpers/relay-heads.ts';
import type { Relay } from '../../src/relay/server.ts';
import type { RunningTracker } from '../../src/tracker/server.ts';

const utf8 = new TextEncoder();
const cleanups: Cleanups = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

const startHead = (relay: Relay, tracker: RunningTracker, behaviour: HeadBehaviour, layerMs = 1) => startHeadIn(cleanups, relay, tracker, behaviour, layerMs);
const mesh = (o: Partial<TrackerOptions> = {}) => startMesh(cleanups, o);

describe('chat proxy over a real relay', () => {
  it('streams a chat completion to the OpenAI client through the relay fast path', async () => {
    const { relay, tracker, openai } = await mesh();
    const head = await startHead(relay, tracker, { words: WORDS });
    const stream = await openai.chat.completions.create({ model: 'small', messages: [{ role: 'user', content: 'Tell me about foxes' }], stream: true, max_tokens: 50, seed: 1, stream_options: { include_usage: true } });
    let text = '';
    let finish: string | null = null;
    let usage: { completion_tokens: number } | undefined;
    for await (const chunk of stream) {
      text += chunk.choices[0]?.delta.content ?? '';
      finish = chunk.choices[0]?.finish_reason ?? finish;
      if (chunk.usage) usage = chunk.usage;
    }
    expect(text).toBe(WORDS.join(''));
    expect(finish).toBe('stop');
    expect(usage?.completion_tokens).toBe(10);
    expect(head.routeErrors).toEqual([]);
    expect(head.requests[0]!.messages).toEqual([{ role: 'user', content: 'Tell me about foxes' }]);
    expect(head.requests[0]!.seed).toBe(1);
  });

  it('answers non-streamed chat and completions through the OpenAI client', async () => {
    const { relay, tracker, openai } = await mesh();
    await startHead(relay, tracker, { words: WORDS });
    const c = await openai.chat.completions.create({ model: 'small', messages: [{ role: 'user', content: 'hi' }], max_tokens: 4 });
    expect(c.choices[0]!.message.content).toBe('The quick brown fox');
    expect(c.choices[0]!.finish_reason).toBe('length');
    expect(c.usage).toMatchObject({ prompt_tokens: 4, completion_tokens: 4, total_tokens: 8 });
    const t = await openai.completions.create({ model: 'small', prompt: 'x', max_tokens: 2 });
    expect(t.choices[0]!.text).toBe('The quick');
    const models = await openai.models.list();
    expect(models.data.map((m) => m.id)).toEqual(['small']);
    await expect(openai.chat.completions.create({ model: 'nope', messages: [{ role: 'user', content: 'hi' }] })).rejects.toMatchObject({ status: 404, code: 'model_not_found' });
    await expect(openai.chat.completions.create({ model: 'small', messages: [{ role: 'user', content: 'hi' }], max_tokens: 100_000 })).rejects.toMatchObject({ status: 400, param: 'max_tokens' });
  });

  it('restarts the generation on another head when the head dies mid-stream; the client sees every token once', async () => {
    const { relay, tracker, openai } = await mesh({ routeSlack: 0 });
    // The faster head is always picked first (slack 0), and dies after 3 tokens.
    const a = await startHead(relay, tracker, { words: WORDS, dieAfter: 3 }, 1);
    const b = await startHead(relay, tracker, { words: WORDS }, 2);
    const stream = await openai.chat.completions.create({ model: 'small', messages: [{ role: 'user', content: 'go' }], stream: true, max_tokens: 50 });
    let text = '';
    let finish: string | null = null;
    let chunks = 0;
    for await (const chunk of stream) {
      text += chunk.choices[0]?.delta.content ?? '';
      finish = chunk.choices[0]?.finish_reason ?? finish;
      chunks++;
    }
    expect(text).toBe(WORDS.join(''));
    expect(finish).toBe('stop');
    expect(a.requests.length).toBe(1);
    expect(b.requests.length).toBe(1);
    expect(b.requests[0]!.prefix_token_ids).toEqual([1000, 1001, 1002]);
    expect(b.requests[0]!.max_tokens).toBe(50);
    expect(chunks).toBe(1 + 10 + 1); // role, one chunk per token, finish: nothing repeated
    expect(tracker.recentRoutes.some((r) => r.kind === 'failover' && r.head === b.peerId)).toBe(true);
  });

  it('answers tracker API calls that arrive over the relay (the tracker is a registered peer)', async () => {
    const { relay, tracker } = await mesh();
    const caller = new RelayClient({ relayUrl: relay.url, WebSocket: WebSocket as unknown as WebSocketConstructor, identity: await Identity.generate() });
    caller.start();
    await caller.ready(5000);
    cleanups.push(() => caller.close());
    const reply = await caller.request(tracker.identity.peerId, { method: 'GET', path: '/api/tracker' });
    expect(reply.status).toBe(200);
    expect((JSON.parse(new TextDecoder().decode(reply.body)) as { public_key: string }).public_key).toBe(tracker.publicKey);
    const bad = await caller.request(tracker.identity.peerId, { method: 'POST', path: '/api/nodes/register', body: utf8.encode('garbage') });
    expect(bad.status).toBe(400);
  });

  it('cancels the head\'s generation when the client goes away', async () => {
    const { relay, tracker } = await mesh();
    const head = await startHead(relay, tracker, { words: Array.from({ length: 200 }, (_, i) => ` w${i}`), delayMs: 20 });
    const ctl = new AbortController();
    const res = await fetch(`${tracker.url}/v1/chat/completions`, { method: 'POST', signal: ctl.signal, body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'x' }], stream: true, max_tokens: 200 }) });
    const reader = res.body!.getReader();
    await reader.read();
    await reader.read();
    ctl.abort();
    await reader.cancel().catch(() => {});
    const deadline = Date.now() + 3000;
    while (head.cancelled === 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
    expect(head.cancelled).toBe(1);
  });
});
