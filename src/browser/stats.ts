/**
 * Served-request counters for the donor page: totals, requests in the last
 * minute, and tokens per second over the last 60 seconds (the sparkline).
 * Fixed-size ring of one-second buckets: O(1) per request, no growth.
 */
export const WINDOW_SECONDS = 60;
export const RECENT_FORWARDS = 64;

export class StatsWindow {
  requests = 0;
  tokens = 0;
  private readonly reqBuckets = new Float64Array(WINDOW_SECONDS);
  private readonly tokBuckets = new Float64Array(WINDOW_SECONDS);
  /** The second (epoch) each slot currently counts. */
  private readonly slotSecond = new Float64Array(WINDOW_SECONDS).fill(-1);

  /** Handler time of the last RECENT_FORWARDS served /forward calls, ms, oldest first. */
  private readonly recent: number[] = [];

  /** A served /forward that took `ms` in the node (decode, layers, encode; not the network). */
  recordLatency(ms: number): void {
    this.recent.push(ms);
    if (this.recent.length > RECENT_FORWARDS) this.recent.shift();
  }

  recentForwardMs(): number[] {
    return this.recent.slice();
  }

  record(nowMs: number, tokens: number): void {
    const sec = Math.floor(nowMs / 1000);
    const i = sec % WINDOW_SECONDS;
    if (this.slotSecond[i] !== sec) {
      this.slotSecond[i] = sec;
      this.reqBuckets[i] = 0;
      this.tokBuckets[i] = 0;
    }
    this.reqBuckets[i]! += 1;
    this.tokBuckets[i]! += tokens;
    this.requests += 1;
    this.tokens += tokens;
  }

  /** Requests in the 60 s before `nowMs`. */
  requestsPerMinute(nowMs: number): number {
    const sec = Math.floor(nowMs / 1000);
    let n = 0;
    for (let i = 0; i < WINDOW_SECONDS; i++) if (sec - this.slotSecond[i]! < WINDOW_SECONDS) n += this.reqBuckets[i]!;
    return n;
  }

  /** Tokens per second for each of the last 60 whole seconds, oldest first (the current, partial second last). */
  tokensPerSecond(nowMs: number): number[] {
    const sec = Math.floor(nowMs / 1000);
    const out: number[] = [];
    for (let s = sec - WINDOW_SECONDS + 1; s <= sec; s++) {
      const i = ((s % WINDOW_SECONDS) + WINDOW_SECONDS) % WINDOW_SECONDS;
      out.push(this.slotSecond[i] === s ? this.tokBuckets[i]! : 0);
    }
    return out;
  }
}
