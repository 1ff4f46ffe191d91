/**
 * Chained hops with real onnxruntime-node executors: a head [0,1) and hops
 * [1,3), [3,4) (plus spares), each node its own handler (forward, chain hop,
 * the head's /chain/token) and its own HopTransport over a fake network that
 * logs who sent what to whom. Routes are signed by a test tracker key.
 */
import { beforeAll, describe, expect, it, vi } from 'vitest';
import { createChainHop, isChainRequest } from '../../src/node/hop/chain-hop.ts';
import { createForwardHandler } from '../../src/node/hop/forward-handler.ts';
import { createHeadHandler } from '../../src/node/head/head-handler.ts';
import { HopTransport } from '../../src/net/hop-transport.ts';
import { Identity } from '../../src/net/identity.ts';
import { PipelineDriver, type HeadTokenizer, type PipelineOptions, type ReplaceSpan } from '../../src/node/head/pipeline.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import { collectBody, type MeshRequest, type MeshResponse } from '../../src/protocol/envelopes.ts';
import { encodeTensor } from '../../src/protocol/tensor.ts';
import { chainReplySigningMessage, routeSigningMessage, type GenerateEvent, type RouteHop } from '../../src/protocol/tracker.ts';
import { executor, fixture } from '../helpers/shard.ts';

const f = fixture('tiny');
const utf8d = new TextDecoder();
const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(f.files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const PROMPT = 'The quick brown fox jumps over the lazy dog. Then';
const pid = (c: string) => c.repeat(32);
const HEAD = pid('a');
const hop = (c: string, start: number, end: number): RouteHop => ({ peer_id: pid(c), start_layer: start, end_layer: end, endpoint: `http://${c}.test` });

type Handler = (r: MeshRequest) => Promise<MeshResponse>;

/** Nodes by host; each sends through its own fetch, so the log says who sent what. */
class Net {
  readonly nodes = new Map<string, Handler>();
  readonly log: Array<{ from: string; to: string; path: string; headers: Record<string, string> }> = [];
  readonly dead = new Set<string>();
  /** Hosts that take requests and never answer (a black hole). */
  readonly silent = new Set<string>();
  /** Kill `host` at its nth /forward (1-based). */
  readonly killAt = new Map<string, number>();
  /** Swallow `host`'s nth /forward (1-based) without an answer, once (a push lost on the way). */
  readonly loseAt = new Map<string, number>();
  private readonly counts = new Map<string, number>();
  fetchFrom(from: string): typeof fetch {
    return async (input, init) => {
      const url = new URL(String(input));
      const to = url.host.replace('.test', '');
      if (url.pathname === '/forward') {
        const n = (this.counts.get(to) ?? 0) + 1;
        this.counts.set(to, n);
        if (this.killAt.get(to) === n) this.dead.add(to);
      }
      const h = this.nodes.get(to);
      if (!h || this.dead.has(to)) throw new TypeError('fetch failed', { cause: { code: 'ECONNREFUSED' } });
      const headers: Record<string, string> = {};
      new Headers(init?.headers).forEach((v, k) => (headers[k] = v));
      this.log.push({ from, to, path: url.pathname, headers });
      if (url.pathname === '/forward' && this.loseAt.get(to) === this.counts.get(to)) {
        this.loseAt.delete(to);
        return new Promise<Response>((_, reject) => init?.signal?.addEventListener('abort', () => reject(init.signal!.reason as Error)));
      }
      if (this.silent.has(to)) {
        return new Promise<Response>((_, reject) => init?.signal?.addEventListener('abort', () => reject(init.signal!.reason as Error)));
      }
      const body = init?.body ? new Uint8Array(init.body as Uint8Array) : new Uint8Array(0);
      const res = await h({ method: init?.method ?? 'GET', path: url.pathname, headers, body });
      return new Response((await collectBody(res.body)) as Uint8Array<ArrayBuffer>, { status: res.status, headers: res.headers });
    };
  }
}

/** A route and the head's reply address, signed as the tracker signs them (`replyKey`: who signs the reply, to forge one). */
async function signed(key: Identity, head: string, hops: RouteHop[], expires = Date.now() + 60_000, replyKey = key): Promise<Record<string, string>> {
  const text = JSON.stringify(hops);
  const sig = await key.sign(routeSigningMessage(head, expires, text));
  const reply = JSON.stringify({ endpoint: 'http://a.test' });
  const rsig = await replyKey.sign(chainReplySigningMessage(head, expires, reply));
  return { 'x-meshnet-route': text, 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': encodeBase64Url(sig), 'x-meshnet-chain-reply': reply, 'x-meshnet-chain-reply-signature': encodeBase64Url(rsig) };
}

async function generate(handler: Handler, headers: Record<string, string>, maxTokens = 10): Promise<GenerateEvent[]> {
  const body = new TextEncoder().encode(JSON.stringify({ prompt: PROMPT, max_tokens: maxTokens, temperature: 0, session_id: 's' }));
  const res = await handler({ method: 'POST', path: '/generate', headers, body });
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${utf8d.decode(await collectBody(res.body))}`);
  return utf8d
    .decode(await collectBody(res.body))
    .trim()
    .split('\n')
    .map((l) => JSON.parse(l) as GenerateEvent);
}
const ids = (ev: GenerateEvent[]) => ev.flatMap((e) => (e.type === 'token' ? [e.token_id] : []));
const logprobs = (ev: GenerateEvent[]) => ev.flatMap((e) => (e.type === 'token' ? [e.logprob] : []));

describe('chained hops', () => {
  const net = new Net();
  let tracker: Identity;
  const keys = new Map<string, Uint8Array>();
  let head: (mode: 'chain' | 'star', replace?: ReplaceSpan, opts?: Partial<PipelineOptions>) => Handler;
  let want: number[];
  const P = tok.encode(PROMPT).length;

  beforeAll(async () => {
    tracker = await Identity.generate();
    want = new ReferenceModel(f.cfg, f.weights).greedy(tok.encode(PROMPT), 10);
    const spans: Array<[string, number, number]> = [['b', 1, 3], ['c', 3, 4], ['d', 1, 3], ['e', 3, 4]];
    for (const [c, a, z] of spans) {
      const forward = createForwardHandler(await executor(f, a, z), { model: 'tiny', backend: 'test' });
      const chain = createChainHop({ peerId: pid(c), trackerKey: () => keys.get(c) ?? tracker.publicKey, transport: new HopTransport({ fetch: net.fetchFrom(c) }), local: forward });
      net.nodes.set(c, (r) => (isChainRequest(r) ? chain(r) : forward(r)));
    }
    const headExec = await executor(f, 0, 1);
    head = (mode, replace, opts = {}) => {
      const driver = new PipelineDriver({ executor: headExec, tokenizer: tok as HeadTokenizer, transport: new HopTransport({ fetch: net.fetchFrom('a') }), hopMode: mode, ...opts, ...(replace ? { replace } : {}) });
      const h = createHeadHandler({ forward: async () => ({ status: 404, headers: {}, body: new Uint8Array(0) }), peerId: HEAD, trackerKey: () => tracker.publicKey, pipeline: () => driver });
      net.nodes.set('a', h);
      return h;
    };
  });

  it('pushes each step head → b → c → head (3 legs, not the star 4) and streams the float64 reference greedy tokens, the same as the star', async () => {
    net.log.length = 0;
    const route = [hop('b', 1, 3), hop('c', 3, 4)];
    const chain = await generate(head('chain'), await signed(tracker, HEAD, route));
    expect(ids(chain)).toEqual(want);
    const legs = net.log.filter((l) => l.path !== '/sessions/' && !l.path.startsWith('/sessions'));
    // Per step: the head sends to b only, b pushes to c, c hands the token to the head.
    expect(legs.filter((l) => l.from === 'a').every((l) => l.to === 'b')).toBe(true);
    expect(legs.filter((l) => l.from === 'b').every((l) => l.to === 'c' && l.headers['x-meshnet-chain-index'] === '1')).toBe(true);
    expect(legs.filter((l) => l.from === 'c').every((l) => l.to === 'a' && l.path === '/chain/token')).toBe(true);
    expect(legs.length).toBe(3 * 10);
    // b never samples; c does; the session's length is declared on the opening request of each hop.
    const toB = legs.filter((l) => l.to === 'b');
    expect(toB.map((l) => l.headers['x-meshnet-position'])).toEqual(['0', ...Array.from({ length: 9 }, (_, i) => String(P + i))]);
    expect(toB[0]!.headers['x-meshnet-session-tokens']).toBe(String(P + 10));
    expect(legs.filter((l) => l.to === 'c')[0]!.headers['x-meshnet-session-tokens']).toBe(String(P + 10));

    net.log.length = 0;
    const star = await generate(head('star'), await signed(tracker, HEAD, route));
    expect(ids(star)).toEqual(want);
    expect(logprobs(star)).toEqual(logprobs(chain));
    expect(net.log.filter((l) => l.path === '/forward').every((l) => l.from === 'a')).toBe(true);
  });

  it('loses no token when the middle hop dies mid-generation: the step runs as a star, the head replays into the replacement', async () => {
    const route = [hop('b', 1, 3), hop('c', 3, 4)];
    const undisturbed = await generate(head('chain'), await signed(tracker, HEAD, route));
    const asked: RouteHop[] = [];
    net.killAt.set('b', 6);
    const counts = (net as unknown as { counts: Map<string, number> }).counts;
    counts.set('b', 0);
    net.log.length = 0;
    const ev = await generate(head('chain', async (h) => (asked.push(h), [hop('d', 1, 3)])), await signed(tracker, HEAD, route));
    // The steps before the failure went down the chain (b pushed to c).
    expect(net.log.filter((l) => l.from === 'b' && l.to === 'c').length).toBe(5);
    net.dead.clear();
    net.killAt.clear();
    expect(ids(ev)).toEqual(want);
    expect(logprobs(ev)).toEqual(logprobs(undisturbed));
    expect(asked).toEqual([hop('b', 1, 3)]);
    expect(ev.find((e) => e.type === 'recovered')).toMatchObject({ failed_peer_id: pid('b'), replacement_peer_id: pid('d') });
  });

  it('chains again after a replacement when the tracker re-signs the route with it: the replacement pushes to the tail', async () => {
    const route = [hop('b', 1, 3), hop('c', 3, 4)];
    const undisturbed = await generate(head('chain'), await signed(tracker, HEAD, route));
    net.killAt.set('b', 4);
    const counts = (net as unknown as { counts: Map<string, number> }).counts;
    counts.set('b', 0);
    net.log.length = 0;
    const sent: RouteHop[][] = [];
    const replace = async (h: RouteHop, _s?: AbortSignal, now?: readonly RouteHop[]) => {
      sent.push([...(now ?? [])]);
      const full = [hop('d', 1, 3), hop('c', 3, 4)];
      const s = await signed(tracker, HEAD, full);
      return {
        hops: [hop('d', h.start_layer, h.end_layer)],
        chain: { hops: full, signed: { text: s['x-meshnet-route']!, expires: Number(s['x-meshnet-route-expires']), signature: s['x-meshnet-route-signature']!, reply: { text: s['x-meshnet-chain-reply']!, signature: s['x-meshnet-chain-reply-signature']! } } },
      };
    };
    const ev = await generate(head('chain', replace), await signed(tracker, HEAD, route));
    net.dead.clear();
    net.killAt.clear();
    expect(ids(ev)).toEqual(want);
    expect(logprobs(ev)).toEqual(logprobs(undisturbed));
    // The head told the tracker the route it ran (so it could re-sign it whole).
    expect(sent).toEqual([route]);
    // Steps 1–3 chained through b; step 4 ran as a star (b gone, d replayed); steps 5–10 chained through d.
    expect(net.log.filter((l) => l.from === 'b' && l.to === 'c').length).toBe(3);
    const viaD = net.log.filter((l) => l.from === 'd' && l.to === 'c' && l.headers['x-meshnet-chain-index'] === '1');
    expect(viaD.length).toBe(6);
    expect(net.log.filter((l) => l.from === 'a' && l.to === 'c' && l.path === '/forward').length).toBeGreaterThan(0);
  });

  it('chains again on the next step after a step was lost (no token within the step timeout, nobody to name): the star step puts every hop in sync', async () => {
    const route = [hop('b', 1, 3), hop('c', 3, 4)];
    const counts = (net as unknown as { counts: Map<string, number> }).counts;
    counts.set('c', 0);
    net.loseAt.set('c', 4);
    net.log.length = 0;
    const ev = await generate(head('chain', undefined, { decodeTimeoutMs: 400 }), await signed(tracker, HEAD, route));
    expect(ids(ev)).toEqual(want);
    // Step 4's push to c was lost: that step ran as a star (the head sent c its row itself); every other step chained.
    const pushesToC = net.log.filter((l) => l.from === 'b' && l.to === 'c' && l.path === '/forward');
    expect(pushesToC.length).toBe(10);
    expect(net.log.filter((l) => l.from === 'c' && l.path === '/chain/token').length).toBe(9);
    expect(net.log.filter((l) => l.from === 'a' && l.to === 'c' && l.path === '/forward').length).toBeGreaterThanOrEqual(1);
  });

  it('replays the last hop into a replacement when the next hop is gone (the hop before it names it), same tokens', async () => {
    const route = [hop('b', 1, 3), hop('c', 3, 4)];
    net.killAt.set('c', 4);
    const counts = (net as unknown as { counts: Map<string, number> }).counts;
    counts.set('c', 0);
    const asked: RouteHop[] = [];
    const ev = await generate(head('chain', async (h) => (asked.push(h), [hop('e', 3, 4)])), await signed(tracker, HEAD, route));
    net.dead.clear();
    net.killAt.clear();
    expect(ids(ev)).toEqual(want);
    expect(asked).toEqual([hop('c', 3, 4)]);
  });

  describe('a hop refuses', () => {
    const rows = encodeTensor(new Float32Array(64).fill(0.01), 'bf16');
    const chainReq = (headers: Record<string, string>, index = '0'): MeshRequest => ({
      method: 'POST',
      path: '/forward',
      headers: { 'x-meshnet-shape': '1,1,64', 'x-meshnet-dtype': 'bf16', 'x-meshnet-session': `r${Math.random().toString(36).slice(2)}`, 'x-meshnet-position': '0', 'x-meshnet-chain-index': index, 'x-meshnet-chain-head': HEAD, ...headers },
      body: rows,
    });
    /** The failure report (POST /chain/failed) a hop sent to `to`, once it came (the hop hands the step on before it knows). */
    const reportTo = (to: string) => vi.waitFor(() => {
      const r = net.log.find((l) => l.path === '/chain/failed' && l.to === to);
      if (!r) throw new Error('no report yet');
      return r;
    }, { timeout: 10_000, interval: 20 });
    const err = async (res: MeshResponse) => JSON.parse(utf8d.decode(await collectBody(res.body))) as { error: { code: string; message: string } };

    it('a forged or expired signature: 403 from the hop that received it, naming it', async () => {
      const route = [hop('b', 1, 3), hop('c', 3, 4)];
      const stranger = await Identity.generate();
      for (const headers of [await signed(stranger, HEAD, route), await signed(tracker, HEAD, route, Date.now() - 1), await signed(tracker, pid('z'), route)]) {
        const res = await net.nodes.get('b')!(chainReq(headers));
        expect(res.status).toBe(403);
        expect(res.headers['x-meshnet-chain-failed']).toBe(pid('b'));
        expect((await err(res)).error.message).toContain(pid('b'));
      }
      // b accepts the route but c holds another tracker key: b hands the step on (202); c cannot trust the head's
      // address, so it only answers b (403), and b, which can, tells the head, naming c.
      keys.set('c', stranger.publicKey);
      try {
        net.log.length = 0;
        const res = await net.nodes.get('b')!(chainReq(await signed(tracker, HEAD, route)));
        expect(res.status).toBe(202);
        const report = await reportTo('a');
        expect(report.from).toBe('b');
        expect(report.headers['x-meshnet-chain-failed']).toBe(pid('c'));
        expect(net.log.filter((l) => l.path === '/chain/failed' && l.from === 'c')).toEqual([]);
      } finally {
        keys.delete('c');
      }
    });

    it('a reply address the tracker did not sign is refused (403): the token never goes where a peer on the route says', async () => {
      const route = [hop('b', 1, 3), hop('c', 3, 4)];
      const stranger = await Identity.generate();
      const forged = await signed(tracker, HEAD, route, Date.now() + 60_000, stranger);
      const res = await net.nodes.get('b')!(chainReq(forged));
      expect(res.status).toBe(403);
      expect((await err(res)).error.message).toMatch(/reply address .* not signed by the tracker/);
      // The signed reply with another address swapped in: refused the same way.
      const swapped = { ...(await signed(tracker, HEAD, route)), 'x-meshnet-chain-reply': JSON.stringify({ endpoint: 'http://evil.test' }) };
      expect((await net.nodes.get('b')!(chainReq(swapped))).status).toBe(403);
      // Unsigned: refused too.
      const unsigned = { ...(await signed(tracker, HEAD, route)) };
      delete unsigned['x-meshnet-chain-reply-signature'];
      expect((await net.nodes.get('b')!(chainReq(unsigned))).status).toBe(403);
    });

    it('a route that visits a node twice, or comes back to the head, is refused', async () => {
      for (const route of [
        [hop('b', 1, 2), hop('b', 2, 3), hop('c', 3, 4)],
        [hop('b', 1, 3), { ...hop('a', 3, 4), peer_id: HEAD }],
      ]) {
        const res = await net.nodes.get('b')!(chainReq(await signed(tracker, HEAD, route)));
        expect(res.status).toBe(400);
        expect((await err(res)).error.message).toMatch(/twice \(a loop\)/);
        expect(res.headers['x-meshnet-chain-failed']).toBe(pid('b'));
      }
    });

    it('a hop that is not route[index] answers 421', async () => {
      const res = await net.nodes.get('b')!(chainReq(await signed(tracker, HEAD, [hop('d', 1, 3), hop('c', 3, 4)])));
      expect(res.status).toBe(421);
    });

    it('a gone next hop: the hop before it tells the head, naming it; a silent one within the chain budget, not a hang', async () => {
      const route = [hop('b', 1, 3), hop('c', 3, 4)];
      net.dead.add('c');
      try {
        net.log.length = 0;
        const res = await net.nodes.get('b')!(chainReq(await signed(tracker, HEAD, route)));
        expect(res.status).toBe(202);
        const report = await reportTo('a');
        expect(report.from).toBe('b');
        expect(report.headers['x-meshnet-chain-failed']).toBe(pid('c'));
      } finally {
        net.dead.delete('c');
      }
      net.silent.add('c');
      try {
        net.log.length = 0;
        const res = await net.nodes.get('b')!(chainReq({ ...(await signed(tracker, HEAD, route)), 'x-meshnet-chain-budget-ms': '600' }));
        expect(res.status).toBe(202);
        const report = await reportTo('a');
        expect(report.headers['x-meshnet-chain-failed']).toBe(pid('c'));
      } finally {
        net.silent.delete('c');
      }
    });
  });
});
