/**
 * Draining: the node takes no new work but lets what it has finish.
 *
 *   start(reason)  the donor paused, the battery is not charging, the page
 *                  is being frozen or closed: heartbeats say `draining`, the
 *                  tracker routes no new chat here at once
 *   admit…         a /forward for a session the node already holds runs;
 *                  a new session, a stateless call or a /generate is refused
 *   grace          after `graceMs` everything is refused and the
 *                  generations this node heads are ended (the tracker
 *                  restarts them elsewhere with the tokens so far; heads
 *                  replace this hop for their sessions)
 *   done           nothing ran for `idleDoneMs` (the chats that were in
 *                  flight ended), or the grace is over
 *   stop(reason)   the last reason gone: serving again, nothing reloaded
 *
 * Host-free: a clock and timers.
 */

/** Why the node drains; several may hold at once (paused by the donor and off the charger). */
export type DrainReason = 'donor' | 'battery' | 'frozen' | 'leaving';

export const DRAIN_DEFAULTS = {
  /** In-flight sessions may finish for this long after draining starts, ms. */
  graceMs: 30_000,
  /** Draining is done once no admitted work ran for this long, ms. */
  idleDoneMs: 5_000,
} as const;

export interface DrainOptions {
  graceMs?: number;
  idleDoneMs?: number;
  /** Clock, ms since epoch. @defaultValue Date.now */
  now?: () => number;
  /** The draining flag or the phase changed (the runtime heartbeats and re-derives its state). */
  onChange?(): void;
}

export interface DrainStatus {
  draining: boolean;
  reasons: DrainReason[];
  /** When draining began, ms since epoch. */
  since: number | undefined;
  /** Left of the grace, ms (0 once over, or when not draining). */
  graceLeftMs: number;
  /** Everything in flight finished (or the grace ended): nothing runs here until the drain stops. */
  done: boolean;
}

export class DrainGate {
  private readonly reasons = new Set<DrainReason>();
  private since: number | undefined;
  private lastWork = 0;
  private running = 0;
  private readonly generations = new Set<AbortController>();
  private graceTimer: ReturnType<typeof setTimeout> | undefined;
  private doneTimer: ReturnType<typeof setTimeout> | undefined;
  private readonly graceMs: number;
  private readonly idleDoneMs: number;
  private readonly now: () => number;

  constructor(private readonly o: DrainOptions = {}) {
    this.graceMs = o.graceMs ?? DRAIN_DEFAULTS.graceMs;
    this.idleDoneMs = o.idleDoneMs ?? DRAIN_DEFAULTS.idleDoneMs;
    this.now = o.now ?? Date.now;
  }

  get draining(): boolean {
    return this.reasons.size > 0;
  }

  has(reason: DrainReason): boolean {
    return this.reasons.has(reason);
  }

  start(reason: DrainReason): void {
    if (this.reasons.has(reason)) return;
    const first = this.reasons.size === 0;
    this.reasons.add(reason);
    if (first) {
      this.since = this.now();
      this.graceTimer = setTimeout(() => this.graceOver(), this.graceMs);
      this.watchDone();
    }
    this.o.onChange?.();
  }

  stop(reason: DrainReason): void {
    if (!this.reasons.delete(reason)) return;
    if (this.reasons.size === 0) {
      this.since = undefined;
      this.clearTimers();
    }
    this.o.onChange?.();
  }

  /** Whether a /forward runs: `heldSession` is true when the executor already holds its session (a step of a chat in flight). */
  admitsForward(heldSession: boolean): boolean {
    if (!this.draining) return true;
    return heldSession && !this.overGrace();
  }

  /** Whether a new generation may start on this head. */
  admitsGenerate(): boolean {
    return !this.draining;
  }

  /** Runs an admitted piece of work, counted as activity (the drain is not done while work runs). */
  async run<T>(work: () => Promise<T>): Promise<T> {
    this.running++;
    this.lastWork = this.now();
    try {
      return await work();
    } finally {
      this.running--;
      this.lastWork = this.now();
    }
  }

  /**
   * A generation this head runs: its signal is aborted when the grace ends.
   * Call `end()` when it finishes. Every event it sends counts as activity.
   */
  generation(parent?: AbortSignal): { signal: AbortSignal; touch(): void; end(): void } {
    const ac = new AbortController();
    const onAbort = () => ac.abort(parent!.reason);
    if (parent) {
      if (parent.aborted) ac.abort(parent.reason);
      else parent.addEventListener('abort', onAbort, { once: true });
    }
    this.generations.add(ac);
    this.lastWork = this.now();
    return {
      signal: ac.signal,
      touch: () => {
        this.lastWork = this.now();
      },
      end: () => {
        this.generations.delete(ac);
        parent?.removeEventListener('abort', onAbort);
        this.lastWork = this.now();
      },
    };
  }

  status(): DrainStatus {
    const draining = this.draining;
    return {
      draining,
      reasons: [...this.reasons],
      since: this.since,
      graceLeftMs: draining ? Math.max(0, this.since! + this.graceMs - this.now()) : 0,
      done: draining && this.isDone(),
    };
  }

  close(): void {
    this.clearTimers();
  }

  private overGrace(): boolean {
    return this.since !== undefined && this.now() - this.since >= this.graceMs;
  }

  private isDone(): boolean {
    if (this.overGrace()) return true;
    if (this.running > 0 || this.generations.size > 0) return false;
    return this.now() - Math.max(this.since!, this.lastWork) >= this.idleDoneMs;
  }

  private graceOver(): void {
    this.graceTimer = undefined;
    for (const ac of this.generations) ac.abort(new Error('the node stopped taking work: its drain grace period ended'));
    this.generations.clear();
    this.o.onChange?.();
  }

  /** Re-check until the drain is done, then tell the runtime once (the page's badge goes from "Pausing…" to "Paused"). */
  private watchDone(): void {
    if (this.doneTimer !== undefined || !this.draining) return;
    this.doneTimer = setTimeout(() => {
      this.doneTimer = undefined;
      if (!this.draining) return;
      if (this.isDone()) this.o.onChange?.();
      else this.watchDone();
    }, Math.min(1000, this.idleDoneMs));
  }

  private clearTimers(): void {
    if (this.graceTimer !== undefined) clearTimeout(this.graceTimer);
    if (this.doneTimer !== undefined) clearTimeout(this.doneTimer);
    this.graceTimer = undefined;
    this.doneTimer = undefined;
  }
}
