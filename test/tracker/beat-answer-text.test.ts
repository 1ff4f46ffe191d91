/**
 * A batch's answers are JSON text built from the parts its beats share
 * (routes/nodes.ts `sharedAnswer`, `answerText`), not objects stringified
 * whole: each must be, character for character, the answer a single relay
 * beat gets (`answerFor`, stringified) — alone and in a cluster, with and
 * without an assignment, with a distrust list, and after the cluster's
 * tracker keys change.
 */
import { describe, expect, it } from 'vitest';
import type { ClusterStore } from '../../src/tracker/cluster/store.ts';
import { FakeNode, makeTracker, type TestTracker } from '../helpers/tracker.ts';

const utf8 = new TextEncoder();
const text = new TextDecoder();

/** The single relay beat's answer text (answerFor), for `n` at the tracker's clock. */
function singleAnswer(t: TestTracker, n: FakeNode): string {
  const r = t.relayBeat(n.peerId, utf8.encode(JSON.stringify(n.message(t.clock.now))));
  expect(r.status).toBe(200);
  return text.decode(r.body as Uint8Array);
}

function batch(t: TestTracker, nodes: FakeNode[], no = 7): { raw: string; answers: Array<{ status: number; body: unknown }> } {
  const raw = t.relayBeats({ type: 'beats', batch: no, beats: nodes.map((n) => ({ from: n.peerId, body: n.message(t.clock.now) })) });
  const msg = JSON.parse(raw) as { type: string; batch: number; answers: Array<{ status: number; body: unknown }> };
  expect(msg.type).toBe('beats-answer');
  expect(msg.batch).toBe(no);
  expect(msg.answers).toHaveLength(nodes.length);
  return { raw, answers: msg.answers };
}

/** A cluster store with what answers read from it (its tracker keys and beat target); the rest does nothing. */
function fakeCluster(keys: () => Array<{ public_key: string; cert?: { operator_key: string; expires_at: number; signature: string } }>, target: string): ClusterStore {
  return {
    trackerKeys: keys,
    beatTarget: () => target,
    onChanged: () => {},
    onRemoved: () => {},
    lateMs: () => 0,
    isLeader: () => true,
    trustOutcome: () => {},
    commitRegistration: () => Promise.resolve(),
  } as unknown as ClusterStore;
}

describe("a batch's answers as text", () => {
  it('are each the single beat\'s answer, character for character; an error touches only its own beat', async () => {
    const t = await makeTracker();
    const a = await FakeNode.create({ memory_budget_mb: 64 });
    const b = await FakeNode.create({ memory_budget_mb: 64 });
    const none = await FakeNode.create({ memory_budget_mb: 5 });
    for (const n of [a, b, none]) await n.register(t, { load: true });
    expect(none.assignment).toBeNull();
    expect(a.assignment).not.toBeNull();
    // A distrust list to carry (checks are on by default).
    t.registry.quarantine(b.peerId, t.clock.now + 60_000);
    const stranger = await FakeNode.create({ memory_budget_mb: 64 });

    t.clock.now += 1000;
    const { raw, answers } = batch(t, [a, stranger, b, none]);
    expect(answers.map((x) => x.status)).toEqual([200, 404, 200, 200]);
    expect((answers[1]!.body as { error: { code: string } }).error.code).toBe('MESH_ERR_NOT_FOUND');
    const first = answers[0]!.body as { distrust?: Array<{ peer_id: string }>; assignment: unknown; tracker_peer_id: string };
    expect(first.distrust?.map((d) => d.peer_id)).toEqual([b.peerId]);
    expect(first.assignment).toEqual(a.assignment);
    expect(first.tracker_peer_id).toBe(t.identity.peerId);
    expect((answers[3]!.body as { assignment: unknown }).assignment).toBeNull();
    for (const n of [a, b, none]) expect(raw).toContain(`{"status":200,"body":${singleAnswer(t, n)}}`);
  });

  it('in a cluster: the tracker keys and the beat target as answerFor has them, and new keys as soon as the list changes', async () => {
    const t = await makeTracker();
    const target = 'ab'.repeat(16);
    let keys = [{ public_key: 'K'.repeat(43) }, { public_key: 'L'.repeat(43), cert: { operator_key: 'O'.repeat(43), expires_at: 1_900_000_000_000, signature: 'S'.repeat(86) } }];
    t.attachCluster(fakeCluster(() => keys, target));
    const a = await FakeNode.create({ memory_budget_mb: 64 });
    await a.register(t, { load: true });

    const one = batch(t, [a]);
    const body = one.answers[0]!.body as { tracker_keys: unknown; tracker_peer_id: string };
    expect(body.tracker_keys).toEqual(keys);
    expect(body.tracker_peer_id).toBe(target);
    expect(one.raw).toContain(singleAnswer(t, a));

    // tracker-peers.ts hands out a new array when a tracker document changes: the next batch says so.
    keys = [{ public_key: 'M'.repeat(43) }];
    t.clock.now += 1000;
    const two = batch(t, [a], 8);
    expect((two.answers[0]!.body as { tracker_keys: unknown }).tracker_keys).toEqual([{ public_key: 'M'.repeat(43) }]);
    expect(two.raw).toContain(singleAnswer(t, a));
  });
});
