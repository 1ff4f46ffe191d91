/**
 * A hop the tracker distrusts in the middle of a generation (a check of
 * another generation proved it lying) is replaced before the head's next
 * step, by the usual replay of its input history — and every hop after it
 * is replayed too, since their caches hold rows computed from its lies. From
 * then on the tokens are the honest continuation of what was streamed.
 */
import { beforeAll, describe, expect, it } from 'vitest';
import { createForwardHandler } from '../../../src/node/hop/forward-handler.ts';
import { HopTransport } from '../../../src/net/hop-transport.ts';
import { PipelineDriver, type HeadTokenizer } from '../../../src/node/head/pipeline.ts';
import { Identity, verifyEd25519 } from '../../../src/net/identity.ts';
import { DistrustSet, HeadVerify } from '../../../src/node/verify/head-verify.ts';
import { Verifier } from '../../../src/node/verify/verifier.ts';
import { Attestor } from '../../../src/verify/attestor.ts';
import { ReferenceModel } from '../../../src/model/reference.ts';
import { ModelTokenizer } from '../../../src/model/tokenizer.ts';
import type { MeshRequest, MeshResponse } from '../../../src/protocol/envelopes.ts';
import { generateRequestSchema, type GenerateEvent, type RouteHop } from '../../../src/protocol/tracker.ts';
import type { ShardExecutor } from '../../../src/shard/executor.ts';
import { executor, fixture } from '../../helpers/shard.ts';
import { lyingForward } from '../../helpers/faults.ts';

const f = fixture('tiny');
const ref = new ReferenceModel(f.cfg, f.weights);
const tok = ModelTokenizer.fromJson(JSON.parse(new TextDecoder().decode(f.files.get('tokenizer.json')!)), JSON.parse(new TextDecoder().decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const HEAD = 'a'.repeat(32);
const pid = (c: string) => c.repeat(32);
const hop = (c: string, start: number, end: number): RouteHop => ({ peer_id: pid(c), start_layer: start, end_layer: end, endpoint: `http://${c}.test` });

describe('a hop distrusted mid-generation', () => {
  const handlers = new Map<string, (r: MeshRequest) => Promise<MeshResponse>>();
  const log: Array<{ host: string; position: string }> = [];
  const fetchFn: typeof fetch = async (input, init) => {
    const url = new URL(String(input));
    const h = handlers.get(url.host)!;
    const headers: Record<string, string> = {};
    new Headers(init?.headers).forEach((v, k) => (headers[k] = v));
    if (url.pathname === '/forward') log.push({ host: url.host, position: headers['x-meshnet-position']! });
    const res = await h({ method: init?.method ?? 'GET', path: url.pathname, headers, body: init?.body ? new Uint8Array(init.body as Uint8Array) : new Uint8Array(0) });
    return new Response(res.body as Uint8Array<ArrayBuffer>, { status: res.status, headers: res.headers });
  };
  let head: ShardExecutor;

  beforeAll(async () => {
    head = await executor(f, 0, 1);
    // b lies (1 % noise on every row it answers); d is an honest spare for its layers; c is the last hop.
    const b = await executor(f, 1, 3);
    const lying = Object.assign(Object.create(b) as ShardExecutor, { forward: lyingForward(b, { mode: 'noise', numLayers: f.cfg.numLayers }) });
    handlers.set('b.test', createForwardHandler(lying, { model: 'tiny', backend: 'test' }));
    handlers.set('d.test', createForwardHandler(await executor(f, 1, 3), { model: 'tiny', backend: 'test' }));
    handlers.set('c.test', createForwardHandler(await executor(f, 3, 4), { model: 'tiny', backend: 'test' }));
  });

  it('is replaced before the next step, every later hop is replayed, and the rest is the honest continuation', async () => {
    const id = await Identity.generate();
    const transport = new HopTransport({ fetch: fetchFn });
    const distrust = new DistrustSet();
    const verify = new HeadVerify({ peerId: HEAD, model: 'tiny', attestor: new Attestor({ peerId: HEAD, sign: (x) => id.sign(x) }), verifier: new Verifier({ peerId: HEAD, transport, verify: verifyEd25519, report: async () => undefined }), distrust, transport });
    const asked: RouteHop[] = [];
    const driver = new PipelineDriver({ executor: head, tokenizer: tok as HeadTokenizer, transport, verify, replace: async (h) => (asked.push(h), [hop('d', 1, 3)]) });
    const prompt = tok.encode('The quick brown fox jumps over the lazy dog. Then');
    const req = generateRequestSchema.parse({ session_id: 'sess', temperature: 0, prompt_token_ids: prompt, max_tokens: 12 });
    const events: GenerateEvent[] = [];
    for await (const e of driver.generate(HEAD, req, [hop('b', 1, 3), hop('c', 3, 4)])) {
      events.push(e);
      // After the 4th token the tracker's notice arrives (a check of another generation caught b).
      if (e.type === 'token' && e.index === 3) distrust.add({ peer_id: pid('b'), until: Date.now() + 60_000 });
    }
    const tokens = events.flatMap((e) => (e.type === 'token' ? [e.token_id] : []));
    expect(tokens).toHaveLength(12);
    expect(asked).toEqual([hop('b', 1, 3)]);
    const rec = events.findIndex((e) => e.type === 'recovered');
    expect(events[rec]).toMatchObject({ type: 'recovered', failed_peer_id: pid('b'), replacement_peer_id: pid('d') });
    // b got no step after the notice; d and c were replayed from position 0, then stepped on.
    const P = prompt.length;
    const positions = (host: string) => log.filter((l) => l.host === host).map((l) => Number(l.position));
    expect(positions('b.test')).toEqual([0, P, P + 1, P + 2]);
    expect(positions('d.test')[0]).toBe(0);
    expect(positions('c.test').filter((p) => p === 0)).toHaveLength(2);
    // From the replacement on, each token is the float64 reference's greedy choice given everything before it.
    for (let k = 4; k < 12; k++) {
      const context = [...prompt, ...tokens.slice(0, k)];
      expect(tokens[k], `token ${k}`).toBe(ref.greedy(context, 1)[0]);
    }
  });
});
