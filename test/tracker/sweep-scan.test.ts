/**
 * The sweep's scan over every node (sweep.ts, node-shares.ts `current`):
 * with nobody quarantined it reads no clock and no quarantine per node,
 * and a quarantine begun, ended or learned from another tracker still
 * takes the node's share out of the sums (and puts it back) at the next
 * sweep, as the per-node lookups did. A follower's sweep (no decisions)
 * skips the scan when no share can have gone stale since its last one,
 * and still scans when a drain cover ends or a quarantine begins or ends;
 * a leader's always scans (for silent nodes).
 */
import { afterEach, describe, expect, it, vi } from 'vitest';
import { NodeShares } from '../../src/tracker/node-shares.ts';
import { TrustBook } from '../../src/tracker/verify/trust.ts';
import { FakeNode, makeTracker, type TestTracker } from '../helpers/tracker.ts';

async function serving(t: TestTracker, start: number, end: number): Promise<FakeNode> {
  const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1);
  n.serving = { start_layer: start, end_layer: end };
  await n.register(t);
  return n;
}

/** Who the availability map (the placement sums) counts as serving layer 0. */
const onLayer0 = (t: TestTracker) => new Set(t.registry.availability('small').layers[0]!.nodes);

describe('the sweep scan', () => {
  it('asks whether anyone is excluded once, not per node, and only a quarantine in force says yes', async () => {
    const t = await makeTracker();
    const a = await serving(t, 0, 12);
    await serving(t, 0, 12);
    expect(t.registry.anyExcluded()).toBe(false);
    let asked = 0;
    const excluded = t.registry.excluded;
    t.registry.excluded = (peer) => {
      asked++;
      return excluded(peer);
    };
    t.sweep();
    expect(asked).toBe(0);
    t.registry.quarantine(a.peerId, t.clock.now + 60_000);
    expect(t.registry.anyExcluded()).toBe(true);
    t.sweep();
    expect(asked).toBeGreaterThan(0);
    t.clock.now += 60_001;
    expect(t.registry.anyExcluded()).toBe(false);
  });

  it('a quarantine (another tracker’s, through the registry) leaves the sums at the next sweep and rejoins them when it ends', async () => {
    const t = await makeTracker({ deadAfterMissedHeartbeats: 1000 });
    const a = await serving(t, 0, 12);
    const b = await serving(t, 0, 12);
    expect(onLayer0(t)).toEqual(new Set([a.peerId, b.peerId]));
    t.registry.quarantine(b.peerId, t.clock.now + 30_000);
    t.sweep();
    expect(onLayer0(t)).toEqual(new Set([a.peerId]));
    t.clock.now += 30_001;
    // Nobody is quarantined now: the scan takes its short path, and still finds b's share stale.
    expect(t.registry.anyExcluded()).toBe(false);
    t.sweep();
    expect(onLayer0(t)).toEqual(new Set([a.peerId, b.peerId]));
  });

  it('a quarantine judged here (the trust book) does the same', async () => {
    const t = await makeTracker({ deadAfterMissedHeartbeats: 1000 });
    const a = await serving(t, 0, 12);
    const b = await serving(t, 0, 12);
    const book = t.verification.trust;
    book.offence({ peer: b.peerId, role: 'hop', model: 'small', start_layer: 0, end_layer: 12, generation: 'g', session: 'g.1', kind: 'rows', rows: 1, steps: 1, threshold: 0.003, claim: { peer: b.peerId, attestation: 'x' }, checker: { peer: a.peerId, attestation: 'y', distance: 0.1 }, reported_by: a.peerId });
    expect(t.verification.anyExcluded()).toBe(true);
    t.sweep();
    expect(onLayer0(t)).toEqual(new Set([a.peerId]));
    t.clock.now += 16 * 60_000; // past the first offence's 15 min
    expect(t.verification.anyExcluded()).toBe(false);
    t.sweep();
    expect(onLayer0(t)).toEqual(new Set([a.peerId, b.peerId]));
  });
});

/** How many nodes the sweeps in `f` asked `current` of. */
function scanned(f: () => void): number {
  const spy = vi.spyOn(NodeShares.prototype, 'current');
  try {
    f();
    return spy.mock.calls.length;
  } finally {
    spy.mockRestore();
  }
}

const follower = (t: TestTracker) => () => void t.registry.sweep({ decide: false });
const leader = (t: TestTracker) => () => void t.registry.sweep({ decide: true });
/** How many nodes the placement sums count as assigned layer 0. */
const assigned0 = (t: TestTracker) => t.registry.placement('small').assigned.count[0];

describe("a follower's sweep", () => {
  afterEach(() => vi.restoreAllMocks());

  it('skips its scan when no share can have gone stale since the last one; a leader always scans', async () => {
    const t = await makeTracker({ deadAfterMissedHeartbeats: 1000 });
    await serving(t, 0, 12);
    await serving(t, 0, 12);
    expect(scanned(follower(t))).toBe(2);
    t.clock.now += 5000;
    expect(scanned(follower(t))).toBe(0);
    expect(scanned(leader(t))).toBe(2);
    t.clock.now += 5000;
    expect(scanned(follower(t))).toBe(0);
  });

  it('still finds a drain past its cover, once', async () => {
    const t = await makeTracker({ heartbeatIntervalMs: 1000, deadAfterMissedHeartbeats: 3 });
    await serving(t, 0, 12);
    const b = await serving(t, 0, 12);
    expect(scanned(follower(t))).toBe(2);
    expect(assigned0(t)).toBe(2);
    t.clock.now += 100;
    expect((await b.post(t, '/api/nodes/heartbeat', t.clock.now, { draining: true })).status).toBe(200);
    // Within its cover the draining node still holds its layers for placement: nothing to find yet.
    t.clock.now += 2000;
    expect(scanned(follower(t))).toBe(0);
    expect(assigned0(t)).toBe(2);
    // Its cover (3 × 1 s) ended: the scan runs and its share leaves the sums.
    t.clock.now += 1000;
    expect(scanned(follower(t))).toBe(2);
    expect(assigned0(t)).toBe(1);
    t.clock.now += 1000;
    expect(scanned(follower(t))).toBe(0);
  });

  it('still finds a quarantine begun and one ended, even one that began and ended between two sweeps', async () => {
    const t = await makeTracker({ deadAfterMissedHeartbeats: 1000 });
    const a = await serving(t, 0, 12);
    const b = await serving(t, 0, 12);
    expect(scanned(follower(t))).toBe(2);
    t.registry.quarantine(b.peerId, t.clock.now + 30_000);
    expect(scanned(follower(t))).toBe(2);
    expect(onLayer0(t)).toEqual(new Set([a.peerId]));
    t.clock.now += 30_001;
    expect(scanned(follower(t))).toBe(2);
    expect(onLayer0(t)).toEqual(new Set([a.peerId, b.peerId]));
    t.clock.now += 5000;
    expect(scanned(follower(t))).toBe(0);
    // Begun and ended between two sweeps, with a beat of b's in it (its share then left the sums).
    t.registry.quarantine(b.peerId, t.clock.now + 1000);
    await b.heartbeat(t);
    expect(onLayer0(t)).toEqual(new Set([a.peerId]));
    t.clock.now += 5000;
    expect(scanned(follower(t))).toBe(2);
    expect(onLayer0(t)).toEqual(new Set([a.peerId, b.peerId]));
    expect(scanned(follower(t))).toBe(0);
  });
});

describe('TrustBook.anyQuarantined', () => {
  it('is true from an offence until its quarantine ends', () => {
    const clock = { now: 1000 };
    const book = new TrustBook({ now: () => clock.now, random: () => 0.5, quarantineMs: 100 });
    expect(book.anyQuarantined()).toBe(false);
    book.offence({ peer: 'p', role: 'hop', model: 'm', start_layer: 0, end_layer: 2, generation: 'g', session: 'g.1', kind: 'rows', rows: 1, steps: 1, threshold: 0.003, claim: { peer: 'p', attestation: 'x' }, checker: { peer: 'c', attestation: 'y', distance: 0.1 }, reported_by: 'h' });
    expect(book.anyQuarantined()).toBe(true);
    expect(book.quarantined('p')).toBe(true);
    clock.now += 100;
    expect(book.anyQuarantined()).toBe(false);
    expect(book.quarantined('p')).toBe(false);
  });
});
