/**
 * The node runtime on an in-memory host (support/fake-host.ts): real graphs
 * on onnxruntime-node, weights from the fixture, a scripted tracker behind
 * fetch, no socket. What both hosts used to do each their own way: the span's
 * life (load, swap, release), the forward gate, pause, the heartbeat's
 * message, the state machine, failures.
 */
import { afterEach, describe, expect, it } from 'vitest';
import { ReferenceModel, newRefCache } from '../../../src/model/reference.ts';
import { NodeRuntime, type RuntimeConfig, type RuntimeEvent } from '../../../src/node/runtime/runtime.ts';
import { NodeState } from '../../../src/node/runtime/state.ts';
import { encodeBase64Url } from '../../../src/protocol/base64.ts';
import type { MeshReply, MeshRequest, MeshResponse } from '../../../src/protocol/envelopes.ts';
import { decodeTensor, encodeTensor } from '../../../src/protocol/tensor.ts';
import { routeSigningMessage, type GenerateEvent } from '../../../src/protocol/tracker.ts';
import { Identity } from '../../../src/net/identity.ts';
import { fixture, maxAbsDiff, nodeBackend } from '../../helpers/shard.ts';
import { MODEL_URL, assignment, fakeHost, scriptedTracker, type FakeHost } from '../../helpers/fake-host.ts';
import { until } from '../../helpers/fake-socket.ts';

const f = fixture('tiny');
const H = f.cfg.hiddenSize;
const ref = new ReferenceModel(f.cfg, f.weights);
const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

let runtimes: NodeRuntime[] = [];
afterEach(async () => {
  await Promise.all(runtimes.map((r) => r.close()));
  runtimes = [];
});

async function runtime(host: FakeHost, config: Partial<RuntimeConfig>): Promise<{ rt: NodeRuntime; events: RuntimeEvent[] }> {
  const rt = await NodeRuntime.create(host, { memoryBudgetBytes: 64 * 2 ** 20, maxContext: 256, backendKind: 'onnxruntime-node', retryFailedLoads: false, ...config });
  runtimes.push(rt);
  const events: RuntimeEvent[] = [];
  rt.on((e) => events.push(e));
  return { rt, events };
}

const staticSpan = (a: number, b: number) => ({ model: 'tiny', modelUrl: MODEL_URL, startLayer: a, endLayer: b });
const states = (events: RuntimeEvent[]) => events.flatMap((e) => (e.type === 'state' ? [e.state] : []));

function reply(res: MeshResponse): MeshReply {
  if (!(res.body instanceof Uint8Array)) throw new Error('streamed');
  return res as MeshReply;
}
function json(res: MeshResponse): Record<string, unknown> {
  return JSON.parse(utf8d.decode(reply(res).body)) as Record<string, unknown>;
}
function forward(x: Float32Array, seq: number, extra: Record<string, string> = {}): MeshRequest {
  return { method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': `1,${seq},${H}`, 'x-meshnet-dtype': 'f32', ...extra }, body: encodeTensor(x, 'f32') };
}
const get = (path: string): MeshRequest => ({ method: 'GET', path, headers: {}, body: new Uint8Array(0) });
const activation = (seq: number) => Float32Array.from(ref.embed(Array.from({ length: seq }, (_, i) => 5 + i * 11)));

describe('NodeRuntime', () => {
  it('serves a static span through its handler (the float64 reference), and walks idle → connecting → downloading → loading → serving', async () => {
    const host = fakeHost();
    const { rt, events } = await runtime(host, { span: staticSpan(1, 3) });
    expect(rt.state).toBe(NodeState.Idle);
    await rt.start();
    expect(states(events)).toEqual([NodeState.Connecting, NodeState.Downloading, NodeState.Loading, NodeState.Serving]);
    expect(events.find((e) => e.type === 'serving')).toMatchObject({ span: staticSpan(1, 3) });
    const x = activation(4);
    const res = await rt.handlerFor('http')(forward(x, 4));
    expect(res.status).toBe(200);
    const { err, scale } = maxAbsDiff(decodeTensor(reply(res).body, 'f32'), ref.layers(1, 3, Float64Array.from(x), 4, 0, newRefCache(f.cfg)));
    expect(err).toBeLessThanOrEqual(1e-4 * Math.max(1, scale));
    const info = json(await rt.handlerFor('relay')(get('/info')));
    expect(info).toMatchObject({ peer_id: rt.peerId, host: 'node', start_layer: 1, end_layer: 3, forwards_served: { relay: 0, link: 0, http: 1 } });
    // A one-token step feeds the heartbeat's per-layer time; the prompt of 4 rows did not.
    expect(rt.nodeMessage().stats).toMatchObject({ layer_ms: 0, tokens_served: 4, queue_depth: 0 });
    await rt.handlerFor('http')(forward(activation(1), 1));
    expect(rt.nodeMessage().stats!.layer_ms).toBeGreaterThan(0);
  });

  it('heads a pipeline on a static [0, 4) span: /generate streams the reference greedy tokens and times its own steps', async () => {
    const tracker = await Identity.generate();
    const host = fakeHost();
    const { rt, events } = await runtime(host, { span: staticSpan(0, 4), trackerKey: tracker.publicKey });
    await rt.start();
    const route = '[]';
    const expires = Date.now() + 60_000;
    const signature = encodeBase64Url(await tracker.sign(routeSigningMessage(rt.peerId, expires, route)));
    const res = await rt.handlerFor('relay')({
      method: 'POST',
      path: '/generate',
      headers: { 'x-meshnet-route': route, 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': signature },
      body: utf8.encode(JSON.stringify({ session_id: 's', prompt: 'The quick brown fox', max_tokens: 6, temperature: 0 })),
    });
    expect(res.status).toBe(200);
    let text = '';
    for await (const chunk of res.body as AsyncIterable<Uint8Array>) text += utf8d.decode(chunk);
    const got = text.trim().split('\n').map((l) => JSON.parse(l) as GenerateEvent);
    const ids = got.flatMap((e) => (e.type === 'token' ? [e.token_id] : []));
    const tokenizer = rt.span!.tokenizer!;
    expect(ids).toEqual(ref.greedy(tokenizer.encode('The quick brown fox'), 6).slice(0, ids.length));
    expect(ids.length).toBeGreaterThan(0);
    expect(events.filter((e) => e.type === 'generate').map((e) => (e as { event: GenerateEvent }).event.type)).toEqual(got.map((e) => e.type));
    const stats = rt.nodeMessage().stats!;
    expect(stats.tokens_served).toBe(ids.length);
    expect(stats.layer_ms).toBeGreaterThan(0);
  });

  it('self-speculation (--draft self:N): the span\'s own first layers and its head draft, the reference tokens come out; self:N past the model is refused', async () => {
    const tracker = await Identity.generate();
    const generate = async (rt: NodeRuntime) => {
      const route = '[]';
      const expires = Date.now() + 60_000;
      const signature = encodeBase64Url(await tracker.sign(routeSigningMessage(rt.peerId, expires, route)));
      const res = await rt.handlerFor('relay')({
        method: 'POST',
        path: '/generate',
        headers: { 'x-meshnet-route': route, 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': signature },
        body: utf8.encode(JSON.stringify({ session_id: 's', prompt: 'The quick brown fox', max_tokens: 12, temperature: 0, speculative_k: 3 })),
      });
      let text = '';
      for await (const chunk of res.body as AsyncIterable<Uint8Array>) text += utf8d.decode(chunk);
      return text.trim().split('\n').map((l) => JSON.parse(l) as GenerateEvent);
    };
    const { rt } = await runtime(fakeHost(), { span: staticSpan(0, 4), trackerKey: tracker.publicKey, draftModelUrl: 'self:2' });
    await rt.start();
    expect(rt.span!.draft).toMatchObject({ name: 'self:2', self: true });
    const got = await generate(rt);
    expect(got.flatMap((e) => (e.type === 'token' ? [e.token_id] : []))).toEqual(ref.greedy(rt.span!.tokenizer!.encode('The quick brown fox'), 12));
    expect(got.at(-1)).toMatchObject({ type: 'done' });
    expect((got.at(-1) as { drafted?: number }).drafted).toBeGreaterThan(0);
    const refused = await runtime(fakeHost(), { span: staticSpan(0, 4), trackerKey: tracker.publicKey, draftModelUrl: 'self:4' });
    await refused.rt.start();
    expect(refused.rt.span!.draft).toBeUndefined();
  });

  it('answers loading and 503 before a span, and 503 to new sessions with "draining" (span kept) in heartbeats while paused', async () => {
    const host = fakeHost();
    host.hold(1, 3);
    const { rt } = await runtime(host, { span: staticSpan(1, 3) });
    const started = rt.start();
    await until(() => rt.state === NodeState.Downloading);
    const handler = rt.handlerFor('link');
    expect(json(await handler(get('/health')))).toEqual({ status: 'loading', sessions: 0 });
    expect(json(await handler(get('/info')))).toMatchObject({ peer_id: rt.peerId, start_layer: null, loading: true });
    const early = await handler(forward(activation(1), 1));
    expect([early.status, (json(early).error as { code: string }).code]).toEqual([503, 'MESH_ERR_UNAVAILABLE']);
    host.release(1, 3);
    await started;
    rt.pause();
    expect(rt.state).toBe(NodeState.Paused);
    const paused = await handler(forward(activation(1), 1));
    expect(paused.status).toBe(503);
    expect(rt.nodeMessage()).toMatchObject({ draining: true, serving: { start_layer: 1, end_layer: 3 } });
    rt.resume();
    expect([rt.state, (await handler(forward(activation(1), 1))).status, rt.nodeMessage().serving]).toEqual([NodeState.Serving, 200, { start_layer: 1, end_layer: 3 }]);
    expect(rt.nodeMessage().draining).toBeUndefined();
  });

  it('pause drains: a session in flight goes on, new ones and /generate are refused, the grace ends it; resume reloads nothing', async () => {
    const tracker = await Identity.generate();
    const host = fakeHost();
    const { rt } = await runtime(host, { span: staticSpan(0, 4), trackerKey: tracker.publicKey, drainGraceMs: 600 });
    await rt.start();
    const h = rt.handlerFor('relay');
    const x = activation(3);
    const open = await h(forward(x, 3, { 'x-meshnet-session': 'live', 'x-meshnet-position': '0' }));
    expect(open.status).toBe(200);
    // A route may use only the end of the span (another node holds layers 0-1): that session has no cache at layer 0.
    const tail = { 'x-meshnet-session': 'tail', 'x-meshnet-start-layer': '2', 'x-meshnet-end-layer': '4' };
    expect((await h(forward(x, 3, { ...tail, 'x-meshnet-position': '0' }))).status).toBe(200);
    rt.pause();
    expect((await h(forward(activation(1), 1, { ...tail, 'x-meshnet-position': '3' }))).status).toBe(200);
    expect((await h(forward(x, 3, { 'x-meshnet-session': 'tail2', 'x-meshnet-start-layer': '2', 'x-meshnet-end-layer': '4', 'x-meshnet-position': '0' }))).status).toBe(503);
    expect(rt.drainStatus()).toMatchObject({ draining: true, reasons: ['donor'], done: false });
    expect(rt.drainStatus().graceLeftMs).toBeGreaterThan(400);
    // The live session's next step runs; a new session, a stateless call and a new generation do not.
    const next = await h(forward(activation(1), 1, { 'x-meshnet-session': 'live', 'x-meshnet-position': '3' }));
    expect(next.status).toBe(200);
    const fresh = await h(forward(x, 3, { 'x-meshnet-session': 'new', 'x-meshnet-position': '0' }));
    expect([fresh.status, (json(fresh).error as { code: string; message: string }).message]).toEqual([503, expect.stringMatching(/draining/)]);
    expect((await h(forward(x, 3))).status).toBe(503);
    const gen = await h({ method: 'POST', path: '/generate', headers: {}, body: utf8.encode('{}') });
    expect([gen.status, (json(gen).error as { code: string }).code]).toEqual([503, 'MESH_ERR_UNAVAILABLE']);
    // Past the grace the held session is refused too (its head replaces this hop).
    await new Promise((r) => setTimeout(r, 700));
    expect(rt.drainStatus().done).toBe(true);
    expect((await h(forward(activation(1), 1, { 'x-meshnet-session': 'live', 'x-meshnet-position': '4' }))).status).toBe(503);
    rt.resume();
    expect(host.opened).toHaveLength(1);
    expect((await h(forward(activation(1), 1, { 'x-meshnet-session': 'live', 'x-meshnet-position': '4' }))).status).toBe(200);
    expect(rt.state).toBe(NodeState.Serving);
  });

  it('a generation this head runs when it pauses finishes within the grace; one still running when the grace ends is stopped', async () => {
    const tracker = await Identity.generate();
    const host = fakeHost();
    const { rt } = await runtime(host, { span: staticSpan(0, 4), trackerKey: tracker.publicKey, drainGraceMs: 400, injectDelayMs: 0 });
    await rt.start();
    const route = '[]';
    const expires = Date.now() + 60_000;
    const signature = encodeBase64Url(await tracker.sign(routeSigningMessage(rt.peerId, expires, route)));
    const generate = (max: number) =>
      rt.handlerFor('relay')({
        method: 'POST',
        path: '/generate',
        headers: { 'x-meshnet-route': route, 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': signature },
        body: utf8.encode(JSON.stringify({ session_id: `s${max}`, prompt: 'The quick brown fox', max_tokens: max, temperature: 0, speculative: false })),
      });
    const short = await generate(4);
    rt.pause();
    let text = '';
    for await (const chunk of short.body as AsyncIterable<Uint8Array>) text += utf8d.decode(chunk);
    expect(text.trim().split('\n').map((l) => (JSON.parse(l) as GenerateEvent).type).pop()).toBe('done');
    rt.resume();
    // A long one, read slowly: the grace ends under it.
    const long = await generate(200);
    rt.pause();
    const types: string[] = [];
    for await (const chunk of long.body as AsyncIterable<Uint8Array>) {
      for (const l of utf8d.decode(chunk).trim().split('\n')) types.push((JSON.parse(l) as GenerateEvent).type);
      await new Promise((r) => setTimeout(r, 50));
    }
    expect(types.at(-1)).toBe('error');
    expect(types.filter((t) => t === 'token').length).toBeLessThan(199);
    expect(rt.drainStatus().done).toBe(true);
  });

  it('announces the duty cycle as throughput: a 50 % cap doubles layer_ms, and the door really rests the executor', async () => {
    const host = fakeHost();
    const { rt } = await runtime(host, { span: staticSpan(1, 3) });
    await rt.start();
    const h = rt.handlerFor('http');
    for (let i = 0; i < 5; i++) await h(forward(activation(1), 1));
    const full = rt.nodeMessage();
    expect(full.info.duty_cycle).toBeUndefined();
    rt.setDutyCycle(0.5);
    const half = rt.nodeMessage();
    expect(half.info.duty_cycle).toBe(0.5);
    expect(half.stats!.layer_ms).toBeCloseTo(full.stats!.layer_ms * 2, 2);
    const waited = rt.duty.waitedMs;
    for (let i = 0; i < 5; i++) await h(forward(activation(1), 1));
    expect(rt.duty.waitedMs).toBeGreaterThan(waited);
    expect(() => rt.setDutyCycle(0)).toThrow(RangeError);
  });

  it('signs a drain beacon beside every message (same timestamp, draining), and the page\'s lifecycle drains and resumes', async () => {
    const tracker = await scriptedTracker(40);
    const host = fakeHost(tracker.fetch);
    tracker.assign(assignment(0, 2));
    const { rt, events } = await runtime(host, { trackerUrl: 'http://tracker.test', drainBeacons: true, storedSpan: { model: 'tiny', startLayer: 0, endLayer: 2 } });
    await rt.start();
    await until(() => tracker.messages.length >= 3);
    const beacons = events.flatMap((e) => (e.type === 'drain-beacon' ? [e] : []));
    expect(beacons.length).toBeGreaterThanOrEqual(2);
    const last = JSON.parse(beacons.at(-1)!.body) as { body: { draining?: boolean; timestamp: number; stored?: unknown }; signature: string };
    expect(beacons.at(-1)!.url).toBe('http://tracker.test/api/nodes/heartbeat');
    expect(last.body.draining).toBe(true);
    expect(last.body.stored).toEqual({ start_layer: 0, end_layer: 2 });
    // Its twin reached the tracker with the same timestamp, not draining; timestamps only grow.
    const twin = tracker.messages.find((m) => m.body.timestamp === last.body.timestamp);
    expect(twin?.body.draining).toBeUndefined();
    const stamps = tracker.messages.map((m) => m.body.timestamp);
    expect(stamps).toEqual([...stamps].sort((a, b) => a - b));
    expect(new Set(stamps).size).toBe(stamps.length);
    rt.lifecycle('frozen');
    await until(() => tracker.messages.at(-1)!.body.draining === true);
    expect(rt.state).toBe(NodeState.Serving);
    rt.lifecycle('resumed');
    await until(() => tracker.messages.at(-1)!.body.draining === undefined);
    expect(rt.drainStatus().draining).toBe(false);
  });

  it('means one thing by the memory budget: the span\'s weights plus KV; a new budget applies in place, a live session going on', async () => {
    const host = fakeHost();
    const perToken = 2 * 2 * f.cfg.numKvHeads * f.cfg.headDim * 4; // layers [1, 3), f32 keys and values
    const budget = 64 * 2 ** 20;
    const { rt } = await runtime(host, { span: staticSpan(1, 3), memoryBudgetBytes: budget });
    expect(rt.kvBudgetBytes()).toBe(budget); // no weights held yet
    await rt.start();
    const executor = rt.span!.executor;
    expect(executor.weightBytes).toBeGreaterThan(0);
    expect(rt.kvBudgetBytes()).toBe(budget - executor.weightBytes);
    const info = json(await rt.handlerFor('http')(get('/info')));
    expect(info).toMatchObject({ weight_bytes: executor.weightBytes, kv: { budget_bytes: budget - executor.weightBytes, bytes_per_token: perToken, sessions: 0 } });
    // A session declared at 100 positions holds two 64-position blocks from its first request on.
    const open = await rt.handlerFor('http')(forward(activation(3), 3, { 'x-meshnet-session': 'live', 'x-meshnet-position': '0', 'x-meshnet-session-tokens': '100' }));
    expect(open.status).toBe(200);
    expect(rt.nodeMessage().stats).toMatchObject({ kv_budget_bytes: budget - executor.weightBytes, kv_used_bytes: 128 * perToken, kv_sessions: 1, kv_bytes_per_token: perToken, kv_block_tokens: 64, kv_free_bytes: budget - executor.weightBytes - 128 * perToken });
    // Down to the weights plus one block: the same executor (no reload), the live session keeps its room.
    await rt.setMemoryBudget(executor.weightBytes + 64 * perToken);
    expect(rt.span!.executor).toBe(executor);
    expect(rt.kvBudgetBytes()).toBe(64 * perToken);
    expect(rt.nodeMessage().info.memory_budget_mb).toBe((executor.weightBytes + 64 * perToken) / 2 ** 20);
    const step = await rt.handlerFor('http')(forward(activation(1), 1, { 'x-meshnet-session': 'live', 'x-meshnet-position': '3' }));
    expect(step.status).toBe(200);
    // No room for another session now: 503 MESH_ERR_BUSY with Retry-After, not an eviction.
    const busy = await rt.handlerFor('http')(forward(activation(1), 1, { 'x-meshnet-session': 'other', 'x-meshnet-position': '0', 'x-meshnet-session-tokens': '8' }));
    expect([busy.status, (json(busy).error as { code: string }).code, busy.headers['retry-after']]).toEqual([503, 'MESH_ERR_BUSY', '1']);
    expect(rt.nodeMessage().stats).toMatchObject({ kv_sessions: 1, kv_free_bytes: 0 });
  });

  it('warns when the span\'s weights leave the KV caches too little of the budget for one session', async () => {
    const host = fakeHost();
    const { rt } = await runtime(host, { span: staticSpan(1, 3), memoryBudgetBytes: 1024 });
    await rt.start();
    expect(rt.kvBudgetBytes()).toBe(0);
    expect(host.logs.some((l) => l.level === 'warn' && /leaving 0\.00 MiB of the 0\.00 MiB budget for KV caches: sessions will be refused/.test(l.message))).toBe(true);
  });

  it('adopts the tracker\'s assignments in order: the old span answers while the new one loads, a superseded one is never loaded, the old executor is released', async () => {
    const tracker = await scriptedTracker();
    tracker.assign(assignment(1, 3));
    const host = fakeHost(tracker.fetch);
    const { rt, events } = await runtime(host, { trackerUrl: 'http://tracker.test' });
    await rt.start();
    expect(rt.model).toBe('tiny');
    expect(rt.span?.spec).toMatchObject({ startLayer: 1, endLayer: 3 });
    const first = rt.span!.executor;
    // The next heartbeat's span loads slowly; meanwhile the tracker changes its mind twice.
    host.hold(2, 4);
    tracker.assign(assignment(2, 4));
    await until(() => host.opened.length === 2);
    const beats = () => tracker.messages.length;
    tracker.assign(assignment(3, 4));
    let n = beats();
    await until(() => beats() >= n + 2); // answered at least once (the second message proves the first answer was handled)
    tracker.assign(assignment(0, 2));
    n = beats();
    await until(() => beats() >= n + 2);
    expect(rt.state).toBe(NodeState.Downloading);
    expect((await rt.handlerFor('http')(forward(activation(1), 1))).status).toBe(200); // still [1, 3)
    host.release(2, 4);
    await until(() => rt.span?.spec.startLayer === 0);
    expect(host.opened.map((s) => `${s.startLayer}-${s.endLayer}`)).toEqual(['1-3', '2-4', '0-2']);
    expect(events.filter((e) => e.type === 'serving').map((e) => (e as { span: { startLayer: number } }).span.startLayer)).toEqual([1, 2, 0]);
    // Released: the old executor holds no session and refuses work.
    await expect(first.forward({ activation: { data: activation(1), shape: [1, 1, H] } })).rejects.toThrow();
    // The tracker hears what is served as soon as it is.
    await until(() => tracker.messages.at(-1)?.body.serving?.start_layer === 0);
  });

  it('stops in the error state when a tracker span fails to load (no more heartbeats) until retry()', async () => {
    const tracker = await scriptedTracker();
    tracker.assign(assignment(1, 3));
    const host = fakeHost(tracker.fetch);
    host.failing.add('1-3');
    const { rt } = await runtime(host, { trackerUrl: 'http://tracker.test' });
    await expect(rt.start()).rejects.toThrow(/model host is down/);
    expect(rt.state).toBe(NodeState.Error);
    expect((rt.error as { code: string }).code).toBe('MESH_ERR_MODEL_FETCH');
    const beats = tracker.messages.length;
    await new Promise((r) => setTimeout(r, 120));
    expect(tracker.messages.length).toBe(beats);
    host.failing.clear();
    await rt.retry();
    expect([rt.state, rt.error]).toEqual([NodeState.Serving, undefined]);
  });

  it('keeps serving and loads again at the next heartbeat when failed loads are retried (a daemon)', async () => {
    const tracker = await scriptedTracker();
    tracker.assign(assignment(1, 3));
    const host = fakeHost(tracker.fetch);
    const { rt, events } = await runtime(host, { trackerUrl: 'http://tracker.test', retryFailedLoads: true });
    await rt.start();
    host.failing.add('2-4');
    tracker.assign(assignment(2, 4));
    await until(() => events.some((e) => e.type === 'load-failed'));
    expect([rt.state, rt.span?.spec.startLayer]).toEqual([NodeState.Serving, 1]);
    host.failing.clear();
    await until(() => rt.span?.spec.startLayer === 2);
    expect(host.opened.filter((s) => s.startLayer === 2).length).toBeGreaterThanOrEqual(2);
  });

  it('stops announcing a span whose lost device could not be rebuilt, answers 503, and loads it afresh at a later assignment', async () => {
    const tracker = await scriptedTracker();
    tracker.assign(assignment(1, 3));
    // A backend with a device that can be lost (onnxruntime-node underneath: the plain executor never touches the device).
    const losers: Array<(reason: string) => void> = [];
    const host: FakeHost = {
      ...fakeHost(tracker.fetch),
      backends: {
        choose: async () => {
          const lost = new Promise<string>((r) => losers.push(r));
          const backend = Object.assign(Object.create(nodeBackend) as typeof nodeBackend, { device: { lost } as unknown as NonNullable<typeof nodeBackend.device> });
          return { backend, info: { name: nodeBackend.name, kind: 'onnxruntime-node', dtype: 'f32' } };
        },
      },
    };
    const { rt, events } = await runtime(host, { trackerUrl: 'http://tracker.test', retryFailedLoads: true });
    await rt.start();
    const handler = rt.handlerFor('http');
    expect(rt.nodeMessage().serving).toEqual({ start_layer: 1, end_layer: 3 });
    const first = rt.span;
    host.failing.add('1-3');
    losers[0]!('destroyed: test');
    await until(() => host.logs.some((l) => /giving up/.test(l.message)));
    expect(rt.span).toBe(first);
    expect(rt.nodeMessage().serving).toBeNull();
    await until(() => tracker.messages.at(-1)?.body.serving === null);
    expect((await handler(forward(activation(1), 1))).status).toBe(503);
    // The tracker assigns the same layers again at each heartbeat: now a load works, and the node serves them again.
    host.failing.clear();
    await until(() => rt.span !== first);
    expect(events.filter((e) => e.type === 'load-failed').length).toBeGreaterThanOrEqual(3);
    expect(rt.nodeMessage().serving).toEqual({ start_layer: 1, end_layer: 3 });
    const x = activation(1);
    const res = reply(await handler(forward(x, 1)));
    expect(res.status).toBe(200);
    const { err, scale } = maxAbsDiff(decodeTensor(res.body, 'f32'), ref.layers(1, 3, Float64Array.from(x), 1, 0, newRefCache(f.cfg)));
    expect(err).toBeLessThanOrEqual(1e-4 * Math.max(1, scale));
  });

  it('takes the wire dtype from the tracker\'s assignment: the hop accepts only it, a new one reloads the span', async () => {
    const tracker = await scriptedTracker();
    tracker.assign({ ...assignment(1, 3), wire_dtype: 'f32' });
    const host = fakeHost(tracker.fetch);
    const { rt } = await runtime(host, { trackerUrl: 'http://tracker.test' });
    await rt.start();
    expect(rt.span?.spec.wireDtype).toBe('f32');
    const handler = rt.handlerFor('http');
    expect(json(await handler(get('/info'))).wire_dtypes).toEqual(['f32']);
    expect((await handler(forward(activation(1), 1))).status).toBe(200);
    const bf16: MeshRequest = { ...forward(activation(1), 1), headers: { 'x-meshnet-shape': `1,1,${H}`, 'x-meshnet-dtype': 'bf16' }, body: encodeTensor(activation(1), 'bf16') };
    const refused = json(await handler(bf16)) as { error: { code: string; message: string } };
    expect(refused.error.code).toBe('MESH_ERR_BAD_REQUEST');
    expect(refused.error.message).toMatch(/is bf16, but this hop's mesh sends f32/);
    tracker.assign({ ...assignment(1, 3), wire_dtype: 'bf16' });
    await until(() => rt.span?.spec.wireDtype === 'bf16');
    expect((await rt.handlerFor('http')(bf16)).status).toBe(200);
  });

  it('waits in connecting, saying why, while the tracker assigns nothing', async () => {
    const tracker = await scriptedTracker();
    const host = fakeHost(tracker.fetch);
    const { rt } = await runtime(host, { trackerUrl: 'http://tracker.test', model: 'tiny', memoryBudgetBytes: 16 * 2 ** 20 });
    await rt.start();
    expect(rt.state).toBe(NodeState.Connecting);
    expect(rt.notice?.message).toMatch(/assigned no layers: 16 MiB/);
    expect(tracker.messages[0]!.body).toMatchObject({ peer_id: rt.peerId, info: { model: 'tiny', memory_budget_mb: 16, host: 'node', backend: 'onnxruntime-node' }, serving: null });
    tracker.assign(assignment(3, 4));
    await until(() => rt.state === NodeState.Serving);
    expect(rt.notice).toBeUndefined();
  });
});
