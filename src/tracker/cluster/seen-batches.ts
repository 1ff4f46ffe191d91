/**
 * Liveness between the trackers of a cluster: each publishes, every
 * `seenEveryMs`, the peer ids it heard heartbeats from since its last batch
 * (core NATS, not the KV: a heartbeat writes nothing stored), and applies
 * the others' batches to its registry, so the leader's deadlines hold
 * whichever tracker a node beats to. A batch is also its tracker's sign of
 * life, with whether it is behind (nobody is removed then).
 */
import type { Logger } from 'pino';
import type { NatsHandle } from '../../cluster/nats.ts';
import type { NodeRegistry } from '../registry.ts';
import { plainSeen, seenSchema } from './doc.ts';

export interface SeenBatchesInit {
  nats: NatsHandle;
  subject: string;
  me: string;
  registry: Pick<NodeRegistry, 'touch'>;
  /** The heartbeat period this tracker hands out now, and whether it is behind (load.ts). */
  load: { intervalMs(): number; readonly current: { behind: boolean } };
  connected: () => boolean;
  now: () => number;
  /** A tracker's batch arrived (its beacon). */
  beacon: (by: string, behind: boolean, now: number) => void;
  /** Count and log a batch dropped as malformed. */
  dropped: (kind: string, why: string) => void;
  logger: Pick<Logger, 'debug'>;
}

export class SeenBatches {
  /** Peers heard from since the last batch. */
  private ids = new Set<string>();
  private readonly decoder = new TextDecoder();

  constructor(private readonly init: SeenBatchesInit) {}

  /** A heartbeat arrived here: its node goes into the next batch. */
  heard(peerId: string): void {
    this.ids.add(peerId);
  }

  publish(): void {
    if (!this.init.connected()) return;
    const ids = [...this.ids];
    this.ids = new Set();
    const { load } = this.init;
    const msg = JSON.stringify({ v: 1, by: this.init.me, interval_ms: load.intervalMs(), behind: load.current.behind, ids });
    try {
      this.init.nats.nc.publish(this.init.subject, msg);
    } catch (e) {
      // The ids go into the next batch.
      for (const id of ids) this.ids.add(id);
      this.init.logger.debug({ err: (e as Error).message }, 'cluster: seen batch not sent');
    }
  }

  /** A batch from the subject (ours included: it is our own beacon). */
  received(data: Uint8Array): void {
    let raw: unknown;
    try {
      raw = JSON.parse(this.decoder.decode(data));
    } catch {
      return this.init.dropped('seen', 'not JSON');
    }
    // The usual batch passes a hand check (doc.ts plainSeen); anything else is the schema's.
    let s = plainSeen(raw);
    if (!s) {
      const p = seenSchema.safeParse(raw);
      if (!p.success) return this.init.dropped('seen', `${p.error.issues[0]?.path.join('.')}: ${p.error.issues[0]?.message}`);
      s = p.data;
    }
    const now = this.init.now();
    this.init.beacon(s.by, s.behind, now);
    if (s.by === this.init.me) return;
    this.init.registry.touch(s.ids, now, s.interval_ms);
  }
}
