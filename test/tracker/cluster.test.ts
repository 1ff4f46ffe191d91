/**
 * Trackers as replicas of one cluster, on a real nats-server (JetStream KV):
 * in-process trackers (startTracker with --nats), nodes as signed fake
 * nodes over HTTP. Any tracker answers any node; two trackers racing on one
 * node's span cannot both win; one leader removes and moves nodes, and
 * another takes over when it goes; liveness heard by one tracker holds at
 * the leader; malformed cluster documents are dropped and counted; NATS
 * lost: trackers keep serving from their copy and catch up; the bucket
 * lost: rebuilt from what the trackers know.
 */
import { Kvm } from '@nats-io/kv';
import { describe, expect, it } from 'vitest';
import { connectNats, type NatsHandle } from '../../src/cluster/nats.ts';
import { trackerSubjects } from '../../src/cluster/subjects.ts';
import { startRelayProcess } from '../helpers/relay-process.ts';
import type { RunningTracker } from '../../src/tracker/server.ts';
import { Identity } from '../../src/net/identity.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import { signBody } from '../../src/tracker/signing.ts';
import { signPlan } from '../../src/tracker/verify/planner.ts';
import type { CheckPlan } from '../../src/verify/plan.ts';
import { FakeNode } from '../helpers/tracker.ts';
import { asTest, mb, span, trackerCluster, until } from '../helpers/tracker-cluster.ts';

const c = trackerCluster();
const tracker = c.tracker;

describe('trackers as replicas of one registry (NATS JetStream KV)', () => {
  it('any tracker answers a node registered at another, with the same span; the cluster\'s keys come with every answer', async () => {
    const name = c.name();
    const [a, b] = [await tracker(name), await tracker(name)];
    const n = await FakeNode.create({ memory_budget_mb: mb });
    const reg = await n.register(asTest(a), { load: true });
    expect(reg.assignment).not.toBeNull();
    await until(() => b.registry.nodes.get(n.peerId), 5000, 'the node at the second tracker');
    const beat = await n.heartbeat(asTest(b));
    expect(span(beat)).toBe(span(reg));
    // Each answer names its tracker and lists every tracker's key.
    expect(beat.tracker_peer_id).toBe(b.identity.peerId);
    await until(async () => ((await n.heartbeat(asTest(b))).tracker_keys ?? []).length === 2, 5000, 'both keys listed');
    const keys = (await n.heartbeat(asTest(a))).tracker_keys!.map((k) => k.public_key).sort();
    expect(keys).toEqual([a.publicKey, b.publicKey].sort());
    // The served span reported to b reaches a's copy (it changed what routing reads).
    await until(() => a.registry.status(a.registry.nodes.get(n.peerId)!) === 'serving', 5000, 'serving at the first tracker');
  });

  it('two trackers racing on one node\'s span cannot both win: both answer the span stored first', async () => {
    const name = c.name();
    const [a, b] = [await tracker(name), await tracker(name)];
    // Make the two copies disagree on where a new node should go: nodes only a's copy holds (never stored).
    for (let i = 0; i < 3; i++) {
      const f = await FakeNode.create({ memory_budget_mb: mb });
      f.serving = { start_layer: 0, end_layer: 4 };
      a.registry.register(f.message(Date.now()));
    }
    const viewA = a.registry.placement('small').assigned.count.join();
    const viewB = b.registry.placement('small').assigned.count.join();
    expect(viewA).not.toBe(viewB);
    for (let round = 0; round < 4; round++) {
      const n = await FakeNode.create({ memory_budget_mb: mb });
      const [ra, rb] = await Promise.all([n.register(asTest(a)), n.register(asTest(b))]);
      expect(span(ra)).toBe(span(rb));
      await until(() => a.registry.nodes.get(n.peerId) && b.registry.nodes.get(n.peerId), 5000, 'the node at both trackers');
      const sa = a.registry.nodes.get(n.peerId)!.assignment;
      const sb = b.registry.nodes.get(n.peerId)!.assignment;
      expect(sa).toEqual(sb);
      expect(`${sa!.start}-${sa!.end}`).toBe(span(ra));
    }
  });

  it('decides a race deterministically: both trackers decided a span for one node at once, one store wins, both copies take it', async () => {
    const name = c.name();
    const [a, b] = [await tracker(name), await tracker(name)];
    for (let i = 0; i < 3; i++) {
      const f = await FakeNode.create({ memory_budget_mb: mb });
      f.serving = { start_layer: 0, end_layer: 4 };
      a.registry.register(f.message(Date.now()));
    }
    const n = await FakeNode.create({ memory_budget_mb: mb });
    // Both decide in the same tick, neither has seen the other's write: their choices differ.
    const ra = a.registry.register(n.message(Date.now()));
    const rb = b.registry.register(n.message(Date.now()));
    const chose = [`${ra.assignment!.start}-${ra.assignment!.end}`, `${rb.assignment!.start}-${rb.assignment!.end}`];
    expect(chose[0]).not.toBe(chose[1]);
    // What each tracker answers the node: its copy as its own write returns.
    const answer = (t: RunningTracker) => () => `${t.registry.nodes.get(n.peerId)!.assignment!.start}-${t.registry.nodes.get(n.peerId)!.assignment!.end}`;
    const after = await Promise.all([a.cluster!.commitRegistration(ra).then(answer(a)), b.cluster!.commitRegistration(rb).then(answer(b))]);
    expect(after[0]).toBe(after[1]);
    expect(chose).toContain(after[0]);
    const conflicts = async (t: RunningTracker) => Number(/meshnet_tracker_cluster_writes_total\{kind="register",result="conflict"\} (\d+)/.exec(await (await fetch(`${t.url}/metrics`)).text())?.[1] ?? 0);
    expect((await conflicts(a)) + (await conflicts(b))).toBe(1);
    // The store holds the winner.
    const h = await connectNats({ servers: c.nats().url, name: 'check' });
    try {
      const e = await (await new Kvm(h.nc).open(trackerSubjects(name).registryBucket)).get(`node.${n.peerId}`);
      const doc = e!.json<{ assignment: { start: number; end: number } }>();
      expect(`${doc.assignment.start}-${doc.assignment.end}`).toBe(after[0]);
    } finally {
      await h.close();
    }
  });

  it('names a tracker on the node\'s own relay for its beats, so they never cross between relays', async () => {
    const name = c.name();
    const [r1, r2] = [await startRelayProcess(), await startRelayProcess()];
    try {
      const [a, b] = [await tracker(name, { relayUrl: r1.url }), await tracker(name, { relayUrl: r2.url })];
      await until(() => a.cluster!.trackerKeys().length === 2 && b.cluster!.trackerKeys().length === 2, 5000, 'both trackers known');
      await until(async () => {
        const n = await FakeNode.create({ memory_budget_mb: mb });
        n.relayAddr = `${r2.url}/rpc/${n.peerId}`;
        const onR2 = await n.register(asTest(a));
        const m = await FakeNode.create({ memory_budget_mb: mb });
        m.relayAddr = `${r1.url}/rpc/${m.peerId}`;
        const onR1 = await m.register(asTest(b));
        return onR2.tracker_peer_id === b.identity.peerId && onR1.tracker_peer_id === a.identity.peerId;
      }, 8000, 'beats sent to the tracker of the node\'s relay');
      // A node with no relay (or a relay no tracker is on) beats to whoever answered.
      const n = await FakeNode.create({ memory_budget_mb: mb });
      expect((await n.register(asTest(a))).tracker_peer_id).toBe(a.identity.peerId);
    } finally {
      await r1.stop();
      await r2.stop();
    }
  });

  it('a quarantine judged at one tracker is routed around by every tracker and outlives a re-registration; a check plan one tracker signed is taken by another', async () => {
    const name = c.name();
    const [a, b] = [await tracker(name), await tracker(name)];
    const nodes: FakeNode[] = [];
    for (const [from, to] of [[0, 4], [4, 8], [4, 8], [8, 12]] as const) {
      const n = await FakeNode.create({ pinned: true });
      n.serving = { start_layer: from, end_layer: to };
      await n.register(asTest(a));
      nodes.push(n);
    }
    const [h, x, y] = nodes as [FakeNode, FakeNode, FakeNode];
    await until(() => nodes.every((n) => b.registry.status(b.registry.nodes.get(n.peerId) ?? ({} as never)) === 'serving'), 5000, 'every node serving at the second tracker');
    const routedAt = (t: RunningTracker) => {
      const seen = new Set<string>();
      for (let i = 0; i < 40; i++) for (const hop of t.registry.pick('small').hops) seen.add(hop.id);
      return seen;
    };
    expect(routedAt(b).has(x.peerId)).toBe(true);
    // The first tracker judges x wrong (as a report's verdict does): the second routes around it at once it hears.
    const off = a.verification.trust.offence({ peer: x.peerId, role: 'hop', model: 'small', start_layer: 4, end_layer: 8, generation: 'g-0', session: 'g-0.x', kind: 'rows', rows: 4, steps: 2, threshold: 0.003, claim: { peer: x.peerId, attestation: 'a' }, checker: { peer: y.peerId, attestation: 'b', distance: 0.1 }, reported_by: h.peerId });
    await until(() => b.verification.excluded(x.peerId), 5000, 'the quarantine at the second tracker');
    expect(routedAt(b).has(x.peerId)).toBe(false);
    expect((await h.heartbeat(asTest(b))).distrust).toEqual([{ peer_id: x.peerId, until: off.until }]);
    // A heartbeat of x's own, written by the second tracker, keeps the quarantine in the shared document.
    await x.heartbeat(asTest(b));
    await x.register(asTest(b));
    const c2 = await tracker(name);
    await until(() => c2.registry.nodes.get(x.peerId), 5000, 'x at a third tracker');
    expect(c2.verification.excluded(x.peerId)).toBe(true);
    expect(routedAt(c2).has(x.peerId)).toBe(false);
    // A planned check the head could not run, reported to the tracker that did not plan it: taken (the plan is
    // signed by a tracker of the cluster); a plan signed by a key outside the cluster is refused.
    const peer = (n: FakeNode) => ({ peer_id: n.peerId, public_key: encodeBase64Url(n.identity.publicKey), format: 'f32' as const, backend: 'onnxruntime-node' });
    const plan: CheckPlan = { head: h.peerId, model: 'small', generation: 'req-0', expires_at: Date.now() + 60_000, checks: [{ peer: peer(y), start_layer: 4, end_layer: 8, checkers: [peer(x)] }] };
    const skipped = async (signer: Identity) => {
      const signed = await signPlan(signer, plan);
      const body = { head: h.peerId, timestamp: Date.now(), plan: signed.text, plan_signature: signed.signature, session: 'req-0.abc', peer_id: y.peerId, start_layer: 4, end_layer: 8, reason: 'refused' as const, why: 'it gave no attestation' };
      return b.app.request('/api/checks/skipped', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(await signBody(h.identity, body)) });
    };
    expect((await skipped(a.identity)).status).toBe(200);
    expect(b.verification.trust.peek(y.peerId)?.refusals).toBe(1);
    expect((await skipped(await Identity.generate())).status).toBe(401);
  });

  it('a node\'s check counters are the cluster\'s: proven at one tracker, not new at another; judgements at two trackers at once all count', async () => {
    const name = c.name();
    const [a, b] = [await tracker(name), await tracker(name)];
    const x = await FakeNode.create({ pinned: true });
    x.serving = { start_layer: 0, end_layer: 12 };
    await x.register(asTest(a));
    await until(() => b.registry.nodes.get(x.peerId), 5000, 'x at the second tracker');
    expect(b.verification.trust.checkProbability(x.peerId)).toBe(1);
    // Ten passes judged at the first tracker: the second samples x as a proven node.
    for (let i = 0; i < 10; i++) a.verification.trust.pass(x.peerId);
    await until(() => b.verification.trust.peek(x.peerId)?.consecutive === 10, 5000, 'ten passes at the second tracker');
    expect(b.verification.trust.checkProbability(x.peerId)).toBeCloseTo(0.1);
    // Both judge at once: every judgement counts at both.
    for (let i = 0; i < 3; i++) {
      a.verification.trust.pass(x.peerId);
      b.verification.trust.pass(x.peerId);
    }
    const both = (n: number) => () => a.verification.trust.peek(x.peerId)?.passes === n && b.verification.trust.peek(x.peerId)?.passes === n;
    await until(both(16), 5000, 'sixteen passes at both');
    // An inconclusive check at the second tracker forces x's next session at the first.
    b.verification.trust.inconclusive(x.peerId);
    await until(() => a.verification.trust.checkProbability(x.peerId) === 1, 5000, 'a forced check at the first tracker');
    a.verification.trust.pass(x.peerId);
    await until(() => b.verification.trust.peek(x.peerId)?.forceNext === false && b.verification.trust.peek(x.peerId)?.consecutive === 17, 5000, 'the forced check passed');
    // A heartbeat written by either tracker keeps the counters; a tracker started later reads them.
    await x.heartbeat(asTest(b));
    const c2 = await tracker(name);
    await until(() => c2.verification.trust.peek(x.peerId)?.passes === 17, 5000, 'the counters at a third tracker');
    expect(c2.verification.trust.peek(x.peerId)).toMatchObject({ consecutive: 17, checks: 18, inconclusive: 1, offences: 0 });
  });

  it('drops and counts malformed cluster documents and batches; keeps serving', async () => {
    const name = c.name();
    const a = await tracker(name);
    const h: NatsHandle = await connectNats({ servers: c.nats().url, name: 'vandal' });
    try {
      const kv = await new Kvm(h.nc).open(trackerSubjects(name).registryBucket);
      await kv.put(`node.${'a'.repeat(32)}`, 'not json');
      await kv.put(`node.${'b'.repeat(32)}`, JSON.stringify({ v: 1, peer_id: 'b'.repeat(32) }));
      await kv.put('route.x', JSON.stringify({ v: 2 }));
      await kv.put('weird.key', '{}');
      h.nc.publish(trackerSubjects(name).seen, 'garbage');
      h.nc.publish(trackerSubjects(name).seen, JSON.stringify({ v: 1, by: 'nope', ids: [1] }));
      await until(() => a.cluster!.dropped >= 6, 5000, 'six drops');
      const metrics = await (await fetch(`${a.url}/metrics`)).text();
      expect(metrics).toMatch(/meshnet_tracker_cluster_dropped_total\{kind="node"\} 2/);
      expect(a.registry.nodes.size).toBe(0);
      const n = await FakeNode.create({ memory_budget_mb: mb });
      expect((await n.register(asTest(a))).assignment).not.toBeNull();
    } finally {
      await h.close();
    }
  });
});

describe('meshnet tracker --nats', () => {
  it('fails at start with one line naming the NATS URL when no server answers, and exits non-zero', async () => {
    const { spawnSync } = await import('node:child_process');
    const { fileURLToPath } = await import('node:url');
    const bin = fileURLToPath(new URL('../../bin/meshnet.js', import.meta.url));
    const r = spawnSync(process.execPath, [bin, 'tracker', '--port', '0', '--model', 'x=http://127.0.0.1:9/m', '--nats', 'nats://127.0.0.1:9,nats://127.0.0.1:10'], { encoding: 'utf8', timeout: 60_000 });
    expect(r.status).toBe(1);
    const lines = r.stderr.trim().split('\n');
    expect(lines).toHaveLength(1);
    expect(lines[0]).toMatch(/^meshnet tracker: cannot reach NATS at nats:\/\/127\.0\.0\.1:9, nats:\/\/127\.0\.0\.1:10/);
    const bad = spawnSync(process.execPath, [bin, 'tracker', '--port', '0', '--model', 'x=http://127.0.0.1:9/m', '--nats', 'http://nope', '--cluster', 'a b'], { encoding: 'utf8', timeout: 60_000 });
    expect(bad.status).toBe(1);
    expect(bad.stderr.trim().split('\n')).toHaveLength(1);
  }, 90_000);
});
