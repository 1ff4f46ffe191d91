/**
 * One clock for a tracker's periodic jobs (the load monitor's tick, the
 * cluster store's late time, `seen` batches, lease and bucket checks, the
 * sweep): a job whose period is a whole number of the clock's beats runs on
 * its one timer, so the process wakes once a beat for all of them rather
 * than once per job at phases of their own. A wakeup costs ~0.1 ms of CPU on
 * a small VM, and an idle cluster tracker had six such timers. A job whose
 * period is not a multiple of the beat (a test's short period) keeps a timer
 * of its own, so every period stays what it was configured to be.
 *
 * The timers are unref'd, like the ones they replace: they never keep a
 * process alive.
 */

interface Job {
  readonly run: () => void;
  /** Beats between runs. */
  readonly beats: number;
  /** Beats until the next run. */
  left: number;
}

export class Ticker {
  private readonly jobs = new Set<Job>();
  private timer: ReturnType<typeof setInterval> | undefined;

  /** `beatMs`: the clock's period; jobs whose period is a multiple of it share its timer. */
  constructor(readonly beatMs = 500) {}

  /**
   * Run `run` every `ms` (first after `ms`, or within one beat less on the
   * shared clock, whose phase is its own). Returns what stops it.
   */
  every(ms: number, run: () => void): () => void {
    const beats = ms / this.beatMs;
    if (!Number.isInteger(beats) || beats < 1) {
      const own = setInterval(run, ms);
      own.unref?.();
      return () => clearInterval(own);
    }
    const job: Job = { run, beats, left: beats };
    this.jobs.add(job);
    if (!this.timer) {
      this.timer = setInterval(() => this.beat(), this.beatMs);
      this.timer.unref?.();
    }
    return () => {
      this.jobs.delete(job);
      if (this.jobs.size === 0 && this.timer) {
        clearInterval(this.timer);
        this.timer = undefined;
      }
    };
  }

  /** Jobs on the shared clock now (tests). */
  get size(): number {
    return this.jobs.size;
  }

  private beat(): void {
    let failed: { error: unknown } | undefined;
    for (const job of this.jobs) {
      if (--job.left > 0) continue;
      job.left = job.beats;
      // One job's throw must not skip the others of this beat; it still reaches the process as it would from its own timer.
      try {
        job.run();
      } catch (error) {
        failed ??= { error };
      }
    }
    if (failed) throw failed.error;
  }
}
