/**
 * Chained hops between real processes on loopback: a relay, a tracker, a
 * chain head and a star head [0,1), two middles [1,3) (slowed a little so a
 * kill lands mid-generation) and a tail [3,4), serving the `tiny` fixture.
 * The test holds the tracker's key, so it signs the routes it sends.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { ensureModel } from '../../src/cli/models.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { Identity } from '../../src/net/identity.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import { encodeTensor } from '../../src/protocol/tensor.ts';
import { chainReplySigningMessage, routeSigningMessage, type GenerateEvent, type RouteHop } from '../../src/protocol/tracker.ts';
import { fixture } from '../helpers/shard.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { collectEvents, generateDirect, hopOf, startNode, startTrackerProc, tokenIds, until, type NodeProc, type TrackerProc } from '../helpers/mesh.ts';

const f = fixture('tiny');
const utf8d = new TextDecoder();
const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(f.files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const PROMPT = 'The quick brown fox jumps over the lazy dog. Then';
const MAX_TOKENS = 30;

const chainForwards = async (n: NodeProc) => ((await (await fetch(`${n.endpoint}/info`)).json()) as { chain_forwards: number }).chain_forwards;

describe('chained hops between meshnet node processes', () => {
  let st: StaticServer;
  let relay: RelayProcess;
  let tracker: TrackerProc;
  let chainHead: NodeProc;
  let starHead: NodeProc;
  let m1: NodeProc;
  let m2: NodeProc;
  let tail: NodeProc;
  let trackerId: Identity;
  const work = mkdtempSync(join(tmpdir(), 'meshnet-chain-test-'));
  const want = new ReferenceModel(f.cfg, f.weights).greedy(tok.encode(PROMPT), MAX_TOKENS);
  const cut = want.findIndex((t) => tok.isEos(t));
  const wantIds = cut >= 0 ? want.slice(0, cut) : want;
  /** The route and the head's reply address (its relay address, as the tracker signs it), signed with the tracker's key. */
  const sign = async (head: string, hops: RouteHop[], ttlMs = 60_000): Promise<Record<string, string>> => {
    const route = JSON.stringify(hops);
    const expires = Date.now() + ttlMs;
    const sig = await trackerId.sign(routeSigningMessage(head, expires, route));
    const headNode = [chainHead, starHead].find((n) => n.peerId === head);
    const reply = JSON.stringify({ relay_addr: headNode?.relayAddr ?? `${relay.url}/rpc/${head}` });
    const rsig = await trackerId.sign(chainReplySigningMessage(head, expires, reply));
    return { 'x-meshnet-route': route, 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': encodeBase64Url(sig), 'x-meshnet-chain-reply': reply, 'x-meshnet-chain-reply-signature': encodeBase64Url(rsig) };
  };
  /**
   * The relay's message counters (every message it sends to a peer, and the one-way requests among them), less
   * the heartbeats' own: a batched beat is one message back to its node plus its share of one batch to the
   * tracker (docs/protocol.md §9.1), a beat sent as a request two (the request and its answer).
   */
  const relayMessages = async (): Promise<{ all: number; oneWay: number }> => {
    const text = await (await fetch(`${relay.httpUrl}/metrics`)).text();
    const read = (name: string) => Number(new RegExp(`^${name} (\\d+)`, 'm').exec(text)?.[1] ?? NaN);
    const beatMsgs = read('meshnet_relay_beats_batched_total') + read('meshnet_relay_beat_batches_total');
    return { all: read('meshnet_relay_messages_total\\{kind="all"\\}') - beatMsgs, oneWay: read('meshnet_relay_messages_total\\{kind="one_way"\\}') };
  };
  /** Heartbeats the tracker took: those that did not go batched were two relay messages each. */
  const beats = async (): Promise<number> => {
    const text = await (await fetch(`${tracker.url}/metrics`)).text();
    const ok = Number(/^meshnet_tracker_registrations_total\{kind="heartbeat",result="ok"\} (\d+)/m.exec(text)?.[1] ?? 0);
    const batched = Number(/^meshnet_relay_beats_batched_total (\d+)/m.exec(await (await fetch(`${relay.httpUrl}/metrics`)).text())?.[1] ?? 0);
    return ok - batched;
  };
  // One row per step: the counts below are per token (speculative steps: test/mesh/speculative.test.ts).
  const body = { prompt: PROMPT, max_tokens: MAX_TOKENS, temperature: 0, session_id: 'chain-test', speculative: false };

  beforeAll(async () => {
    st = await startStaticServer({ root: await ensureModel('tiny') });
    relay = await startRelayProcess();
    trackerId = await Identity.generate();
    writeFileSync(join(work, 'tracker.key'), JSON.stringify(await trackerId.export()));
    tracker = await startTrackerProc(['--model', `tiny=${st.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000', '--key-file', join(work, 'tracker.key')]);
    const common = ['--relay', relay.url, '--tracker', tracker.url, '--model', 'tiny', '--model-url', st.url, '--budget-mb', '64'];
    const started = await Promise.all([
      startNode([...common, '--layers', '0-1', '--hop-mode', 'chain']),
      startNode([...common, '--layers', '0-1', '--hop-mode', 'star']),
      startNode([...common, '--layers', '1-3', '--inject-delay-ms', '10']),
      startNode([...common, '--layers', '1-3', '--inject-delay-ms', '10']),
      startNode([...common, '--layers', '3-4']),
    ]);
    [chainHead, starHead, m1, m2, tail] = started as [NodeProc, NodeProc, NodeProc, NodeProc, NodeProc];
    await Promise.all(started.map((n) => n.waitFor((e) => e.event === 'registered')));
    await until(async () => (await fetch(`${tracker.url}/api/route?model=tiny`)).ok, 20_000, 'a complete route');
  }, 120_000);

  afterAll(async () => {
    await Promise.all([chainHead, starHead, m1, m2, tail].filter(Boolean).map((n) => n.stop()));
    await tracker?.stop();
    await relay?.stop();
    await st?.close();
    rmSync(work, { recursive: true, force: true });
  });

  it('chain and star heads both stream the float64 reference greedy tokens; only the chain makes the middle push to the tail', async () => {
    expect(wantIds.length).toBeGreaterThan(5);
    const route = [hopOf(m1, 1, 3, 'relay'), hopOf(tail, 3, 4, 'relay')];
    const before = await chainForwards(tail);
    const [m0, b0] = [await relayMessages(), await beats()];
    const chained = await collectEvents(generateDirect(chainHead.endpoint, await sign(chainHead.peerId, route), body));
    const [m1c, b1] = [await relayMessages(), await beats()];
    expect(tokenIds(chained)).toEqual(wantIds);
    const steps = tokenIds(chained).length + (cut >= 0 ? 1 : 0);
    expect((await chainForwards(tail)) - before).toBe(steps);
    const mid = await chainForwards(tail);
    const star = await collectEvents(generateDirect(starHead.endpoint, await sign(starHead.peerId, route), body));
    const [m2s, b2] = [await relayMessages(), await beats()];
    expect(tokenIds(star)).toEqual(wantIds);
    expect(await chainForwards(tail)).toBe(mid);
    // Messages per token through the relay: the chain's 3 one-way pushes (head → middle → tail → head), against the
    // star's 4 (two requests, two answers). Besides the steps, each generation drops its sessions on both hops (2 requests + 2 answers).
    const chainMsgs = m1c.all - m0.all - 2 * (b1 - b0);
    const starMsgs = m2s.all - m1c.all - 2 * (b2 - b1);
    console.log(`[chain mesh] relay messages for ${steps} steps, heartbeats left out: chain ${chainMsgs} (${(m1c.oneWay - m0.oneWay)} one-way; ${b1 - b0} beats not batched), star ${starMsgs} (${b2 - b1} beats not batched)`);
    expect(m1c.oneWay - m0.oneWay).toBe(3 * steps);
    // (The session drops are fire-and-forget: some may still be on their way when the counters are read, and a
    // relay control message of another test's node can land in the window: the one-way count above is the exact one.)
    expect(chainMsgs).toBeGreaterThanOrEqual(3 * steps);
    expect(chainMsgs).toBeLessThanOrEqual(3 * steps + 8);
    expect(starMsgs).toBeGreaterThanOrEqual(4 * steps);
    expect(chainMsgs).toBeLessThan(starMsgs);
  });

  it('loses no token when the middle node is killed mid-generation in chain mode (the tracker replaces it, the head replays)', async () => {
    const route = [hopOf(m1, 1, 3, 'relay'), hopOf(tail, 3, 4, 'relay')];
    const events: GenerateEvent[] = [];
    let tokenAt: number[] = [];
    let killedAt = 0;
    const tailBefore = await chainForwards(tail);
    for await (const e of generateDirect(chainHead.endpoint, await sign(chainHead.peerId, route), body)) {
      events.push(e);
      if (e.type === 'token') tokenAt.push(performance.now());
      if (e.type === 'token' && e.index === 5) {
        m1.child.kill('SIGKILL');
        killedAt = performance.now();
      }
    }
    tokenAt = tokenAt.filter((t) => t > killedAt);
    expect(tokenIds(events)).toEqual(wantIds);
    const rec = events.find((e) => e.type === 'recovered');
    expect(rec).toMatchObject({ failed_peer_id: m1.peerId, replacement_peer_id: m2.peerId });
    // The tracker re-signed the route with m2 in it: the steps after the recovery chained again (m2 pushing to the
    // tail), not only the ≤ 8 before the kill.
    const steps = tokenIds(events).length + (cut >= 0 ? 1 : 0);
    const chained = (await chainForwards(tail)) - tailBefore;
    console.log(`[chain mesh] ${chained} of ${steps} steps chained with a kill in the middle`);
    expect(chained).toBeGreaterThanOrEqual(steps - 3);
    console.log(`[chain mesh] middle killed after token 5: next token ${Math.round(tokenAt[0]! - killedAt)} ms later (recovery_ms ${rec?.type === 'recovered' ? rec.recovery_ms : '?'})`);
  });

  it('a hop refuses a forged or expired route (403 naming it), a route with a repeated node, and reports a gone next hop to the head without hanging', async () => {
    const rows = encodeTensor(new Float32Array(f.cfg.hiddenSize).fill(0.01), 'bf16');
    const forward = (headers: Record<string, string>) =>
      fetch(`${m2.endpoint}/forward`, {
        method: 'POST',
        headers: { 'x-meshnet-shape': `1,1,${f.cfg.hiddenSize}`, 'x-meshnet-dtype': 'bf16', 'x-meshnet-session': `t${Date.now()}`, 'x-meshnet-position': '0', 'x-meshnet-chain-index': '0', 'x-meshnet-chain-head': chainHead.peerId, ...headers },
        body: rows as Uint8Array<ArrayBuffer>,
      });
    const route = [hopOf(m2, 1, 3, 'relay'), hopOf(tail, 3, 4, 'relay')];
    const forged = await sign(chainHead.peerId, route);
    forged['x-meshnet-route-signature'] = encodeBase64Url(new Uint8Array(64).fill(7));
    for (const headers of [forged, await sign(chainHead.peerId, route, -1000)]) {
      const res = await forward(headers);
      expect(res.status).toBe(403);
      expect(res.headers.get('x-meshnet-chain-failed')).toBe(m2.peerId);
    }
    const looped = await forward(await sign(chainHead.peerId, [hopOf(m2, 1, 2, 'relay'), hopOf(m2, 2, 3, 'relay'), hopOf(tail, 3, 4, 'relay')]));
    expect(looped.status).toBe(400);
    expect(((await looped.json()) as { error: { message: string } }).error.message).toMatch(/twice/);
    // The next hop is a peer the relay does not know (gone): m2 hands the step on (202), hears the relay's
    // refusal, and tells the head, naming it. The reply address (signed with the tracker's key, which the test
    // holds) is a listener of the test's, so the report can be read.
    const reports: Array<{ path: string; failed: string | undefined; body: string }> = [];
    const inbox = createServer((req, res) => {
      const parts: Buffer[] = [];
      req.on('data', (c: Buffer) => parts.push(c));
      req.on('end', () => {
        // (m2 may also try to open a direct link to the address: only the reports count.)
        if (req.url === '/chain/failed') reports.push({ path: req.url ?? '', failed: req.headers['x-meshnet-chain-failed'] as string | undefined, body: Buffer.concat(parts).toString() });
        res.writeHead(204).end();
      });
    });
    await new Promise<void>((r) => inbox.listen(0, '127.0.0.1', r));
    try {
      const gone = 'f'.repeat(32);
      const headers = await sign(chainHead.peerId, [hopOf(m2, 1, 3, 'relay'), { peer_id: gone, start_layer: 3, end_layer: 4, relay_addr: m2.relayAddr!.replace(m2.peerId, gone) }]);
      const reply = JSON.stringify({ endpoint: `http://127.0.0.1:${(inbox.address() as AddressInfo).port}` });
      headers['x-meshnet-chain-reply'] = reply;
      headers['x-meshnet-chain-reply-signature'] = encodeBase64Url(await trackerId.sign(chainReplySigningMessage(chainHead.peerId, Number(headers['x-meshnet-route-expires']), reply)));
      const res = await forward(headers);
      expect(res.status, await res.clone().text()).toBe(202);
      await until(async () => reports.length > 0, 10_000, 'a failure report');
      expect(reports[0]).toMatchObject({ path: '/chain/failed', failed: gone });
      expect(reports[0]!.body).toContain(`could not reach the next hop ${gone}`);
      // An expired route or a forged one, with the head's reply address as the tracker signed it: the hop refuses
      // (403) and tells the head itself, naming itself — on a one-way path (pushes through the relay or a link)
      // nobody else hears a refusal. A reply address the tracker did not sign is told nothing.
      const withReply = async (h: Record<string, string>, signer = trackerId): Promise<Record<string, string>> => ({
        ...h,
        'x-meshnet-chain-reply': reply,
        'x-meshnet-chain-reply-signature': encodeBase64Url(await signer.sign(chainReplySigningMessage(chainHead.peerId, Number(h['x-meshnet-route-expires']), reply))),
      });
      const expired = await withReply(await sign(chainHead.peerId, route, -1000));
      const tampered = await withReply(await sign(chainHead.peerId, route));
      tampered['x-meshnet-route'] = JSON.stringify([hopOf(m2, 1, 4, 'relay')]);
      for (const [headers, why] of [[expired, /expired/], [tampered, /not signed by the tracker/]] as const) {
        reports.length = 0;
        const res = await forward(headers);
        expect(res.status).toBe(403);
        expect(res.headers.get('x-meshnet-chain-reported')).toBe('1');
        await until(async () => reports.length > 0, 10_000, 'a refusal report');
        expect(reports[0]!.failed).toBe(m2.peerId);
        expect(reports[0]!.body).toMatch(why);
      }
      reports.length = 0;
      const strangerSigned = await withReply(await sign(chainHead.peerId, route, -1000), await Identity.generate());
      const refused = await forward(strangerSigned);
      expect(refused.status).toBe(403);
      expect(refused.headers.get('x-meshnet-chain-reported')).toBeNull();
    } finally {
      inbox.close();
    }
  });
});
