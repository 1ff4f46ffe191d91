/**
 * Admission at the tracker: a chat starts only on a route whose every node
 * has KV room for it (from heartbeats, what this tracker's own generations
 * hold since, and MESH_ERR_BUSY answers), and otherwise waits in a bounded
 * FIFO queue, streaming nothing, until room frees up:
 *
 *   acquire ──▶ room now? ── yes ──▶ Lease (KV held on each node of the route)
 *                  │ no
 *                  ▼
 *         queue full? ── yes ──▶ 429 + Retry-After
 *                  │ no
 *                  ▼
 *      wait (FIFO) ── room (a lease released, a heartbeat, a busy mark expired) ──▶ Lease
 *                  └─ queueMaxWaitMs passed ──▶ 429 + Retry-After
 *
 * The order is FIFO per model (a chat of one model never waits behind
 * another model's), and strict: a later, smaller chat does not overtake the
 * first waiting one, so a long chat is never starved.
 *
 * Nodes stay the authority on their memory: the tracker's view is an
 * estimate, and a node that refuses anyway (503 MESH_ERR_BUSY) is marked busy
 * for its Retry-After while the chat is routed again, ahead of the queue.
 */
import { MeshError } from '../protocol/errors.ts';
import type { TrackerMetrics } from './metrics.ts';
import type { TrackerOptions } from './options.ts';
import type { NodeRegistry } from './registry.ts';
import type { RoutePlan } from './routing.ts';

export type AdmissionOptions = Pick<TrackerOptions, 'queueMaxLength' | 'queueMaxWaitMs' | 'now'> & {
  /** Until this time (the tracker's clock), a chat with no route at all waits for nodes instead of getting 503 (a tracker that just started). */
  waitForNodesUntil?: number;
};

/**
 * Told of every lease's KV holdings (a cluster store writes them where the
 * other trackers count them): per node of the route, the bytes held.
 */
export interface LeaseObserver {
  leaseOpened(id: string, model: string, held: ReadonlyMap<string, number>): void;
  leaseChanged(id: string, model: string, held: ReadonlyMap<string, number>): void;
  leaseClosed(id: string): void;
}

/** KV room one chat holds on its route's nodes, as the tracker counts it. */
export interface Lease {
  readonly plan: RoutePlan;
  /** Positions held on each node of the route. */
  readonly tokens: number;
  /** Hold room for `tokens` positions instead (the head reported the real prompt length). */
  resize(tokens: number): void;
  /** The chat ended (or moved to another route): give the room back. Idempotent. */
  release(): void;
}

export interface AcquireOptions {
  signal: AbortSignal;
  /** Nodes not to route through (heads that failed this chat). */
  exclude?: ReadonlySet<string>;
  /** A chat that already started once (re-routed after MESH_ERR_BUSY or a failed head): it waits at the head of the queue, never refused as full. */
  front?: boolean;
}

interface Waiter {
  model: string;
  tokens: number;
  exclude: ReadonlySet<string> | undefined;
  since: number;
  resolve(lease: Lease): void;
  reject(e: unknown): void;
  cleanup(): void;
}

/** How often a non-empty queue looks for room that no event announced (busy marks expiring), ms. */
const POLL_MS = 100;

export class Admission {
  private readonly queue: Waiter[] = [];
  private poll: ReturnType<typeof setInterval> | undefined;
  private active = 0;
  /** Smoothed lease duration, ms: the Retry-After estimate. */
  private leaseMs: number | undefined;

  /** Set by a cluster store: every lease's holdings, as they change. */
  observer: LeaseObserver | undefined;
  /** Lease ids unique across trackers and restarts: a random prefix per process. */
  private readonly idPrefix = Math.random().toString(36).slice(2, 10);
  private leases = 0;

  constructor(
    private readonly registry: NodeRegistry,
    private readonly o: AdmissionOptions,
    private readonly metrics?: Pick<TrackerMetrics, 'queueWait' | 'queueRejections'> & Partial<Pick<TrackerMetrics, 'routePick'>>,
  ) {}

  /** Chats waiting now. */
  get length(): number {
    return this.queue.length;
  }

  /** Chats holding a lease now. */
  get running(): number {
    return this.active;
  }

  /** How long the longest waiting chat has waited, ms (0 when none waits). */
  oldestWaitMs(): number {
    const w = this.queue[0];
    return w ? this.o.now() - w.since : 0;
  }

  /**
   * A lease on a route with room for `tokens` positions, now or after a wait
   * in the queue. Rejects with 429 MESH_ERR_TOO_MANY_REQUESTS (with
   * `retry_after_ms`) when the queue is full or the wait passes
   * queueMaxWaitMs, 503 when layers are missing, 413 when no route could
   * ever hold the chat, 499 when the signal aborts.
   */
  acquire(model: string, tokens: number, opts: AcquireOptions): Promise<Lease> {
    if (opts.signal.aborted) return Promise.reject(cancelled());
    // FIFO: a newcomer goes straight through only when no chat of its model waits; a re-routed chat always may.
    if (opts.front || !this.queue.some((w) => w.model === model)) {
      let plan: RoutePlan | undefined;
      try {
        plan = this.pick(model, tokens, opts.exclude);
      } catch (e) {
        if (!this.waitingForNodes(e)) return Promise.reject(e);
      }
      if (plan) return Promise.resolve(this.lease(plan, tokens, model));
    }
    if (!opts.front && this.queue.length >= this.o.queueMaxLength) return Promise.reject(this.tooMany('queue_full'));
    return new Promise<Lease>((resolve, reject) => {
      const onAbort = () => {
        this.remove(w);
        reject(cancelled());
      };
      const timer = setTimeout(() => {
        this.remove(w);
        reject(this.tooMany('queue_timeout'));
      }, this.o.queueMaxWaitMs);
      const w: Waiter = {
        model,
        tokens,
        exclude: opts.exclude,
        since: this.o.now(),
        resolve,
        reject,
        cleanup: () => {
          clearTimeout(timer);
          opts.signal.removeEventListener('abort', onAbort);
        },
      };
      opts.signal.addEventListener('abort', onAbort, { once: true });
      if (opts.front) this.queue.unshift(w);
      else this.queue.push(w);
      this.startPolling();
    });
  }

  /** Room may have freed up (a lease ended, a heartbeat came): start waiting chats in order, per model while its first one fits. */
  kick(): void {
    const blocked = new Set<string>();
    for (let i = 0; i < this.queue.length; ) {
      const w = this.queue[i]!;
      if (blocked.has(w.model)) {
        i++;
        continue;
      }
      let plan: RoutePlan | undefined;
      try {
        plan = this.pick(w.model, w.tokens, w.exclude);
      } catch (e) {
        if (this.waitingForNodes(e)) {
          blocked.add(w.model);
          i++;
          continue;
        }
        // Layers went missing while it waited (a node left): it gets the same answer a newcomer would.
        this.queue.splice(i, 1);
        w.cleanup();
        w.reject(e);
        continue;
      }
      if (!plan) {
        blocked.add(w.model);
        i++;
        continue;
      }
      this.queue.splice(i, 1);
      w.cleanup();
      this.metrics?.queueWait.observe((this.o.now() - w.since) / 1000);
      w.resolve(this.lease(plan, w.tokens, w.model));
    }
    if (this.queue.length === 0) this.stopPolling();
  }

  /** True when `e` is "no route" and the tracker just started: nodes are still registering again, so the chat waits (kick() answers it 503 once the wait is over). */
  private waitingForNodes(e: unknown): boolean {
    const until = this.o.waitForNodesUntil;
    return until !== undefined && this.o.now() < until && e instanceof MeshError && e.code === 'MESH_ERR_UNAVAILABLE';
  }

  private pick(model: string, tokens: number, exclude: ReadonlySet<string> | undefined): RoutePlan | undefined {
    const pick = () => this.registry.pickWithRoom(model, tokens, exclude);
    return this.metrics?.routePick ? this.metrics.routePick.time(pick) : pick();
  }

  /** Stop the poll timer and refuse every waiting chat (the tracker is closing). */
  close(): void {
    this.stopPolling();
    for (const w of this.queue.splice(0)) {
      w.cleanup();
      w.reject(new MeshError('MESH_ERR_SHUTTING_DOWN', 'the tracker is shutting down'));
    }
  }

  /** When to try again, ms: about one average chat per running chat ahead of the caller, within 1..60 s. */
  retryAfterMs(): number {
    const per = this.leaseMs ?? 5_000;
    const est = (per * (this.queue.length + 1)) / Math.max(1, this.active);
    return Math.round(Math.min(60_000, Math.max(1_000, est)));
  }

  private tooMany(reason: 'queue_full' | 'queue_timeout'): MeshError {
    this.metrics?.queueRejections.inc({ reason });
    const message =
      reason === 'queue_full'
        ? `every route is at its KV capacity and ${this.queue.length} chat(s) already wait (the queue holds ${this.o.queueMaxLength}); retry later`
        : `no route had KV room for this chat within ${this.o.queueMaxWaitMs} ms; retry later`;
    return new MeshError('MESH_ERR_TOO_MANY_REQUESTS', message, { retry_after_ms: this.retryAfterMs(), reason, queue_length: this.queue.length });
  }

  private lease(plan: RoutePlan, tokens: number, model: string): Lease {
    const registry = this.registry;
    const held = new Map<string, number>();
    const id = `${this.idPrefix}${(++this.leases).toString(36)}`;
    const hold = (t: number) => {
      for (const h of plan.hops) {
        const n = registry.nodes.get(h.id);
        const bytes = n ? registry.kvNeed(n, t) : 0;
        registry.holdKv(h.id, bytes - (held.get(h.id) ?? 0));
        held.set(h.id, bytes);
      }
    };
    hold(tokens);
    this.observer?.leaseOpened(id, model, held);
    this.active++;
    const t0 = this.o.now();
    let released = false;
    let current = tokens;
    return {
      plan,
      get tokens() {
        return current;
      },
      resize: (t: number) => {
        if (released || t === current) return;
        current = t;
        hold(t);
        this.observer?.leaseChanged(id, model, held);
        this.kick();
      },
      release: () => {
        if (released) return;
        released = true;
        for (const [id, bytes] of held) registry.holdKv(id, -bytes);
        this.observer?.leaseClosed(id);
        this.active--;
        const ms = this.o.now() - t0;
        this.leaseMs = this.leaseMs === undefined ? ms : this.leaseMs + 0.2 * (ms - this.leaseMs);
        this.kick();
      },
    };
  }

  private remove(w: Waiter): void {
    const i = this.queue.indexOf(w);
    if (i >= 0) this.queue.splice(i, 1);
    w.cleanup();
    if (this.queue.length === 0) this.stopPolling();
  }

  private startPolling(): void {
    if (this.poll !== undefined) return;
    this.poll = setInterval(() => this.kick(), POLL_MS);
    (this.poll as { unref?: () => void }).unref?.();
  }

  private stopPolling(): void {
    if (this.poll === undefined) return;
    clearInterval(this.poll);
    this.poll = undefined;
  }
}

function cancelled(): MeshError {
  return new MeshError('MESH_ERR_CANCELLED', 'the client went away while the chat waited for KV room');
}
