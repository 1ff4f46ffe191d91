/**
 * A head audit on the node side (src/node/verify/audit.ts): the audit head
 * re-runs prompt + produced tokens in one prefill through its route (hops
 * answer stateless forwards; the last hop judges every token) and answers
 * one record per token. The float64 reference's greedy tokens are each
 * confirmed; a substituted token is not.
 */
import { beforeAll, describe, expect, it } from 'vitest';
import { createForwardHandler } from '../../../src/node/hop/forward-handler.ts';
import { HopTransport } from '../../../src/net/hop-transport.ts';
import { PipelineDriver, type HeadTokenizer } from '../../../src/node/head/pipeline.ts';
import { runAudit } from '../../../src/node/verify/audit.ts';
import { ReferenceModel } from '../../../src/model/reference.ts';
import { ModelTokenizer } from '../../../src/model/tokenizer.ts';
import type { MeshRequest, MeshResponse } from '../../../src/protocol/envelopes.ts';
import type { RouteHop } from '../../../src/protocol/tracker.ts';
import { executor, fixture } from '../../helpers/shard.ts';

const f = fixture('tiny');
const ref = new ReferenceModel(f.cfg, f.weights);
const tok = ModelTokenizer.fromJson(JSON.parse(new TextDecoder().decode(f.files.get('tokenizer.json')!)), JSON.parse(new TextDecoder().decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const HEAD = 'a'.repeat(32);
const hop = (c: string, start: number, end: number): RouteHop => ({ peer_id: c.repeat(32), start_layer: start, end_layer: end, endpoint: `http://${c}.test` });

describe('a head audit through a route', () => {
  const handlers = new Map<string, (r: MeshRequest) => Promise<MeshResponse>>();
  const sessions: string[] = [];
  const fetchFn: typeof fetch = async (input, init) => {
    const url = new URL(String(input));
    const headers: Record<string, string> = {};
    new Headers(init?.headers).forEach((v, k) => (headers[k] = v));
    if (headers['x-meshnet-session']) sessions.push(headers['x-meshnet-session']);
    const res = await handlers.get(url.host)!({ method: init?.method ?? 'GET', path: url.pathname, headers, body: init?.body ? new Uint8Array(init.body as Uint8Array) : new Uint8Array(0) });
    return new Response(res.body as Uint8Array<ArrayBuffer>, { status: res.status, headers: res.headers });
  };
  let driver: PipelineDriver;

  beforeAll(async () => {
    handlers.set('b.test', createForwardHandler(await executor(f, 1, 3), { model: 'tiny', backend: 'test' }));
    handlers.set('c.test', createForwardHandler(await executor(f, 3, 4), { model: 'tiny', backend: 'test' }));
    driver = new PipelineDriver({ executor: await executor(f, 0, 1), tokenizer: tok as HeadTokenizer, transport: new HopTransport({ fetch: fetchFn }), wireDtype: 'f32' });
  });

  it('confirms each of the reference\'s greedy tokens in one prefill, keeps nothing on the hops, and flags a substituted token', async () => {
    const prompt = tok.encode('The quick brown fox jumps over the lazy dog. Then');
    const tokens = ref.greedy(prompt, 10);
    const route = [hop('b', 1, 3), hop('c', 3, 4)];
    const records = await runAudit(driver, HEAD, { prompt_token_ids: prompt, token_ids: tokens, temperature: 0, top_p: 1, top_k: 0 }, route);
    expect(records.map((r) => r.claimed)).toEqual(tokens);
    expect(records.map((r) => r.sampled)).toEqual(tokens);
    for (const r of records) expect(r.deficit).toBeLessThan(1e-3);
    expect(sessions).toEqual([]); // stateless forwards only
    const lied = [...tokens];
    lied[4] = (lied[4]! + 1) % f.cfg.vocabSize;
    const bad = await runAudit(driver, HEAD, { prompt_token_ids: prompt, token_ids: lied, temperature: 0, top_p: 1, top_k: 0 }, route);
    expect(bad[4]!.deficit).toBeGreaterThan(0.01);
    expect(bad[4]!.sampled).toBe(tokens[4]);
    expect(bad.slice(0, 4).every((r) => r.deficit < 1e-3)).toBe(true);
  });
});
