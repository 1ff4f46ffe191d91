/**
 * The trackers of the cluster as this one knows them: each one's document
 * (its route-signing key, certificate, URL, relay) from the bucket, and
 * when its last `seen` batch came and whether it said it was behind. From
 * these: which tracker a node should beat to, the keys nodes accept routes
 * from, whether every other tracker is heard from (late time otherwise),
 * and which went silent for good.
 */
import type { KV } from '@nats-io/kv';
import type { Logger } from 'pino';
import type { NodeRecord } from '../registry.ts';
import { keys, type TrackerDoc } from './doc.ts';

export interface ClusterSelf {
  peerId: string;
  publicKey: string;
  url: string;
  /** The relay the tracker is attached to (base of its relay address), when it is. */
  relay?: string;
  cert?: TrackerDoc['cert'];
}

/** A relay address without its `/rpc/<peer id>`: which relay it is. */
export function relayBase(addr: string | undefined): string | undefined {
  if (!addr) return undefined;
  const i = addr.lastIndexOf('/rpc/');
  return i < 0 ? addr : addr.slice(0, i);
}

export interface TrackerPeersInit {
  kv: () => KV;
  self: ClusterSelf;
  startedAt: number;
  /** A tracker whose batches stop for this long is late; for `trackerGoneMs`, gone. */
  overdueMs: number;
  trackerGoneMs: number;
  now: () => number;
  logger: Pick<Logger, 'info' | 'warn'>;
}

/** How long the trackers found on a relay are reused for beat targets, ms. */
const NEAR_TTL_MS = 250;

interface Peer {
  doc?: TrackerDoc;
  beaconAt: number;
  behind: boolean;
}

export class TrackerPeers {
  private readonly trackers = new Map<string, Peer>();
  /**
   * What every answer reads (each heartbeat's answer names a beat target and lists the keys), kept between
   * changes of the trackers' documents rather than rebuilt per beat: the keys until a document changes, the
   * trackers on a relay for at most NEAR_TTL_MS (a tracker turning overdue is seen that much later).
   */
  private keysCache: Array<{ public_key: string; cert?: TrackerDoc['cert'] }> | undefined;
  private readonly nearCache = new Map<string, { near: string[]; at: number }>();

  constructor(private readonly init: TrackerPeersInit) {}

  private get me(): string {
    return this.init.self.peerId;
  }

  /** Our own tracker document (key, certificate, URL): nodes learn the cluster's keys from it. */
  async announce(): Promise<void> {
    const s = this.init.self;
    const doc: TrackerDoc = { v: 1, peer_id: s.peerId, public_key: s.publicKey, url: s.url, ...(s.relay ? { relay: s.relay } : {}), ...(s.cert ? { cert: s.cert } : {}), started_at: this.init.startedAt };
    this.trackers.set(s.peerId, { doc, beaconAt: this.init.now(), behind: false });
    this.changed();
    await this.init.kv().put(keys.tracker(s.peerId), JSON.stringify(doc)).catch((e: unknown) => this.init.logger.warn({ err: (e as Error).message }, 'cluster: tracker key not announced yet'));
  }

  /** A tracker's document from the bucket. */
  stored(id: string, doc: TrackerDoc): void {
    const t = this.trackers.get(id);
    this.trackers.set(id, { doc, beaconAt: t?.beaconAt ?? this.init.now(), behind: t?.behind ?? false });
    this.changed();
  }

  private changed(): void {
    this.keysCache = undefined;
    this.nearCache.clear();
  }

  /** A tracker's document was deleted from the bucket. */
  deleted(id: string): void {
    this.trackers.delete(id);
    this.changed();
  }

  /** A tracker's `seen` batch arrived at `now`. */
  beacon(by: string, behind: boolean, now: number): void {
    const t = this.trackers.get(by);
    this.trackers.set(by, { ...(t?.doc ? { doc: t.doc } : {}), beaconAt: now, behind });
  }

  /** Every other tracker not yet gone is heard from in time and not behind. */
  allHeard(now: number): boolean {
    for (const [id, t] of this.trackers) {
      if (id === this.me) continue;
      if (now - t.beaconAt > this.init.trackerGoneMs) continue; // gone: the leader cleans it up
      if (t.behind || now - t.beaconAt > this.init.overdueMs) return false;
    }
    return true;
  }

  /** The leader forgets trackers gone silent (their key goes); `after` releases what each held. */
  async forgetGone(now: number, after: (id: string) => Promise<void>): Promise<void> {
    for (const [id, t] of this.trackers) {
      if (id === this.me || now - t.beaconAt <= this.init.trackerGoneMs) continue;
      this.trackers.delete(id);
      this.changed();
      this.init.logger.info({ tracker: id }, 'cluster: a tracker went silent; its routes in flight are released');
      await this.init.kv().delete(keys.tracker(id)).catch(() => undefined);
      await after(id);
    }
  }

  /**
   * The tracker a node should send its heartbeats to over its relay: one
   * attached to the node's own relay when the cluster has one (the beat
   * stays on that relay), spread by peer id; else this one.
   */
  beatTarget(n: NodeRecord): string {
    const base = relayBase(n.relayAddr);
    if (!base) return this.me;
    const near = this.near(base);
    if (near.length === 0) return this.me;
    let h = 0;
    for (let i = 0; i < 8; i++) h = (h * 16 + parseInt(n.peerId[i]!, 16)) >>> 0;
    return near[h % near.length]!;
  }

  /** The trackers attached to relay `base` and not overdue, sorted. */
  private near(base: string): string[] {
    const now = this.init.now();
    const hit = this.nearCache.get(base);
    if (hit && now - hit.at < NEAR_TTL_MS) return hit.near;
    const near: string[] = [];
    for (const [id, t] of this.trackers) if (t.doc?.relay === base && (id === this.me || now - t.beaconAt <= this.init.overdueMs)) near.push(id);
    near.sort();
    this.nearCache.set(base, { near, at: now });
    return near;
  }

  /** The route-signing keys of every tracker of the cluster (what nodes accept routes from). The same array until one changes (answers share it): callers must not modify it. */
  trackerKeys(): Array<{ public_key: string; cert?: TrackerDoc['cert'] }> {
    if (this.keysCache) return this.keysCache;
    const out: Array<{ public_key: string; cert?: TrackerDoc['cert'] }> = [];
    for (const t of this.trackers.values()) if (t.doc) out.push({ public_key: t.doc.public_key, ...(t.doc.cert ? { cert: t.doc.cert } : {}) });
    this.keysCache = out;
    return out;
  }

  /** Trackers not gone at `now` (this one included). */
  live(now: number): number {
    return [...this.trackers.values()].filter((t) => now - t.beaconAt <= this.init.trackerGoneMs).length;
  }
}
