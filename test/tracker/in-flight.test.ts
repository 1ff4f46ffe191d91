/**
 * The tracker's in-flight count (routing reads it as load) and what each
 * request holds must come back to zero after every kind of chat: streamed,
 * non-streamed, stopped by a stop string, cut by max_tokens, cancelled by the
 * client, failed over to another head. A real relay, real HTTP, in-test heads.
 */
import { getEventListeners } from 'node:events';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { Identity } from '../../src/net/identity.ts';
import { registerNode, startHead, startMesh, WORDS, type Cleanups } from '../helpers/relay-heads.ts';

const cleanups: Cleanups = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/**
 * Live 'abort' listeners on AbortSignals in this process (tracker, relay,
 * heads and clients), counted after a full GC: every listener added is
 * remembered weakly (a strong reference would keep its closure's signal
 * alive), and counts while its signal is alive and still has it.
 */
const added: Array<{ signal: WeakRef<AbortSignal>; listener: WeakRef<object> }> = [];
const originalAdd = AbortSignal.prototype.addEventListener;
let gc: () => void;
beforeAll(() => {
  setFlagsFromString('--expose-gc');
  gc = runInNewContext('gc') as () => void;
  AbortSignal.prototype.addEventListener = function (this: AbortSignal, type: string, listener: unknown, options?: unknown) {
    if (type === 'abort' && listener) added.push({ signal: new WeakRef(this), listener: new WeakRef(listener as object) });
    return originalAdd.call(this, type, listener as EventListener, options as AddEventListenerOptions);
  } as typeof AbortSignal.prototype.addEventListener;
});
afterAll(() => {
  AbortSignal.prototype.addEventListener = originalAdd;
});
async function liveAbortListeners(): Promise<number> {
  for (let i = 0; i < 3; i++) {
    await new Promise((r) => setTimeout(r, 20));
    gc();
  }
  let live = 0;
  for (const a of added) {
    const s = a.signal.deref();
    const l = a.listener.deref();
    if (s && l && getEventListeners(s, 'abort').includes(l as EventListener)) live++;
  }
  return live;
}

interface DashboardNode {
  peer_id: string;
  in_flight: number;
}

describe('in-flight accounting', () => {
  it('is zero on every node after streamed, non-streamed, stopped, cut, cancelled and failed-over chats, and nothing piles up', async () => {
    const { relay, tracker, openai } = await startMesh(cleanups, { routeSlack: 0 });
    // Route: a head for [0, 6) then a node for [6, 12) — both count the request. The second head
    // [0, 12) is slower, so it only takes over when the first one dies.
    const head = await startHead(cleanups, relay, tracker, { words: WORDS, span: [0, 6] }, 1);
    const tail = await Identity.generate();
    await registerNode(tracker, tail, [6, 12], 1);
    const backup = await startHead(cleanups, relay, tracker, { words: WORDS }, 50);
    const messages = [{ role: 'user' as const, content: 'go' }];

    const dashboard = async () => ((await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { nodes: DashboardNode[] }).nodes;
    /** Chats holding an admission lease of KV room: none once every chat ended, however it ended. */
    const leases = async () => ((await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { queue: { running: number; length: number } }).queue;
    const quiet = async () => {
      // Cancellation runs when the tracker sees the client's socket close: give it a moment.
      const deadline = Date.now() + 3000;
      let nodes = await dashboard();
      while (nodes.some((n) => n.in_flight !== 0) && Date.now() < deadline) {
        await new Promise((r) => setTimeout(r, 50));
        nodes = await dashboard();
      }
      return nodes;
    };

    const round = async () => {
      for (let i = 0; i < 2; i++) {
        const stream = await openai.chat.completions.create({ model: 'small', messages, stream: true, max_tokens: 50 });
        let text = '';
        for await (const c of stream) text += c.choices[0]?.delta.content ?? '';
        expect(text).toBe(WORDS.join(''));
        const whole = await openai.chat.completions.create({ model: 'small', messages, max_tokens: 50 });
        expect(whole.choices[0]!.message.content).toBe(WORDS.join(''));
      }
      // Cut by the tracker's own max_tokens count while the head still streams.
      const cut = await openai.completions.create({ model: 'small', prompt: 'x', max_tokens: 3 });
      expect(cut.choices[0]!.finish_reason).toBe('length');
      // Stopped by a stop string: the tracker stops pulling mid-generation.
      const stopped = await openai.chat.completions.create({ model: 'small', messages, stream: true, max_tokens: 50, stop: [' fox'] });
      let stoppedText = '';
      for await (const c of stopped) stoppedText += c.choices[0]?.delta.content ?? '';
      expect(stoppedText).toBe('The quick brown');
      // Cancelled by the client after two chunks.
      const ctl = new AbortController();
      const res = await fetch(`${tracker.url}/v1/chat/completions`, { method: 'POST', signal: ctl.signal, body: JSON.stringify({ model: 'small', messages, stream: true, max_tokens: 50 }) });
      const reader = res.body!.getReader();
      await reader.read();
      await reader.read();
      ctl.abort();
      await reader.cancel().catch(() => {});
    };

    await round();
    const afterFirst = await quiet();
    expect(afterFirst.map((n) => n.in_flight)).toEqual([0, 0, 0]);
    const baseline = await liveAbortListeners();
    for (let i = 0; i < 3; i++) await round();
    const nodes = await quiet();
    expect(nodes.map((n) => n.in_flight)).toEqual([0, 0, 0]);
    expect(await leases()).toEqual(expect.objectContaining({ running: 0, length: 0 }));
    expect(tracker.relay!.pendingOutgoing).toBe(0);
    expect(head.client.pendingIncoming).toBe(0);
    expect(await liveAbortListeners()).toBeLessThanOrEqual(baseline);
    expect(head.requests.length).toBe(4 * 7);
    expect(backup.requests.length).toBe(0);

    // Failed over: the first head dies mid-stream, the backup finishes the chat.
    const dying = await startHead(cleanups, relay, tracker, { words: WORDS, span: [0, 6], dieAfter: 3 }, 0.5);
    const stream = await openai.chat.completions.create({ model: 'small', messages, stream: true, max_tokens: 50 });
    let text = '';
    for await (const c of stream) text += c.choices[0]?.delta.content ?? '';
    expect(text).toBe(WORDS.join(''));
    expect(dying.requests.length).toBe(1);
    expect(backup.requests.length + head.requests.length).toBe(4 * 7 + 1);
    const after = await quiet();
    expect(after.map((n) => n.in_flight)).toEqual([0, 0, 0, 0]);
    expect(await leases()).toEqual(expect.objectContaining({ running: 0, length: 0 }));
    expect(tracker.relay!.pendingOutgoing).toBe(0);
  });
});
