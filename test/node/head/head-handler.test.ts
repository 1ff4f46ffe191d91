import { beforeAll, describe, expect, it } from 'vitest';
import { createHeadHandler } from '../../../src/node/head/head-handler.ts';
import { HopTransport } from '../../../src/net/hop-transport.ts';
import { Identity } from '../../../src/net/identity.ts';
import { PipelineDriver, type HeadTokenizer } from '../../../src/node/head/pipeline.ts';
import { ModelTokenizer } from '../../../src/model/tokenizer.ts';
import { encodeBase64Url } from '../../../src/protocol/base64.ts';
import { collectBody, type MeshRequest, type MeshResponse } from '../../../src/protocol/envelopes.ts';
import { routeSigningMessage, type RouteHop } from '../../../src/protocol/tracker.ts';
import { executor, fixture } from '../../helpers/shard.ts';

const f = fixture('tiny');
const utf8d = new TextDecoder();
const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(f.files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const HEAD = 'a'.repeat(32);
const OTHER = 'b'.repeat(32);
const body = new TextEncoder().encode(JSON.stringify({ prompt: 'hello world', max_tokens: 3, temperature: 0, session_id: 's' }));

async function sign(key: Identity, head: string, hops: RouteHop[], expires = Date.now() + 60_000, text = JSON.stringify(hops)): Promise<Record<string, string>> {
  const sig = await key.sign(routeSigningMessage(head, expires, text));
  return { 'x-meshnet-route': text, 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': encodeBase64Url(sig) };
}
const post = (headers: Record<string, string>, b = body): MeshRequest => ({ method: 'POST', path: '/generate', headers, body: b });
async function json(res: MeshResponse): Promise<{ error?: { code: string; message: string } }> {
  return JSON.parse(utf8d.decode(await collectBody(res.body)));
}

describe('createHeadHandler', () => {
  let tracker: Identity;
  let driver: PipelineDriver;
  let isHead = true;
  let trackerKey: Uint8Array | undefined;
  const forwarded: string[] = [];
  let handle: (r: MeshRequest) => Promise<MeshResponse>;

  beforeAll(async () => {
    tracker = await Identity.generate();
    trackerKey = tracker.publicKey;
    driver = new PipelineDriver({ executor: await executor(f, 0, 4), tokenizer: tok as HeadTokenizer, transport: new HopTransport({}) });
    handle = createHeadHandler({
      forward: async (r) => (forwarded.push(r.path), { status: 204, headers: {}, body: new Uint8Array(0) }),
      peerId: HEAD,
      trackerKey: () => trackerKey,
      pipeline: () => (isHead ? driver : undefined),
    });
  });

  it('streams NDJSON events for a tracker-signed route (an empty hop list: the head runs every layer)', async () => {
    const res = await handle(post(await sign(tracker, HEAD, [])));
    expect(res.status).toBe(200);
    expect(res.headers['content-type']).toBe('application/x-ndjson');
    expect(res.body).not.toBeInstanceOf(Uint8Array);
    const lines = utf8d.decode(await collectBody(res.body)).trim().split('\n').map((l) => JSON.parse(l) as { type: string });
    expect(lines.map((l) => l.type)).toEqual(['start', 'token', 'token', 'token', 'done']);
  });

  it('refuses with 403 a route that is unsigned, signed by another key, expired, for another head, or altered after signing', async () => {
    const stranger = await Identity.generate();
    const good = await sign(tracker, HEAD, []);
    const cases: Record<string, Record<string, string>> = {
      unsigned: { 'x-meshnet-route': '[]' },
      'no expiry': { 'x-meshnet-route': '[]', 'x-meshnet-route-signature': good['x-meshnet-route-signature']! },
      'another key': await sign(stranger, HEAD, []),
      expired: await sign(tracker, HEAD, [], Date.now() - 1),
      'another head': await sign(tracker, OTHER, []),
      altered: { ...good, 'x-meshnet-route': '[ ]' },
      'expiry moved': { ...good, 'x-meshnet-route-expires': String(Number(good['x-meshnet-route-expires']) + 1) },
      'garbage signature': { ...good, 'x-meshnet-route-signature': '!!!' },
    };
    for (const [name, headers] of Object.entries(cases)) {
      const res = await handle(post(headers));
      expect([name, res.status, (await json(res)).error?.code]).toEqual([name, 403, 'MESH_ERR_FORBIDDEN']);
    }
  });

  it('takes a signature it checked once again (the tracker shares one per route), but never past its expiry, for other text or under another tracker key', async () => {
    const good = await sign(tracker, HEAD, [], Date.now() + 400);
    for (let i = 0; i < 2; i++) {
      const res = await handle(post(good));
      expect(res.status).toBe(200);
      expect(utf8d.decode(await collectBody(res.body))).toContain('"type":"done"');
    }
    const cases: Record<string, Record<string, string>> = {
      altered: { ...good, 'x-meshnet-route': '[ ]' },
      'expiry moved': { ...good, 'x-meshnet-route-expires': String(Number(good['x-meshnet-route-expires']) + 1) },
    };
    for (const [name, headers] of Object.entries(cases)) {
      const res = await handle(post(headers));
      expect([name, res.status, (await json(res)).error?.code]).toEqual([name, 403, 'MESH_ERR_FORBIDDEN']);
    }
    trackerKey = (await Identity.generate()).publicKey;
    const otherKey = await handle(post(good));
    trackerKey = tracker.publicKey;
    expect([otherKey.status, (await json(otherKey)).error?.code]).toEqual([403, 'MESH_ERR_FORBIDDEN']);
    await new Promise((r) => setTimeout(r, 450));
    const expired = await handle(post(good));
    expect([expired.status, (await json(expired)).error?.message]).toEqual([403, expect.stringContaining('expired')]);
  });

  it('refuses every route with 403 while it knows no tracker key', async () => {
    trackerKey = undefined;
    const res = await handle(post(await sign(tracker, HEAD, [])));
    trackerKey = tracker.publicKey;
    expect(res.status).toBe(403);
    expect((await json(res)).error?.message).toMatch(/no tracker key/);
  });

  it('answers 421 when this node is not a head (no layer 0 / tokenizer)', async () => {
    isHead = false;
    const res = await handle(post(await sign(tracker, HEAD, [])));
    isHead = true;
    expect(res.status).toBe(421);
  });

  it('answers 400 for a signed route that does not chain to the last layer, and for a body that is not a GenerateRequest', async () => {
    const gap = await handle(post(await sign(tracker, HEAD, [{ peer_id: OTHER, start_layer: 2, end_layer: 3 }])));
    expect(gap.status).toBe(400);
    const noMax = await handle(post(await sign(tracker, HEAD, []), new TextEncoder().encode(JSON.stringify({ prompt: 'x', session_id: 's' }))));
    expect([noMax.status, (await json(noMax)).error?.message]).toEqual([400, expect.stringMatching(/max_tokens/)]);
    const notJson = await handle(post(await sign(tracker, HEAD, []), new TextEncoder().encode('{')));
    expect(notJson.status).toBe(400);
  });

  it('answers 405 to GET /generate and hands every other path to the forward handler', async () => {
    expect((await handle({ method: 'GET', path: '/generate', headers: {}, body: new Uint8Array(0) })).status).toBe(405);
    const res = await handle({ method: 'POST', path: '/forward', headers: {}, body: new Uint8Array(0) });
    expect([res.status, forwarded.at(-1)]).toEqual([204, '/forward']);
  });
});
