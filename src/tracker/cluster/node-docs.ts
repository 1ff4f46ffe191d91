/**
 * The nodes' documents in the cluster's bucket (cluster/doc.ts), as this
 * tracker reads and writes them: each stored document with its revision,
 * applied to the registry as it comes (store.ts's watch); every write a
 * compare-and-swap on that revision (a lost race reads the winner and
 * builds on it); the writes the registry's changes call for, batched, and
 * kept while NATS is away; the tombstones of nodes in their rejoin grace;
 * the check counters every tracker's judgements add up in.
 */
import type { KV, KvEntry } from '@nats-io/kv';
import type { TrackerMetrics } from '../metrics.ts';
import { sameSpan } from '../node-record.ts';
import type { ChangeKind, NodeRecord, NodeRegistry } from '../registry.ts';
import { applyOutcome, type TrustCounters, type TrustOutcome } from '../verify/trust.ts';
import { isConflict } from './conflict.ts';
import { beatNeedsWrite, keys, nodeDocOf, remoteOf, type NodeDoc } from './doc.ts';
import { StoredDoc } from './stored-doc.ts';

export interface NodeDocsInit {
  kv: () => KV;
  me: string;
  connected: () => boolean;
  registry: NodeRegistry;
  writes: TrackerMetrics['clusterWrites'];
  heartbeatIntervalMs: number;
  docRefreshMs: number;
  now: () => number;
  /** A node document read from the bucket, validated (undefined: malformed, counted). */
  parse: (e: KvEntry) => NodeDoc | undefined;
  /** Count and log a document dropped as malformed. */
  dropped: (kind: string, why: string) => void;
  /** A heartbeat arrived here: its node goes into the next `seen` batch. */
  heard: (peerId: string) => void;
}

export class NodeDocs {
  /**
   * Stored node documents with their revisions (what a CAS write builds on), keyed by the records' own peer id
   * strings: a key cut from the KV entry's would keep that whole string alive beside it.
   */
  private readonly nodes = new Map<string, StoredDoc>();
  /** The ids of the trackers that wrote documents, each kept once (stored-doc.ts). */
  private readonly writers = new Map<string, string>();
  /**
   * The stored documents that are tombstones, with when their grace ends: the leader's burial looks only at
   * these (a scan of every document twice a second was 9 % of a 10,000-node leader's busy thread).
   */
  private readonly tombstones = new Map<string, number>();
  /** Node documents to write (by peer id) and why. */
  private readonly pending = new Map<string, ChangeKind | 'remove'>();
  private readonly trustOps = new Map<string, Promise<void>>();
  private flushing = false;
  private trustSink: ((peerId: string, counters: TrustCounters) => void) | undefined;

  constructor(private readonly init: NodeDocsInit) {}

  /** Check counters stored by the cluster for a node go to `sink` (the verification service: app.ts), those read at start first. */
  set onTrust(sink: ((peerId: string, counters: TrustCounters) => void) | undefined) {
    this.trustSink = sink;
    if (sink) for (const [peer, stored] of this.nodes) if (stored.trust) sink(peer, stored.trust);
  }

  get onTrust(): ((peerId: string, counters: TrustCounters) => void) | undefined {
    return this.trustSink;
  }

  /** Documents stored, and writes waiting for NATS. */
  get size(): number {
    return this.nodes.size;
  }

  get pendingWrites(): number {
    return this.pending.size;
  }

  /** `node.<id>` changed in the bucket: our copy and the registry take it. `snapshot`: read at (re)start. */
  entry(e: KvEntry, id: string, snapshot: boolean): void {
    const del = e.operation !== 'PUT';
    const had = this.nodes.get(id);
    if (had && had.rev >= e.revision) return; // our own write, already applied
    if (del) {
      this.forgetDoc(id);
      this.init.registry.removeRemote(id);
      return;
    }
    const doc = this.init.parse(e);
    if (!doc || doc.peer_id !== id) {
      if (doc) this.init.dropped('node', `${e.key}: names peer ${doc.peer_id}`);
      return;
    }
    const stored = this.keep(id, doc, e.revision);
    if (stored.vacated_until !== undefined) {
      // Dropped for silence by the leader, in its rejoin grace: gone here too, its span held from moves till then.
      this.init.registry.vacateRemote(remoteOf(stored), stored.vacated_until);
      if (stored.trust) this.onTrust?.(id, stored.trust);
      return;
    }
    // What the document says the same as the record keeps the record's objects (the copy shares them).
    const r = remoteOf(stored);
    // A tracker (re)starting: everything stored counts as just seen, until the batches tell it otherwise.
    if (snapshot) r.lastSeen = Math.max(r.lastSeen, this.init.now());
    this.init.registry.applyRemote(r);
    if (stored.trust) this.onTrust?.(id, stored.trust);
  }

  /** `doc`, stored at `rev`, becomes our copy; what it says the same as the registry's record (or the last copy) shares their objects. */
  private keep(id: string, doc: NodeDoc, rev: number): StoredDoc {
    const prev = this.nodes.get(id);
    const rec = this.init.registry.nodes.get(id);
    const stored = new StoredDoc(rev, doc, rec?.peerId ?? prev?.peer_id ?? doc.peer_id, rec ?? prev, this.writers);
    this.nodes.set(stored.peer_id, stored);
    if (stored.vacated_until !== undefined) this.tombstones.set(stored.peer_id, stored.vacated_until);
    else this.tombstones.delete(id);
    return stored;
  }

  private forgetDoc(id: string): void {
    this.nodes.delete(id);
    this.tombstones.delete(id);
  }

  /** Tombstones being deleted (by peer id): one delete each at a time. */
  private readonly burying = new Set<string>();

  /** The leader deletes the documents of nodes whose rejoin grace ended (unless rewritten since: then they are back). */
  buryTombstones(now: number): void {
    for (const [id, until] of this.tombstones) {
      if (until > now || this.burying.has(id)) continue;
      const rev = this.nodes.get(id)?.rev;
      if (rev === undefined) continue;
      this.burying.add(id);
      void this.init.kv()
        .delete(keys.node(id), { previousSeq: rev })
        .then(() => {
          if (this.nodes.get(id)?.rev === rev) this.forgetDoc(id);
        })
        .catch(() => undefined)
        .finally(() => this.burying.delete(id));
    }
  }

  /**
   * Write node `peerId`'s document by compare-and-swap: `build` makes the new
   * document from the stored one (undefined when none); null writes nothing.
   * A conflict reads the winner and builds again (a few times).
   */
  private async writeNode(peerId: string, build: (stored: NodeDoc | undefined) => NodeDoc | null, kind: string): Promise<'ok' | 'none' | 'conflict' | 'failed'> {
    const key = keys.node(peerId);
    for (let attempt = 0; attempt < 4; attempt++) {
      const cur = this.nodes.get(peerId);
      const built = build(cur?.doc());
      if (!built) return 'none';
      // A quarantine stored by any tracker stays until it ends, whatever this write is about.
      const quarantined = Math.max(cur?.quarantined_until ?? 0, built.quarantined_until ?? 0);
      let next = quarantined > 0 ? { ...built, quarantined_until: quarantined } : built;
      // So do the check counters: only a judgement (trustOutcome) changes them.
      if (!next.trust && cur?.trust) next = { ...next, trust: cur.trust };
      try {
        const body = JSON.stringify(next);
        const rev = cur ? await this.init.kv().update(key, body, cur.rev) : await this.init.kv().create(key, body);
        const now = this.nodes.get(peerId);
        if (!now || now.rev < rev) {
          this.keep(peerId, next, rev);
          // What we wrote may carry another tracker's decision (a move or a quarantine we had not seen yet): our copy takes it,
          // since the watch will not bring back an older revision than ours.
          const local = this.init.registry.nodes.get(peerId);
          if (local && (!sameSpan(local.assignment, next.assignment) || (next.quarantined_until ?? 0) > (local.quarantinedUntil ?? 0))) this.init.registry.applyRemote(remoteOf(next));
          if (next.trust && next.trust !== cur?.trust) this.onTrust?.(peerId, next.trust);
        }
        this.init.writes.inc({ kind, result: 'ok' });
        return 'ok';
      } catch (e) {
        if (!isConflict(e)) {
          this.init.writes.inc({ kind, result: 'failed' });
          return 'failed';
        }
        this.init.writes.inc({ kind, result: 'conflict' });
        await this.refresh(peerId);
      }
    }
    return 'conflict';
  }

  /** Read a node's stored document again (after a lost CAS) and apply it. */
  private async refresh(peerId: string): Promise<void> {
    const e = await this.init.kv().get(keys.node(peerId)).catch(() => null);
    if (!e || e.operation !== 'PUT') {
      this.forgetDoc(peerId);
      return;
    }
    this.entry(e, peerId, false);
  }

  /**
   * A registration this tracker answers: store it, and answer with what is
   * stored. When another tracker already decided this node's span (the node
   * registered there too, or it was moved), that span wins and our copy takes it.
   */
  async commitRegistration(n: NodeRecord): Promise<void> {
    if (!this.init.connected()) {
      this.pending.set(n.peerId, 'register');
      return;
    }
    const mine = nodeDocOf(n, this.init.me);
    const r = await this.writeNode(
      n.peerId,
      (stored) => {
        // A tombstone's span (a node back within its rejoin grace) is not adopted: the registry placed it as a node back after a drop.
        const same = stored && stored.vacated_until === undefined && stored.info.model === n.info.model && stored.info.memory_budget_mb === n.info.memory_budget_mb && stored.info.weight_format === n.info.weight_format;
        return same && stored.assignment && !n.info.pinned ? { ...mine, assignment: stored.assignment } : mine;
      },
      'register',
    );
    if (r === 'failed') this.pending.set(n.peerId, 'register');
    const stored = this.nodes.get(n.peerId);
    if (stored && !sameSpan(stored.assignment, n.assignment)) this.init.registry.applyRemote(remoteOf(stored));
  }

  /** A change of a record here (registry event): written when it matters to the other trackers. */
  onChanged(n: NodeRecord, kind: ChangeKind): void {
    if (kind === 'register') return; // commitRegistration, awaited by the answer
    if (kind === 'heartbeat') {
      this.init.heard(n.peerId);
      if (!beatNeedsWrite(n, this.nodes.get(n.peerId), this.init.now(), this.init.docRefreshMs)) return;
    }
    this.pending.set(n.peerId, kind);
    this.scheduleFlush();
  }

  /** A node removed here (the leader's sweep): delete its document, unless it was written since (it is alive after all). */
  onRemoved(n: NodeRecord, remote: boolean): void {
    if (remote) return;
    this.pending.set(n.peerId, 'remove');
    this.scheduleFlush();
  }

  private scheduleFlush(): void {
    if (this.flushing) return;
    this.flushing = true;
    setImmediate(() => void this.flush());
  }

  private async flush(): Promise<void> {
    try {
      if (!this.init.connected()) return;
      const batch = [...this.pending];
      this.pending.clear();
      await Promise.all(batch.map(([peer, kind]) => this.writeOne(peer, kind)));
    } finally {
      this.flushing = false;
      if (this.pending.size > 0 && this.init.connected()) this.scheduleFlush();
    }
  }

  private async writeOne(peer: string, kind: ChangeKind | 'remove'): Promise<void> {
    const { registry } = this.init;
    if (kind === 'remove') {
      const cur = this.nodes.get(peer);
      if (!cur) return;
      // Dropped for silence with a rejoin grace: the document stays through it, as a tombstone every tracker (and
      // the next leader) reads; else it goes.
      const until = registry.nodes.has(peer) ? undefined : registry.vacatedUntil(peer);
      try {
        if (until !== undefined) {
          const doc: NodeDoc = { ...cur.doc(), vacated_until: until, by: this.init.me };
          const rev = await this.init.kv().update(keys.node(peer), JSON.stringify(doc), cur.rev);
          if ((this.nodes.get(peer)?.rev ?? 0) < rev) this.keep(peer, doc, rev);
        } else {
          await this.init.kv().delete(keys.node(peer), { previousSeq: cur.rev });
          this.forgetDoc(peer);
        }
        this.init.writes.inc({ kind: 'remove', result: 'ok' });
      } catch (e) {
        if (!isConflict(e)) {
          this.pending.set(peer, 'remove');
          return;
        }
        // Written since we decided: it beat somewhere after all. Take the stored one back.
        this.init.writes.inc({ kind: 'remove', result: 'conflict' });
        await this.refresh(peer);
      }
      return;
    }
    const n = registry.nodes.get(peer);
    if (!n) return;
    const mine = nodeDocOf(n, this.init.me);
    const r = await this.writeNode(
      peer,
      (stored) => {
        if (!stored) return mine;
        switch (kind) {
          case 'moved':
          case 'assigned':
            // The leader's decision over what the node last said.
            return { ...stored, assignment: mine.assignment, by: this.init.me };
          case 'busy':
            return { ...stored, busy_until: Math.max(stored.busy_until, mine.busy_until), by: this.init.me };
          case 'quarantined':
            return { ...stored, quarantined_until: Math.max(stored.quarantined_until ?? 0, mine.quarantined_until ?? 0), by: this.init.me };
          default:
            // What the node says over the stored; the span it was given stays the stored one.
            return { ...mine, assignment: stored.assignment, busy_until: Math.max(stored.busy_until, mine.busy_until), last_seen: Math.max(stored.last_seen, mine.last_seen) };
        }
      },
      kind,
    );
    if (r === 'failed') this.pending.set(peer, kind);
    // A move that lost its race: our copy takes the stored span (refresh applied it); the leader decides again next sweep.
  }

  /**
   * A judgement of this tracker: applied to the counters stored for the node (every tracker's judgements
   * add up there, by compare-and-swap). `local` is our own count, the start when none is stored yet (the
   * node re-registered, or judged before the cluster stored it). Not queued while NATS is away: the
   * counters only set how often a node is checked, and the next judgement writes them again.
   */
  trustOutcome(peerId: string, outcome: TrustOutcome, local: TrustCounters): void {
    if (!this.init.connected()) return;
    // One node's judgements in order: concurrent writes of one tracker would only lose compare-and-swaps to each other.
    const prev = this.trustOps.get(peerId) ?? Promise.resolve();
    const next = prev
      .then(() => this.writeNode(peerId, (stored) => (stored ? { ...stored, trust: stored.trust ? applyOutcome(stored.trust, outcome) : local, by: this.init.me } : null), 'trust'))
      .then(
        () => {},
        () => {},
      );
    this.trustOps.set(peerId, next);
    void next.then(() => {
      if (this.trustOps.get(peerId) === next) this.trustOps.delete(peerId);
    });
  }

  /** NATS is back: write what waited. */
  flushPending(): void {
    if (this.pending.size > 0) this.scheduleFlush();
  }

  /** The bucket was lost and opened again: nothing is stored, as far as we know. */
  forget(): void {
    this.nodes.clear();
    this.tombstones.clear();
  }

  /** Write back the nodes this tracker heard from within their deadline (the bucket was lost). */
  async rebuild(): Promise<void> {
    const now = this.init.now();
    for (const n of this.init.registry.nodes.values()) {
      const deadline = 3 * Math.max(n.intervalMs, this.init.heartbeatIntervalMs);
      if (now - n.lastSeen > deadline) continue;
      const mine = nodeDocOf(n, this.init.me);
      await this.writeNode(n.peerId, (stored) => (stored ? null : mine), 'rebuild');
    }
  }
}
