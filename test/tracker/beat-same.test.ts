/**
 * Heartbeats that leave out what the tracker already has (`same`,
 * docs/protocol.md §9): the fields it names come from the node's record;
 * a node the tracker does not know is 404 (it registers in full); `same`
 * on a registration, a name both listed and sent, an unknown name are 400;
 * a signed HTTP beat without its key verifies against the registered one.
 */
import { afterEach, describe, expect, it, vi } from 'vitest';
import { nodeBeatSchema, nodeMessageSchema } from '../../src/protocol/tracker.ts';
import { signBody } from '../../src/node/tracker-client.ts';
import { beatNeedsWrite, nodeDocOf } from '../../src/tracker/cluster/doc.ts';
import { Identity } from '../../src/net/identity.ts';
import { FakeNode, makeTracker, type TestTracker } from '../helpers/tracker.ts';

const utf8 = new TextEncoder();
const text = new TextDecoder();

const STATS = { rpm: 3, layer_ms: 5, queue_depth: 0, kv_free_bytes: 1 << 20, tokens_served: 9 };

/** `n`'s message less the fields in `same`, naming them. */
function delta(n: FakeNode, now: number, same: string[], over: Record<string, unknown> = {}): Record<string, unknown> {
  const m: Record<string, unknown> = { ...n.message(now), ...over, same };
  for (const f of same) delete m[f];
  return m;
}

function relayBeat(t: TestTracker, from: string, body: unknown): { status: number; body: { error?: { code: string; message: string } } & Record<string, unknown> } {
  const r = t.relayBeat(from, utf8.encode(JSON.stringify(body)));
  return { status: r.status, body: JSON.parse(text.decode(r.body as Uint8Array)) };
}

async function postSigned(t: TestTracker, identity: Identity, path: string, body: unknown): Promise<Response> {
  const signed = await signBody(identity, body);
  return t.app.request(path, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(signed) });
}

async function joined(): Promise<{ t: TestTracker; n: FakeNode }> {
  const t = await makeTracker();
  const n = await FakeNode.create({ memory_budget_mb: 64 });
  n.stats = STATS;
  n.relayAddr = 'relay://r1';
  n.endpoint = 'http://10.0.0.1:9000';
  await n.join(t);
  return { t, n };
}

afterEach(() => vi.restoreAllMocks());

describe('heartbeats with same', () => {
  it('a delta beat keeps the record\'s info, key, addresses and stats, and extends the stats history', async () => {
    const { t, n } = await joined();
    const rec = t.registry.nodes.get(n.peerId)!;
    const before = { info: rec.info, stats: rec.stats, publicKey: rec.publicKey, relayAddr: rec.relayAddr, endpoint: rec.endpoint, history: rec.history.length, ewma: rec.layerMsEwma };
    t.clock.now += 1000;
    const r = relayBeat(t, n.peerId, delta(n, t.clock.now, ['public_key', 'info', 'relay_addr', 'endpoint', 'stats']));
    expect(r.status).toBe(200);
    expect(r.body.assignment).toEqual(n.assignment);
    // The very objects: nothing changed, nothing replaced.
    expect(rec.info).toBe(before.info);
    expect(rec.stats).toBe(before.stats);
    expect(rec.publicKey).toBe(before.publicKey);
    expect(rec.relayAddr).toBe('relay://r1');
    expect(rec.endpoint).toBe('http://10.0.0.1:9000');
    expect(rec.history.length).toBe(before.history + 1);
    expect(rec.history.at(-1)).toMatchObject({ at: t.clock.now, rpm: 3, layer_ms: 5 });
    expect(rec.lastSeen).toBe(t.clock.now);
    expect(rec.layerMsEwma).toBe(5);

    // What travels still counts: new stats replace the record's, and an address left out and not listed is gone, as today.
    t.clock.now += 1000;
    expect(relayBeat(t, n.peerId, delta(n, t.clock.now, ['public_key', 'info'], { stats: { ...STATS, layer_ms: 15 }, endpoint: undefined })).status).toBe(200);
    expect(rec.stats!.layer_ms).toBe(15);
    expect(rec.layerMsEwma).toBeCloseTo(8);
    expect(rec.endpoint).toBeUndefined();
    expect(rec.relayAddr).toBe('relay://r1');
  });

  it('in a cluster, a delta beat of an unchanged node needs no write of its document', async () => {
    const { t, n } = await joined();
    const rec = t.registry.nodes.get(n.peerId)!;
    const doc = nodeDocOf(rec, 'tracker-a');
    t.clock.now += 1000;
    expect(relayBeat(t, n.peerId, delta(n, t.clock.now, ['public_key', 'info', 'relay_addr', 'endpoint', 'stats'])).status).toBe(200);
    expect(beatNeedsWrite(rec, doc, t.clock.now, 60_000)).toBe(false);
    // A record another tracker wrote (copyRemote): the same.
    const copy = { ...doc, info: { ...doc.info }, stats: { ...doc.stats! } };
    rec.info = copy.info;
    rec.stats = copy.stats;
    t.clock.now += 1000;
    expect(relayBeat(t, n.peerId, delta(n, t.clock.now, ['public_key', 'info', 'relay_addr', 'endpoint', 'stats'])).status).toBe(200);
    expect(rec.info).toBe(copy.info);
    expect(beatNeedsWrite(rec, copy, t.clock.now, 60_000)).toBe(false);
  });

  it('an unknown node is 404; a name listed and sent, an unknown name, a name twice are 400; so is same on a registration', async () => {
    const { t, n } = await joined();
    const stranger = await FakeNode.create();
    const unknown = relayBeat(t, stranger.peerId, delta(stranger, t.clock.now, ['public_key', 'info']));
    expect(unknown.status).toBe(404);
    expect(unknown.body.error!.code).toBe('MESH_ERR_NOT_FOUND');
    // The same over signed HTTP: 404 before the key is needed.
    expect((await postSigned(t, stranger.identity, '/api/nodes/heartbeat', delta(stranger, t.clock.now, ['public_key', 'info']))).status).toBe(404);

    const both = relayBeat(t, n.peerId, { ...delta(n, t.clock.now, ['info']), info: n.info });
    expect(both.status).toBe(400);
    expect(both.body.error!.message).toMatch(/"info" is both sent and listed in "same"/);
    const odd = relayBeat(t, n.peerId, delta(n, t.clock.now, ['info', 'serving']));
    expect(odd.status).toBe(400);
    expect(odd.body.error!.message).toMatch(/same\.1/);
    expect(relayBeat(t, n.peerId, { ...delta(n, t.clock.now, ['info']), same: ['info', 'info'] }).status).toBe(400);
    expect(relayBeat(t, n.peerId, { ...delta(n, t.clock.now, ['info']), same: [] }).status).toBe(400);
    // Left out without being listed: the key is still required.
    const keyless = relayBeat(t, n.peerId, { ...delta(n, t.clock.now, ['info']), public_key: undefined });
    expect(keyless.status).toBe(400);
    expect(keyless.body.error!.message).toMatch(/public_key/);

    const reg = await postSigned(t, n.identity, '/api/nodes/register', { ...n.message(t.clock.now), same: ['stored'] });
    expect(reg.status).toBe(400);
    expect(((await reg.json()) as { error: { message: string } }).error.message).toMatch(/registration sends every field/);
  });

  it('a signed HTTP delta beat without its key verifies against the registered key; a forged one does not', async () => {
    const { t, n } = await joined();
    t.clock.now += 1000;
    const ok = await postSigned(t, n.identity, '/api/nodes/heartbeat', delta(n, t.clock.now, ['public_key', 'info', 'stats']));
    expect(ok.status).toBe(200);
    expect(t.registry.nodes.get(n.peerId)!.lastSeen).toBe(t.clock.now);
    // Signed by someone else, speaking for this node: the registered key says no.
    const mallory = await Identity.generate();
    t.clock.now += 1000;
    const forged = await postSigned(t, mallory, '/api/nodes/heartbeat', delta(n, t.clock.now, ['public_key', 'info', 'stats'], { draining: true }));
    expect(forged.status).toBe(401);
    expect(t.registry.nodes.get(n.peerId)!.draining).toBe(false);
    // A signature over the body with `same` removed (not what was sent) does not verify either.
    const body = delta(n, t.clock.now, ['public_key', 'info']);
    const { same: _same, ...unsigned } = body;
    const sig = (await signBody(n.identity, unsigned)).signature;
    const tampered = await t.app.request('/api/nodes/heartbeat', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ body, signature: sig }) });
    expect(tampered.status).toBe(401);
  });

  it('a batched relay beat with same passes the hand check (no zod) and is answered with the same bytes as a full one', async () => {
    const { t, n } = await joined();
    const m = await FakeNode.create({ memory_budget_mb: 64 });
    m.stats = STATS;
    await m.join(t);
    t.clock.now += 1000;
    const full = t.relayBeats({ type: 'beats', batch: 1, beats: [n, m].map((x) => ({ from: x.peerId, body: x.message(t.clock.now) })) });
    const beatParse = vi.spyOn(nodeBeatSchema, 'safeParse');
    const messageParse = vi.spyOn(nodeMessageSchema, 'safeParse');
    t.clock.now += 1000;
    const same = t.relayBeats({ type: 'beats', batch: 1, beats: [n, m].map((x) => ({ from: x.peerId, body: delta(x, t.clock.now, ['public_key', 'info', 'stats', 'relay_addr']) })) });
    expect(beatParse).not.toHaveBeenCalled();
    expect(messageParse).not.toHaveBeenCalled();
    expect(same).toBe(full);
    expect(JSON.parse(same).answers.map((a: { status: number }) => a.status)).toEqual([200, 200]);
  });
});
