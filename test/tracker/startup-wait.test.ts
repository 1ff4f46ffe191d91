/**
 * A tracker that just started (a restart: it knows no node until they
 * register again, within about a second) lets a chat with no route wait for
 * them for `startupWaitMs`, instead of answering 503 "layers not served";
 * past that wait, or with the wait off (0, the library default), 503 at once.
 */
import { describe, expect, it } from 'vitest';
import type { GenerateEvent } from '../../src/protocol/tracker.ts';
import { FakeNode, makeTracker, scriptedTransport, tokenEvents } from '../helpers/tracker.ts';

type Script = Parameters<typeof scriptedTransport>[0][string][number];

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const happy: Script = () => [{ type: 'start', prompt_tokens: 3, route: [] } as GenerateEvent, ...tokenEvents(['hi']), { type: 'done', finish_reason: 'stop', completion_tokens: 1, prompt_tokens: 3 } as GenerateEvent];

async function setup(startupWaitMs: number) {
  const scripts: Record<string, Script[]> = {};
  const st = scriptedTransport(scripts);
  const t = await makeTracker({ startupWaitMs }, st.transport);
  const post = () => t.app.request('/v1/chat/completions', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'hi' }], max_tokens: 4 }) });
  const join = async () => {
    const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1);
    n.serving = { start_layer: 0, end_layer: 12 };
    scripts[n.peerId] = [happy];
    await n.register(t);
    return n;
  };
  return { t, post, join };
}

describe('a tracker that just started', () => {
  it('holds a chat with no route until a node serving the model registers, then runs it', async () => {
    const { t, post, join } = await setup(5_000);
    let answered = false;
    const pending = post().then((r) => {
      answered = true;
      return r;
    });
    await sleep(300);
    expect(answered).toBe(false);
    expect(t.admission.length).toBe(1);
    await join();
    const res = await pending;
    expect(res.status).toBe(200);
    expect(((await res.json()) as { choices: Array<{ message: { content: string } }> }).choices[0]!.message.content).toBe('hi');
  });

  it('answers 503 naming the missing layers once its start-up wait is over, and at once with the wait off', async () => {
    const { t, post } = await setup(5_000);
    const pending = post();
    await sleep(200);
    t.clock.now += 5_001;
    const res = await pending;
    expect(res.status).toBe(503);
    expect(((await res.json()) as { error: { message: string } }).error.message).toMatch(/not served by any node/);
    const off = await setup(0);
    const t0 = performance.now();
    expect((await off.post()).status).toBe(503);
    expect(performance.now() - t0).toBeLessThan(1_000);
  });
});
