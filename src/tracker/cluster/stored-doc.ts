/**
 * What a tracker keeps of one node's document as the cluster's bucket holds
 * it (node-docs.ts): its revision, and every field a compare-and-swap write
 * builds on or a heartbeat's check compares (doc.ts's beatNeedsWrite), in
 * one object of fixed shape.
 *
 * It was the parsed document itself beside its revision: a wrapper, the
 * document with its properties out of line, a fresh copy of the writer's id
 * and a map key that held the KV entry's key string. At 3,000 donors that was
 * 438 B and 8 heap objects per node on each tracker, for the GC to mark on
 * every major collection and to promote on every write. What the registry's
 * record already holds (info, stats, spans, key, addresses) is shared with it,
 * not copied: a document that says the same as the last one keeps the last
 * one's objects. {@link StoredDoc.doc} gives the document back, as JSON would
 * say it, for a write to build on.
 */
import type { Span } from '../assignment.ts';
import { sameData, sameSpan } from '../node-record.ts';
import type { NodeDoc } from './doc.ts';

/** The fields of a node document a stored copy holds by name; anything else one carries stays in `extra`. */
const KNOWN = new Set([
  'v',
  'peer_id',
  'public_key',
  'relay_addr',
  'endpoint',
  'info',
  'stats',
  'assignment',
  'serving',
  'layer_ms_ewma',
  'registered_at',
  'last_seen',
  'interval_ms',
  'busy_until',
  'kv_held_at_beat',
  'draining',
  'draining_since',
  'quarantined_until',
  'vacated_until',
  'trust',
  'by',
]);

/** What a stored copy may share instead of a document's own objects: the previous copy's, or the registry record's. */
export interface ShareFrom {
  info: NodeDoc['info'];
  stats?: NodeDoc['stats'];
  assignment: Span | null;
  serving: Span | null;
}

function shareSpan(s: Span | null, from: ShareFrom | undefined): Span | null {
  if (!s || !from) return s;
  if (sameSpan(from.assignment, s)) return from.assignment;
  return sameSpan(from.serving, s) ? from.serving : s;
}

export class StoredDoc {
  readonly peer_id: string;
  readonly public_key: string;
  readonly relay_addr: string | undefined;
  readonly endpoint: string | undefined;
  readonly info: NodeDoc['info'];
  readonly stats: NodeDoc['stats'];
  readonly assignment: NodeDoc['assignment'];
  readonly serving: NodeDoc['serving'];
  readonly layer_ms_ewma: number | undefined;
  readonly registered_at: number;
  readonly last_seen: number;
  readonly interval_ms: number;
  readonly busy_until: number;
  readonly kv_held_at_beat: number;
  readonly draining: boolean | undefined;
  readonly draining_since: number | undefined;
  readonly quarantined_until: number | undefined;
  readonly vacated_until: number | undefined;
  readonly trust: NodeDoc['trust'];
  /** The writer: one of a few trackers, so one string per tracker (`writers`), not one per document. */
  readonly by: string;
  /** Fields this version does not know (a newer tracker's), kept so a rewrite here keeps them; undefined when none (nearly always). */
  readonly extra: Record<string, unknown> | undefined;

  /**
   * `doc` as stored at `rev`. `peerId`: the node's id as the registry keys it (the document's names the same
   * node: node-docs.ts checks); `share`: objects to keep instead of the document's equal ones (the last
   * stored copy, the registry's record); `writers`: the writers' ids seen so far, by value.
   */
  constructor(
    readonly rev: number,
    doc: NodeDoc,
    peerId: string,
    share: ShareFrom | undefined,
    writers: Map<string, string>,
  ) {
    this.peer_id = peerId;
    this.public_key = doc.public_key;
    this.relay_addr = doc.relay_addr;
    this.endpoint = doc.endpoint;
    this.info = share && sameData(share.info, doc.info) ? share.info : doc.info;
    this.stats = share?.stats && doc.stats && sameData(share.stats, doc.stats) ? share.stats : doc.stats;
    this.assignment = shareSpan(doc.assignment, share);
    this.serving = shareSpan(doc.serving, share);
    this.layer_ms_ewma = doc.layer_ms_ewma;
    this.registered_at = doc.registered_at;
    this.last_seen = doc.last_seen;
    this.interval_ms = doc.interval_ms;
    this.busy_until = doc.busy_until;
    this.kv_held_at_beat = doc.kv_held_at_beat;
    this.draining = doc.draining;
    this.draining_since = doc.draining_since;
    this.quarantined_until = doc.quarantined_until;
    this.vacated_until = doc.vacated_until;
    this.trust = doc.trust;
    let by = writers.get(doc.by);
    if (by === undefined) {
      // A handful of trackers write; a bucket that names thousands of writers is someone's mistake, not worth a leak.
      if (writers.size >= 64) writers.clear();
      writers.set(doc.by, (by = doc.by));
    }
    this.by = by;
    let extra: Record<string, unknown> | undefined;
    for (const k in doc) if (!KNOWN.has(k)) (extra ??= {})[k] = doc[k];
    this.extra = extra;
  }

  /** The document as stored (what JSON of it says: an absent field stays absent), for a write to build on. */
  doc(): NodeDoc {
    const d: NodeDoc = {
      ...this.extra,
      v: 1,
      peer_id: this.peer_id,
      public_key: this.public_key,
      info: this.info,
      assignment: this.assignment,
      serving: this.serving,
      registered_at: this.registered_at,
      last_seen: this.last_seen,
      interval_ms: this.interval_ms,
      busy_until: this.busy_until,
      kv_held_at_beat: this.kv_held_at_beat,
      by: this.by,
    };
    if (this.relay_addr !== undefined) d.relay_addr = this.relay_addr;
    if (this.endpoint !== undefined) d.endpoint = this.endpoint;
    if (this.stats !== undefined) d.stats = this.stats;
    if (this.layer_ms_ewma !== undefined) d.layer_ms_ewma = this.layer_ms_ewma;
    if (this.draining !== undefined) d.draining = this.draining;
    if (this.draining_since !== undefined) d.draining_since = this.draining_since;
    if (this.quarantined_until !== undefined) d.quarantined_until = this.quarantined_until;
    if (this.vacated_until !== undefined) d.vacated_until = this.vacated_until;
    if (this.trust !== undefined) d.trust = this.trust;
    return d;
  }
}
