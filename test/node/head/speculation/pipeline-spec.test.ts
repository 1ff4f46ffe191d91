/**
 * Speculative decoding through the head's pipeline over real executors and
 * forward handlers (a fake network of direct HTTP hops, as the pipeline
 * tests): greedy output equals the float64 reference and speculation off,
 * with several tokens per trip; a hop that dies mid-verification is replaced
 * and replayed (padded chunks) without changing a token; stop strings and
 * max_tokens end exactly where speculation off ends; a draft model drafts.
 */
import { beforeAll, describe, expect, it } from 'vitest';
import { createForwardHandler } from '../../../../src/node/hop/forward-handler.ts';
import { HopTransport } from '../../../../src/net/hop-transport.ts';
import { PipelineDriver, type HeadTokenizer } from '../../../../src/node/head/pipeline.ts';
import { DraftModelDrafter } from '../../../../src/node/head/speculation/draft-model.ts';
import { ReferenceModel } from '../../../../src/model/reference.ts';
import { ModelTokenizer } from '../../../../src/model/tokenizer.ts';
import type { MeshRequest, MeshResponse } from '../../../../src/protocol/envelopes.ts';
import { generateRequestSchema, type GenerateEvent, type RouteHop } from '../../../../src/protocol/tracker.ts';
import type { ShardExecutor } from '../../../../src/shard/executor.ts';
import type { SignedPlan } from '../../../../src/node/verify/verifier.ts';
import { executor, fixture } from '../../../helpers/shard.ts';

const f = fixture('tiny');
const ref = new ReferenceModel(f.cfg, f.weights);
const tok = ModelTokenizer.fromJson(JSON.parse(new TextDecoder().decode(f.files.get('tokenizer.json')!)), JSON.parse(new TextDecoder().decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const PROMPT = 'The quick brown fox jumps over the lazy dog. Then';
const HEAD = 'a'.repeat(32);
const pid = (c: string) => c.repeat(32);

class FakeNet {
  readonly handlers = new Map<string, (r: MeshRequest) => Promise<MeshResponse>>();
  readonly log: Array<{ host: string; headers: Record<string, string> }> = [];
  readonly dead = new Set<string>();
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
const text = (ev: GenerateEvent[]) => ev.map((e) => (e.type === 'token' ? e.text : '')).join('');

describe('speculative decoding through the pipeline', () => {
  let head: ShardExecutor;
  const net = new FakeNet();
  const promptIds = tok.encode(PROMPT);
  let want: number[];
  const route = () => [hop('b', 1, 3), hop('c', 3, 4)];

  beforeAll(async () => {
    head = await executor(f, 0, 1);
    for (const [c, a, b] of [['b', 1, 3], ['c', 3, 4], ['d', 1, 3]] as Array<[string, number, number]>) net.handlers.set(`${c}.test`, createForwardHandler(await executor(f, a, b), { model: 'tiny', backend: 'test' }));
    want = ref.greedy(promptIds, 24);
  });

  function driver(o: { replace?: (h: RouteHop) => Promise<RouteHop[]>; drafter?: ConstructorParameters<typeof PipelineDriver>[0]['drafter'] } = {}): PipelineDriver {
    return new PipelineDriver({ executor: head, tokenizer: tok as HeadTokenizer, transport: new HopTransport({ fetch: net.fetch }), ...o });
  }

  it('an exact prediction (the oracle): the reference tokens, k + 1 of them per trip, ids only back', async () => {
    net.log.length = 0;
    const ev = await run(driver(), route(), { prompt: PROMPT, max_tokens: 24, speculative_k: 4, prediction_token_ids: want });
    expect(ids(ev)).toEqual(want);
    const done = ev.at(-1)!;
    expect(done).toMatchObject({ type: 'done', finish_reason: 'length', completion_tokens: 24 });
    // 24 tokens in 5-token trips (the prompt's step drafts too): 5 steps, every draft accepted.
    const toC = net.log.filter((l) => l.host === 'c.test');
    expect(toC).toHaveLength(5);
    expect(done).toMatchObject({ drafted: 19, accepted: 19 });
    expect(toC.every((l) => l.headers['x-meshnet-draft'] !== undefined)).toBe(true);
    expect(net.log.filter((l) => l.host === 'b.test').every((l) => l.headers['x-meshnet-draft'] === undefined)).toBe(true);
    // Each trip's first token says what the trip drafted and accepted.
    expect(ev.filter((e) => e.type === 'token' && e.drafted !== undefined).map((e) => e.type === 'token' && [e.drafted, e.accepted])).toEqual([[4, 4], [4, 4], [4, 4], [4, 4], [3, 3]]);
  });

  it('prompt lookup by default: the same tokens as speculation off; a wrong prediction costs nothing in output', async () => {
    const off = await run(driver(), route(), { prompt: PROMPT, max_tokens: 24, speculative: false });
    expect(ids(off)).toEqual(want);
    expect(off.at(-1)).not.toHaveProperty('drafted');
    const on = await run(driver(), route(), { prompt: PROMPT, max_tokens: 24 });
    expect(ids(on)).toEqual(want);
    const bad = await run(driver(), route(), { prompt: PROMPT, max_tokens: 24, speculative_k: 3, prediction_token_ids: want.map((t) => (t + 7) % f.cfg.vocabSize) });
    expect(ids(bad)).toEqual(want);
    expect(bad.at(-1)).toMatchObject({ accepted: expect.any(Number) });
    // Temperature 0.8: point-mass drafts are speculation off's own draws.
    const sampledOff = await run(driver(), route(), { prompt: PROMPT, max_tokens: 16, temperature: 0.8, seed: 11, speculative: false });
    const sampledOn = await run(driver(), route(), { prompt: PROMPT, max_tokens: 16, temperature: 0.8, seed: 11, speculative_k: 4, prediction_token_ids: ids(sampledOff).slice(0, 9) });
    expect(ids(sampledOn)).toEqual(ids(sampledOff));
  });

  it('a generation the tracker plans to check drafts like any other (its checks rebuild the rows cut back: test/node/verify/spec-checks.test.ts)', async () => {
    net.log.length = 0;
    const req = generateRequestSchema.parse({ session_id: 'checked', temperature: 0, prompt: PROMPT, max_tokens: 12, speculative_k: 4, prediction_token_ids: want });
    const plan = { text: '{}', signature: 'x', plan: { checks: [{}] } } as unknown as SignedPlan;
    const ev: GenerateEvent[] = [];
    for await (const e of driver().generate(HEAD, req, route(), { plan })) ev.push(e);
    expect(ids(ev)).toEqual(want.slice(0, 12));
    expect(ev.at(-1)).toMatchObject({ drafted: expect.any(Number) });
    expect(net.log.filter((l) => l.host === 'c.test').length).toBeLessThan(12);
    expect(net.log.some((l) => l.headers['x-meshnet-draft'] !== undefined)).toBe(true);
  });

  it('a hop dying mid-verification is replaced and replayed to the last accepted position: no token changes', async () => {
    net.log.length = 0;
    net.killAt.set('b.test', (net.counts.get('b.test') ?? 0) + 3);
    const asked: RouteHop[] = [];
    // Every third draft wrong: trips that accept some, reject the rest, and leave rows to cut back.
    const prediction = want.map((t, i) => (i % 3 === 2 ? (t + 1) % f.cfg.vocabSize : t));
    const ev = await run(driver({ replace: async (h) => (asked.push(h), [hop('d', 1, 3)]) }), route(), { prompt: PROMPT, max_tokens: 24, speculative_k: 4, prediction_token_ids: prediction });
    net.dead.clear();
    net.killAt.clear();
    expect(asked).toEqual([hop('b', 1, 3)]);
    expect(ev.some((e) => e.type === 'recovered')).toBe(true);
    expect(ids(ev)).toEqual(want);
    // The replacement got the history in the chunks first computed: widths of the verification steps, not the kept rows.
    const toD = net.log.filter((l) => l.host === 'd.test');
    const toB = net.log.filter((l) => l.host === 'b.test');
    const shapes = (l: typeof toB) => l.map((x) => x.headers['x-meshnet-shape']);
    expect(shapes(toD).slice(0, 2)).toEqual(shapes(toB).slice(0, 2));
    expect(toD[1]!.headers['x-meshnet-rollback']).toBeDefined();
  });

  it('a stop string inside accepted drafts ends exactly where speculation off ends', async () => {
    const off = await run(driver(), route(), { prompt: PROMPT, max_tokens: 24, speculative: false });
    const full = text(off);
    const stopAt = full.slice(10, 14);
    const offStop = await run(driver(), route(), { prompt: PROMPT, max_tokens: 24, speculative: false, stop: [stopAt] });
    const onStop = await run(driver(), route(), { prompt: PROMPT, max_tokens: 24, speculative_k: 8, prediction_token_ids: want, stop: [stopAt] });
    expect(text(onStop)).toBe(text(offStop));
    expect(ids(onStop)).toEqual(ids(offStop));
    expect(onStop.at(-1)).toMatchObject({ finish_reason: 'stop', completion_tokens: ids(offStop).length });
  });

  it('a draft model sampling at T > 0 (Leviathan): the same tokens for a seed whatever k, and another seed gives others', async () => {
    const other = fixture('tiny', 1);
    const draftEx = await executor(other, 0, other.cfg.numLayers);
    try {
      const drafter = (req: Parameters<NonNullable<ConstructorParameters<typeof PipelineDriver>[0]['drafter']>>[0], ctx: { session: string; declared: number }) =>
        new DraftModelDrafter(draftEx, { session: `${ctx.session}.draft`, sampling: { temperature: req.temperature, ...(req.seed !== undefined ? { seed: req.seed } : {}) }, declared: ctx.declared });
      const body = { prompt: PROMPT, max_tokens: 16, temperature: 0.8, seed: 21 };
      const a = await run(driver({ drafter }), route(), { ...body, speculative_k: 2 });
      const b = await run(driver({ drafter }), route(), { ...body, speculative_k: 5 });
      expect(ids(a)).toHaveLength(16);
      expect(ids(b)).toEqual(ids(a));
      expect(a.at(-1)).toMatchObject({ type: 'done', drafted: expect.any(Number) });
      const c = await run(driver({ drafter }), route(), { ...body, seed: 22, speculative_k: 2 });
      expect(ids(c)).not.toEqual(ids(a));
    } finally {
      await draftEx.release();
    }
  });

  it('turns itself off while a hop says its batches run full (X-Meshnet-Batch-Full), and back on after', async () => {
    const c = net.handlers.get('c.test')!;
    let fullFor = 0;
    net.handlers.set('c.test', async (r) => {
      const res = await c(r);
      if (fullFor > 0) {
        fullFor--;
        res.headers['x-meshnet-batch-full'] = '1';
      }
      return res;
    });
    try {
      net.log.length = 0;
      fullFor = 1;
      const ev = await run(driver(), route(), { prompt: PROMPT, max_tokens: 24, prediction_token_ids: want });
      expect(ids(ev)).toEqual(want);
      const drafts = net.log.filter((l) => l.host === 'c.test').map((l) => (l.headers['x-meshnet-draft'] ? JSON.parse(l.headers['x-meshnet-draft']).ids.length : 0));
      // The prompt's step drafted and heard "full": the next 8 trips are plain, then drafting resumes.
      expect(drafts[0]).toBeGreaterThan(0);
      expect(drafts.slice(1, 9)).toEqual(new Array(8).fill(0));
      expect(drafts.slice(9).some((k) => k > 0)).toBe(true);
    } finally {
      net.handlers.set('c.test', c);
    }
  });

  it('refuses a prediction with ids outside the vocabulary (400, before anything runs)', async () => {
    const ev = await run(driver(), route(), { prompt: PROMPT, max_tokens: 4, prediction_token_ids: [5, f.cfg.vocabSize] });
    expect(ev).toEqual([expect.objectContaining({ type: 'error', code: 'MESH_ERR_BAD_REQUEST', message: expect.stringMatching(/prediction token id/) })]);
  });

  it('max_tokens cuts the draft: exactly max_tokens tokens, the last step drafting only what fits', async () => {
    net.log.length = 0;
    const ev = await run(driver(), route(), { prompt: PROMPT, max_tokens: 7, speculative_k: 4, prediction_token_ids: want });
    expect(ids(ev)).toEqual(want.slice(0, 7));
    const drafts = net.log.filter((l) => l.host === 'c.test').map((l) => JSON.parse(l.headers['x-meshnet-draft'] ?? '{"ids":[]}').ids.length);
    expect(drafts).toEqual([4, 1]);
  });

  it('a draft model (the target itself: every draft right) drafts on the head\'s own backend', async () => {
    const draftEx = await executor(f, 0, f.cfg.numLayers);
    try {
      const ev = await run(driver({ drafter: (req, ctx) => new DraftModelDrafter(draftEx, { session: `${ctx.session}.draft`, sampling: { temperature: req.temperature }, declared: ctx.declared }) }), route(), { prompt: PROMPT, max_tokens: 24, speculative_k: 4 });
      expect(ids(ev)).toEqual(want);
      expect(ev.at(-1)).toMatchObject({ drafted: 19, accepted: 19 });
      // Its session ended with the generation.
      expect(draftEx.kvStats().sessions).toBe(0);
    } finally {
      await draftEx.release();
    }
  });

  it('a greedy draft model catches up on the tokens accepted since its last draft in one forward, proposing what it would have one by one', async () => {
    const draftEx = await executor(f, 0, f.cfg.numLayers);
    const forwards: number[] = [];
    const counted = { config: draftEx.config, maxContext: draftEx.maxContext, dropSession: (id: string) => draftEx.dropSession(id), forward: (r: Parameters<typeof draftEx.forward>[0]) => (forwards.push(r.tokenIds!.length), draftEx.forward(r)) };
    try {
      const promptIds = tok.encode(PROMPT);
      const d = new DraftModelDrafter(counted, { session: 'catch-up', sampling: { temperature: 0 }, declared: promptIds.length + 24 });
      // The prompt, then eight plain steps (nothing drafted), then a draft.
      expect((await d.propose(promptIds, 1)).ids).toEqual(want.slice(0, 1));
      forwards.length = 0;
      const proposed = await d.propose([...promptIds, ...want.slice(0, 9)], 3);
      // One forward for the nine tokens, then one for each draft fed (the last draft is not fed).
      expect(forwards).toEqual([9, 1, 1]);
      expect(proposed.ids).toEqual(want.slice(9, 12));
      // A draft's cost is timed on one-token forwards (the catch-up's rows are cheaper each).
      expect(d.costPerToken()).toBeGreaterThan(0);
      // Caught up ahead (while a step travels), the next draft feeds only the token that step emitted.
      await d.prepare([...promptIds, ...want.slice(0, 16)]);
      forwards.length = 0;
      expect((await d.propose([...promptIds, ...want.slice(0, 17)], 1)).ids).toEqual(want.slice(17, 18));
      expect(forwards).toEqual([1]);
      d.release();
    } finally {
      await draftEx.release();
    }
  });

  it('a draft model new to the head probes before it drafts, and the head carries a losing one\'s acceptance to its next generation', async () => {
    // The same preset made with another seed: the same vocabulary, a draft that (nearly) never agrees.
    const other = fixture('tiny', 1);
    const draftEx = await executor(other, 0, other.cfg.numLayers);
    const forwards: number[] = [];
    const counted = { config: draftEx.config, maxContext: draftEx.maxContext, dropSession: (id: string) => draftEx.dropSession(id), forward: (r: Parameters<typeof draftEx.forward>[0]) => (forwards.push(r.tokenIds!.length), draftEx.forward(r)) };
    try {
      const d = driver({ drafter: (req, ctx) => new DraftModelDrafter(counted, { session: `${ctx.session}.draft`, sampling: { temperature: req.temperature }, declared: ctx.declared, name: 'other' }) });
      const draftedTrips = (ev: GenerateEvent[]) => ev.filter((e) => e.type === 'token' && (e.drafted ?? 0) > 0).length;
      const perGeneration: number[] = [];
      for (let g = 0; g < 4; g++) {
        net.log.length = 0;
        forwards.length = 0;
        const ev = await run(d, route(), { prompt: PROMPT, max_tokens: 24, session_id: `carry-${g}` });
        expect(ids(ev)).toEqual(want);
        perGeneration.push(draftedTrips(ev));
        if (g === 0) {
          // New to this head, it probes first: the prompt's step drafts nothing (the draft model reads the prompt
          // beside it, in one forward), the first decode trip drafts one token (one forward: the token emitted).
          // (What follows depends on trip times: in process a draft costs next to nothing against a trip.)
          const drafts = net.log.filter((l) => l.host === 'c.test').map((l) => (l.headers['x-meshnet-draft'] ? JSON.parse(l.headers['x-meshnet-draft']).ids.length : 0));
          expect(drafts.slice(0, 2)).toEqual([0, 1]);
          expect(forwards.slice(0, 2)).toEqual([promptIds.length, 1]);
        }
      }
      // The next generations start from what the first learnt: a probe or two in all.
      expect(perGeneration.slice(1).reduce((a, b) => a + b, 0)).toBeLessThanOrEqual(2);
      expect(draftEx.kvStats().sessions).toBe(0);
    } finally {
      await draftEx.release();
    }
  });

  it('self-speculation (the target\'s first layers with its final norm and LM head as the draft): the reference tokens', async () => {
    // What `--draft self:2` loads: the same weights, a config cut to 2 layers, so the span [0, 2) ends at the head.
    const early = await executor({ ...f, cfg: { ...f.cfg, numLayers: 2 } }, 0, 2);
    try {
      const kinds = new Set<string>();
      const d = driver({ drafter: (req, ctx) => { const x = new DraftModelDrafter(early, { session: `${ctx.session}.draft`, sampling: { temperature: req.temperature }, declared: ctx.declared, name: 'self:2', kind: 'self' }); kinds.add(x.kind); return x; } });
      const ev = await run(d, route(), { prompt: PROMPT, max_tokens: 24, speculative_k: 3, session_id: 'self-spec' });
      expect(ids(ev)).toEqual(want);
      expect(kinds).toEqual(new Set(['self']));
      const done = ev.at(-1) as { drafted?: number; accepted?: number };
      expect(done.drafted).toBeGreaterThan(0);
      // An early exit of a random-weight model agrees with the whole model now and then, not always.
      expect(done.accepted!).toBeLessThan(done.drafted!);
    } finally {
      await early.release();
    }
  });
});
