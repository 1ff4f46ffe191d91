/**
 * The tracker's admission: routing by each node's free KV (heartbeats, what
 * the tracker's own chats hold, MESH_ERR_BUSY answers), the bounded FIFO
 * queue that holds chats while no route has room (streaming nothing), and
 * 429 + Retry-After in OpenAI's shape past its length or wait limit.
 */
import { describe, expect, it } from 'vitest';
import type { GenerateEvent } from '../../src/protocol/tracker.ts';
import type { TrackerOptions } from '../../src/tracker/options.ts';
import { FakeNode, makeTracker, scriptedTransport, smallSpec, tokenEvents, type TestTracker } from '../helpers/tracker.ts';

type Script = Parameters<typeof scriptedTransport>[0][string][number];

/** One session of a short chat (≤ 64 positions) takes one 64-position block of 1000 bytes per position. */
const BLOCK = 64_000;
const KV = { perToken: 1000, block: 64 };

function deferred(): { promise: Promise<void>; resolve: () => void } {
  let resolve!: () => void;
  const promise = new Promise<void>((r) => (resolve = r));
  return { promise, resolve };
}

/** A head that starts, then holds the chat open until `gate` resolves. */
function gated(gate: Promise<void>, texts = ['Hel', 'lo']): Script {
  return async function* () {
    yield { type: 'start', prompt_tokens: 5, route: [] } as GenerateEvent;
    await gate;
    yield* tokenEvents(texts);
    yield { type: 'done', finish_reason: 'stop', completion_tokens: texts.length, prompt_tokens: 5 } as GenerateEvent;
  };
}

const happy = (texts: string[]): Script => gated(Promise.resolve(), texts);

async function head(t: TestTracker, kv: { budget: number; used?: number }): Promise<FakeNode> {
  const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1).withKv({ ...KV, ...kv });
  n.serving = { start_layer: 0, end_layer: 12 };
  await n.register(t);
  return n;
}

const chat = (content: string, extra: Record<string, unknown> = {}) => ({ model: 'small', messages: [{ role: 'user', content }], max_tokens: 8, ...extra });
const post = (t: TestTracker, body: unknown) => t.app.request('/v1/chat/completions', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

async function until(check: () => boolean, what: string, ms = 5_000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

async function tracker(o: Partial<TrackerOptions>, scripts: Record<string, Script[]>) {
  const st = scriptedTransport(scripts);
  // random() = 0: among equally good routes the first registered node wins, so each test knows where a chat lands.
  const t = await makeTracker({ random: () => 0, ...o }, st.transport);
  return { t, calls: st.calls };
}

const content = (call: { body: Record<string, unknown> }) => (call.body.messages as Array<{ content: string }>)[0]!.content;

describe('KV admission at the tracker', () => {
  it('routes around a node whose KV is full (its heartbeat) and counts what its own chats hold', async () => {
    const scripts: Record<string, Script[]> = {};
    const { t, calls } = await tracker({}, scripts);
    const full = await head(t, { budget: 2 * BLOCK, used: 2 * BLOCK });
    const roomy = await head(t, { budget: 2 * BLOCK });
    const gate = deferred();
    scripts[roomy.peerId] = [gated(gate.promise), gated(gate.promise), happy(['x'])];
    scripts[full.peerId] = [happy(['never'])];
    const a = post(t, chat('one'));
    const b = post(t, chat('two'));
    await until(() => calls.length === 2, 'two chats started');
    expect(calls.map((c) => c.head)).toEqual([roomy.peerId, roomy.peerId]);
    // Both nodes are full now (one by its own heartbeat, one by this tracker's two chats): a third waits.
    const dash = (await (await t.app.request('/api/dashboard')).json()) as { queue: { length: number; running: number }; nodes: Array<{ peer_id: string; kv: { budget_bytes: number; used_bytes: number; held_by_tracker_bytes: number; free_estimate_bytes: number } }> };
    const kvOf = (id: string) => dash.nodes.find((n) => n.peer_id === id)!.kv;
    expect(kvOf(full.peerId)).toMatchObject({ budget_bytes: 2 * BLOCK, used_bytes: 2 * BLOCK, held_by_tracker_bytes: 0, free_estimate_bytes: 0 });
    expect(kvOf(roomy.peerId)).toMatchObject({ budget_bytes: 2 * BLOCK, used_bytes: 0, held_by_tracker_bytes: 2 * BLOCK, free_estimate_bytes: 0 });
    const c = post(t, chat('three'));
    await until(() => t.admission.length === 1, 'the third chat queued');
    expect(calls.length).toBe(2);
    gate.resolve();
    for (const r of await Promise.all([a, b, c])) expect(r.status).toBe(200);
    // 'one' and 'two' were posted together, so either may reach the tracker first; 'three' queued behind both.
    expect(calls.map((x) => x.head)).toEqual([roomy.peerId, roomy.peerId, roomy.peerId]);
    expect(calls.slice(0, 2).map(content).sort()).toEqual(['one', 'two']);
    expect(content(calls[2]!)).toBe('three');
    expect(t.registry.kvHeldOn(roomy.peerId)).toBe(0);
  });

  it('queues chats in FIFO order while no route has room, and answers 429 + Retry-After in the OpenAI shape once the queue is full', async () => {
    const scripts: Record<string, Script[]> = {};
    const { t, calls } = await tracker({ queueMaxLength: 2 }, scripts);
    const n = await head(t, { budget: BLOCK });
    const gates = [deferred(), deferred(), deferred()];
    scripts[n.peerId] = gates.map((g) => gated(g.promise));
    const first = post(t, chat('chat-1'));
    await until(() => calls.length === 1, 'the first chat started');
    const second = post(t, chat('chat-2'));
    // Queued before the third is posted: the order under test is the queue's, not the two requests' race to it.
    await until(() => t.admission.length === 1, 'the second chat queued');
    const third = post(t, chat('chat-3', { stream: true }));
    await until(() => t.admission.length === 2, 'two chats queued');
    const metricsWhileQueued = await (await t.app.request('/metrics')).text();
    expect(metricsWhileQueued).toMatch(/^meshnet_tracker_queue_length 2$/m);
    expect(metricsWhileQueued).toContain(`meshnet_tracker_node_kv_bytes{peer_id="${n.peerId}",model="small",kind="held"} ${BLOCK}`);

    const refused = await post(t, chat('chat-4'));
    expect(refused.status).toBe(429);
    expect(Number(refused.headers.get('retry-after'))).toBeGreaterThanOrEqual(1);
    expect(Number(refused.headers.get('retry-after-ms'))).toBeGreaterThanOrEqual(1000);
    const err = ((await refused.json()) as { error: Record<string, unknown> }).error;
    expect(err).toMatchObject({ type: 'rate_limit_error', code: 'rate_limit_exceeded', param: null, reason: 'queue_full', queue_length: 2 });
    expect(typeof err.message).toBe('string');

    // Room frees one chat at a time, in arrival order; the streamed one sent nothing while it waited.
    let thirdAnswered = false;
    void third.then(() => (thirdAnswered = true));
    gates[0]!.resolve();
    expect((await first).status).toBe(200);
    await until(() => calls.length === 2, 'the second chat started');
    expect(content(calls[1]!)).toBe('chat-2');
    expect(thirdAnswered).toBe(false);
    gates[1]!.resolve();
    expect((await second).status).toBe(200);
    await until(() => calls.length === 3, 'the third chat started');
    expect(content(calls[2]!)).toBe('chat-3');
    gates[2]!.resolve();
    const streamed = await third;
    expect(streamed.status).toBe(200);
    expect(streamed.headers.get('content-type')).toContain('text/event-stream');
    expect(await streamed.text()).toContain('[DONE]');
    const m = await (await t.app.request('/metrics')).text();
    expect(m).toMatch(/^meshnet_tracker_queue_rejections_total\{reason="queue_full"\} 1$/m);
    expect(m).toMatch(/^meshnet_tracker_queue_wait_seconds_count 2$/m);
    expect(m).toMatch(/^meshnet_tracker_queue_length 0$/m);
  });

  it('keeps one FIFO per model: a chat of a model with room does not wait behind another model\'s queue', async () => {
    const scripts: Record<string, Script[]> = {};
    const st = scriptedTransport(scripts);
    const t = await makeTracker({ random: () => 0 }, st.transport, [smallSpec('small'), smallSpec('other')]);
    const a = await head(t, { budget: BLOCK });
    const b = (await FakeNode.create({ memory_budget_mb: 4096, model: 'other' })).withStats(1).withKv({ ...KV, budget: BLOCK });
    b.serving = { start_layer: 0, end_layer: 12 };
    await b.register(t);
    const gate = deferred();
    scripts[a.peerId] = [gated(gate.promise), happy(['x'])];
    scripts[b.peerId] = [happy(['y'])];
    const running = post(t, chat('a-1'));
    await until(() => st.calls.length === 1, 'the first chat started');
    const waiting = post(t, chat('a-2'));
    await until(() => t.admission.length === 1, 'a-2 queued');
    const other = await post(t, { ...chat('b-1'), model: 'other' });
    expect(other.status).toBe(200);
    expect(st.calls.map(content)).toEqual(['a-1', 'b-1']);
    gate.resolve();
    expect((await running).status).toBe(200);
    expect((await waiting).status).toBe(200);
  });

  it('answers a chat 429 + Retry-After within its wait limit when no room frees up, streamed or not', async () => {
    const scripts: Record<string, Script[]> = {};
    const { t, calls } = await tracker({ queueMaxWaitMs: 300 }, scripts);
    const n = await head(t, { budget: BLOCK });
    const gate = deferred();
    scripts[n.peerId] = [gated(gate.promise)];
    const running = post(t, chat('runs'));
    await until(() => calls.length === 1, 'the first chat started');
    for (const stream of [false, true]) {
      const t0 = performance.now();
      const res = await post(t, chat('waits', { stream }));
      const waited = performance.now() - t0;
      expect(res.status).toBe(429);
      expect(res.headers.get('content-type')).toContain('application/json');
      expect(res.headers.get('retry-after')).toMatch(/^[1-9]\d*$/);
      expect(((await res.json()) as { error: { reason: string } }).error.reason).toBe('queue_timeout');
      expect(waited).toBeGreaterThanOrEqual(290);
      expect(waited).toBeLessThan(1300);
    }
    gate.resolve();
    expect((await running).status).toBe(200);
    expect(await (await t.app.request('/metrics')).text()).toMatch(/^meshnet_tracker_queue_rejections_total\{reason="queue_timeout"\} 2$/m);
  });

  it('routes a chat again when a node answers MESH_ERR_BUSY: no failover counted, the node avoided for its Retry-After', async () => {
    const scripts: Record<string, Script[]> = {};
    const { t, calls } = await tracker({}, scripts);
    const a = await head(t, { budget: 4 * BLOCK });
    const b = await head(t, { budget: 4 * BLOCK });
    scripts[a.peerId] = [() => [{ type: 'start', prompt_tokens: 5, route: [] } as GenerateEvent, { type: 'error', code: 'MESH_ERR_BUSY', message: 'no KV room', peer_id: a.peerId, retry_after_ms: 5000 } as GenerateEvent], happy(['back'])];
    scripts[b.peerId] = [happy(['Hel', 'lo']), happy(['again'])];
    const res = await post(t, chat('hi'));
    expect(res.status).toBe(200);
    expect(((await res.json()) as { choices: Array<{ message: { content: string } }> }).choices[0]!.message.content).toBe('Hello');
    expect(calls.map((c) => c.head)).toEqual([a.peerId, b.peerId]);
    // A fresh session on the second head: the busy answer cost nothing but a route.
    expect(calls[1]!.body.prefix_token_ids).toEqual([]);
    expect(t.registry.nodes.get(a.peerId)!.failures).toBe(0);
    // a stays avoided for its Retry-After, then gets chats again.
    expect((await post(t, chat('next'))).status).toBe(200);
    expect(calls[2]!.head).toBe(b.peerId);
    t.clock.now += 5_001;
    expect((await post(t, chat('later'))).status).toBe(200);
    expect(calls[3]!.head).toBe(a.peerId);
    const m = await (await t.app.request('/metrics')).text();
    expect(m).toMatch(/^meshnet_tracker_busy_answers_total 1$/m);
    expect(m).toMatch(/^meshnet_tracker_head_failovers_total 0$/m);
    expect(m).not.toMatch(/meshnet_tracker_requests_total\{endpoint="chat",status="5\d\d"\}/);
  });

  it('holds an estimate of the chat\'s length until the head counts it, and learns the model\'s tokens per byte from that count', async () => {
    const scripts: Record<string, Script[]> = {};
    const { t } = await tracker({}, scripts);
    // Blocks of one position: what the tracker holds is its token estimate × 1000 bytes.
    const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1).withKv({ perToken: 1000, block: 1, budget: 10 * BLOCK });
    n.serving = { start_layer: 0, end_layer: 12 };
    await n.register(t);
    const held = () => t.registry.kvHeldOn(n.peerId);
    const text = 'x'.repeat(90); // 90 + 4 (role) + 8 (template) = 102 bytes
    for (const [before, after] of [
      [Math.ceil((102 / 3) * 1.1) + 4 + 8, 51 + 8], // no count yet: a third of a token per byte
      [Math.ceil(102 * 0.5 * 1.1) + 4 + 8, 51 + 8], // learned: 51 tokens for 102 bytes
    ]) {
      const started = deferred();
      const gate = deferred();
      scripts[n.peerId] = [
        async function* () {
          await started.promise;
          yield { type: 'start', prompt_tokens: 51, route: [] } as GenerateEvent;
          await gate.promise;
          yield* tokenEvents(['a']);
          yield { type: 'done', finish_reason: 'stop', completion_tokens: 1, prompt_tokens: 51 } as GenerateEvent;
        },
      ];
      const res = post(t, chat(text));
      await until(() => held() > 0, 'the chat holding room');
      expect(held()).toBe(before! * 1000);
      started.resolve();
      await until(() => held() === after! * 1000, 'the lease resized to the head\'s count');
      gate.resolve();
      expect((await res).status).toBe(200);
      expect(held()).toBe(0);
    }
  });

  it('answers 400 context_length_exceeded at once when no route could hold the chat even idle', async () => {
    const { t, calls } = await tracker({}, {});
    await head(t, { budget: BLOCK });
    const res = await post(t, chat('long', { max_tokens: 100 }));
    expect(res.status).toBe(400);
    expect(((await res.json()) as { error: { code: string } }).error.code).toBe('context_length_exceeded');
    expect(calls.length).toBe(0);
  });

  it('counts other callers\' sessions from the heartbeat apart from its own chats', async () => {
    const scripts: Record<string, Script[]> = {};
    const { t } = await tracker({}, scripts);
    const n = await head(t, { budget: 3 * BLOCK });
    const gate = deferred();
    scripts[n.peerId] = [gated(gate.promise), gated(gate.promise)];
    const rec = () => t.registry.nodes.get(n.peerId)!;
    const chats = [post(t, chat('a')), post(t, chat('b'))];
    await until(() => t.registry.kvHeldOn(n.peerId) === 2 * BLOCK, 'two chats holding room');
    expect(t.registry.kvFree(rec())).toBe(BLOCK);
    // The node's next heartbeat counts our two sessions plus one of someone else's: one foreign block.
    n.withKv({ ...KV, budget: 3 * BLOCK, used: 3 * BLOCK });
    await n.heartbeat(t);
    expect(t.registry.kvFree(rec())).toBe(0);
    gate.resolve();
    await Promise.all(chats);
    // Our chats ended; the foreign session still counts until a heartbeat says otherwise.
    expect(t.registry.kvFree(rec())).toBe(2 * BLOCK);
  });
});
