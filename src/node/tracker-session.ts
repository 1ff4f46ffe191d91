/**
 * A node's life with the tracker, on any host: register, then heartbeat
 * every `heartbeat_interval_ms` with fresh stats; hand every assignment the
 * tracker answers to the host (it decides whether that is a change); when
 * the tracker answers 404 (it restarted, or expired us) register again.
 *
 *   start() ── register ──▶ onAssignment(a)
 *      ├─ every interval: heartbeat ──▶ onAssignment(a)   (404 → register)
 *      └─ watch: the relay tells when the tracker's peer detaches (a node whose
 *         beats go over a relay with `peer-watch`; with `peer-back` also when a
 *         tracker not attached there attaches), else GET /api/nodes/watch
 *         held open; when the tracker went away (or a beat found it unreachable)
 *         heartbeats come every 250 ms → 1 s until one is answered (a
 *         restarted tracker answers 404 → register at once), then it watches again
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
import { NotRegisteredError, TrackerUnreachableError, WatchUnsupportedError, type TrackerClient } from './tracker-client.ts';

/** After the tracker went away: heartbeats this far apart, growing by half each time, ms (with jitter: [half, whole])… */
const LOST_RETRY_MS = [250, 1_000] as const;
/** …for this long; then at the heartbeat period (a tracker down for long is not hammered by every node each second). */
const LOST_FAST_FOR_MS = 15_000;

/** Longest a message waits for the host to take its drain beacon (a frozen page never answers), ms. */
const BEACON_HANDOFF_MS = 250;

/** Resolves when `p` settles or after `ms`, whichever is first; never rejects. */
async function settledWithin(p: Promise<unknown>, ms: number): Promise<void> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  await Promise.race([p.then(() => undefined, () => undefined), new Promise<void>((r) => (timer = setTimeout(r, ms)))]);
  clearTimeout(timer);
}

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
  onDrainBeacon?(beacon: { url: string; body: string }): void | Promise<void>;
  /** Until the first answer tells us. @defaultValue 5000 */
  heartbeatMs?: number;
}

export class TrackerSession {
  private timer: ReturnType<typeof setTimeout> | undefined;
  private registered = false;
  private beating: Promise<boolean> | undefined;
  private again = false;
  private closed = false;
  private heartbeatMs: number;
  /** Aborts the watch stream and the lost-tracker loop on close(). */
  private readonly stop = new AbortController();
  private watching = false;
  /** The last beat failed: the next failures are not logged again until one succeeds. */
  private failing = false;
  /** Waiting for the next beat to end (the watch, between relay watches): true when it found the tracker unreachable. */
  private beatWaiters: Array<(unreachable: boolean) => void> = [];

  constructor(private readonly init: TrackerSessionInit) {
    this.heartbeatMs = init.heartbeatMs ?? 5_000;
  }

  /** The heartbeat period the tracker handed out last, ms. */
  get periodMs(): number {
    return this.heartbeatMs;
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
      void this.watch();
    }
  }

  /** Heartbeat now (after a span loaded); overlapping calls coalesce into one more beat. Resolves true when the tracker answered (a registration included). */
  beatNow(): Promise<boolean> {
    if (this.closed) return Promise.resolve(false);
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
    this.stop.abort();
    this.tellBeat(false);
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
  }

  /** The message to send now, with its draining twin handed to the host first. */
  private async message(): Promise<NodeMessage> {
    const msg = this.init.message();
    if (this.init.onDrainBeacon) {
      try {
        const handed = this.init.onDrainBeacon(await this.init.client.signedHeartbeat({ ...msg, draining: true }));
        // The message leaves once the host holds its beacon (or after BEACON_HANDOFF_MS): a tracker that applied
        // this message ignores any older beacon, so a page frozen between the two would send one it ignores.
        if (handed) await settledWithin(handed, BEACON_HANDOFF_MS);
      } catch (e) {
        this.init.onLog?.('warn', `signing the drain beacon failed: ${(e as Error).message}`);
      }
    }
    return msg;
  }

  /**
   * Keep watching the tracker (the relay's notice, else its HTTP stream);
   * each time the watch ends or cannot be opened, heartbeat on a short
   * schedule until the tracker answers, so a restarted tracker has this node
   * again within about a second of its return, not a heartbeat period later.
   * Between relay watches (the tracker not attached to a relay without
   * `peer-back`, the relay reconnecting) the next beat tells: one that finds
   * the tracker unreachable starts the same short schedule; a relay with
   * `peer-back` holds the watch instead, and such a beat ends it
   * (`unreachable`) with the same effect. Stops on close(), or for good when the tracker has no watch
   * stream (heartbeats alone then).
   */
  private async watch(): Promise<void> {
    if (this.watching) return;
    this.watching = true;
    const signal = this.stop.signal;
    try {
      while (!this.closed) {
        const t0 = Date.now();
        try {
          const end = await this.init.client.watch(signal);
          if (end === 'rearm') {
            if (!(await this.nextBeat())) continue;
          } else if (end === 'gone') {
            // Every node of the relay hears it at once: spread their first beats over [250 ms, 1 s] (a tracker that only
            // lost its relay connection is back on it by then, and is not hit by every node's signed HTTP beat at once).
            await pause(LOST_RETRY_MS[0] + Math.random() * (LOST_RETRY_MS[1] - LOST_RETRY_MS[0]), signal);
          }
        } catch (e) {
          if (e instanceof WatchUnsupportedError) return;
        }
        if (this.closed) return;
        // A stream that ended at once (a proxy refusing it, a tracker going down) is not a reason to spin.
        if (Date.now() - t0 < LOST_RETRY_MS[0]) await pause(LOST_RETRY_MS[0], signal);
        await this.untilAnswered(signal);
      }
    } finally {
      this.watching = false;
    }
  }

  /** Heartbeat every 250 ms → 1 s (then the heartbeat period) until the tracker answers one (a 404 registers again, at once). */
  private async untilAnswered(signal: AbortSignal): Promise<void> {
    const t0 = Date.now();
    let lost = false;
    for (let delay: number = LOST_RETRY_MS[0]; !this.closed; delay = Math.min(LOST_RETRY_MS[1], delay * 1.5)) {
      if (await this.beatNow()) {
        if (lost) this.init.onLog?.('info', `the tracker answers again after ${Date.now() - t0} ms`);
        return;
      }
      if (!lost) this.init.onLog?.('warn', 'the tracker went away; heartbeating every second at most until it is back');
      lost = true;
      const wait = Date.now() - t0 < LOST_FAST_FOR_MS ? delay : this.heartbeatMs;
      await pause(wait / 2 + (Math.random() * wait) / 2, signal);
    }
  }

  /** Resolves when the next beat ends: true when it found the tracker unreachable. */
  private nextBeat(): Promise<boolean> {
    return new Promise<boolean>((resolve) => this.beatWaiters.push(resolve));
  }

  private tellBeat(unreachable: boolean): void {
    if (this.beatWaiters.length === 0) return;
    for (const w of this.beatWaiters.splice(0)) w(unreachable);
  }

  private async register(): Promise<void> {
    const ans = await this.init.client.register(await this.message());
    this.registered = true;
    this.heartbeatMs = ans.heartbeat_interval_ms;
    if (this.closed) return;
    this.init.onRegistered?.(ans);
    this.init.onAssignment(ans.assignment);
  }

  private async beat(): Promise<boolean> {
    let unreachable = false;
    try {
      if (!this.registered) {
        await this.register();
        return true;
      }
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
      this.failing = false;
      return true;
    } catch (e) {
      unreachable = e instanceof TrackerUnreachableError;
      // A missed beat is not fatal: the next one retries, and the tracker expires us only after several. Said once per spell.
      if (!this.failing) this.init.onLog?.('warn', `tracker: ${(e as Error).message}`);
      this.failing = true;
      return false;
    } finally {
      this.tellBeat(unreachable);
    }
  }

  private schedule(): void {
    if (this.closed) return;
    this.timer = setTimeout(() => {
      void this.beatNow().finally(() => this.schedule());
    }, this.heartbeatMs);
  }
}

function pause(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise<void>((resolve) => {
    const done = (): void => {
      clearTimeout(t);
      signal.removeEventListener('abort', done);
      resolve();
    };
    const t = setTimeout(done, ms);
    signal.addEventListener('abort', done, { once: true });
  });
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
