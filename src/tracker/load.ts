/**
 * Is the tracker keeping up? A timer every `tickMs` measures how busy the
 * event loop was since the last tick (event-loop utilisation) and how late
 * the tick itself fired (a loop stalled by one long task). From that:
 *
 * - **late time**: a counter of the milliseconds the tracker was behind
 *   (stalled, or busy past `busyAbove`). The sweep does not count a node's
 *   silence that falls in late time: a heartbeat that waited in the
 *   tracker's own backlog is not the node's fault, and removing a live
 *   donor then makes it re-register, which costs more, which is how one
 *   tracker used to collapse past ~2,000 donors.
 * - **the heartbeat period handed out**: doubled (up to `maxIntervalMs`)
 *   after two ticks behind in a row, halved back after `calmTicks` calm
 *   ones. Every node honours the period of its last answer, so the load
 *   falls within one period. Nodes' deadlines are counted in the period
 *   they were told, so a longer one never expires anyone.
 * - **shedding**: while behind at the longest period, new registrations
 *   get 503 with Retry-After (heartbeats are always answered).
 */
import { performance, type EventLoopUtilization } from 'node:perf_hooks';
import { Ticker } from './ticker.ts';

export interface LoadMonitorOptions {
  /** The period nodes are told when the tracker keeps up, ms. */
  baseIntervalMs: number;
  /** The longest period handed out when behind, ms. @defaultValue 60000 */
  maxIntervalMs?: number;
  /** @defaultValue 500 */
  tickMs?: number;
  /** Event-loop utilisation above which a tick counts as behind. @defaultValue 0.9 */
  busyAbove?: number;
  /** Below this, a tick counts as calm. @defaultValue 0.5 */
  calmBelow?: number;
  /** Calm ticks before the period halves back. @defaultValue 10 */
  calmTicks?: number;
  /** A tick firing this much late counts its lateness as late time. @defaultValue 100 */
  stallMs?: number;
}

export interface LoadState {
  /** Event-loop utilisation over the last tick, 0..1. */
  utilization: number;
  /** How late the last tick fired, ms. */
  lagMs: number;
  behind: boolean;
  /** The heartbeat period handed out now, ms. */
  intervalMs: number;
  /** All late time so far, ms. */
  lateMs: number;
}

export class LoadMonitor {
  private readonly o: Required<LoadMonitorOptions>;
  private stopTicks: (() => void) | undefined;
  private lastTick = 0;
  private lastElu: EventLoopUtilization | undefined;
  private late = 0;
  private behindTicks = 0;
  private calm = 0;
  private factor = 1;
  private state: LoadState;

  constructor(o: LoadMonitorOptions) {
    this.o = { maxIntervalMs: 60_000, tickMs: 500, busyAbove: 0.9, calmBelow: 0.5, calmTicks: 10, stallMs: 100, ...o };
    this.state = { utilization: 0, lagMs: 0, behind: false, intervalMs: o.baseIntervalMs, lateMs: 0 };
  }

  /** Tick every `tickMs` on `ticker` (the tracker's shared clock: ticker.ts), or on a timer of its own. */
  start(ticker: Ticker = new Ticker(this.o.tickMs)): void {
    if (this.stopTicks) return;
    this.lastTick = performance.now();
    this.lastElu = performance.eventLoopUtilization();
    this.stopTicks = ticker.every(this.o.tickMs, () => this.tick());
  }

  stop(): void {
    this.stopTicks?.();
    this.stopTicks = undefined;
  }

  /** One measurement (the timer calls it; tests may call it with their own figures). */
  tick(measured?: { utilization: number; elapsedMs: number }): void {
    let utilization: number;
    let elapsed: number;
    if (measured) {
      ({ utilization, elapsedMs: elapsed } = measured);
    } else {
      const now = performance.now();
      elapsed = now - this.lastTick;
      this.lastTick = now;
      const elu = performance.eventLoopUtilization();
      utilization = this.lastElu ? performance.eventLoopUtilization(elu, this.lastElu).utilization : 0;
      this.lastElu = elu;
    }
    const lag = Math.max(0, elapsed - this.o.tickMs);
    const busy = utilization > this.o.busyAbove;
    const behind = busy || lag > this.o.stallMs;
    // Busy: the whole tick was late (heartbeats queued behind work); stalled: the stall was.
    if (busy) this.late += elapsed;
    else if (lag > this.o.stallMs) this.late += lag;
    if (behind) {
      this.calm = 0;
      if (++this.behindTicks >= 2) {
        this.behindTicks = 0;
        this.factor = Math.min(this.factor * 2, this.o.maxIntervalMs / this.o.baseIntervalMs);
      }
    } else {
      this.behindTicks = 0;
      if (utilization < this.o.calmBelow && ++this.calm >= this.o.calmTicks) {
        this.calm = 0;
        this.factor = Math.max(1, this.factor / 2);
      }
    }
    this.state = { utilization, lagMs: lag, behind, intervalMs: this.intervalMs(), lateMs: this.late };
  }

  /** The counter of late time, ms (only grows). */
  lateMs(): number {
    return this.late;
  }

  /** The heartbeat period to hand out now, ms. */
  intervalMs(): number {
    return Math.round(Math.min(this.o.maxIntervalMs, this.o.baseIntervalMs * this.factor));
  }

  /** Behind even at the longest period: refuse what can wait (new registrations). */
  get saturated(): boolean {
    return this.state.behind && this.intervalMs() >= this.o.maxIntervalMs;
  }

  /** When a refused caller should come back, ms (jittered so a crowd does not return at once). */
  retryAfterMs(random: () => number = Math.random): number {
    return Math.round(this.o.baseIntervalMs * (1 + random()));
  }

  get current(): LoadState {
    return this.state;
  }
}
