/**
 * The cluster's one leader (docs/cluster.md): the tracker holding
 * `lease.leader` in the bucket removes silent nodes and moves nodes. The
 * holder renews it by compare-and-swap every `leaseMs / 3`; another tracker
 * takes it over, by compare-and-swap too, once its revision has not moved
 * for `leaseMs` by the taker's own clock, so two can never both hold it.
 */
import type { KV } from '@nats-io/kv';
import type { Logger } from 'pino';
import { isConflict } from './conflict.ts';
import { keys, leaseDocSchema } from './doc.ts';

export interface LeaderLeaseInit {
  /** The bucket now (a lost one is opened again). */
  kv: () => KV;
  /** This tracker's peer id. */
  me: string;
  connected: () => boolean;
  leaseMs: number;
  now: () => number;
  logger: Pick<Logger, 'info' | 'debug'>;
}

export class LeaderLease {
  private lease: { by: string; rev: number; seenAt: number } | undefined;
  private renewedAt = 0;

  constructor(private readonly init: LeaderLeaseInit) {}

  /** This tracker holds the lease (and NATS): it removes and moves nodes. */
  holds(): boolean {
    return this.init.connected() && this.lease?.by === this.init.me && this.init.now() - this.renewedAt < this.init.leaseMs;
  }

  holder(): string | null {
    return this.lease?.by ?? null;
  }

  /** The lease as the bucket's watch brought it (undefined: deleted). */
  seen(by: string | undefined, rev: number): void {
    if (by === undefined) this.lease = undefined;
    else if (!this.lease || rev > this.lease.rev) this.lease = { by, rev, seenAt: this.init.now() };
  }

  /** The bucket was lost: whoever held the lease, nobody does now. */
  forget(): void {
    this.lease = undefined;
  }

  /** Renew our lease, or take over a stale one. */
  async tick(): Promise<void> {
    const { kv, me } = this.init;
    const now = this.init.now();
    const body = JSON.stringify({ v: 1, by: me, at: now });
    const l = this.lease;
    try {
      let rev: number;
      if (!l) rev = await kv().create(keys.leader, body);
      else if (l.by === me || now - l.seenAt > this.init.leaseMs) rev = await kv().update(keys.leader, body, l.rev);
      else return;
      if (l?.by !== me) this.init.logger.info({ tracker: me, previous: l?.by ?? null }, 'cluster: this tracker is the leader (removes silent nodes, moves nodes)');
      this.lease = { by: me, rev, seenAt: this.init.now() };
      this.renewedAt = this.init.now();
    } catch (e) {
      if (isConflict(e)) {
        // Someone else renewed or took it: the watch brings the new holder.
        const cur = await kv().get(keys.leader).catch(() => null);
        if (cur && cur.operation === 'PUT') {
          const d = leaseDocSchema.safeParse((() => { try { return cur.json(); } catch { return undefined; } })());
          if (d.success && (!this.lease || cur.revision > this.lease.rev)) this.lease = { by: d.data.by, rev: cur.revision, seenAt: this.init.now() };
        } else this.lease = undefined;
        return;
      }
      this.init.logger.debug({ err: (e as Error).message }, 'cluster: lease not renewed');
    }
  }

  /** Leaving: a lease we hold is free at once. */
  async release(): Promise<void> {
    if (this.lease?.by === this.init.me) await this.init.kv().delete(keys.leader, { previousSeq: this.lease.rev }).catch(() => undefined);
  }
}
