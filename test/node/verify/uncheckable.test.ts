/**
 * A generation whose signed rows the head no longer holds (rows cut back
 * after the hops computed them, as a rejected speculative draft is) is not
 * checked: every planned check is reported skipped as `uncheckable` — no
 * checker is asked, and nothing is held against the hop (a refusal would be).
 */
import { describe, expect, it } from 'vitest';
import { Verifier, type FinishedGeneration } from '../../../src/node/verify/verifier.ts';
import type { SkippedCheck } from '../../../src/verify/evidence.ts';
import type { CheckPlan, PlanPeer } from '../../../src/verify/plan.ts';

const peer = (id: string): PlanPeer => ({ peer_id: id, public_key: 'A'.repeat(43), format: 'f32', backend: 'onnxruntime-node' });

function generation(uncheckable?: string): FinishedGeneration {
  const plan: CheckPlan = { head: 'head', model: 'm', generation: 'g', expires_at: Date.now() + 60_000, checks: [{ peer: peer('x'), start_layer: 3, end_layer: 6, checkers: [peer('y'), peer('z')] }] };
  const rows = new Uint8Array(4 * 8);
  return {
    plan: { text: JSON.stringify(plan), signature: 'sig', plan },
    session: 'g.1',
    steps: [3, 1],
    spans: [{ peer: 'x', start: 3, end: 6, input: rows, inputRowBytes: 8, output: { kind: 'tokens', tokens: [{ tokenId: 1, logprob: -1 }] }, attestation: 'x.4.AAAA' }],
    dtype: 'f32',
    hidden: 2,
    sampling: '{}',
    ...(uncheckable !== undefined ? { uncheckable } : {}),
  };
}

describe('a generation the head cannot check', () => {
  it('reports its planned checks skipped as uncheckable and asks no checker', async () => {
    const skipped: SkippedCheck[] = [];
    const events: Array<{ type: string }> = [];
    let asked = 0;
    const v = new Verifier({
      peerId: 'head',
      transport: { send: () => { asked++; return Promise.reject(new Error('no checker may be asked')); } },
      verify: () => Promise.resolve(true),
      report: () => Promise.reject(new Error('nothing may be reported')),
      skipped: (s) => { skipped.push(s); return Promise.resolve({}); },
      onEvent: (e) => events.push(e),
    });
    v.finished(generation('draft rows were cut back'));
    await v.idle();
    await new Promise((r) => setTimeout(r, 10));
    expect(asked).toBe(0);
    expect(skipped).toHaveLength(1);
    expect(skipped[0]).toMatchObject({ peer_id: 'x', start_layer: 3, end_layer: 6, reason: 'uncheckable', why: 'draft rows were cut back' });
    expect(events.map((e) => e.type)).toEqual(['uncheckable']);
    expect(v.ran).toBe(0);
  });
});
