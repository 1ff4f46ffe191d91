/**
 * A RelayClient's outage: from a lost registration to the next one. One
 * shorter than its budget (`outageBudgetMs`) is waited out: requests made
 * meanwhile wait for the new registration instead of failing, and fail all
 * at once when it outlives the budget. The reconnect backoff reads how long
 * the connection has been away (relay-options.ts reconnectDelay).
 */
import { MeshError } from '../protocol/errors.ts';

export class RelayOutage {
  /** When (performance.now) the registered connection was last lost; kept after it is back (the outage's window). */
  private lostAt: number | undefined;
  /** True from a lost registration until the next one. */
  private inOutage = false;
  /** Reconnect attempts since the outage outlived its budget. */
  pastBudget = 0;
  /** Fires when the outage outlives its budget: waiting requests fail then. */
  private timer: ReturnType<typeof setTimeout> | undefined;
  /** Requests waiting for the registration while the connection is down (within the budget). */
  private readonly waiters = new Set<{ resolve: () => void; reject: (e: unknown) => void }>();

  constructor(private readonly budgetMs: number) {}

  /** True from a lost registration until the next one. */
  get active(): boolean {
    return this.inOutage;
  }

  /** While in an outage: ms since the connection was lost; else undefined. */
  lostForMs(): number | undefined {
    return this.inOutage && this.lostAt !== undefined ? performance.now() - this.lostAt : undefined;
  }

  /** While a lost connection is being waited out: ms until its budget runs out (0: registered, or not waiting any more). */
  leftMs(): number {
    if (!this.inOutage || this.lostAt === undefined) return 0;
    return Math.max(0, this.lostAt + this.budgetMs - performance.now());
  }

  /** Ms left of the last outage's window (from the moment the connection was lost, the budget long), whether or not it is back. */
  windowLeftMs(): number {
    if (this.lostAt === undefined) return 0;
    return Math.max(0, this.lostAt + this.budgetMs - performance.now());
  }

  /** The registered connection was lost now; `overBudget` runs if no registration comes within the budget. */
  begin(overBudget: () => void): void {
    this.lostAt = performance.now();
    this.inOutage = true;
    if (this.budgetMs > 0) {
      this.timer = setTimeout(() => {
        this.timer = undefined;
        overBudget();
      }, this.budgetMs);
    }
  }

  /** Registered again: how long it was away, ms (undefined when there was no outage). The waiting requests go on (settle()). */
  back(): number | undefined {
    const away = this.lostForMs();
    this.inOutage = false;
    this.pastBudget = 0;
    return away === undefined ? undefined : Math.round(away);
  }

  /** Wait for the registration (see RelayClient.whenRegistered); the caller checked that the budget is not spent. */
  wait(signal?: AbortSignal): Promise<void> {
    if (signal?.aborted) return Promise.reject(new MeshError('MESH_ERR_CANCELLED', 'cancelled while the relay was reconnecting'));
    return new Promise<void>((resolve, reject) => {
      const onAbort = (): void => {
        this.waiters.delete(w);
        reject(new MeshError('MESH_ERR_CANCELLED', 'cancelled while the relay was reconnecting'));
      };
      const w = {
        resolve: () => {
          signal?.removeEventListener('abort', onAbort);
          resolve();
        },
        reject: (e: unknown) => {
          signal?.removeEventListener('abort', onAbort);
          reject(e);
        },
      };
      this.waiters.add(w);
      signal?.addEventListener('abort', onAbort, { once: true });
    });
  }

  /** The connection is back (no `err`), closed, or the outage outlived its budget: settle the requests waiting for it. */
  settle(err?: unknown): void {
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
    const waiters = [...this.waiters];
    this.waiters.clear();
    for (const w of waiters) {
      if (err === undefined) w.resolve();
      else w.reject(err);
    }
  }
}
