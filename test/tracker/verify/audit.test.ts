/**
 * Head audits (src/tracker/verify/audit.ts): a disjoint route re-runs a
 * finished generation and confirms each token; a contradiction is checked by
 * a second disjoint route, then the head is asked to walk its hops; when the
 * walk names nobody, two independent routes against the head's stream
 * quarantine the head. Two audits that disagree punish nobody.
 */
import { describe, expect, it } from 'vitest';
import type { HeadTransport } from '../../../src/tracker/head-proxy.ts';
import { FakeNode, makeTracker } from '../../helpers/tracker.ts';
import { signBody } from '../../../src/tracker/signing.ts';
import type { CheckPlan } from '../../../src/verify/plan.ts';

const TOKENS = [100, 101, 102, 103];

/** A transport whose /audit answers confirm the tokens, or contradict one on the heads in `liars`. */
function auditTransport(liars: Set<string>) {
  const audits: string[] = [];
  const walks: string[] = [];
  /** What the walked head does with the walk's plan (nothing by default: a walk that names nobody). */
  const onWalk: { fn?: (head: string, body: { plan: string; signature: string }) => Promise<void> } = {};
  const transport: HeadTransport = {
    async open(head, _headers, body, o) {
      const enc = new TextEncoder();
      if (o.path === '/audit') {
        audits.push(head.peerId);
        const req = JSON.parse(new TextDecoder().decode(body)) as { token_ids: number[] };
        const records = req.token_ids.map((t, i) => ({ claimed: t, sampled: liars.has(head.peerId) && i === 2 ? 7 : t, argmax: t, deficit: liars.has(head.peerId) && i === 2 ? 5 : 0, gap: 0, logprob: -0.1 }));
        return (async function* () {
          yield enc.encode(JSON.stringify({ records }));
        })();
      }
      if (o.path === '/verify/walk') {
        walks.push(head.peerId);
        await onWalk.fn?.(head.peerId, JSON.parse(new TextDecoder().decode(body)) as { plan: string; signature: string });
        return (async function* () {})();
      }
      throw new Error(`unexpected ${o.path}`);
    },
  };
  return { transport, audits, walks, onWalk };
}

async function mesh(liars: (ids: string[]) => string[]) {
  const holder = new Set<string>();
  const net = auditTransport(holder);
  // Slack 0: the cheapest disjoint route audits first (head 1), then the next (head 2).
  const t = await makeTracker({ auditWalkMs: 300, routeSlack: 0 }, net.transport);
  const heads: FakeNode[] = [];
  for (let i = 0; i < 4; i++) {
    const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1 + i);
    n.serving = { start_layer: 0, end_layer: 12 };
    await n.register(t);
    heads.push(n);
  }
  for (const l of liars(heads.map((h) => h.peerId))) holder.add(l);
  return { t, heads, ...net };
}

function subject(t: Awaited<ReturnType<typeof makeTracker>>, head: string) {
  const record = t.verification.log.open('gen', 'small');
  record.attempt('gen-0', head, [{ peer: head, start: 0, end: 12 }], new Set(), 0);
  t.verification.log.link('gen-0', record);
  record.ended('gen-0');
  return { model: 'small', input: { messages: [{ role: 'user', content: 'hi' }], max_tokens: 4, temperature: 0, top_p: 1, top_k: 0, stop: [] }, tokens: TOKENS, logprobs: TOKENS.map(() => -0.1), head, route: [head], generation: 'gen-0', record };
}

describe('head audits', () => {
  it('confirm every token on a disjoint route: the generation is clean and the head passes', async () => {
    const { t, heads, audits } = await mesh(() => []);
    const s = subject(t, heads[0]!.peerId);
    expect(await t.verification.audits.audit(s)).toBe('confirmed');
    expect(audits).toHaveLength(1);
    expect(audits[0]).not.toBe(heads[0]!.peerId);
    expect(s.record.view(t.verification.trust, t.clock.now, '')).toMatchObject({ status: 'clean', audit: { status: 'clean' } });
    expect(t.verification.trust.peek(heads[0]!.peerId)?.passes).toBe(1);
  });

  it('two disjoint routes contradicting the head, and a walk that names no hop, quarantine the head', async () => {
    // Both audit routes (heads 1 and 2: the cheapest disjoint ones) say token 2 is wrong.
    const { t, heads, audits, walks } = await mesh((ids) => [ids[1]!, ids[2]!]);
    const s = subject(t, heads[0]!.peerId);
    expect(await t.verification.audits.audit(s)).toBe('convicted');
    expect(new Set(audits)).toEqual(new Set([heads[1]!.peerId, heads[2]!.peerId]));
    expect(walks).toEqual([heads[0]!.peerId]);
    expect(t.verification.trust.quarantined(heads[0]!.peerId)).toBe(true);
    expect(t.verification.offences().at(-1)).toMatchObject({ peer: heads[0]!.peerId, role: 'head' });
    expect(s.record.view(t.verification.trust, t.clock.now, '').status).toBe('wrong');
  });

  it('a contradicted generation whose head reports its checks uncheckable (speculative rows cut back) convicts nobody', async () => {
    const { t, heads, walks, onWalk } = await mesh((ids) => [ids[1]!, ids[2]!]);
    const s = subject(t, heads[0]!.peerId);
    // The head answers the walk as a speculating head does: every planned check skipped as uncheckable, signed.
    onWalk.fn = async (head, walk) => {
      const plan = JSON.parse(walk.plan) as CheckPlan;
      for (const c of plan.checks) {
        const body = { head, timestamp: t.clock.now, plan: walk.plan, plan_signature: walk.signature, session: `${plan.generation}.x`, peer_id: c.peer.peer_id, start_layer: c.start_layer, end_layer: c.end_layer, reason: 'uncheckable' as const, why: 'rejected draft rows were cut back' };
        await t.verification.skipped(await signBody(heads[0]!.identity, body));
      }
    };
    expect(await t.verification.audits.audit(s)).toBe('unwalkable');
    expect(walks).toEqual([heads[0]!.peerId]);
    expect(t.verification.trust.quarantined(heads[0]!.peerId)).toBe(false);
    expect(t.verification.trust.checkProbability(heads[0]!.peerId)).toBe(1);
    // The answer was still wrong: its record says so.
    expect(s.record.view(t.verification.trust, t.clock.now, '').status).toBe('wrong');
  });

  it('two audits that disagree punish nobody, and everyone involved is checked next', async () => {
    const { t, heads } = await mesh((ids) => [ids[1]!]);
    const s = subject(t, heads[0]!.peerId);
    expect(await t.verification.audits.audit(s)).toBe('inconclusive');
    for (const h of heads) expect(t.verification.trust.quarantined(h.peerId)).toBe(false);
    expect(t.verification.trust.checkProbability(heads[0]!.peerId)).toBe(1);
  });
});
