/**
 * A whole mesh of real processes on loopback: a relay, a tracker, five
 * `meshnet node` processes (two heads [0,1), two middles [1,3) slowed by
 * --inject-delay-ms, one tail [3,4)) serving the `tiny` fixture from the
 * static server, and the official `openai` client talking to the tracker.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { request } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { ensureModel } from '../../src/cli/models.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { Identity } from '../../src/net/identity.ts';
import { RelayClient } from '../../src/net/relay-client.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import { generateEventSchema, routeSigningMessage, type GenerateEvent, type RouteHop } from '../../src/protocol/tracker.ts';
import { fixture } from '../helpers/shard.ts';
import { NodeWebSocket } from '../helpers/ws-host.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { collectEvents, generateDirect, hopOf, sessionsOn, startNode, startTrackerProc, testSigner, tokenIds, until, type NodeProc, type TrackerProc } from '../helpers/mesh.ts';

const f = fixture('tiny');
const utf8d = new TextDecoder();
const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(f.files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const MESSAGES = [{ role: 'user' as const, content: 'Tell me about the quick brown fox.' }];
const MAX_TOKENS = 40;

/** Reference greedy ids (cut at eos) and the text a streaming detokenizer makes of them. */
function reference(): { ids: number[]; text: string } {
  const ref = new ReferenceModel(f.cfg, f.weights);
  const all = ref.greedy(tok.encodeChat(MESSAGES), MAX_TOKENS);
  const eos = all.findIndex((t) => tok.isEos(t));
  const ids = eos >= 0 ? all.slice(0, eos) : all;
  const dec = tok.streamDecoder({ skipSpecialTokens: true });
  return { ids, text: ids.map((t) => dec.push(t)).join('') };
}

async function streamChat(client: OpenAI, onChunk?: (n: number) => Promise<void> | void): Promise<{ text: string; chunks: number; completionTokens: number | undefined; finish: string | null }> {
  const stream = await client.chat.completions.create({ model: 'tiny', messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let chunks = 0;
  let completionTokens: number | undefined;
  let finish: string | null = null;
  for await (const c of stream) {
    if (c.usage) completionTokens = c.usage.completion_tokens;
    const choice = c.choices[0];
    if (!choice) continue;
    if (choice.finish_reason) finish = choice.finish_reason;
    if (choice.delta.content !== undefined && choice.delta.content !== null) {
      text += choice.delta.content;
      chunks++;
      await onChunk?.(chunks);
    }
  }
  return { text, chunks, completionTokens, finish };
}

describe('a mesh of meshnet node processes behind a tracker', () => {
  let st: StaticServer;
  let relay: RelayProcess;
  let tracker: TrackerProc;
  let heads: NodeProc[] = [];
  let middles: NodeProc[] = [];
  let tail: NodeProc;
  let client: OpenAI;
  const want = reference();
  // The test holds the tracker's key (given to it by --key-file), so it can sign any route a real tracker could.
  let trackerId: Identity;
  const work = mkdtempSync(join(tmpdir(), 'meshnet-mesh-test-'));
  const signed = async (head: string, hops: RouteHop[]): Promise<Record<string, string>> => {
    const route = JSON.stringify(hops);
    const expires = Date.now() + 60_000;
    const sig = await trackerId.sign(routeSigningMessage(head, expires, route));
    return { 'x-meshnet-route': route, 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': encodeBase64Url(sig) };
  };

  beforeAll(async () => {
    st = await startStaticServer({ root: await ensureModel('tiny') });
    relay = await startRelayProcess();
    trackerId = await Identity.generate();
    writeFileSync(join(work, 'tracker.key'), JSON.stringify(await trackerId.export()));
    tracker = await startTrackerProc(['--model', `tiny=${st.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000', '--key-file', join(work, 'tracker.key')]);
    const common = ['--relay', relay.url, '--tracker', tracker.url, '--model', 'tiny', '--model-url', st.url, '--budget-mb', '64'];
    // Pinned spans (--layers) are adopted by the tracker as served, so the route shape is known.
    const started = await Promise.all([
      startNode([...common, '--layers', '0-1']),
      startNode([...common, '--layers', '0-1']),
      startNode([...common, '--layers', '1-3', '--inject-delay-ms', '15']),
      startNode([...common, '--layers', '1-3', '--inject-delay-ms', '15']),
      startNode([...common, '--layers', '3-4']),
    ]);
    heads = started.slice(0, 2);
    middles = started.slice(2, 4);
    tail = started[4]!;
    await Promise.all(started.map((n) => n.waitFor((e) => e.event === 'registered')));
    await until(async () => (await fetch(`${tracker.url}/api/route?model=tiny`)).ok, 20_000, 'a complete route');
    client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
  }, 120_000);

  afterAll(async () => {
    await Promise.all([...heads, ...middles, tail].filter(Boolean).map((n) => n.stop()));
    await tracker?.stop();
    await relay?.stop();
    await st?.close();
    rmSync(work, { recursive: true, force: true });
  });

  it('streams a chat completion through the openai client whose text and token count are the float64 reference greedy continuation', async () => {
    expect(want.ids.length).toBeGreaterThan(5);
    const got = await streamChat(client);
    expect(got.text).toBe(want.text);
    expect(got.completionTokens).toBe(want.ids.length);
    expect(got.finish).toBe(want.ids.length === MAX_TOKENS ? 'length' : 'stop');
  });

  it('lets a client check output exactly: token_ids in the stream, and prompts given as token ids, equal the reference', async () => {
    const stream = await client.chat.completions.create({ model: 'tiny', messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0, stream: true });
    const streamed: number[] = [];
    for await (const c of stream) streamed.push(...((c.choices[0] as { token_ids?: number[] } | undefined)?.token_ids ?? []));
    expect(streamed).toEqual(want.ids);
    // The chat's own prompt as token ids (one choice: the reference continuation), and a text prompt's ids (the other
    // choice: what the same text given as a string generates — the ids are fed exactly as the head's tokenizer would).
    const completions = async (prompt: unknown) => {
      const res = await fetch(`${tracker.url}/v1/completions`, { method: 'POST', body: JSON.stringify({ model: 'tiny', prompt, max_tokens: 8, temperature: 0 }) });
      expect(res.status).toBe(200);
      return ((await res.json()) as { choices: Array<{ index: number; token_ids: number[] }> }).choices;
    };
    const text = 'The quick brown fox';
    const [asText] = await completions(text);
    const choices = await completions([tok.encodeChat(MESSAGES), tok.encode(text)]);
    expect(choices.map((c) => c.index)).toEqual([0, 1]);
    expect(choices[0]!.token_ids).toEqual(want.ids.slice(0, 8));
    expect(asText!.token_ids.length).toBeGreaterThan(0);
    expect(choices[1]!.token_ids).toEqual(asText!.token_ids);
  });

  it('streams the reference token ids over POST /generate when a head is given a tracker-signed route', async () => {
    const route = (await (await fetch(`${tracker.url}/api/route?model=tiny`)).json()) as { head: string; route_header: string; expires_at: number; signature: string };
    const head = heads.find((h) => h.peerId === route.head)!;
    const events = await collectEvents(
      generateDirect(head.endpoint, { 'x-meshnet-route': route.route_header, 'x-meshnet-route-expires': String(route.expires_at), 'x-meshnet-route-signature': route.signature }, { messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0, session_id: 'direct-1' }),
    );
    expect(tokenIds(events)).toEqual(want.ids);
  });

  it('reaches hops over the relay fast path, over /rpc (a hop on another relay address), and falls back to direct HTTP when the relay path fails', async () => {
    const [h1] = heads as [NodeProc];
    const [m1] = middles as [NodeProc];
    const run = async (hops: RouteHop[], id: string) => tokenIds(await collectEvents(generateDirect(h1.endpoint, await signed(h1.peerId, hops), { messages: MESSAGES, max_tokens: 12, temperature: 0, session_id: id })));
    const fast = await run([hopOf(m1, 1, 3, 'relay'), hopOf(tail, 3, 4, 'relay')], 't-fast');
    // "localhost" is not the host the head's relay client uses: the head takes the ADR-0014 /rpc path to it.
    const rpcAddr = (n: NodeProc) => n.relayAddr!.replace('127.0.0.1', 'localhost');
    const rpc = await run([{ ...hopOf(m1, 1, 3, 'relay'), relay_addr: rpcAddr(m1) }, { ...hopOf(tail, 3, 4, 'relay'), relay_addr: rpcAddr(tail) }], 't-rpc');
    // A relay address nobody listens on, plus an endpoint: the head falls back to direct HTTP.
    const dead = (n: NodeProc) => `ws://127.0.0.1:1/rpc/${n.peerId}`;
    const fallback = await run([{ ...hopOf(m1, 1, 3, 'both'), relay_addr: dead(m1) }, { ...hopOf(tail, 3, 4, 'both'), relay_addr: dead(tail) }], 't-fallback');
    expect(fast).toEqual(want.ids.slice(0, 12));
    expect(rpc).toEqual(want.ids.slice(0, 12));
    expect(fallback).toEqual(want.ids.slice(0, 12));
  });

  it('reaches direct-only hops over direct links once they are up (HTTP until then), with the same tokens', async () => {
    const [h1] = heads as [NodeProc];
    const [m1] = middles as [NodeProc];
    const servedOn = async (n: NodeProc) => ((await (await fetch(`${n.endpoint}/info`)).json()) as { forwards_served: { relay: number; link: number; http: number } }).forwards_served;
    const headers = await signed(h1.peerId, [hopOf(m1, 1, 3, 'direct'), hopOf(tail, 3, 4, 'direct')]);
    const run = async (id: string) => tokenIds(await collectEvents(generateDirect(h1.endpoint, headers, { messages: MESSAGES, max_tokens: 12, temperature: 0, session_id: id })));
    // The first generation dials the links (its steps go by HTTP until they are up).
    expect(await run('t-link-1')).toEqual(want.ids.slice(0, 12));
    await m1.waitFor((e) => e.event === 'link-open' && e.caller_peer_id === h1.peerId, 10_000);
    await tail.waitFor((e) => e.event === 'link-open' && e.caller_peer_id === h1.peerId, 10_000);
    const before = await Promise.all([servedOn(m1), servedOn(tail)]);
    expect(await run('t-link-2')).toEqual(want.ids.slice(0, 12));
    const after = await Promise.all([servedOn(m1), servedOn(tail)]);
    // Every step of the second one went over the links: none by HTTP or the relay.
    for (const k of [0, 1]) {
      expect(after[k]!.link - before[k]!.link).toBeGreaterThanOrEqual(12);
      expect(after[k]!.http).toBe(before[k]!.http);
      expect(after[k]!.relay).toBe(before[k]!.relay);
    }
  });

  it('streams /generate as fast-path DATA frames to a peer that asks over the relay', async () => {
    const [h1] = heads as [NodeProc];
    const caller = new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity: await Identity.generate() });
    caller.start();
    await caller.ready(10_000);
    try {
      const headers = await signed(h1.peerId, [hopOf(middles[0]!, 1, 3, 'relay'), hopOf(tail, 3, 4, 'relay')]);
      const reply = await caller.requestStream(h1.peerId, { method: 'POST', path: '/generate', headers: { 'content-type': 'application/json', ...headers }, body: new TextEncoder().encode(JSON.stringify({ messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0, session_id: 'via-relay' })) });
      expect(reply.status).toBe(200);
      let text = '';
      let frames = 0;
      for await (const chunk of reply.body) {
        frames++;
        text += utf8d.decode(chunk, { stream: true });
      }
      const events: GenerateEvent[] = text.trim().split('\n').map((l) => generateEventSchema.parse(JSON.parse(l)));
      expect(tokenIds(events)).toEqual(want.ids);
      // One frame per event: tokens are pushed as they come, not buffered to the end.
      expect(frames).toBeGreaterThanOrEqual(want.ids.length);
    } finally {
      caller.close();
    }
  });

  it('refuses unsigned, forged, expired and other-head routes with 403 and keeps serving', async () => {
    const [h1, h2] = heads as [NodeProc, NodeProc];
    const hops = [hopOf(middles[0]!, 1, 3), hopOf(tail, 3, 4)];
    const forger = await testSigner();
    const body = JSON.stringify({ messages: MESSAGES, max_tokens: 3, session_id: 'forged' });
    const post = (headers: Record<string, string>) => fetch(`${h1.endpoint}/generate`, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body });
    const cases: Array<[string, Record<string, string>]> = [
      ['unsigned', { 'x-meshnet-route': JSON.stringify(hops) }],
      ['signed by another key', await forger.sign(h1.peerId, hops)],
    ];
    // A real tracker signature, replayed against the other head or with the route text changed.
    const real = (await (await fetch(`${tracker.url}/api/route?model=tiny`)).json()) as { head: string; route_header: string; expires_at: number; signature: string };
    const realHeaders = { 'x-meshnet-route': real.route_header, 'x-meshnet-route-expires': String(real.expires_at), 'x-meshnet-route-signature': real.signature };
    const other = real.head === h1.peerId ? h2 : h1;
    const tampered = { ...realHeaders, 'x-meshnet-route': real.route_header.replace(/"end_layer":4/, '"end_layer":4 ') };
    const expired = { ...realHeaders, 'x-meshnet-route-expires': String(Date.now() - 1000) };
    for (const [name, headers] of cases) {
      const r = await post(headers);
      expect([name, r.status]).toEqual([name, 403]);
      expect(((await r.json()) as { error: { code: string } }).error.code).toBe('MESH_ERR_FORBIDDEN');
    }
    for (const [name, headers] of [['other head', realHeaders], ['tampered', tampered], ['expired', expired]] as const) {
      const target = name === 'other head' ? other : heads.find((h) => h.peerId === real.head)!;
      const r = await fetch(`${target.endpoint}/generate`, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body });
      expect([name, r.status]).toEqual([name, 403]);
    }
    expect((await fetch(`${h1.endpoint}/health`)).status).toBe(200);
  });

  it('answers 413 to a direct body over the limit and keeps serving', async () => {
    // Declared length over the limit: refused from the headers, before a byte of body is read.
    const status = await new Promise<number>((resolve, reject) => {
      const req = request(`${tail.endpoint}/forward`, { method: 'POST', headers: { 'content-length': String(65 * 1024 * 1024), 'x-meshnet-shape': '1,1,64' } }, (res) => {
        res.resume();
        resolve(res.statusCode ?? 0);
      });
      req.on('error', reject);
      req.flushHeaders();
    });
    expect(status).toBe(413);
    expect((await fetch(`${tail.endpoint}/health`)).status).toBe(200);
  });

  it('loses no token when the middle node serving the stream is killed mid-generation (hop replacement + history replay)', async () => {
    let killed: NodeProc | undefined;
    // The middle in this stream's route is the one that gained a session since it started.
    const before = new Map(await Promise.all(middles.map(async (m) => [m, await sessionsOn(m)] as const)));
    const got = await streamChat(client, async (n) => {
      if (n !== 6) return;
      for (const m of middles) if ((await sessionsOn(m)) > before.get(m)!) killed = m;
      killed?.child.kill('SIGKILL');
    });
    expect(killed).toBeDefined();
    expect(got.text).toBe(want.text);
    expect(got.completionTokens).toBe(want.ids.length);
    const rec = await until(async () => heads.flatMap((h) => h.events).find((e) => e.event === 'generate-recovered' && e.failed_peer_id === killed!.peerId), 5_000, 'a recovered event');
    expect(rec.replacement_peer_id).toBe(middles.find((m) => m !== killed)!.peerId);
    console.log(`[mesh] middle node killed after 6 tokens: recovered in ${rec.recovery_ms} ms (replacement ${String(rec.replacement_peer_id).slice(0, 8)})`);
    middles = middles.filter((m) => m !== killed);
  });

  it('re-registers every node (with the span it serves) after the tracker restarts, and chats flow again', async () => {
    const port = new URL(tracker.url).port;
    const registeredBefore = [...heads, ...middles, tail].map((n) => n.events.filter((e) => e.event === 'registered').length);
    await tracker.stop();
    tracker = await startTrackerProc(['--model', `tiny=${st.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000', '--key-file', join(work, 'tracker.key'), '--port', port]);
    // The next heartbeat gets 404; the node registers again, and the tracker adopts its span.
    await Promise.all([...heads, ...middles, tail].map((n, i) => until(async () => n.events.filter((e) => e.event === 'registered').length > registeredBefore[i]!, 15_000, 're-registration')));
    await until(async () => (await fetch(`${tracker.url}/api/route?model=tiny`)).ok, 10_000, 'a complete route after the restart');
    const got = await streamChat(client);
    expect(got.text).toBe(want.text);
  });

  it('goes on streaming when the head is killed mid-generation (tracker failover with prefix_token_ids)', async () => {
    let killed: NodeProc | undefined;
    const t0 = performance.now();
    let killedAt = 0;
    const doneBefore = new Map(heads.map((h) => [h, h.events.filter((e) => e.event === 'generate-done').length]));
    const before = new Map(await Promise.all(heads.map(async (h) => [h, await sessionsOn(h)] as const)));
    const got = await streamChat(client, async (n) => {
      if (n !== 6) return;
      for (const h of heads) if ((await sessionsOn(h)) > before.get(h)!) killed = h;
      killedAt = performance.now();
      killed?.child.kill('SIGKILL');
    });
    expect(killed).toBeDefined();
    expect(got.text).toBe(want.text);
    expect(got.completionTokens).toBe(want.ids.length);
    const survivor = heads.find((h) => h !== killed)!;
    // The other head finished the stream (it was restarted there with the tokens so far).
    expect(survivor.events.filter((e) => e.event === 'generate-done').length).toBe(doneBefore.get(survivor)! + 1);
    console.log(`[mesh] head killed after 6 tokens: stream finished ${Math.round(performance.now() - killedAt)} ms later (${Math.round(performance.now() - t0)} ms total)`);
  });

  it('exits 0 on SIGTERM', async () => {
    expect(await tail.stop('SIGTERM')).toBe(0);
  });
});
