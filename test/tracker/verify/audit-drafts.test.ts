/**
 * A generation whose tokens a sampling draft model's drafts decided (the head
 * marks those trips `drafts_sampled`: Leviathan's rule drew the tokens from
 * drafts only the head holds) is not offered for a head audit — a replay
 * without those drafts would contradict an honest head; the last hop's checks
 * judge the rule instead. Any other finished generation is audited.
 */
import { describe, expect, it } from 'vitest';
import type { GenerateEvent } from '../../../src/protocol/tracker.ts';
import { FakeNode, makeTracker, scriptedTransport } from '../../helpers/tracker.ts';

type Script = Parameters<typeof scriptedTransport>[0][string][number];

function head(sampledDrafts: boolean): Script {
  return () => {
    const events: GenerateEvent[] = [{ type: 'start', prompt_tokens: 7, route: [] }];
    for (let i = 0; i < 4; i++) events.push({ type: 'token', index: i, token_id: 100 + i, text: `<${i}>`, logprob: -0.1, ...(i === 1 ? { drafted: 3, accepted: 2, ...(sampledDrafts ? { drafts_sampled: true as const } : {}) } : {}) });
    events.push({ type: 'done', finish_reason: 'stop', completion_tokens: 4, prompt_tokens: 7 });
    return events;
  };
}

describe('head audits and sampled drafts', () => {
  it('audits a plain generation, and leaves one whose drafts were sampled unaudited', async () => {
    const scripts: Record<string, Script[]> = {};
    const st = scriptedTransport(scripts);
    const t = await makeTracker({ routeSlack: 0 }, st.transport);
    for (let i = 0; i < 3; i++) {
      const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1 + i);
      n.serving = { start_layer: 0, end_layer: 12 };
      await n.register(t);
      // Head 0 (the cheapest) serves both chats: first with sampled drafts, then without.
      scripts[n.peerId] = i === 0 ? [head(true), head(false)] : [];
    }
    const ask = async () => {
      const res = await t.app.request('/v1/chat/completions', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'hi' }], max_tokens: 10, temperature: 0.8, seed: 3 }) });
      expect(res.status).toBe(200);
      await res.json();
      // The audit (if offered) starts off the chat's path.
      await new Promise((r) => setTimeout(r, 50));
    };
    await ask();
    expect(st.others.filter((o) => o.path === '/audit')).toEqual([]);
    await ask();
    expect(st.others.filter((o) => o.path === '/audit')).toHaveLength(1);
  });
});
