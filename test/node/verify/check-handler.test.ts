/**
 * POST /check refuses what it must, and keeps serving (docs/protocol.md §11):
 * no plan or one its tracker did not sign (403), a plan that does not name
 * this node for these layers or this session (403), layers it does not hold
 * (416), rows that do not match their shape, steps or dtype (400), a plan
 * entry used up (403), a second check while one runs (503) — and answers a
 * good check afterwards.
 */
import { beforeAll, describe, expect, it } from 'vitest';
import { Identity, verifyEd25519 } from '../../../src/net/identity.ts';
import { createCheckHandler } from '../../../src/node/verify/check-handler.ts';
import { collectBody, type MeshRequest } from '../../../src/protocol/envelopes.ts';
import { encodeBase64Url } from '../../../src/protocol/base64.ts';
import { encodeTensor } from '../../../src/protocol/tensor.ts';
import type { ShardExecutor } from '../../../src/shard/executor.ts';
import { signPlan } from '../../../src/tracker/verify/planner.ts';
import type { CheckPlan } from '../../../src/verify/plan.ts';
import { executor, fixture } from '../../helpers/shard.ts';

const f = fixture('tiny');
const H = f.cfg.hiddenSize;

describe('POST /check', () => {
  let tracker: Identity;
  let other: Identity;
  let me: Identity;
  let ex: ShardExecutor;
  const checked = 'c'.repeat(32);

  beforeAll(async () => {
    [tracker, other, me] = await Promise.all([Identity.generate(), Identity.generate(), Identity.generate()]);
    ex = await executor(f, 1, 3);
  });

  const plan = (o: Partial<CheckPlan> = {}): CheckPlan => ({
    head: 'a'.repeat(32),
    model: 'tiny',
    generation: 'gen-0',
    expires_at: Date.now() + 60_000,
    checks: [{ peer: { peer_id: checked, public_key: 'k'.repeat(43), format: 'f32', backend: 'x' }, start_layer: 1, end_layer: 3, checkers: [{ peer_id: me.peerId, public_key: encodeBase64Url(me.publicKey), format: 'f32', backend: 'x' }] }],
    ...o,
  });
  const rows = (n: number) => encodeTensor(Float32Array.from({ length: n * H }, (_, i) => Math.sin(i) * 0.5), 'bf16');

  async function request(signer: Identity, p: CheckPlan, over: Record<string, string> = {}, body = rows(5)): Promise<MeshRequest> {
    const signed = await signPlan(signer, p);
    return {
      method: 'POST',
      path: '/check',
      headers: {
        'x-meshnet-check-plan': signed.text,
        'x-meshnet-check-plan-signature': signed.signature,
        'x-meshnet-check-peer': checked,
        'x-meshnet-session': 'gen-0.x1',
        'x-meshnet-start-layer': '1',
        'x-meshnet-end-layer': '3',
        'x-meshnet-dtype': 'bf16',
        'x-meshnet-shape': `1,5,${H}`,
        'x-meshnet-check-steps': '3,1x2',
        ...over,
      },
      body,
    };
  }

  it('refuses what it must with the right status, and answers a good check after all of it', async () => {
    let release: (() => void) | undefined;
    let slow = false;
    const gated = Object.assign(Object.create(ex) as ShardExecutor, {
      forward: async (req: Parameters<ShardExecutor['forward']>[0]) => {
        if (slow) await new Promise<void>((r) => (release = r));
        return ex.forward(req);
      },
    });
    const handle = createCheckHandler({ peerId: me.peerId, model: 'tiny', executor: () => gated, trackerKey: () => tracker.publicKey, sign: (b) => me.sign(b), verify: verifyEd25519 });
    const status = async (r: MeshRequest) => (await handle(r)).status;
    const good = await request(tracker, plan());
    expect(await status({ ...good, headers: { ...good.headers, 'x-meshnet-check-plan': undefined as unknown as string } })).toBe(403);
    expect(await status(await request(other, plan()))).toBe(403); // not its tracker's signature
    expect(await status(await request(tracker, plan({ model: 'other' })))).toBe(403);
    expect(await status(await request(tracker, plan({ expires_at: Date.now() - 1 })))).toBe(403);
    expect(await status(await request(tracker, plan(), { 'x-meshnet-session': 'gen-9.x1' }))).toBe(403);
    expect(await status(await request(tracker, plan(), { 'x-meshnet-check-peer': 'd'.repeat(32) }))).toBe(403);
    const wider = plan();
    wider.checks[0]!.end_layer = 4;
    expect(await status(await request(tracker, wider, { 'x-meshnet-end-layer': '4' }))).toBe(416);
    expect(await status(await request(tracker, plan(), { 'x-meshnet-check-steps': '3,1' }))).toBe(400); // 4 rows of steps, 5 in the shape
    expect(await status(await request(tracker, plan(), { 'x-meshnet-check-steps': 'x' }))).toBe(400);
    expect(await status(await request(tracker, plan(), {}, rows(4)))).toBe(400);
    expect(await status(await request(tracker, plan(), { 'x-meshnet-dtype': 'f64' }))).toBe(400);
    expect(await status({ ...good, method: 'GET' })).toBe(405);

    // One check at a time: a second while the first runs is 503 (the head asks the next checker).
    slow = true;
    const first = handle(await request(tracker, plan(), { 'x-meshnet-session': 'gen-0.a' }));
    await new Promise((r) => setTimeout(r, 20));
    const busy = await handle(await request(tracker, plan(), { 'x-meshnet-session': 'gen-0.b' }));
    expect(busy.status).toBe(503);
    slow = false;
    release!();
    expect((await first).status).toBe(200);

    // A good check: rows for every step and the check attestation; the entry can be used twice, not three times.
    const ok = await handle(good);
    expect(ok.status).toBe(200);
    expect((await collectBody(ok.body)).byteLength).toBe(5 * H * 2);
    expect(ok.headers['x-meshnet-check-attest']).toMatch(new RegExp(`^${me.peerId}\\.5\\.`));
    expect((await handle(good)).status).toBe(200);
    expect((await handle(good)).status).toBe(403);
  });
});
