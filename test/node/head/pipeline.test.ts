import { beforeAll, describe, expect, it } from 'vitest';
import { createForwardHandler } from '../../../src/node/hop/forward-handler.ts';
import { HopTransport } from '../../../src/net/hop-transport.ts';
import { PipelineDriver, type HeadTokenizer } from '../../../src/node/head/pipeline.ts';
import { StopMatcher } from '../../../src/model/text-stream.ts';
import { ReferenceModel } from '../../../src/model/reference.ts';
import { ModelTokenizer } from '../../../src/model/tokenizer.ts';
import type { MeshRequest, MeshResponse } from '../../../src/protocol/envelopes.ts';
import { generateRequestSchema, type GenerateEvent, type RouteHop } from '../../../src/protocol/tracker.ts';
import { decodeTensor, encodeTensor } from '../../../src/protocol/tensor.ts';
import type { ShardExecutor } from '../../../src/shard/executor.ts';
import { executor, fixture } from '../../helpers/shard.ts';

const f = fixture('tiny');
const ref = new ReferenceModel(f.cfg, f.weights);
const tok = ModelTokenizer.fromJson(JSON.parse(new TextDecoder().decode(f.files.get('tokenizer.json')!)), JSON.parse(new TextDecoder().decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const PROMPT = 'The quick brown fox jumps over the lazy dog. Then';
const HEAD = 'a'.repeat(32);
const pid = (c: string) => c.repeat(32);

/** Hosts by endpoint; a fake `fetch` routes to their forward handlers and logs every request. */
class FakeNet {
  readonly handlers = new Map<string, (r: MeshRequest) => Promise<MeshResponse>>();
  readonly log: Array<{ host: string; headers: Record<string, string> }> = [];
  readonly dead = new Set<string>();
  /** Kill `host` when it receives its nth /forward (1-based). */
  killAt = new Map<string, number>();
  readonly counts = new Map<string, number>();
  fetch: typeof fetch = async (input, init) => {
    const url = new URL(String(input));
    const host = url.host;
    const n = (this.counts.get(host) ?? 0) + 1;
    if (url.pathname === '/forward') this.counts.set(host, n);
    if (this.killAt.get(host) === n && url.pathname === '/forward') this.dead.add(host);
    const h = this.handlers.get(host);
    if (!h || this.dead.has(host)) throw new TypeError('fetch failed', { cause: { code: 'ECONNREFUSED' } });
    const headers: Record<string, string> = {};
    new Headers(init?.headers).forEach((v, k) => (headers[k] = v));
    if (url.pathname === '/forward') this.log.push({ host, headers });
    const body = init?.body ? new Uint8Array(init.body as Uint8Array) : new Uint8Array(0);
    const res = await h({ method: init?.method ?? 'GET', path: url.pathname, headers, body });
    return new Response(res.body as Uint8Array<ArrayBuffer>, { status: res.status, headers: res.headers });
  };
}

function hop(c: string, start: number, end: number): RouteHop {
  return { peer_id: pid(c), start_layer: start, end_layer: end, endpoint: `http://${c}.test` };
}

async function run(driver: PipelineDriver, route: RouteHop[], body: Record<string, unknown>): Promise<GenerateEvent[]> {
  const req = generateRequestSchema.parse({ session_id: 'sess', temperature: 0, ...body });
  const out: GenerateEvent[] = [];
  for await (const e of driver.generate(HEAD, req, route)) out.push(e);
  return out;
}
const ids = (ev: GenerateEvent[]) => ev.flatMap((e) => (e.type === 'token' ? [e.token_id] : []));

describe('PipelineDriver', () => {
  let head: ShardExecutor;
  const net = new FakeNet();
  const promptIds = tok.encode(PROMPT);
  let want: number[];
  let undisturbed: GenerateEvent[] = [];
  const logprobs = (ev: GenerateEvent[]) => ev.flatMap((e) => (e.type === 'token' ? [e.logprob] : []));

  beforeAll(async () => {
    head = await executor(f, 0, 1);
    // b and d hold [1,3) (d is the spare), c holds [3,4), e and g split [1,3) into [1,2)+[2,3).
    const spans: Array<[string, number, number]> = [['b', 1, 3], ['c', 3, 4], ['d', 1, 3], ['e', 1, 2], ['g', 2, 3]];
    for (const [c, a, b] of spans) net.handlers.set(`${c}.test`, createForwardHandler(await executor(f, a, b), { model: 'tiny', backend: 'test' }));
    want = ref.greedy(promptIds, 12);
  });

  function driver(replace?: (h: RouteHop) => Promise<RouteHop[]>): PipelineDriver {
    return new PipelineDriver({ executor: head, tokenizer: tok as HeadTokenizer, transport: new HopTransport({ fetch: net.fetch }), ...(replace ? { replace } : {}) });
  }

  it('streams the float64 reference greedy tokens through a head and two hops, sending one token per hop after the prompt', async () => {
    net.log.length = 0;
    const ev = await run(driver(), [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 12 });
    undisturbed = ev;
    expect(ev[0]).toMatchObject({ type: 'start', prompt_tokens: promptIds.length, route: [pid('b'), pid('c')] });
    expect(ids(ev)).toEqual(want);
    expect(ev.at(-1)).toEqual({ type: 'done', finish_reason: 'length', completion_tokens: 12, prompt_tokens: promptIds.length });
    const toB = net.log.filter((l) => l.host === 'b.test');
    expect(toB.map((l) => l.headers['x-meshnet-shape'])).toEqual([`1,${promptIds.length},64`, ...Array(11).fill('1,1,64')]);
    expect(toB.map((l) => Number(l.headers['x-meshnet-position']))).toEqual([0, ...Array.from({ length: 11 }, (_, i) => promptIds.length + i)]);
    expect(toB.every((l) => l.headers['x-meshnet-dtype'] === 'bf16' && l.headers['x-meshnet-sampling'] === undefined)).toBe(true);
    // The request that opens each hop's session declares its whole length (prompt + max_tokens): the hop reserves its KV room once.
    for (const host of ['b.test', 'c.test']) {
      const sent = net.log.filter((l) => l.host === host);
      expect(sent[0]!.headers['x-meshnet-session-tokens']).toBe(String(promptIds.length + 12));
      expect(sent.slice(1).every((l) => l.headers['x-meshnet-session-tokens'] === undefined)).toBe(true);
    }
    expect(net.log.filter((l) => l.host === 'c.test').every((l) => l.headers['x-meshnet-sampling'] !== undefined)).toBe(true);
  });

  it('replaces a hop that dies mid-generation by two hops, replays the history into them once, and loses no token', async () => {
    net.log.length = 0;
    net.killAt.set('b.test', (net.counts.get('b.test') ?? 0) + 6);
    const asked: RouteHop[] = [];
    const ev = await run(driver(async (h) => (asked.push(h), [hop('e', 1, 2), hop('g', 2, 3)])), [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 12 });
    net.dead.clear();
    net.killAt.clear();
    expect(ids(ev)).toEqual(want);
    expect(asked).toEqual([hop('b', 1, 3)]);
    const rec = ev.find((e) => e.type === 'recovered');
    expect(rec).toMatchObject({ failed_peer_id: pid('b'), replacement_peer_id: `${pid('e')},${pid('g')}` });
    // The recovered event comes before the token of the step that failed.
    expect(ev.findIndex((e) => e.type === 'recovered')).toBe(ev.findIndex((e) => e.type === 'token' && e.index === 5) - 1);
    // b answered 5 steps (prompt + 4 tokens); for the 6th, e and then g got the history replayed in the
    // same chunks (prompt at 0, then one row per step), then the step itself: the cache is bit-identical.
    const P = promptIds.length;
    const chunks = (host: string) => net.log.filter((l) => l.host === host).slice(0, 6).map((l) => [l.headers['x-meshnet-position'], l.headers['x-meshnet-shape']]);
    const expected = [['0', `1,${P},64`], ...[0, 1, 2, 3, 4].map((k) => [String(P + k), '1,1,64'])];
    expect(chunks('e.test')).toEqual(expected);
    expect(chunks('g.test')).toEqual(expected);
    const toE = net.log.filter((l) => l.host === 'e.test');
    expect(toE[0]!.headers).toMatchObject({ 'x-meshnet-start-layer': '1', 'x-meshnet-end-layer': '2' });
    expect(toE.length).toBe(5 + (12 - 5));
    net.dead.clear();
    net.killAt.clear();
  });

  it('rebuilds a replacement cache bit for bit: the same log-probabilities as the undisturbed run', async () => {
    net.killAt.set('b.test', (net.counts.get('b.test') ?? 0) + 7);
    const ev = await run(driver(async () => [hop('d', 1, 3)]), [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 12 });
    net.dead.clear();
    net.killAt.clear();
    expect(ev.some((e) => e.type === 'recovered')).toBe(true);
    expect(logprobs(ev)).toEqual(logprobs(undisturbed));
  });

  it('replays each hop whose cache vanished (409) on the same hop, without asking the tracker, two in one step included', async () => {
    const c = net.handlers.get('c.test')!;
    const d = net.handlers.get('d.test')!;
    // Drop both hops' sessions before their 4th step: each answers 409 and must be replayed.
    const dropping = (h: typeof c) => {
      let calls = 0;
      return async (r: MeshRequest) => {
        if (r.path === '/forward' && ++calls === 4) await h({ method: 'DELETE', path: `/sessions/${r.headers['x-meshnet-session']}`, headers: {}, body: new Uint8Array(0) });
        return h(r);
      };
    };
    net.handlers.set('c.test', dropping(c));
    net.handlers.set('d.test', dropping(d));
    let asked = 0;
    const ev = await run(driver(async () => (asked++, [])), [hop('d', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 8 });
    net.handlers.set('c.test', c);
    net.handlers.set('d.test', d);
    expect(ids(ev)).toEqual(want.slice(0, 8));
    expect(asked).toBe(0);
    expect(ev.some((e) => e.type === 'error')).toBe(false);
  });

  it('replays a hop once: a second 409 in the same step ends the generation instead of replaying again', async () => {
    const c = net.handlers.get('c.test')!;
    let calls = 0;
    let opens = 0;
    net.handlers.set('c.test', async (r) => {
      if (r.path !== '/forward') return c(r);
      calls++;
      if (r.headers['x-meshnet-position'] === '0') opens++;
      // From its 4th request on, c has lost every session it is asked to continue.
      if (calls >= 4 && r.headers['x-meshnet-position'] !== '0') return { status: 409, headers: { 'content-type': 'application/json' }, body: new TextEncoder().encode('{"error":{"code":"MESH_ERR_POSITION_MISMATCH","message":"gone","actual_length":0}}') };
      return c(r);
    });
    const ev = await run(driver(async () => []), [hop('d', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 8 });
    net.handlers.set('c.test', c);
    expect(ids(ev)).toEqual(want.slice(0, 3));
    expect(ev.at(-1)).toMatchObject({ type: 'error', code: 'MESH_ERR_POSITION_MISMATCH' });
    expect(opens).toBe(2); // the first prompt and one replay
  });

  it('ends with MESH_ERR_BUSY naming the hop (no replay, no replacement) when a hop has no KV room for the session', async () => {
    const perToken = 2 * 2 * f.cfg.numKvHeads * f.cfg.headDim * 4;
    const full = await executor(f, 1, 3, { kvBudgetBytes: 64 * perToken, kvBlockTokens: 64 });
    await full.forward({ session: 'hog', position: 0, activation: { data: new Float32Array(f.cfg.hiddenSize), shape: [1, 1, f.cfg.hiddenSize] } });
    net.handlers.set('full.test', createForwardHandler(full, { model: 'tiny', backend: 'test' }));
    net.log.length = 0;
    let asked = 0;
    const ev = await run(driver(async () => (asked++, [])), [hop('full', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 12 });
    expect(ids(ev)).toEqual([]);
    expect(ev.at(-1)).toMatchObject({ type: 'error', code: 'MESH_ERR_BUSY', peer_id: pid('full'), retry_after_ms: 1000 });
    expect(asked).toBe(0);
    expect(net.log.filter((l) => l.host === 'full.test').length).toBe(1);
    expect(net.log.filter((l) => l.host === 'c.test').length).toBe(0);
    expect(full.kvStats()).toMatchObject({ sessions: 1, refusals: 1 });

    // The head's own cache full: the same, naming the head.
    const fullHead = await executor(f, 0, 1, { kvBudgetBytes: 64 * (perToken / 2), kvBlockTokens: 64 });
    await fullHead.forward({ session: 'hog', position: 0, tokenIds: [5] });
    const d = new PipelineDriver({ executor: fullHead, tokenizer: tok as HeadTokenizer, transport: new HopTransport({ fetch: net.fetch }) });
    const ev2 = await run(d, [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 4 });
    expect(ev2.at(-1)).toMatchObject({ type: 'error', code: 'MESH_ERR_BUSY', peer_id: HEAD });
  });

  it('continues after prefix_token_ids without emitting them again (head failover)', async () => {
    const ev = await run(driver(), [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 12, prefix_token_ids: want.slice(0, 5) });
    const tokens = ev.filter((e) => e.type === 'token');
    expect(ev.at(-1)).toMatchObject({ type: 'done' });
    expect(tokens.map((e) => e.index)).toEqual([5, 6, 7, 8, 9, 10, 11]);
    expect(ids(ev)).toEqual(want.slice(5));
    expect(ev.at(-1)).toMatchObject({ type: 'done', completion_tokens: 12 });
  });

  it('runs the whole model on the head when the route lists only the head (or nothing)', async () => {
    const whole = await executor(f, 0, 4);
    const d = new PipelineDriver({ executor: whole, tokenizer: tok as HeadTokenizer, transport: new HopTransport({}) });
    const ev = await run(d, [], { prompt: PROMPT, max_tokens: 6 });
    expect(ids(ev)).toEqual(want.slice(0, 6));
    const ev2 = await run(d, [{ peer_id: HEAD, start_layer: 0, end_layer: 4 }], { prompt: PROMPT, max_tokens: 6 });
    expect(ids(ev2)).toEqual(want.slice(0, 6));
  });

  it('ends with an error event (no token skipped) when a hop dies and there is no tracker to ask', async () => {
    net.killAt.set('c.test', (net.counts.get('c.test') ?? 0) + 3);
    const ev = await run(driver(), [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 12 });
    net.dead.clear();
    net.killAt.clear();
    expect(ids(ev)).toEqual(want.slice(0, ids(ev).length));
    expect(ev.at(-1)).toMatchObject({ type: 'error', code: 'MESH_ERR_UPSTREAM' });
  });

  it('stops at eos and at a stop string, dropping the stop text', async () => {
    const text = ids([]).length === 0 ? tok.decode(want.slice(0, 6), { skipSpecialTokens: true }) : '';
    const clean = text.replace(/\uFFFD/g, '');
    const stop = clean.slice(Math.floor(clean.length / 2), Math.floor(clean.length / 2) + 2);
    const ev = await run(driver(), [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 12, stop: [stop] });
    expect(ev.at(-1)).toMatchObject({ type: 'done', finish_reason: 'stop' });
    const out = ev.map((e) => (e.type === 'token' ? e.text : '')).join('');
    expect(out.includes(stop)).toBe(false);
    expect(ids(ev).length).toBeLessThan(12);
  });

  it('after a head failover, holds back and then drops or releases the same text as an undisturbed run (stop strings over the prefix boundary)', async () => {
    // Token texts of the greedy run; k: a token whose text ends in a character the next one does not start with.
    const dec = tok.streamDecoder({ skipSpecialTokens: true });
    const texts = want.map((id) => dec.push(id));
    const k = texts.findIndex((t, i) => i > 0 && i + 1 < 10 && t.length > 0 && (texts[i + 1] ?? '').length > 0 && !texts.slice(0, i).join('').includes(t.slice(-1)));
    expect(k).toBeGreaterThan(0);
    const straddling = texts[k]!.slice(-1) + texts[k + 1]![0]; // completes at token k+1
    const never = texts[k]!.slice(-1) + '\u0001'; // held at token k, released at k+1
    for (const stop of [straddling, never]) {
      const whole = await run(driver(), [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 10, stop: [stop] });
      const resumed = await run(driver(), [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 10, stop: [stop], prefix_token_ids: want.slice(0, k + 1) });
      const after = (ev: GenerateEvent[]) => ev.flatMap((e) => (e.type === 'token' && e.index > k ? [[e.index, e.token_id, e.text]] : []));
      expect(after(resumed)).toEqual(after(whole));
      expect(resumed.at(-1)).toMatchObject({ type: 'done', finish_reason: whole.at(-1)!.type === 'done' ? (whole.at(-1) as { finish_reason: string }).finish_reason : 'none' });
    }
  });

  it('sends its wire dtype on every hop (f32: the reference tokens, 4 bytes per element) and ends with an error when a hop answers in another', async () => {
    const f32 = new PipelineDriver({ executor: head, tokenizer: tok as HeadTokenizer, transport: new HopTransport({ fetch: net.fetch }), wireDtype: 'f32' });
    net.log.length = 0;
    const ev = await run(f32, [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 12 });
    expect(ids(ev)).toEqual(want);
    expect(net.log.length).toBeGreaterThan(0);
    expect(new Set(net.log.map((l) => l.headers['x-meshnet-dtype']))).toEqual(new Set(['f32']));
    // f16 travels the same way (2 bytes per element, checked by each hop against the shape); its tokens may differ at a near-tie, so only completion is asserted.
    const f16 = new PipelineDriver({ executor: head, tokenizer: tok as HeadTokenizer, transport: new HopTransport({ fetch: net.fetch }), wireDtype: 'f16' });
    net.log.length = 0;
    const ev16 = await run(f16, [hop('b', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 12 });
    expect(ev16.at(-1)).toMatchObject({ type: 'done', completion_tokens: 12 });
    expect(new Set(net.log.map((l) => l.headers['x-meshnet-dtype']))).toEqual(new Set(['f16']));
    // A hop that answers bf16 bytes labelled bf16 to an f32 request: refused by the head, not passed on.
    const honest = net.handlers.get('b.test')!;
    net.handlers.set('x.test', async (req) => {
      const res = await honest({ ...req, headers: { ...req.headers, 'x-meshnet-dtype': 'bf16' }, body: encodeTensor(decodeTensor(req.body, 'f32'), 'bf16') });
      return res;
    });
    const bad = await run(f32, [hop('x', 1, 3), hop('c', 3, 4)], { prompt: PROMPT, max_tokens: 4 });
    expect(bad.at(-1)).toMatchObject({ type: 'error', code: 'MESH_ERR_UPSTREAM' });
    expect((bad.at(-1) as { message: string }).message).toMatch(/answered x-meshnet-dtype bf16 to a f32 request/);
  });

  it('refuses a route with a gap or one that does not end at the last layer', () => {
    const d = driver();
    expect(() => d.planRoute(HEAD, [hop('c', 3, 4)])).toThrow(/previous one ends at 1/);
    expect(() => d.planRoute(HEAD, [hop('b', 1, 3)])).toThrow(/ends at layer 3/);
    expect(d.planRoute(HEAD, [hop('e', 1, 2), hop('g', 2, 3), hop('c', 3, 4)]).localEnd).toBe(1);
  });
});

describe('StopMatcher', () => {
  it('holds back a possible stop prefix and releases it when the stop does not complete', () => {
    const m = new StopMatcher(['</s>']);
    expect(m.push('hello <')).toEqual({ text: 'hello ', stopped: false });
    expect(m.push('/')).toEqual({ text: '', stopped: false });
    expect(m.push('x')).toEqual({ text: '</x', stopped: false });
    expect(m.push(' a </')).toEqual({ text: ' a ', stopped: false });
    expect(m.push('s> tail')).toEqual({ text: '', stopped: true });
  });
  it('stops at the earliest of several stop strings', () => {
    const m = new StopMatcher(['bb', 'a']);
    expect(m.push('xxbba')).toEqual({ text: 'xx', stopped: true });
  });
});
