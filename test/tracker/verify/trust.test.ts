/**
 * The tracker's trust book and check planner (src/tracker/verify): BOINC's
 * adaptive replication odds, quarantine with a doubling backoff, and which
 * holders may check a span.
 */
import { describe, expect, it } from 'vitest';
import { TrustBook } from '../../../src/tracker/verify/trust.ts';
import { planChecks, type PlannerNode } from '../../../src/tracker/verify/planner.ts';

const offence = (peer: string) => ({
  peer,
  role: 'hop' as const,
  model: 'm',
  start_layer: 0,
  end_layer: 2,
  generation: 'g',
  session: 'g.1',
  kind: 'rows' as const,
  rows: 10,
  steps: 3,
  threshold: 0.003,
  claim: { peer, attestation: 'x' },
  checker: { peer: 'c', attestation: 'y', distance: 0.1 },
  reported_by: 'h',
});

describe('the trust book (BOINC adaptive replication)', () => {
  it('checks every session of a new node until 10 checks pass in a row, then with probability max(p_min, 1/consecutive)', () => {
    const t = new TrustBook({ now: () => 0, random: () => 0.5 });
    for (let i = 0; i < 10; i++) {
      expect(t.checkProbability('n')).toBe(1);
      t.pass('n');
    }
    expect(t.checkProbability('n')).toBeCloseTo(1 / 10);
    for (let i = 0; i < 10; i++) t.pass('n');
    expect(t.checkProbability('n')).toBeCloseTo(1 / 20);
    for (let i = 0; i < 100; i++) t.pass('n');
    expect(t.checkProbability('n')).toBe(0.02); // p_min
    // The draw follows the odds: random() 0.5 is above 2 %.
    expect(t.draw('n')).toBe(false);
  });

  it('an offence resets the count and quarantines for 15 min, doubling with each offence; the node is distrusted meanwhile', () => {
    let now = 1_000_000;
    const t = new TrustBook({ now: () => now, random: () => 0.5 });
    for (let i = 0; i < 30; i++) t.pass('n');
    const first = t.offence(offence('n'));
    expect(first.until - now).toBe(15 * 60_000);
    expect(t.quarantined('n')).toBe(true);
    expect(t.checkProbability('n')).toBe(1);
    expect(t.distrusted()).toEqual([{ peer_id: 'n', until: first.until }]);
    now = first.until + 1;
    expect(t.quarantined('n')).toBe(false);
    const second = t.offence(offence('n'));
    expect(second.until - now).toBe(30 * 60_000);
    expect(t.offencesSince('n', 0)).toHaveLength(2);
    expect(t.offencesSince('n', now + 1)).toHaveLength(0);
  });

  it('an inconclusive check punishes nobody but forces the next check', () => {
    const t = new TrustBook({ now: () => 0, random: () => 0.99 });
    for (let i = 0; i < 50; i++) t.pass('n');
    expect(t.draw('n')).toBe(false);
    t.inconclusive('n');
    expect(t.quarantined('n')).toBe(false);
    expect(t.draw('n')).toBe(true);
    t.pass('n');
    expect(t.draw('n')).toBe(false);
  });
});

describe('the check planner', () => {
  const node = (peerId: string, start: number, end: number, format: 'f32' | 'q4' = 'f32'): PlannerNode => ({ peerId, publicKey: 'k'.repeat(43), model: 'm', format, backend: 'onnxruntime-node', serving: { start, end } });
  const nodes = [node('head', 0, 3), node('hop', 3, 6), node('a', 3, 6), node('b', 2, 6), node('c', 0, 6), node('q', 3, 6, 'q4'), node('short', 4, 6)];
  const deps = (trust: TrustBook) => ({ nodes: () => nodes, node: (p: string) => nodes.find((n) => n.peerId === p), trust, random: () => 0.5, now: () => 0 });

  it('names holders of the whole span, never the node itself nor a node on the route, same format first', () => {
    const trust = new TrustBook({ now: () => 0, random: () => 0.5 });
    const plan = planChecks(deps(trust), { model: 'm', generation: 'g-0', head: 'head', spans: [{ peer: 'head', start: 0, end: 3 }, { peer: 'hop', start: 3, end: 6 }] })!;
    const forHop = plan.checks.find((c) => c.peer.peer_id === 'hop')!;
    const ids = forHop.checkers.map((c) => c.peer_id);
    expect(ids).not.toContain('hop');
    expect(ids).not.toContain('head');
    expect(ids).not.toContain('short'); // holds only [4, 6)
    expect(new Set(ids.slice(0, 3))).toEqual(new Set(['a', 'b', 'c'])); // the f32 holders before the 4-bit one
    // The head's own span: only `c` holds [0, 3) off the route.
    expect(plan.checks.find((c) => c.peer.peer_id === 'head')!.checkers.map((c) => c.peer_id)).toEqual(['c']);
  });

  it('leaves quarantined nodes out as checkers, and plans nothing for a proven node the draw skips (unless forced)', () => {
    const trust = new TrustBook({ now: () => 0, random: () => 0.5 });
    trust.offence(offence('a'));
    for (let i = 0; i < 100; i++) trust.pass('hop');
    const spans = [{ peer: 'head', start: 0, end: 3 }, { peer: 'hop', start: 3, end: 6 }];
    const plan = planChecks(deps(trust), { model: 'm', generation: 'g-0', head: 'head', spans })!;
    expect(plan.checks.map((c) => c.peer.peer_id)).toEqual(['head']); // hop: 2 % odds, the draw (0.5) skips it
    const forced = planChecks(deps(trust), { model: 'm', generation: 'g-0', head: 'head', spans, force: true })!;
    expect(forced.checks.find((c) => c.peer.peer_id === 'hop')!.checkers.map((c) => c.peer_id)).not.toContain('a');
  });
});
