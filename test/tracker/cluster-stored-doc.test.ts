/**
 * What a cluster tracker keeps of each node's stored document
 * (cluster/stored-doc.ts) over an in-memory bucket: a write that lost its
 * compare-and-swap builds on the winner (its check counters, its quarantine,
 * fields this version does not know); check counters read from the bucket
 * reach the verification service; a document that says the same as the
 * record keeps the record's objects.
 */
import type { KV, KvEntry } from '@nats-io/kv';
import { describe, expect, it } from 'vitest';
import { nodeDocOf, nodeDocSchema, type NodeDoc } from '../../src/tracker/cluster/doc.ts';
import { NodeDocs } from '../../src/tracker/cluster/node-docs.ts';
import { StoredDoc } from '../../src/tracker/cluster/stored-doc.ts';
import type { TrackerMetrics } from '../../src/tracker/metrics.ts';
import type { TrustCounters } from '../../src/tracker/verify/trust.ts';
import { FakeNode, makeTracker } from '../helpers/tracker.ts';

/** A bucket of one history: revisions, compare-and-swap, the error JetStream gives a lost one. */
class MemoryKv {
  rev = 0;
  readonly values = new Map<string, { body: string; rev: number }>();

  entry(key: string): KvEntry {
    const v = this.values.get(key)!;
    return { key, revision: v.rev, operation: 'PUT', json: () => JSON.parse(v.body), string: () => v.body } as unknown as KvEntry;
  }

  put(key: string, body: string): number {
    this.values.set(key, { body, rev: ++this.rev });
    return this.rev;
  }

  asKv(): KV {
    const lost = () => Object.assign(new Error('wrong last sequence'), { code: 10071 });
    return {
      create: async (key: string, body: string) => {
        if (this.values.has(key)) throw lost();
        return this.put(key, body);
      },
      update: async (key: string, body: string, rev: number) => {
        if (this.values.get(key)?.rev !== rev) throw lost();
        return this.put(key, body);
      },
      get: async (key: string) => (this.values.has(key) ? this.entry(key) : null),
      delete: async (key: string) => void this.values.delete(key),
    } as unknown as KV;
  }
}

const TRUST: TrustCounters = { consecutive: 4, checks: 9, passes: 8, offences: 0, inconclusive: 1, refusals: 0, force_next: false };

async function setup() {
  const t = await makeTracker();
  const kv = new MemoryKv();
  const judged: Array<[string, TrustCounters]> = [];
  const docs = new NodeDocs({
    kv: () => kv.asKv(),
    me: 'a'.repeat(32),
    connected: () => true,
    registry: t.registry,
    writes: { inc: () => {} } as unknown as TrackerMetrics['clusterWrites'],
    heartbeatIntervalMs: 5000,
    docRefreshMs: 1_800_000,
    now: () => t.clock.now,
    parse: (e) => nodeDocSchema.parse(e.json()),
    dropped: () => {},
    heard: () => {},
  });
  docs.onTrust = (peer, c) => judged.push([peer, c]);
  const n = await FakeNode.create({ memory_budget_mb: 64 });
  await n.join(t);
  const rec = t.registry.nodes.get(n.peerId)!;
  await docs.commitRegistration(rec);
  return { t, kv, docs, judged, n, rec, key: `node.${n.peerId}` };
}

const flushed = () => new Promise((r) => setImmediate(() => setImmediate(r)));

describe('the stored copy of a node document', () => {
  it('a write that lost its compare-and-swap builds on the winner: its counters, quarantine and unknown fields stay', async () => {
    const { kv, docs, judged, rec, key, t } = await setup();
    expect(kv.values.get(key)!.rev).toBe(1);
    // Another tracker wrote meanwhile; this one has not seen it (no watch here).
    const winner = { ...(JSON.parse(kv.values.get(key)!.body) as NodeDoc), trust: TRUST, quarantined_until: t.clock.now + 60_000, future_field: { x: [1, 2] }, by: 'b'.repeat(32) };
    kv.put(key, JSON.stringify(winner));
    rec.busyUntil = t.clock.now + 5000;
    docs.onChanged(rec, 'busy');
    await flushed();
    await until(() => kv.values.get(key)!.rev === 3);
    const stored = JSON.parse(kv.values.get(key)!.body) as NodeDoc;
    expect(stored.busy_until).toBe(t.clock.now + 5000);
    expect(stored.trust).toEqual(TRUST);
    expect(stored.quarantined_until).toBe(t.clock.now + 60_000);
    expect(stored.future_field).toEqual({ x: [1, 2] });
    expect(stored.by).toBe('a'.repeat(32));
    // The counters read from the winner reached the verification service, and a new listener hears them at once.
    expect(judged).toEqual([[rec.peerId, TRUST]]);
    const later: string[] = [];
    docs.onTrust = (peer) => later.push(peer);
    expect(later).toEqual([rec.peerId]);
  });

  it('gives back the document as stored; one that says the same as the record keeps the record\'s objects', async () => {
    const { kv, docs, rec, key, t } = await setup();
    const doc = { ...nodeDocOf(rec, 'c'.repeat(32)), draining: false, extra_one: 'kept' } as NodeDoc;
    const parsed = nodeDocSchema.parse(JSON.parse(JSON.stringify(doc)));
    const s = new StoredDoc(7, parsed, rec.peerId, rec, new Map());
    expect(JSON.parse(JSON.stringify(s.doc()))).toEqual(JSON.parse(JSON.stringify(doc)));
    expect(s.info).toBe(rec.info);
    expect(s.assignment).toBe(rec.assignment);

    // Through the bucket: another tracker's rewrite with equal info leaves the record's info object in place.
    const info = rec.info;
    const rev = kv.put(key, JSON.stringify({ ...doc, last_seen: t.clock.now + 1000 }));
    docs.entry(kv.entry(key), rec.peerId, false);
    expect(t.registry.nodes.get(rec.peerId)!.info).toBe(info);
    expect(kv.values.get(key)!.rev).toBe(rev);
  });
});

async function until(ok: () => boolean): Promise<void> {
  for (let i = 0; i < 100 && !ok(); i++) await new Promise((r) => setTimeout(r, 5));
  expect(ok()).toBe(true);
}
