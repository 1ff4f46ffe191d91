import { describe, expect, it } from 'vitest';
import { Identity, verifyEd25519 } from '../../src/net/identity.ts';
import { NotRegisteredError, TrackerClient } from '../../src/node/tracker-client.ts';
import { decodeBase64, encodeBase64Url } from '../../src/protocol/base64.ts';
import { canonicalJson, routeSigningMessage, type NodeMessage, type RouteHop } from '../../src/protocol/tracker.ts';

const FAILED: RouteHop = { peer_id: 'f'.repeat(32), start_layer: 1, end_layer: 3 };
const REPL: RouteHop = { peer_id: 'e'.repeat(32), start_layer: 1, end_layer: 3, endpoint: 'http://e' };

/** A scripted tracker: answers in order, records what it was sent. */
function scripted(answers: Array<(body: unknown) => Promise<Response> | Response>): { fetch: typeof fetch; sent: Array<{ url: string; body: { body: Record<string, unknown>; signature: string } }> } {
  const sent: Array<{ url: string; body: { body: Record<string, unknown>; signature: string } }> = [];
  let i = 0;
  return {
    sent,
    fetch: (async (url: string, init: RequestInit) => {
      const body = JSON.parse(String(init.body));
      sent.push({ url: String(url), body });
      return answers[Math.min(i++, answers.length - 1)]!(body);
    }) as typeof fetch,
  };
}
const json = (status: number, v: unknown) => new Response(JSON.stringify(v), { status, headers: { 'content-type': 'application/json' } });

async function signedReplace(key: Identity, head: string, hops: RouteHop[]) {
  const route = JSON.stringify(hops);
  const expires_at = Date.now() + 60_000;
  return { route, expires_at, signature: encodeBase64Url(await key.sign(routeSigningMessage(head, expires_at, route))) };
}

describe('TrackerClient', () => {
  it('signs register bodies over canonicalJson with the node key and keeps the tracker key it answers with', async () => {
    const node = await Identity.generate();
    const trackerKey = await Identity.generate();
    const t = scripted([() => json(200, { assignment: null, heartbeat_interval_ms: 1000, tracker_public_key: encodeBase64Url(trackerKey.publicKey) })]);
    const c = new TrackerClient({ trackerUrl: 'http://tracker/', fetch: t.fetch, identity: node });
    const msg: NodeMessage = { peer_id: node.peerId, public_key: encodeBase64Url(node.publicKey), info: { model: 'tiny', backend: 'cpu', memory_budget_mb: 1, host: 'node' }, timestamp: Date.now() };
    const ans = await c.register(msg);
    expect(ans.heartbeat_interval_ms).toBe(1000);
    expect(t.sent[0]!.url).toBe('http://tracker/api/nodes/register');
    const ok = await verifyEd25519(node.publicKey, new TextEncoder().encode(canonicalJson(t.sent[0]!.body.body)), decodeBase64(t.sent[0]!.body.signature));
    expect(ok).toBe(true);
    expect([...c.trackerKey!]).toEqual([...trackerKey.publicKey]);
  });

  it('reports a heartbeat 404 as NotRegisteredError (the tracker restarted)', async () => {
    const node = await Identity.generate();
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: scripted([() => json(404, { error: { code: 'MESH_ERR_NOT_FOUND', message: 'no' } })]).fetch, identity: node });
    await expect(c.heartbeat({} as NodeMessage)).rejects.toBeInstanceOf(NotRegisteredError);
  });

  it('keeps asking for a replacement through 503s and answers naming the failed peer, then returns the signed hops', async () => {
    const head = await Identity.generate();
    const tracker = await Identity.generate();
    const t = scripted([
      () => json(503, { error: { code: 'MESH_ERR_UNAVAILABLE', message: 'layers 1-2 not served' } }),
      async () => json(200, await signedReplace(tracker, head.peerId, [FAILED])),
      async () => json(200, await signedReplace(tracker, head.peerId, [REPL])),
    ]);
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: t.fetch, identity: head });
    c.trackerKey = tracker.publicKey;
    expect(await c.replace('tiny', FAILED)).toEqual({ hops: [REPL] });
    expect(t.sent).toHaveLength(3);
    expect(t.sent[0]!.body.body).toMatchObject({ head_peer_id: head.peerId, failed_peer_id: FAILED.peer_id, start_layer: 1, end_layer: 3, model: 'tiny' });
  });

  it('refuses a replacement not signed by the tracker for this head', async () => {
    const head = await Identity.generate();
    const tracker = await Identity.generate();
    const forger = await Identity.generate();
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: scripted([async () => json(200, await signedReplace(forger, head.peerId, [REPL]))]).fetch, identity: head });
    c.trackerKey = tracker.publicKey;
    await expect(c.replace('tiny', FAILED)).rejects.toMatchObject({ code: 'MESH_ERR_FORBIDDEN' });
    const c2 = new TrackerClient({ trackerUrl: 'http://tracker', fetch: scripted([async () => json(200, await signedReplace(tracker, 'c'.repeat(32), [REPL]))]).fetch, identity: head });
    c2.trackerKey = tracker.publicKey;
    await expect(c2.replace('tiny', FAILED)).rejects.toMatchObject({ code: 'MESH_ERR_FORBIDDEN' });
  });

  it('gives up after its deadline while the tracker has no replacement', async () => {
    const head = await Identity.generate();
    const c = new TrackerClient({ trackerUrl: 'http://tracker', fetch: scripted([() => json(503, { error: { code: 'MESH_ERR_UNAVAILABLE', message: 'none' } })]).fetch, identity: head, replaceDeadlineMs: 300 });
    c.trackerKey = head.publicKey;
    const t0 = Date.now();
    await expect(c.replace('tiny', FAILED)).rejects.toMatchObject({ code: 'MESH_ERR_UNAVAILABLE' });
    expect(Date.now() - t0).toBeLessThan(2_000);
  });
});
