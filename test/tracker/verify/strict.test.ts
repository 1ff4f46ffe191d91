/**
 * Strict mode (`verification: "strict"`): every token computed by two routes
 * that share no node and released only when both agree; a disagreement is
 * decided by a third disjoint route, and the route that lost goes on from the
 * agreed tokens elsewhere. With fewer than two disjoint routes the request is
 * refused rather than run unchecked.
 */
import { describe, expect, it } from 'vitest';
import type { GenerateEvent } from '../../../src/protocol/tracker.ts';
import { FakeNode, makeTracker, scriptedTransport, type TestTracker } from '../../helpers/tracker.ts';

type Script = Parameters<typeof scriptedTransport>[0][string][number];
const TRUTH = [100, 101, 102, 103, 104];

/** A head that answers the truth after whatever prefix it is given; `lieAt`: that index gets token 999 instead. */
function head(lieAt?: number): Script {
  return ({ body }) => {
    const prefix = (body as { prefix_token_ids: number[] }).prefix_token_ids;
    const events: GenerateEvent[] = [{ type: 'start', prompt_tokens: 7, route: [] }];
    for (let i = prefix.length; i < TRUTH.length; i++) events.push({ type: 'token', index: i, token_id: i === lieAt ? 999 : TRUTH[i]!, text: `<${i === lieAt ? 999 : TRUTH[i]}>`, logprob: -0.1 });
    events.push({ type: 'done', finish_reason: 'stop', completion_tokens: TRUTH.length, prompt_tokens: 7 });
    return events;
  };
}

async function setup(heads: number, liar?: number) {
  const scripts: Record<string, Script[]> = {};
  const st = scriptedTransport(scripts);
  // Slack 0: the cheapest route always wins, so head 0 is route A and head 1 (the next cheapest) route B.
  const t: TestTracker = await makeTracker({ routeSlack: 0 }, st.transport);
  const hs: FakeNode[] = [];
  for (let i = 0; i < heads; i++) {
    const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1 + i);
    n.serving = { start_layer: 0, end_layer: 12 };
    await n.register(t);
    scripts[n.peerId] = Array.from({ length: 8 }, () => head(i === liar ? 2 : undefined));
    hs.push(n);
  }
  return { t, heads: hs, calls: st.calls };
}

const ask = (t: TestTracker) =>
  t.app.request('/v1/chat/completions', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'hi' }], max_tokens: 10, temperature: 0, verification: 'strict' }) });

describe('strict mode', () => {
  it('releases each token only when two disjoint routes agree', async () => {
    const { t, heads, calls } = await setup(2);
    const res = await ask(t);
    expect(res.status).toBe(200);
    const body = (await res.json()) as { choices: Array<{ token_ids: number[]; message: { content: string } }>; usage: { verification: { status: string; mode: string; generations: Array<{ tokens_agreed: number; disputes: number }> } } };
    expect(body.choices[0]!.token_ids).toEqual(TRUTH);
    expect(new Set(calls.map((c) => c.head))).toEqual(new Set(heads.map((h) => h.peerId)));
    expect(body.usage.verification).toMatchObject({ status: 'clean', mode: 'strict', generations: [{ tokens_agreed: 5, disputes: 0 }] });
  });

  it('lets a third disjoint route decide a disagreement; the route that lost goes on from the agreed tokens elsewhere', async () => {
    const { t, heads, calls } = await setup(3, 1);
    const res = await ask(t);
    const body = (await res.json()) as { choices: Array<{ token_ids: number[]; message: { content: string } }>; usage: { verification: { generations: Array<{ tokens_agreed: number; disputes: number }> } } };
    expect(body.choices[0]!.token_ids).toEqual(TRUTH);
    expect(body.choices[0]!.message.content).toBe(TRUTH.map((x) => `<${x}>`).join(''));
    expect(body.usage.verification.generations[0]).toMatchObject({ disputes: 1, tokens_agreed: 4 });
    // The third route was asked for the disputed step only, from the agreed tokens; then the lost side restarted after the decided one.
    const toC = calls.filter((c) => c.head === heads[2]!.peerId).map((c) => c.body.prefix_token_ids);
    expect(toC).toEqual([[100, 101], [100, 101, 102]]);
    // Every node of both routes is checked at its next session.
    for (const h of heads.slice(0, 2)) expect(t.verification.trust.checkProbability(h.peerId)).toBe(1);
  });

  it('is refused when the mesh has no two routes that share no node', async () => {
    const { t } = await setup(1);
    const res = await ask(t);
    expect(res.status).toBe(503);
    expect(((await res.json()) as { error: { message: string } }).error.message).toMatch(/two routes that share no node/);
  });
});
