/**
 * The simulated swarm's donors spread over child processes.
 *
 * One Node.js process cannot hold 10,000 donors here: each has a relay
 * WebSocket and an HTTP pool, the per-process file limit is 20,000 and
 * cannot be raised, and one event loop serving them all stalls for seconds
 * (its donors' beats then go out late and a tracker rightly drops them). So
 * the bench forks `--donor-procs` children (bench/lib/swarm-child.ts); each
 * runs a slice of the donors, exactly as before (own keys, RelayClient,
 * TrackerClient, TrackerSession), keeps its own SwarmStats and stall clock,
 * and answers the bench's requests over IPC. Processes rather than worker
 * threads: each gets its own file limit and its own heap and GC, and the
 * kernel spreads them over the cores.
 *
 * Donor i gets relay i % relays and tracker i % trackers, wherever it runs,
 * so the load the trackers see does not depend on the number of children.
 */
import { fork, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import type { CallKind } from './swarm-donors.ts';

export interface ChildInit {
  relayUrls: string[];
  trackerUrls: string[];
  heartbeatMs: number;
  sharedHttp: boolean;
}

/** A request from the bench to a child; each is answered once, in a message with the same id. */
export type ChildRequest =
  | { op: 'init'; init: ChildInit }
  /** Create and start these donors (global indices), one after another. */
  | { op: 'start'; indices: number[] }
  /** Wait until every donor started so far has started (or failed to). */
  | { op: 'started' }
  | { op: 'status' }
  /** Start the measured window: stats reset, recording on, stall clock and CPU read. */
  | { op: 'record' }
  | { op: 'counters' }
  /** Beats stop (each answered in the donor's process with the tracker's last answer) or go on again. */
  | { op: 'pause'; paused: boolean }
  /** `leave` donors leave silently (random among the live ones); the `join` indices join. */
  | { op: 'churn'; leave: number; join: number[] }
  /** Remember the live donors on this relay, to follow their return after a restart at `at` (Date.now()). */
  | { op: 'restart-mark'; relay: number; at: number }
  | { op: 'restart-status' }
  /** End the window: recording off; the window's stats. */
  | { op: 'collect' }
  | { op: 'close' };

export interface ChildStatus {
  alive: number;
  registered: number;
  /** Live donors told a heartbeat period longer than the configured one. */
  longPeriods: number;
}

export interface ChildStarted {
  registered: number;
  failures: string[];
}

export interface ChildCounters {
  shed: number;
  dropped: number;
  errorCodes: Record<string, number>;
}

export interface ChildChurn {
  left: number;
  /** Of those, the ones registered at the tracker as they left (the others will never be removed). */
  leftRegistered: number;
}

export interface ChildRestartStatus {
  mine: number;
  back: number;
  backIn60s: number;
}

/** One child's window. */
export interface ChildWindow {
  latency: Record<CallKind, Float64Array>;
  latencyLessStall: Record<CallKind, Float64Array>;
  outcomes: Record<CallKind, Record<string, number>>;
  dropped: number;
  shed: number;
  /** Answers that were not 200, by kind, outcome and error code ('heartbeat relay-503 MESH_ERR_BACKPRESSURE'). */
  errorCodes: Record<string, number>;
  stalledMs: number;
  cpuMs: number;
  windowMs: number;
  /** Heartbeats over the relay socket / as signed HTTP, by every donor this child ever ran (whole run). */
  beatsRelay: number;
  beatsHttp: number;
  /** Of beatsRelay, those the relay batched (beat-batch). */
  beatsBatched: number;
  alive: number;
  /** Heartbeat periods the live donors were last told: ms → donors. */
  periods: Record<string, number>;
  heapUsedMiB: number;
  rssMiB: number;
}

type Reply = { id: number; ok: true; value: unknown } | { id: number; ok: false; error: string };

class Child {
  private next = 0;
  private readonly pending = new Map<number, { resolve: (v: unknown) => void; reject: (e: Error) => void }>();
  exited: string | undefined;

  constructor(
    readonly index: number,
    readonly proc: ChildProcess,
  ) {
    proc.on('message', (m: Reply) => {
      const p = this.pending.get(m.id);
      if (!p) return;
      this.pending.delete(m.id);
      if (m.ok) p.resolve(m.value);
      else p.reject(new Error(`donor process ${index + 1}: ${m.error}`));
    });
    proc.on('exit', (code, signal) => {
      this.exited = `donor process ${index + 1} (pid ${proc.pid}) exited (${signal ?? code})`;
      for (const p of this.pending.values()) p.reject(new Error(this.exited));
      this.pending.clear();
    });
  }

  request<T>(req: ChildRequest): Promise<T> {
    if (this.exited) return Promise.reject(new Error(this.exited));
    const id = this.next++;
    return new Promise<T>((resolve, reject) => {
      this.pending.set(id, { resolve: resolve as (v: unknown) => void, reject });
      this.proc.send({ id, ...req }, (e) => {
        if (e && this.pending.delete(id)) reject(e);
      });
    });
  }
}

/** The merged window of every child. */
export interface PoolWindow {
  latency: Record<CallKind, number[]>;
  latencyLessStall: Record<CallKind, number[]>;
  outcomes: Record<CallKind, Map<string, number>>;
  dropped: number;
  shed: number;
  errorCodes: Record<string, number>;
  /** Each child's own stall over the window, ms. */
  stalledMsEach: number[];
  /** Each child's CPU over the window, ms. */
  cpuMsEach: number[];
  beatsRelay: number;
  beatsHttp: number;
  beatsBatched: number;
  alive: number;
  periods: Record<string, number>;
  heapUsedMiBEach: number[];
  rssMiBEach: number[];
}

/** How many children for `donors` by default: 2,500 donors each (about 7,500 of a child's 20,000 files; a tenth of a second of key generation per tick of the ramp). */
export function defaultDonorProcs(donors: number): number {
  return Math.max(1, Math.min(8, Math.ceil(donors / 2500)));
}

export class DonorPool {
  private constructor(
    private readonly children: Child[],
    private readonly relays: number,
  ) {}

  /**
   * Fork `n` children (`sim1`…`simN`, the name their loop probe takes) and give each the cluster's addresses.
   * `entry`: another checkout's swarm-child.ts, so that the donors run that checkout's node code (`--donors-per-bin`).
   */
  static async start(n: number, init: ChildInit, entry = fileURLToPath(new URL('./swarm-child.ts', import.meta.url))): Promise<DonorPool> {
    const children = Array.from({ length: n }, (_, i) => new Child(i, fork(entry, [`sim${i + 1}`], { serialization: 'advanced', stdio: ['ignore', 'inherit', 'inherit', 'ipc'] })));
    const pool = new DonorPool(children, Math.max(1, init.relayUrls.length));
    try {
      await pool.all(() => ({ op: 'init', init }));
    } catch (e) {
      await pool.close();
      throw e;
    }
    return pool;
  }

  get size(): number {
    return this.children.length;
  }

  get pids(): Array<number | undefined> {
    return this.children.map((c) => c.proc.pid);
  }

  private all<T>(req: (c: Child) => ChildRequest): Promise<T[]> {
    return Promise.all(this.children.map((c) => c.request<T>(req(c))));
  }

  /**
   * The child that runs donor `i` of the ramp. Not `i % children`: with two
   * relays and four children that would put every donor of a relay in two
   * children, and a relay restart's reconnections on half of them. Donors
   * `i` and `i + 1` (on different relays) go to the same child, the next pair
   * to the next child, so each child holds the same share of every relay.
   */
  childOf(i: number): number {
    return Math.floor(i / this.relays) % this.children.length;
  }

  /** Start these donors, each in its child (childOf). Resolves once sent. */
  start(indices: number[]): void {
    const by = new Map<number, number[]>();
    for (const i of indices) {
      const c = this.childOf(i);
      by.set(c, [...(by.get(c) ?? []), i]);
    }
    for (const [c, list] of by) void this.children[c]!.request({ op: 'start', indices: list }).catch(() => {});
  }

  async started(): Promise<ChildStarted> {
    const all = await this.all<ChildStarted>(() => ({ op: 'started' }));
    return { registered: all.reduce((a, s) => a + s.registered, 0), failures: all.flatMap((s) => s.failures).slice(0, 5) };
  }

  async status(): Promise<ChildStatus> {
    const all = await this.all<ChildStatus>(() => ({ op: 'status' }));
    return { alive: sum(all.map((s) => s.alive)), registered: sum(all.map((s) => s.registered)), longPeriods: sum(all.map((s) => s.longPeriods)) };
  }

  async record(): Promise<void> {
    await this.all(() => ({ op: 'record' }));
  }

  async pause(paused: boolean): Promise<void> {
    await this.all(() => ({ op: 'pause', paused }));
  }

  async counters(): Promise<ChildCounters> {
    const all = await this.all<ChildCounters>(() => ({ op: 'counters' }));
    const errorCodes: Record<string, number> = {};
    for (const c of all) for (const [k, n] of Object.entries(c.errorCodes)) errorCodes[k] = (errorCodes[k] ?? 0) + n;
    return { shed: sum(all.map((c) => c.shed)), dropped: sum(all.map((c) => c.dropped)), errorCodes };
  }

  /** In child `c`, `leave` donors leave and the `join` indices join; resolves to how many left. */
  churn(c: number, leave: number, join: number[]): Promise<ChildChurn> {
    return this.children[c]!.request<ChildChurn>({ op: 'churn', leave, join });
  }

  async restartMark(relay: number, at: number): Promise<number> {
    return sum(await this.all<number>(() => ({ op: 'restart-mark', relay, at })));
  }

  async restartStatus(): Promise<ChildRestartStatus> {
    const all = await this.all<ChildRestartStatus>(() => ({ op: 'restart-status' }));
    return { mine: sum(all.map((s) => s.mine)), back: sum(all.map((s) => s.back)), backIn60s: sum(all.map((s) => s.backIn60s)) };
  }

  async collect(): Promise<PoolWindow> {
    const all = await this.all<ChildWindow>(() => ({ op: 'collect' }));
    const kinds: CallKind[] = ['register', 'heartbeat'];
    const cat = (f: (w: ChildWindow) => Float64Array): number[] => all.flatMap((w) => Array.from(f(w)));
    const outcomes = Object.fromEntries(kinds.map((k) => {
      const m = new Map<string, number>();
      for (const w of all) for (const [o, n] of Object.entries(w.outcomes[k])) m.set(o, (m.get(o) ?? 0) + n);
      return [k, m];
    })) as Record<CallKind, Map<string, number>>;
    const merge = (f: (w: ChildWindow) => Record<string, number>) => {
      const out: Record<string, number> = {};
      for (const w of all) for (const [k, n] of Object.entries(f(w))) out[k] = (out[k] ?? 0) + n;
      return out;
    };
    return {
      latency: { register: cat((w) => w.latency.register), heartbeat: cat((w) => w.latency.heartbeat) },
      latencyLessStall: { register: cat((w) => w.latencyLessStall.register), heartbeat: cat((w) => w.latencyLessStall.heartbeat) },
      outcomes,
      dropped: sum(all.map((w) => w.dropped)),
      shed: sum(all.map((w) => w.shed)),
      errorCodes: merge((w) => w.errorCodes),
      stalledMsEach: all.map((w) => Math.round(w.stalledMs)),
      cpuMsEach: all.map((w) => w.cpuMs),
      beatsRelay: sum(all.map((w) => w.beatsRelay)),
      beatsHttp: sum(all.map((w) => w.beatsHttp)),
      beatsBatched: sum(all.map((w) => w.beatsBatched)),
      alive: sum(all.map((w) => w.alive)),
      periods: merge((w) => w.periods),
      heapUsedMiBEach: all.map((w) => w.heapUsedMiB),
      rssMiBEach: all.map((w) => w.rssMiB),
    };
  }

  /** Every donor leaves, then every child exits (killed if it has not within 10 s). */
  async close(): Promise<void> {
    await Promise.all(this.children.map(async (c) => {
      if (c.exited) return;
      const gone = new Promise<void>((r) => c.proc.once('exit', () => r()));
      await Promise.race([c.request({ op: 'close' }).catch(() => {}), sleep(10_000)]);
      const t = setTimeout(() => c.proc.kill('SIGKILL'), 10_000);
      if (!c.exited) await gone;
      clearTimeout(t);
    }));
  }
}

const sum = (xs: number[]) => xs.reduce((a, b) => a + b, 0);
const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));
