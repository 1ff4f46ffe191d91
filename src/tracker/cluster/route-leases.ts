/**
 * Chats running in the cluster (admission leases, admission.ts): each is
 * `route.<id>` in the bucket, written by the tracker running it and deleted
 * when it ends; every tracker counts every other tracker's route bytes
 * against the nodes' KV (its own admission holds its own).
 */
import type { KV } from '@nats-io/kv';
import type { Logger } from 'pino';
import type { NodeRegistry } from '../registry.ts';
import { keys, type RouteDoc } from './doc.ts';

export interface RouteLeasesInit {
  kv: () => KV;
  me: string;
  connected: () => boolean;
  registry: Pick<NodeRegistry, 'holdKv'>;
  logger: Pick<Logger, 'debug'>;
}

export class RouteLeases {
  private readonly routes = new Map<string, { doc: RouteDoc; rev: number }>();
  private readonly ops = new Map<string, Promise<void>>();

  constructor(private readonly init: RouteLeasesInit) {}

  /**
   * `route.<id>` changed in the bucket at revision `rev` (`doc` undefined: deleted, or malformed —
   * `deleted` tells which). Our own routes are held by our admission already.
   */
  stored(id: string, rev: number, deleted: boolean, doc: () => RouteDoc | undefined): void {
    const had = this.routes.get(id);
    if (had && had.rev >= rev) return;
    if (had && had.doc.by !== this.init.me) this.hold(had.doc, -1);
    if (deleted) {
      this.routes.delete(id);
      return;
    }
    const d = doc();
    if (!d) return;
    this.routes.set(id, { doc: d, rev });
    if (d.by !== this.init.me) this.hold(d, 1);
  }

  private hold(doc: RouteDoc, sign: 1 | -1): void {
    for (const [peer, bytes] of doc.hops) this.init.registry.holdKv(peer, sign * bytes);
  }

  opened(id: string, model: string, held: ReadonlyMap<string, number>): void {
    this.op(id, () => this.init.kv().put(keys.route(id), JSON.stringify({ v: 1, by: this.init.me, model, hops: [...held] } satisfies RouteDoc)));
  }

  closed(id: string): void {
    this.op(id, () => this.init.kv().delete(keys.route(id)), true);
  }

  /** One route's writes in order (a chat shorter than a KV round trip must not leave its route behind). */
  private op(id: string, op: () => Promise<unknown>, last = false): void {
    const prev = this.ops.get(id) ?? Promise.resolve();
    const next = prev.then(async () => {
      if (!this.init.connected()) return;
      await op().catch((e: unknown) => this.init.logger.debug({ err: (e as Error).message, route: id }, 'cluster: route lease not written'));
    });
    this.ops.set(id, next);
    if (last) void next.finally(() => this.ops.get(id) === next && this.ops.delete(id));
  }

  /** Delete the routes of tracker `by` (gone silent: the leader releases their KV room). */
  async deleteBy(by: string): Promise<void> {
    for (const [rid, r] of this.routes) if (r.doc.by === by) await this.init.kv().delete(keys.route(rid)).catch(() => undefined);
  }

  /** The bucket was lost: every route of another tracker stops counting (the new bucket's watch brings back what is written again). */
  releaseAll(): void {
    for (const r of this.routes.values()) if (r.doc.by !== this.init.me) this.hold(r.doc, -1);
    this.routes.clear();
  }
}
