/**
 * What a node counts about the work it serves, on every host: the donor
 * page's counters (StatsWindow) and the heartbeat's (NodeActivity: requests
 * per minute, per-layer step time, queue depth, tokens served).
 */
import type { NodeStats } from '../../protocol/tracker.ts';
import type { KvHeartbeat } from '../tracker-session.ts';

export const WINDOW_SECONDS = 60;
export const RECENT_FORWARDS = 64;

/**
 * Served-request counters: totals, requests in the last minute, and tokens
 * per second over the last 60 seconds (the page's sparkline). Fixed-size
 * ring of one-second buckets: O(1) per request, no growth.
 */
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

/** Recent one-token steps kept for the median layer time. */
const STEP_SAMPLES = 101;

/**
 * The heartbeat's stats (ADR-0013): what the tracker routes and rebalances
 * by. A step's time per layer is sampled from one-token forwards only (a
 * prompt's rows cost more per call and would skew the median); a head times
 * its own steps the same way, or the tracker would only see a guess for it.
 */
export class NodeActivity {
  readonly window = new StatsWindow();
  /** /forward requests running now: the queue depth. */
  inFlight = 0;
  private readonly stepMs: number[] = [];

  constructor(private readonly now: () => number = Date.now) {}

  /** A /forward answered 200 after `ms` over `tokens` rows through `layers` layers. */
  served(tokens: number, ms: number, layers: number): void {
    this.window.record(this.now(), tokens);
    this.window.recordLatency(ms);
    if (tokens === 1) this.step(ms, layers);
  }

  /** A token the head computed and streamed (no /forward for it). */
  headToken(): void {
    this.window.record(this.now(), 1);
  }

  /** One one-token step through `layers` layers took `ms`. */
  step(ms: number, layers: number): void {
    if (layers <= 0) return;
    this.stepMs.push(ms / layers);
    if (this.stepMs.length > STEP_SAMPLES) this.stepMs.shift();
  }

  /**
   * The span now runs on another backend (a lost GPU rebuilt, or the CPU
   * instead): the old steps say nothing about it. `measuredMs`, a per-layer
   * step just timed on the new backend, is the estimate until steps come in.
   */
  resetSteps(measuredMs?: number): void {
    this.stepMs.length = 0;
    if (measuredMs !== undefined && measuredMs > 0) this.stepMs.push(measuredMs);
  }

  /** Median per-layer step time, ms (0: none measured yet). */
  layerMs(): number {
    if (this.stepMs.length === 0) return 0;
    const sorted = [...this.stepMs].sort((a, b) => a - b);
    return Math.round(sorted[sorted.length >> 1]! * 1000) / 1000;
  }

  /** The heartbeat's stats, with the KV fields of `kvHeartbeat` (tracker-session.ts). */
  heartbeat(kv: KvHeartbeat): NodeStats {
    return {
      rpm: this.window.requestsPerMinute(this.now()),
      layer_ms: this.layerMs(),
      queue_depth: this.inFlight,
      tokens_served: this.window.tokens,
      ...kv,
    };
  }
}
