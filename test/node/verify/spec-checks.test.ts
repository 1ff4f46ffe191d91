/**
 * Speculation and spot-checks together (docs/verification.md): a generation
 * whose drafts are partly rejected — rows the hops computed and signed, then
 * cut back — is checked like any other. Real executors, forward handlers
 * that attest, check handlers and the tracker's judge, through the head's
 * pipeline with a signed plan: the head keeps the rows it cut aside, hands
 * every hop's steps as computed to the checker, which recomputes the kept
 * rows in one prefill; the judge compares the kept rows (a middle hop) and
 * every emitted token, accepted drafts included (the last hop). Honest hops
 * pass; a hop adding 1 % noise, and a last hop answering the second-best
 * token after the drafts it accepted, are found lying. At T > 0 with a
 * sampling draft model (Leviathan's rule drew the tokens), the checker
 * replays that rule against the draft the last hop signed: an honest last
 * hop passes, one answering the second-best token is found lying.
 */
import { beforeAll, describe, expect, it } from 'vitest';
import { createForwardHandler } from '../../../src/node/hop/forward-handler.ts';
import { createCheckHandler } from '../../../src/node/verify/check-handler.ts';
import { HopTransport } from '../../../src/net/hop-transport.ts';
import { PipelineDriver, type HeadTokenizer } from '../../../src/node/head/pipeline.ts';
import { Identity, verifyEd25519 } from '../../../src/net/identity.ts';
import { DistrustSet, HeadVerify } from '../../../src/node/verify/head-verify.ts';
import { Verifier } from '../../../src/node/verify/verifier.ts';
import { Attestor } from '../../../src/verify/attestor.ts';
import { judgeReport, type CheckReport, type Verdict } from '../../../src/verify/evidence.ts';
import { signPlan } from '../../../src/tracker/verify/planner.ts';
import type { CheckPlan, PlanPeer } from '../../../src/verify/plan.ts';
import { encodeBase64Url } from '../../../src/protocol/base64.ts';
import { ReferenceModel } from '../../../src/model/reference.ts';
import { ModelTokenizer } from '../../../src/model/tokenizer.ts';
import type { MeshRequest, MeshResponse } from '../../../src/protocol/envelopes.ts';
import { generateRequestSchema, type GenerateEvent, type RouteHop } from '../../../src/protocol/tracker.ts';
import type { ShardExecutor } from '../../../src/shard/executor.ts';
import { executor, fixture } from '../../helpers/shard.ts';
import { lyingForward } from '../../helpers/faults.ts';
import { DraftModelDrafter } from '../../../src/node/head/speculation/draft-model.ts';
import { readStepClaim } from '../../../src/verify/attest.ts';

const f = fixture('tiny');
const ref = new ReferenceModel(f.cfg, f.weights);
const tok = ModelTokenizer.fromJson(JSON.parse(new TextDecoder().decode(f.files.get('tokenizer.json')!)), JSON.parse(new TextDecoder().decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const PROMPT = 'The quick brown fox jumps over the lazy dog. Then';
const HEAD = 'a'.repeat(32);
const pid = (c: string) => c.repeat(32);
const hop = (c: string, start: number, end: number): RouteHop => ({ peer_id: pid(c), start_layer: start, end_layer: end, endpoint: `http://${c}.test` });

describe('speculation with spot-checks', () => {
  const forward = new Map<string, (r: MeshRequest) => Promise<MeshResponse>>();
  const check = new Map<string, (r: MeshRequest) => Promise<MeshResponse>>();
  const ids = new Map<string, Identity>();
  /** A host that fails its /forward calls once it has answered `n` of them (a hop dying mid-generation). */
  const dieAfter = new Map<string, number>();
  const fetchFn: typeof fetch = async (input, init) => {
    const url = new URL(String(input));
    if (url.pathname === '/forward' && dieAfter.has(url.host)) {
      const left = dieAfter.get(url.host)!;
      if (left <= 0) throw new TypeError('fetch failed', { cause: { code: 'ECONNREFUSED' } });
      dieAfter.set(url.host, left - 1);
    }
    const h = (url.pathname === '/check' ? check : forward).get(url.host)!;
    const headers: Record<string, string> = {};
    new Headers(init?.headers).forEach((v, k) => (headers[k] = v));
    const res = await h({ method: init?.method ?? 'GET', path: url.pathname, headers, body: init?.body ? new Uint8Array(init.body as Uint8Array) : new Uint8Array(0) });
    return new Response(res.status === 204 ? null : (res.body as Uint8Array<ArrayBuffer>), { status: res.status, headers: res.headers });
  };
  let head: ShardExecutor;
  let tracker: Identity;
  /** b answers with 1 % noise while `b` is on; c picks the second-best token while `c` is on. */
  const lies = { b: false, c: false };
  const peer = (c: string, endpoint = true): PlanPeer => ({ peer_id: pid(c), public_key: encodeBase64Url(ids.get(c)!.publicKey), format: 'f32', backend: 'onnxruntime-node', ...(endpoint ? { endpoint: `http://${c}.test` } : {}) });

  beforeAll(async () => {
    tracker = await Identity.generate();
    for (const c of 'bcdef9') ids.set(c, await Identity.generate());
    head = await executor(f, 0, 1);
    // b [1, 3) lies when asked to (1 % noise on its rows); c [3, 4) is the last hop; d, e hold [1, 3) and check b;
    // f, 9 hold [3, 4) and check c.
    const b = await executor(f, 1, 3);
    const lie = lyingForward(b, { mode: 'noise', numLayers: f.cfg.numLayers });
    const bLying = Object.assign(Object.create(b) as ShardExecutor, { forward: (req: Parameters<ShardExecutor['forward']>[0]) => (lies.b ? lie(req) : b.forward(req)) });
    const c = await executor(f, 3, 4);
    const cLie = lyingForward(c, { mode: 'second-best', numLayers: f.cfg.numLayers });
    const cLying = Object.assign(Object.create(c) as ShardExecutor, { forward: (req: Parameters<ShardExecutor['forward']>[0]) => (lies.c ? cLie(req) : c.forward(req)) });
    const spans: Array<[string, ShardExecutor]> = [['b', bLying], ['c', cLying], ['d', await executor(f, 1, 3)], ['e', await executor(f, 1, 3)], ['f', await executor(f, 3, 4)], ['9', await executor(f, 3, 4)]];
    for (const [c, ex] of spans) {
      const id = ids.get(c)!;
      forward.set(`${c}.test`, createForwardHandler(ex, { model: 'tiny', backend: 'test', attestor: new Attestor({ peerId: pid(c), sign: (x) => id.sign(x) }) }));
      check.set(`${c}.test`, createCheckHandler({ peerId: pid(c), model: 'tiny', executor: () => ex, trackerKey: () => tracker.publicKey, sign: (x) => id.sign(x), verify: verifyEd25519 }));
    }
  });

  type Drafter = NonNullable<ConstructorParameters<typeof PipelineDriver>[0]['drafter']>;
  async function generate(session: string, prediction: number[], replace?: (h: RouteHop) => Promise<RouteHop[]>, o: { temperature?: number; seed?: number; drafter?: Drafter } = {}): Promise<{ events: GenerateEvent[]; verdicts: Verdict[]; reports: CheckReport[]; skipped: string[] }> {
    const headId = await Identity.generate();
    const transport = new HopTransport({ fetch: fetchFn });
    const verdicts: Verdict[] = [];
    const reports: CheckReport[] = [];
    const skipped: string[] = [];
    const verifier = new Verifier({
      peerId: HEAD,
      transport,
      verify: verifyEd25519,
      report: async (r) => {
        reports.push(r);
        const v = await judgeReport(r, { trackerKeys: [tracker.publicKey], now: Date.now(), verify: verifyEd25519 });
        verdicts.push(v);
        return v;
      },
      skipped: async (s) => (skipped.push(`${s.reason}: ${s.why}`), {}),
    });
    const verify = new HeadVerify({ peerId: HEAD, model: 'tiny', attestor: new Attestor({ peerId: HEAD, sign: (x) => headId.sign(x) }), verifier, distrust: new DistrustSet(), transport });
    const driver = new PipelineDriver({ executor: head, tokenizer: tok as HeadTokenizer, transport, verify, ...(replace ? { replace } : {}), ...(o.drafter ? { drafter: o.drafter } : {}) });
    const plan: CheckPlan = {
      head: HEAD,
      model: 'tiny',
      generation: session,
      expires_at: Date.now() + 60_000,
      checks: [
        { peer: peer('b', false), start_layer: 1, end_layer: 3, checkers: [peer('d'), peer('e')] },
        { peer: peer('c', false), start_layer: 3, end_layer: 4, checkers: [peer('f'), peer('9')] },
        // d is b's replacement when b dies.
        ...(replace ? [{ peer: peer('d', false), start_layer: 1, end_layer: 3, checkers: [peer('e')] }] : []),
      ],
    };
    const signed = await signPlan(tracker, plan);
    const req = generateRequestSchema.parse({ session_id: session, temperature: o.temperature ?? 0, ...(o.seed !== undefined ? { seed: o.seed } : {}), prompt: PROMPT, max_tokens: 20, speculative_k: 4, prediction_token_ids: prediction });
    const events: GenerateEvent[] = [];
    for await (const e of driver.generate(HEAD, req, [hop('b', 1, 3), hop('c', 3, 4)], { plan: { ...signed, plan } })) events.push(e);
    // The checks run after the generation, off its path.
    for (let i = 0; i < 200 && verdicts.length + skipped.length < 2; i++) await new Promise((r) => setTimeout(r, 25));
    await verifier.idle();
    return { events, verdicts, reports, skipped };
  }

  it('checks a generation whose rejected draft rows were cut back: honest hops pass on their kept rows and every emitted token; a noisy hop is found lying', async () => {
    const want = ref.greedy(tok.encode(PROMPT), 20);
    // Every third drafted token wrong: steps accept some drafts and cut the rows of the rest.
    const prediction = want.map((t, i) => (i % 3 === 2 ? (t + 1) % f.cfg.vocabSize : t));
    const honest = await generate('spec1', prediction);
    expect(honest.events.flatMap((e) => (e.type === 'token' ? [e.token_id] : []))).toEqual(want);
    const done = honest.events.at(-1) as { drafted: number; accepted: number };
    expect(done.drafted).toBeGreaterThan(done.accepted); // drafts were rejected: rows were cut back
    expect(done.accepted).toBeGreaterThan(0);
    expect(honest.skipped).toEqual([]);
    const byPeer = new Map(honest.verdicts.map((v) => [v.checked, v]));
    expect(byPeer.get(pid('b'))).toMatchObject({ outcome: 'pass', kind: 'rows' });
    expect(byPeer.get(pid('c'))).toMatchObject({ outcome: 'pass', kind: 'tokens' });
    // The evidence names steps cut back (ROWS:KEPT), and the judge compared rows and tokens of them.
    for (const r of honest.reports) expect(r.claim.steps).toMatch(/\d+:\d+/);
    const b = byPeer.get(pid('b'))!;
    expect(b.distance.checker).toBeLessThan(b.threshold / 10);
    // Kept rows compared: the whole session's accepted rows (the prompt and every token fed).
    expect(b.comparedRows).toBe(tok.encode(PROMPT).length + want.length - 1);
    // The last hop's samples hold several tokens for a step that accepted drafts.
    const cReport = honest.reports.find((r) => r.claim.peer_id === pid('c'))!;
    expect(cReport.samples.some((s) => Buffer.from(s.claim, 'base64url').byteLength > 12)).toBe(true);

    lies.b = true;
    const lying = await generate('spec2', prediction);
    lies.b = false;
    const v = lying.verdicts.find((x) => x.checked === pid('b'))!;
    expect(v).toMatchObject({ outcome: 'offence', guilty: pid('b') });
    expect(v.distance.checker).toBeGreaterThan(v.threshold);
    expect(v.distance.between).toBeLessThan(v.threshold);
  }, 60_000);

  it('a generation whose every draft was accepted (several tokens a step, nothing cut back) is checked, its last hop passes', async () => {
    const want = ref.greedy(tok.encode(PROMPT), 20);
    const r = await generate('spec7', want);
    const done = r.events.at(-1) as { drafted: number; accepted: number };
    expect(done.accepted).toBe(done.drafted);
    expect(done.accepted).toBeGreaterThan(0);
    expect(r.skipped).toEqual([]);
    expect(r.verdicts.find((x) => x.checked === pid('c'))).toMatchObject({ outcome: 'pass', kind: 'tokens' });
  }, 60_000);

  it('a last hop that answers the second-best token after the drafts it accepted is found lying (it signed what it answered)', async () => {
    const want = ref.greedy(tok.encode(PROMPT), 20);
    lies.c = true;
    const r = await generate('spec3', want.map((t, i) => (i % 3 === 2 ? (t + 1) % f.cfg.vocabSize : t)));
    lies.c = false;
    expect(r.skipped).toEqual([]);
    expect((r.events.at(-1) as { drafted?: number }).drafted).toBeGreaterThan(0);
    expect(r.verdicts.find((x) => x.checked === pid('c'))).toMatchObject({ outcome: 'offence', guilty: pid('c'), kind: 'tokens' });
    expect(r.verdicts.find((x) => x.checked === pid('b'))).toMatchObject({ outcome: 'pass' });
  }, 60_000);

  it('a hop rebuilt after rows were cut back (its replay pads the cut rows) is left unchecked, never refused; the others are checked', async () => {
    const want = ref.greedy(tok.encode(PROMPT), 20);
    dieAfter.set('b.test', 3); // b dies at its 4th step, after verification steps cut rows back
    const asked: RouteHop[] = [];
    const r = await generate('spec4', want.map((t, i) => (i % 3 === 2 ? (t + 1) % f.cfg.vocabSize : t)), async (h) => (asked.push(h), [hop('d', 1, 3)]));
    dieAfter.delete('b.test');
    expect(asked.map((h) => h.peer_id)).toEqual([pid('b')]);
    expect(r.events.flatMap((e) => (e.type === 'token' ? [e.token_id] : []))).toEqual(want);
    // b left the route (not checked this time); its replacement d, rebuilt by a replay, is reported uncheckable
    // (not refused); c, never rebuilt, is checked and passes.
    expect(r.skipped).toEqual(['uncheckable: it was rebuilt after rows were cut back (a replay pads the cut rows)']);
    expect(r.verdicts.map((v) => [v.checked, v.outcome])).toEqual([[pid('c'), 'pass']]);
  }, 60_000);

  it('at T > 0 with a sampling draft model, the checker replays the acceptance rule against the draft the last hop signed: honest passes, second-best is found lying', async () => {
    const other = fixture('tiny', 1);
    const draftEx = await executor(other, 0, other.cfg.numLayers);
    const drafter: Drafter = (req, ctx) => new DraftModelDrafter(draftEx, { session: `${ctx.session}.draft`, sampling: { temperature: req.temperature, ...(req.seed !== undefined ? { seed: req.seed } : {}) }, declared: ctx.declared });
    try {
      const sampled = { temperature: 0.8, seed: 5, drafter };
      const honest = await generate('spec5', [], undefined, sampled);
      expect(honest.skipped).toEqual([]);
      const trips = honest.events.filter((e) => e.type === 'token' && e.drafted !== undefined);
      expect(trips.length).toBeGreaterThan(0);
      expect(trips.every((e) => (e as { drafts_sampled?: boolean }).drafts_sampled === true)).toBe(true);
      const c = honest.verdicts.find((x) => x.checked === pid('c'))!;
      expect(c).toMatchObject({ outcome: 'pass', kind: 'tokens' });
      expect(c.distance.checker).toBeLessThan(0.1);
      // The last hop signed each drafted step's draft digest; the checker judged against the same one.
      const cReport = honest.reports.find((r) => r.claim.peer_id === pid('c'))!;
      const drafted = cReport.samples.filter((x) => readStepClaim(Buffer.from(x.claim, 'base64url')).draft !== undefined);
      expect(drafted.length).toBeGreaterThan(0);
      for (const x of drafted) expect(Buffer.from(x.checks[0]!, 'base64url').subarray(-32)).toEqual(Buffer.from(readStepClaim(Buffer.from(x.claim, 'base64url')).draft!));
      expect(honest.verdicts.find((x) => x.checked === pid('b'))).toMatchObject({ outcome: 'pass' });

      lies.c = true;
      const lying = await generate('spec6', [], undefined, sampled);
      lies.c = false;
      expect(lying.skipped).toEqual([]);
      expect(lying.verdicts.find((x) => x.checked === pid('c'))).toMatchObject({ outcome: 'offence', guilty: pid('c'), kind: 'tokens' });
    } finally {
      await draftEx.release();
    }
  }, 60_000);
});
