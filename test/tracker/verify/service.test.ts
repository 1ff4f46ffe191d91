/**
 * The tracker's verification service in the app (src/tracker/verify): a
 * quarantined node leaves routing and is listed to every node with its
 * heartbeat answer; a planned check a head could not run is recorded (and
 * needs the head's and the tracker's signatures); a generation's record is
 * answered at /v1/verifications/:id.
 */
import { describe, expect, it } from 'vitest';
import { encodeBase64Url } from '../../../src/protocol/base64.ts';
import { signBody } from '../../../src/tracker/signing.ts';
import { signPlan } from '../../../src/tracker/verify/planner.ts';
import type { CheckPlan } from '../../../src/verify/plan.ts';
import { FakeNode, makeTracker } from '../../helpers/tracker.ts';

const offence = (peer: string) => ({ peer, role: 'hop' as const, model: 'small', start_layer: 6, end_layer: 12, generation: 'g-0', session: 'g-0.x', kind: 'rows' as const, rows: 4, steps: 2, threshold: 0.003, claim: { peer, attestation: 'a' }, checker: { peer: 'c', attestation: 'b', distance: 0.1 }, reported_by: 'h' });

async function mesh() {
  const t = await makeTracker();
  const nodes: FakeNode[] = [];
  for (const [a, b] of [[0, 6], [6, 12], [6, 12], [6, 12]] as const) {
    const n = await FakeNode.create({ pinned: true });
    n.serving = { start_layer: a, end_layer: b };
    await n.register(t);
    nodes.push(n);
  }
  return { t, nodes };
}

describe('quarantine at the tracker', () => {
  it('leaves a quarantined node out of every route, and tells every node in its heartbeat answer', async () => {
    const { t, nodes } = await mesh();
    const [, x] = nodes as [FakeNode, FakeNode];
    const seen = new Set<string>();
    for (let i = 0; i < 40; i++) for (const h of t.registry.pick('small').hops) seen.add(h.id);
    expect(seen.has(x.peerId)).toBe(true);
    const off = t.verification.trust.offence(offence(x.peerId));
    seen.clear();
    for (let i = 0; i < 40; i++) for (const h of t.registry.pick('small').hops) seen.add(h.id);
    expect(seen.has(x.peerId)).toBe(false);
    const ans = await nodes[0]!.heartbeat(t);
    expect(ans.distrust).toEqual([{ peer_id: x.peerId, until: off.until }]);
    // After the quarantine ends it is routed again.
    t.clock.now = off.until + 1;
    seen.clear();
    for (let i = 0; i < 40; i++) for (const h of t.registry.pick('small').hops) seen.add(h.id);
    expect(seen.has(x.peerId)).toBe(true);
  });
});

describe('a planned check that could not run', () => {
  it('is recorded as unchecked when the head and the plan are signed; refused otherwise', async () => {
    const { t, nodes } = await mesh();
    const [h, x, y] = nodes as [FakeNode, FakeNode, FakeNode];
    const peer = (n: FakeNode) => ({ peer_id: n.peerId, public_key: encodeBase64Url(n.identity.publicKey), format: 'f32' as const, backend: 'onnxruntime-node' });
    const plan: CheckPlan = { head: h.peerId, model: 'small', generation: 'req-0', expires_at: t.clock.now + 60_000, checks: [{ peer: peer(x), start_layer: 6, end_layer: 12, checkers: [peer(y)] }] };
    const signed = await signPlan(t.identity, plan);
    const record = t.verification.log.open('req', 'small');
    record.attempt('req-0', h.peerId, [{ peer: h.peerId, start: 0, end: 6 }, { peer: x.peerId, start: 6, end: 12 }], new Set([`${x.peerId}:6:12`]), plan.expires_at);
    t.verification.log.link('req-0', record);
    record.ended('req-0');
    const body = { head: h.peerId, timestamp: t.clock.now, plan: signed.text, plan_signature: signed.signature, session: 'req-0.abc', peer_id: x.peerId, start_layer: 6, end_layer: 12, reason: 'refused' as const, why: 'it gave no attestation' };
    const post = async (b: unknown) => t.app.request('/api/checks/skipped', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(b) });
    // Signed by another node than the head: refused.
    expect((await post(await signBody(y.identity, body))).status).toBe(401);
    // A plan the tracker did not sign: refused.
    expect((await post(await signBody(h.identity, { ...body, plan: signed.text.replace('req-0', 'req-9') }))).status).toBe(401);
    expect((await post(await signBody(h.identity, body))).status).toBe(200);
    const view = (await (await t.app.request('/v1/verifications/req')).json()) as { status: string; hops: Array<{ peer_id: string; status: string; detail?: string }> };
    expect(view.status).toBe('unchecked');
    expect(view.hops.find((x2) => x2.peer_id === x.peerId)).toMatchObject({ status: 'unchecked', detail: expect.stringContaining('would not be checked') as unknown });
    // A refusing node earns no pass and is checked again next time.
    expect(t.verification.trust.peek(x.peerId)?.refusals).toBe(1);
    expect(t.verification.trust.checkProbability(x.peerId)).toBe(1);
    expect((await t.app.request('/v1/verifications/nope')).status).toBe(404);
  });

  it('is held against nobody when the head no longer holds the rows the hop signed (uncheckable)', async () => {
    const { t, nodes } = await mesh();
    const [h, x, y] = nodes as [FakeNode, FakeNode, FakeNode];
    const peer = (n: FakeNode) => ({ peer_id: n.peerId, public_key: encodeBase64Url(n.identity.publicKey), format: 'f32' as const, backend: 'onnxruntime-node' });
    const plan: CheckPlan = { head: h.peerId, model: 'small', generation: 'req-0', expires_at: t.clock.now + 60_000, checks: [{ peer: peer(x), start_layer: 6, end_layer: 12, checkers: [peer(y)] }] };
    const signed = await signPlan(t.identity, plan);
    const record = t.verification.log.open('req', 'small');
    record.attempt('req-0', h.peerId, [{ peer: h.peerId, start: 0, end: 6 }, { peer: x.peerId, start: 6, end: 12 }], new Set([`${x.peerId}:6:12`]), plan.expires_at);
    t.verification.log.link('req-0', record);
    record.ended('req-0');
    const body = { head: h.peerId, timestamp: t.clock.now, plan: signed.text, plan_signature: signed.signature, session: 'req-0.abc', peer_id: x.peerId, start_layer: 6, end_layer: 12, reason: 'uncheckable' as const, why: 'draft rows were cut back' };
    const res = await t.app.request('/api/checks/skipped', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(await signBody(h.identity, body)) });
    expect(res.status).toBe(200);
    const view = (await (await t.app.request('/v1/verifications/req')).json()) as { status: string; hops: Array<{ peer_id: string; status: string; detail?: string }> };
    expect(view.status).toBe('unchecked');
    expect(view.hops.find((x2) => x2.peer_id === x.peerId)).toMatchObject({ status: 'unchecked', detail: expect.stringContaining('draft rows were cut back') as unknown });
    expect(t.verification.trust.peek(x.peerId)?.refusals ?? 0).toBe(0);
  });
});
