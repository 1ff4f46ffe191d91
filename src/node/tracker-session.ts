/**
 * A node's life with the tracker, on any host: register, then heartbeat
 * every `heartbeat_interval_ms` with fresh stats; hand every assignment the
 * tracker answers to the host (it decides whether that is a change); when
 * the tracker answers 404 (it restarted, or expired us) register again.
 *
 *   start() ── register ──▶ onAssignment(a)
 *      └─ every interval: heartbeat ──▶ onAssignment(a)   (404 → register)
 *   beatNow()  the host loaded a span: tell the tracker at once, not a period later
 *   onDrainBeacon  with every message, the same message saying `draining`,
 *              signed at once, for a host that must tell the tracker in a
 *              handler that cannot wait (a page's freeze: sendBeacon)
 *
 * The signing is TrackerClient's (the relay identity); the message is built
 * by the host on each beat, so stats and the served span are always current.
 * Host-agnostic: only timers, which Node.js and browsers both have.
 */
import type { Assignment, NodeMessage, NodeStats, RegisterAnswer } from '../protocol/tracker.ts';
import type { KvStats } from '../shard/kv-store.ts';
import { NotRegisteredError, type TrackerClient } from './tracker-client.ts';

export interface TrackerSessionInit {
  client: TrackerClient;
  /** The message to send now (peer, info, stats, the span served). */
  message(): NodeMessage;
  /** Every answer's assignment (the same one again, most of the time). */
  onAssignment(assignment: Assignment | null): void;
  /** Each (re-)registration's answer. */
  onRegistered?(answer: RegisterAnswer): void;
  onLog?(level: 'info' | 'warn', message: string): void;
  /**
   * A draining heartbeat signed with each message's timestamp, ready to send as it is (the tracker
   * applies a drain at an equal timestamp, so it holds even when it overtakes the message it was signed beside).
   */
  onDrainBeacon?(beacon: { url: string; body: string }): void;
  /** Until the first answer tells us. @defaultValue 5000 */
  heartbeatMs?: number;
}

export class TrackerSession {
  private timer: ReturnType<typeof setTimeout> | undefined;
  private registered = false;
  private beating: Promise<void> | undefined;
  private again = false;
  private closed = false;
  private heartbeatMs: number;

  constructor(private readonly init: TrackerSessionInit) {
    this.heartbeatMs = init.heartbeatMs ?? 5_000;
  }

  get isRegistered(): boolean {
    return this.registered;
  }

  /** Registers once, then heartbeats until close(); rejects when that first registration fails (refused, unreachable), and keeps trying on the heartbeat period unless closed. */
  async start(): Promise<void> {
    try {
      await this.register();
    } finally {
      this.schedule();
    }
  }

  /** Heartbeat now (after a span loaded); overlapping calls coalesce into one more beat. */
  beatNow(): Promise<void> {
    if (this.closed) return Promise.resolve();
    if (this.beating) {
      this.again = true;
      return this.beating;
    }
    this.beating = this.beat().finally(() => {
      this.beating = undefined;
      if (this.again) {
        this.again = false;
        void this.beatNow();
      }
    });
    return this.beating;
  }

  close(): void {
    this.closed = true;
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
  }

  /** The message to send now, with its draining twin handed to the host first. */
  private async message(): Promise<NodeMessage> {
    const msg = this.init.message();
    if (this.init.onDrainBeacon) {
      try {
        this.init.onDrainBeacon(await this.init.client.signedHeartbeat({ ...msg, draining: true }));
      } catch (e) {
        this.init.onLog?.('warn', `signing the drain beacon failed: ${(e as Error).message}`);
      }
    }
    return msg;
  }

  private async register(): Promise<void> {
    const ans = await this.init.client.register(await this.message());
    this.registered = true;
    this.heartbeatMs = ans.heartbeat_interval_ms;
    if (this.closed) return;
    this.init.onRegistered?.(ans);
    this.init.onAssignment(ans.assignment);
  }

  private async beat(): Promise<void> {
    try {
      if (!this.registered) return await this.register();
      try {
        const ans = await this.init.client.heartbeat(await this.message());
        if (ans.heartbeatIntervalMs) this.heartbeatMs = ans.heartbeatIntervalMs;
        if (ans.assignment !== undefined && !this.closed) this.init.onAssignment(ans.assignment);
      } catch (e) {
        if (!(e instanceof NotRegisteredError)) throw e;
        this.init.onLog?.('warn', 'the tracker forgot this node (restarted, or heartbeats were missed); registering again');
        this.registered = false;
        await this.register();
      }
    } catch (e) {
      // A missed beat is not fatal: the next one retries, and the tracker expires us only after several.
      this.init.onLog?.('warn', `tracker: ${(e as Error).message}`);
    }
  }

  private schedule(): void {
    if (this.closed) return;
    this.timer = setTimeout(() => {
      void this.beatNow().finally(() => this.schedule());
    }, this.heartbeatMs);
  }
}

export type KvHeartbeat = Pick<NodeStats, 'kv_free_bytes' | 'kv_budget_bytes' | 'kv_used_bytes' | 'kv_sessions' | 'kv_bytes_per_token' | 'kv_block_tokens' | 'kv_max_tokens'>;

/**
 * The KV fields of a heartbeat: the tracker routes by free KV and sizes its
 * own estimates with bytes per position. Without a span loaded the whole
 * memory budget is free (no weights held yet).
 */
export function kvHeartbeat(kv: KvStats | undefined, memoryBudgetBytes: number): KvHeartbeat {
  if (!kv) return { kv_free_bytes: Math.max(0, memoryBudgetBytes) };
  return {
    kv_free_bytes: kv.freeBytes,
    kv_budget_bytes: kv.budgetBytes,
    kv_used_bytes: kv.reservedBytes - kv.idleBytes,
    kv_sessions: kv.sessions,
    kv_bytes_per_token: kv.bytesPerToken,
    kv_block_tokens: kv.blockTokens,
    kv_max_tokens: kv.maxTokens,
  };
}
