/**
 * Speculative decoding between real processes on loopback: a relay, a
 * tracker (whose key the test holds, to sign routes), a head [0,1) drafting
 * with a draft model (`--draft`: the target checkpoint itself, so every
 * draft is right), a head drafting by prompt lookup, two middles [1,3) (one
 * a spare, slowed a little so a kill lands mid-generation) and a tail [3,4),
 * serving the `tiny` fixture. Greedy output equals the float64 reference and
 * speculation off, chained and across a failover mid-verification; stop
 * strings end where speculation off ends; /info counts the drafts.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { ensureModel } from '../../src/cli/models.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { Identity } from '../../src/net/identity.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import { chainReplySigningMessage, routeSigningMessage, type GenerateEvent, type GenerateRequest, type RouteHop } from '../../src/protocol/tracker.ts';
import { fixture } from '../helpers/shard.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { collectEvents, generateDirect, hopOf, startNode, startTrackerProc, tokenIds, until, type NodeProc, type TrackerProc } from '../helpers/mesh.ts';

const f = fixture('tiny');
const utf8d = new TextDecoder();
const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(f.files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const PROMPT = 'The quick brown fox jumps over the lazy dog. Then';
const MAX_TOKENS = 30;

interface Spec {
  drafted: number;
  accepted: number;
  trips: number;
  tokens: number;
}
const specInfo = async (n: NodeProc) => ((await (await fetch(`${n.endpoint}/info`)).json()) as { speculation?: Spec }).speculation;
const text = (ev: GenerateEvent[]) => ev.map((e) => (e.type === 'token' ? e.text : '')).join('');

describe('speculative decoding between meshnet node processes', () => {
  let st: StaticServer;
  let relay: RelayProcess;
  let tracker: TrackerProc;
  let draftHead: NodeProc;
  let lookupHead: NodeProc;
  let m1: NodeProc;
  let m2: NodeProc;
  let tail: NodeProc;
  let trackerId: Identity;
  const work = mkdtempSync(join(tmpdir(), 'meshnet-spec-test-'));
  const want = new ReferenceModel(f.cfg, f.weights).greedy(tok.encode(PROMPT), MAX_TOKENS);
  const cut = want.findIndex((t) => tok.isEos(t));
  const wantIds = cut >= 0 ? want.slice(0, cut) : want;
  const sign = async (head: NodeProc, hops: RouteHop[], ttlMs = 60_000): Promise<Record<string, string>> => {
    const route = JSON.stringify(hops);
    const expires = Date.now() + ttlMs;
    const sig = await trackerId.sign(routeSigningMessage(head.peerId, expires, route));
    const reply = JSON.stringify({ relay_addr: head.relayAddr });
    const rsig = await trackerId.sign(chainReplySigningMessage(head.peerId, expires, reply));
    return { 'x-meshnet-route': route, 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': encodeBase64Url(sig), 'x-meshnet-chain-reply': reply, 'x-meshnet-chain-reply-signature': encodeBase64Url(rsig) };
  };
  const run = async (head: NodeProc, body: Partial<GenerateRequest>, hops = [hopOf(m1, 1, 3, 'relay'), hopOf(tail, 3, 4, 'relay')]) =>
    collectEvents(generateDirect(head.endpoint, await sign(head, hops), { prompt: PROMPT, max_tokens: MAX_TOKENS, temperature: 0, session_id: 'spec-test', ...body }));

  beforeAll(async () => {
    st = await startStaticServer({ root: await ensureModel('tiny') });
    relay = await startRelayProcess();
    trackerId = await Identity.generate();
    writeFileSync(join(work, 'tracker.key'), JSON.stringify(await trackerId.export()));
    tracker = await startTrackerProc(['--model', `tiny=${st.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000', '--key-file', join(work, 'tracker.key')]);
    const common = ['--relay', relay.url, '--tracker', tracker.url, '--model', 'tiny', '--model-url', st.url, '--budget-mb', '64'];
    const started = await Promise.all([
      startNode([...common, '--layers', '0-1', '--draft', st.url]),
      startNode([...common, '--layers', '0-1']),
      startNode([...common, '--layers', '1-3', '--inject-delay-ms', '10']),
      startNode([...common, '--layers', '1-3', '--inject-delay-ms', '10']),
      startNode([...common, '--layers', '3-4']),
    ]);
    [draftHead, lookupHead, m1, m2, tail] = started as [NodeProc, NodeProc, NodeProc, NodeProc, NodeProc];
    await Promise.all(started.map((n) => n.waitFor((e) => e.event === 'registered')));
    await until(async () => (await fetch(`${tracker.url}/api/route?model=tiny`)).ok, 20_000, 'a complete route');
  }, 120_000);

  afterAll(async () => {
    await Promise.all([draftHead, lookupHead, m1, m2, tail].filter(Boolean).map((n) => n.stop()));
    await tracker?.stop();
    await relay?.stop();
    await st?.close();
    rmSync(work, { recursive: true, force: true });
  });

  it('a draft model (the target itself) on the chain: the reference tokens, every draft accepted, k + 1 tokens a trip', async () => {
    expect(wantIds.length).toBeGreaterThan(8);
    const before = await specInfo(draftHead);
    const ev = await run(draftHead, { speculative_k: 4 });
    expect(tokenIds(ev)).toEqual(wantIds);
    const done = ev.at(-1)!;
    expect(done.type).toBe('done');
    if (done.type !== 'done') return;
    expect(done.drafted).toBeGreaterThan(0);
    expect(done.accepted).toBe(done.drafted);
    const after = (await specInfo(draftHead))!;
    expect(after.drafted - (before?.drafted ?? 0)).toBe(done.drafted);
    expect(after.accepted - (before?.accepted ?? 0)).toBe(done.accepted);
    // Decode trips yield 5 tokens each (the last ones cut by max_tokens or eos).
    expect((after.tokens - (before?.tokens ?? 0)) / (after.trips - (before?.trips ?? 0))).toBeGreaterThan(3);
    const off = await run(draftHead, { speculative: false });
    expect(tokenIds(off)).toEqual(wantIds);
  });

  it('prompt lookup with a prediction at temperature 0.8 draws what speculation off draws, seed for seed', async () => {
    const off = await run(lookupHead, { temperature: 0.8, seed: 5, speculative: false });
    const on = await run(lookupHead, { temperature: 0.8, seed: 5, speculative_k: 3, prediction_token_ids: tokenIds(off).slice(0, 12) });
    expect(tokenIds(on)).toEqual(tokenIds(off));
    expect(on.at(-1)).toMatchObject({ type: 'done', accepted: expect.any(Number) });
  });

  it('a stop string inside accepted drafts ends where speculation off ends', async () => {
    const off = await run(draftHead, { speculative: false });
    const stop = text(off).slice(8, 12);
    const offStop = await run(draftHead, { speculative: false, stop: [stop] });
    const onStop = await run(draftHead, { speculative_k: 6, stop: [stop] });
    expect(tokenIds(onStop)).toEqual(tokenIds(offStop));
    expect(text(onStop)).toBe(text(offStop));
  });

  it('loses no token when the middle is killed mid-verification (the tracker replaces it, the head replays the accepted rows)', async () => {
    const events: GenerateEvent[] = [];
    const hops = [hopOf(m1, 1, 3, 'relay'), hopOf(tail, 3, 4, 'relay')];
    for await (const e of generateDirect(draftHead.endpoint, await sign(draftHead, hops), { prompt: PROMPT, max_tokens: MAX_TOKENS, temperature: 0, session_id: 'spec-kill', speculative_k: 3 })) {
      events.push(e);
      if (e.type === 'token' && e.index === 5) m1.child.kill('SIGKILL');
    }
    expect(tokenIds(events)).toEqual(wantIds);
    expect(events.find((e) => e.type === 'recovered')).toMatchObject({ failed_peer_id: m1.peerId, replacement_peer_id: m2.peerId });
    expect(events.at(-1)).toMatchObject({ type: 'done' });
  });
});
