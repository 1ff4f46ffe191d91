/**
 * Batching at a hop (docs/architecture.md): an executor's forward queue that runs the
 * queued decode steps of different sessions together, as one batch.
 *
 *   forward(a) ─┐                 ┌─ runOne(a)            (the executor was free)
 *   forward(b) ─┤  while a runs   │
 *   forward(c) ─┼─ b, c, d queue ─┴─ runBatch([b, c, d])  (when a is done)
 *   forward(d) ─┘
 *
 * (Requests submitted in the same tick as `a` join `a`'s batch: the queue
 * starts on the next microtask.)
 *
 * A request never waits for a batch to fill: the batch is whatever is queued
 * when the executor frees, up to `maxBatch` requests. Only requests with the
 * same batch key (same layers, same input kind, one row, a KV session) join
 * one batch; anything else runs alone, in arrival order. A session appears at
 * most once per batch, and never overtakes its own earlier request: its
 * positions must advance in order.
 *
 * `runBatch` answers per request (a result or an Error), so one malformed
 * input fails only its own session. `maxBatch` 1 turns batching off: every
 * request runs alone, exactly as before batching existed.
 *
 * A runner that runs a batch in steps (the plain executor: one graph per
 * layer) may take more requests into it between steps (`join`): requests
 * that arrived while it ran and would have formed the next batch with it —
 * same key, sessions not in it, none overtaking its own earlier request. It
 * catches them up on the steps they missed and runs the rest together. Nobody
 * waits for them: without it a request that arrives just after a batch
 * started runs alone after it, and at every later hop again (it arrives
 * while the batch runs there too), so a chat can trail a convoy for good.
 */

import { trace } from '../protocol/trace.ts';

export interface BatchRunner<Req, Res> {
  /** Requests with equal keys may run as one batch; undefined: this one runs alone. */
  batchKey(req: Req): string | undefined;
  /** The session a request advances (at most one request per session in a batch). */
  sessionOf(req: Req): string | undefined;
  runOne(req: Req): Promise<Res>;
  /**
   * One answer per request, in order: its result, or the Error that failed it alone.
   * `join` hands over queued requests that may join the running batch; the runner settles those itself.
   */
  runBatch(reqs: readonly Req[], join?: JoinQueued<Req, Res>): Promise<Array<Res | Error>>;
}

/** A queued request handed to a running batch: the runner answers it. */
export interface Joiner<Req, Res> {
  req: Req;
  resolve(v: Res): void;
  reject(e: unknown): void;
}

/** The queued requests that may join a running batch whose sessions are `inBatch` (at most maxBatch in all), now out of the queue. */
export type JoinQueued<Req, Res> = (inBatch: ReadonlySet<string>) => Array<Joiner<Req, Res>>;

export interface BatchStats {
  /** Largest batch this queue forms. */
  maxBatch: number;
  /** Runs so far (a request alone counts as a batch of 1). */
  batches: number;
  /** Requests those runs started with (the sum of sizes[n]·n). */
  requests: number;
  /** Runs by batch size when they started: sizes[n] = runs of n requests; index 0 unused. */
  sizes: number[];
  /** Requests that joined a batch while it ran (on top of `requests` and `sizes`). */
  joined: number;
}

interface Pending<Req, Res> {
  req: Req;
  resolve(v: Res): void;
  reject(e: unknown): void;
}

/** Default largest batch: a WebGPU call stays under 32 rows (a known onnxruntime-web fault at ≥32), and a CPU gains little past 16. */
export const DEFAULT_MAX_BATCH = 16;

export class BatchQueue<Req, Res> {
  readonly maxBatch: number;
  private readonly pending: Array<Pending<Req, Res>> = [];
  private running: Promise<void> | null = null;
  private readonly sizes: number[];
  private batches = 0;
  private requests = 0;
  private joined = 0;
  private lastFull = false;

  constructor(
    private readonly runner: BatchRunner<Req, Res>,
    maxBatch = DEFAULT_MAX_BATCH,
  ) {
    if (!(Number.isInteger(maxBatch) && maxBatch >= 1 && maxBatch <= 1024)) throw new RangeError(`max batch ${maxBatch} is not an integer in 1..1024`);
    this.maxBatch = maxBatch;
    this.sizes = new Array<number>(maxBatch + 1).fill(0);
  }

  submit(req: Req): Promise<Res> {
    return new Promise<Res>((resolve, reject) => {
      this.pending.push({ req, resolve, reject });
      // Start on the next microtask, not now: requests submitted in the same tick (a head's steps
      // for many chats, frames read off one socket) form one batch. Nothing waits for more.
      if (!this.running) this.running = Promise.resolve().then(() => this.drain());
    });
  }

  /** Settles when nothing is queued or running. */
  async idle(): Promise<void> {
    while (this.running) await this.running;
  }

  /** Whether the last run started with as many requests as a batch takes (speculative decoding stops drafting then: the batch amortizes the trip already). */
  get full(): boolean {
    return this.lastFull;
  }

  stats(): BatchStats {
    return { maxBatch: this.maxBatch, batches: this.batches, requests: this.requests, sizes: this.sizes.slice(), joined: this.joined };
  }

  private async drain(): Promise<void> {
    try {
      while (this.pending.length > 0) {
        const batch = this.take();
        this.lastFull = this.maxBatch > 1 && batch.length >= this.maxBatch;
        this.batches++;
        this.requests += batch.length;
        this.sizes[batch.length]!++;
        if (batch.length === 1) {
          const p = batch[0]!;
          trace?.('run', this.runner.sessionOf(p.req));
          await this.runner.runOne(p.req).then(p.resolve, p.reject);
          continue;
        }
        let answers: Array<Res | Error>;
        try {
          const key = this.runner.batchKey(batch[0]!.req)!;
          answers = await this.runner.runBatch(
            batch.map((p) => p.req),
            (inBatch) => this.joiners(key, inBatch),
          );
        } catch (e) {
          // The batch as a whole failed (the backend threw): every member gets the error.
          for (const p of batch) p.reject(e);
          continue;
        }
        batch.forEach((p, i) => {
          const a = answers[i];
          if (a instanceof Error) p.reject(a);
          else if (a === undefined) p.reject(new Error('the batch gave no answer for this request'));
          else p.resolve(a);
        });
      }
    } finally {
      this.running = null;
    }
  }

  /** Queued requests that may join a running batch of `key` (take's rule, the batch's sessions already seen). */
  private joiners(key: string, inBatch: ReadonlySet<string>): Array<Pending<Req, Res>> {
    const out: Array<Pending<Req, Res>> = [];
    const seen = new Set(inBatch);
    for (let i = 0; i < this.pending.length && inBatch.size + out.length < this.maxBatch; ) {
      const p = this.pending[i]!;
      const s = this.runner.sessionOf(p.req);
      const fresh = s === undefined || !seen.has(s);
      if (s !== undefined) seen.add(s);
      if (fresh && this.runner.batchKey(p.req) === key) {
        out.push(p);
        this.pending.splice(i, 1);
      } else i++;
    }
    this.joined += out.length;
    return out;
  }

  /** The head of the queue, plus every later request that may join it (same key, a session not seen before it). */
  private take(): Array<Pending<Req, Res>> {
    const head = this.pending.shift()!;
    // Alone in the queue (one chat): nothing could join, so no key is worked out (it is on a hop's critical path).
    if (this.pending.length === 0) return [head];
    const key = this.maxBatch > 1 ? this.runner.batchKey(head.req) : undefined;
    if (key === undefined) return [head];
    const batch = [head];
    const seen = new Set<string>();
    const s0 = this.runner.sessionOf(head.req);
    if (s0 !== undefined) seen.add(s0);
    for (let i = 0; i < this.pending.length && batch.length < this.maxBatch; ) {
      const p = this.pending[i]!;
      const s = this.runner.sessionOf(p.req);
      const fresh = s === undefined || !seen.has(s);
      if (s !== undefined) seen.add(s); // a session's later requests wait behind this one, joined or not
      if (fresh && this.runner.batchKey(p.req) === key) {
        batch.push(p);
        this.pending.splice(i, 1);
      } else i++;
    }
    return batch;
  }
}
