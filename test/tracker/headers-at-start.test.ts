/**
 * When a streamed chat's SSE headers go out: at its first token, or — once
 * the head accepted it (its `start` event) — after a short grace at the
 * latest, so a chat whose first token is slow (a hop being replaced, a relay
 * being waited out) is never left without headers for tens of seconds. A
 * refusal before `start` still gets a plain HTTP status.
 */
import { describe, expect, it } from 'vitest';
import type { GenerateEvent } from '../../src/protocol/tracker.ts';
import { HEADERS_GRACE_MS } from '../../src/tracker/completion.ts';
import { FakeNode, makeTracker, scriptedTransport, tokenEvents } from '../helpers/tracker.ts';

type Script = Parameters<typeof scriptedTransport>[0][string][number];

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function setup(script: Script) {
  const scripts: Record<string, Script[]> = {};
  const st = scriptedTransport(scripts);
  const t = await makeTracker({}, st.transport);
  const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1);
  n.serving = { start_layer: 0, end_layer: 12 };
  await n.register(t);
  scripts[n.peerId] = [script];
  return t;
}

function post(t: Awaited<ReturnType<typeof setup>>, stream: boolean) {
  return t.app.request('/v1/chat/completions', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'hi' }], max_tokens: 4, stream }) });
}

async function sseText(res: Response): Promise<string> {
  let text = '';
  for (const line of (await res.text()).split('\n')) {
    if (!line.startsWith('data:') || line.includes('[DONE]')) continue;
    text += (JSON.parse(line.slice(5)) as { choices: Array<{ delta: { content?: string } }> }).choices[0]?.delta.content ?? '';
  }
  return text;
}

describe('SSE headers', () => {
  it(`go out ${HEADERS_GRACE_MS} ms after the head accepted the chat when its first token is slower, and the stream then carries every token`, async () => {
    const t = await setup(async function* () {
      yield { type: 'start', prompt_tokens: 3, route: [] } as GenerateEvent;
      await sleep(HEADERS_GRACE_MS + 1_500);
      yield* tokenEvents(['Hel', 'lo']);
      yield { type: 'done', finish_reason: 'stop', completion_tokens: 2, prompt_tokens: 3 } as GenerateEvent;
    });
    const t0 = performance.now();
    const res = await post(t, true);
    const headersMs = performance.now() - t0;
    expect(res.status).toBe(200);
    expect(headersMs).toBeGreaterThanOrEqual(HEADERS_GRACE_MS - 50);
    expect(headersMs).toBeLessThan(HEADERS_GRACE_MS + 1_400);
    expect(await sseText(res)).toBe('Hello');
    expect(performance.now() - t0).toBeGreaterThanOrEqual(HEADERS_GRACE_MS + 1_500 - 50);
  });

  it('still wait for the first token when it comes within the grace, and a refusal before start is a plain HTTP error', async () => {
    const quick = await setup(async function* () {
      yield { type: 'start', prompt_tokens: 3, route: [] } as GenerateEvent;
      await sleep(50);
      yield* tokenEvents(['ok']);
      yield { type: 'done', finish_reason: 'stop', completion_tokens: 1, prompt_tokens: 3 } as GenerateEvent;
    });
    const res = await post(quick, true);
    expect(res.status).toBe(200);
    expect(await sseText(res)).toBe('ok');
    const refused = await setup(function* () {
      yield { type: 'error', code: 'MESH_ERR_BAD_REQUEST', message: 'the prompt encodes to no tokens' } as GenerateEvent;
    });
    const bad = await post(refused, true);
    expect(bad.status).toBe(400);
    // Not streamed either: the answer is one JSON completion, no headers early.
    const plain = await setup(async function* () {
      yield { type: 'start', prompt_tokens: 3, route: [] } as GenerateEvent;
      await sleep(HEADERS_GRACE_MS + 300);
      yield* tokenEvents(['late']);
      yield { type: 'done', finish_reason: 'stop', completion_tokens: 1, prompt_tokens: 3 } as GenerateEvent;
    });
    const whole = await post(plain, false);
    expect(whole.status).toBe(200);
    expect(((await whole.json()) as { choices: Array<{ message: { content: string } }> }).choices[0]!.message.content).toBe('late');
  });
});
