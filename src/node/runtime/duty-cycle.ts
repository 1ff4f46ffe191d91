/**
 * The donor's cap on how much of the device the node uses: a duty cycle.
 *
 * Work passes a door. The door opens when the executor is idle and has
 * rested long enough: after a busy period of t ms (from the first piece of
 * work starting to the last one ending) it stays shut for t·(1/c − 1) ms, so
 * over time the device is busy a fraction c of the wall clock. Everything
 * waiting when it opens goes through together (so the executor's batch queue
 * still batches them), and work arriving while a busy period runs waits for
 * the next opening: overlapping requests cannot keep the device busy past
 * the cap. At c = 1 the door is never shut and costs nothing.
 *
 * The node announces the cap to the tracker as throughput: its per-layer step
 * time divided by c (stats.ts), so routing counts on what the donor gives.
 */

export const MIN_DUTY_CYCLE = 0.05;

export interface DutyCycleOptions {
  /** Clock, ms. @defaultValue performance.now */
  now?: () => number;
}

export class DutyCycle {
  private cap = 1;
  private running = 0;
  private busySince = 0;
  private restUntil = 0;
  private waiters: Array<() => void> = [];
  private timer: ReturnType<typeof setTimeout> | undefined;
  /** Time work spent waiting at the door, ms (the page and /info show what the cap costs). */
  waitedMs = 0;
  private readonly now: () => number;

  constructor(o: DutyCycleOptions = {}) {
    this.now = o.now ?? (() => performance.now());
  }

  /** The fraction of the time the device may be busy, in [MIN_DUTY_CYCLE, 1]. */
  get fraction(): number {
    return this.cap;
  }

  /** A new cap; work already waiting is released at once when it is lifted. */
  set(fraction: number): void {
    if (!Number.isFinite(fraction) || fraction < MIN_DUTY_CYCLE || fraction > 1) {
      throw new RangeError(`a duty cycle is a fraction in [${MIN_DUTY_CYCLE}, 1], got ${fraction}`);
    }
    const loosened = fraction > this.cap;
    this.cap = fraction;
    if (fraction >= 1) {
      this.restUntil = 0;
      this.open();
    } else if (loosened) {
      // The rest already owed was sized for the old cap: shorten it.
      this.restUntil = Math.min(this.restUntil, this.now());
      this.schedule();
    }
  }

  /** Runs `work` once the door is open; its time counts as busy. */
  async run<T>(work: () => Promise<T>): Promise<T> {
    if (this.cap < 1 && (this.running > 0 || this.waiters.length > 0 || this.now() < this.restUntil)) {
      const t0 = this.now();
      await new Promise<void>((resolve) => {
        this.waiters.push(resolve);
        this.schedule();
      });
      this.waitedMs += this.now() - t0;
    }
    if (this.running++ === 0) this.busySince = this.now();
    try {
      return await work();
    } finally {
      if (--this.running === 0) {
        const end = this.now();
        if (this.cap < 1) this.restUntil = end + (end - this.busySince) * (1 / this.cap - 1);
        this.schedule();
      }
    }
  }

  /** Stop: release whoever waits (the node is closing). */
  close(): void {
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
    this.open();
  }

  private schedule(): void {
    if (this.running > 0 || this.waiters.length === 0 || this.timer !== undefined) return;
    const wait = Math.max(0, this.restUntil - this.now());
    this.timer = setTimeout(() => {
      this.timer = undefined;
      if (this.running > 0) return;
      this.open();
    }, wait);
  }

  private open(): void {
    const w = this.waiters;
    this.waiters = [];
    for (const resolve of w) resolve();
  }
}
