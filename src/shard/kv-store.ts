/**
 * Per-session KV caches, preallocated to the executor's max context when the
 * session opens and written in place afterwards (never reallocated per step).
 * Layout per layer: [maxContext, kvHeads, headDim], position-major, so the
 * filled prefix is one contiguous view (see src/model/graph.ts).
 *
 * A byte budget bounds the caches; opening a session that does not fit first
 * drops sessions idle longer than the TTL, then the least recently used.
 */
import { tooLargeError } from './errors.ts';

export type KvElem = 'f32' | 'f16';

export interface KvSession {
  readonly id: string;
  /** keys[i] / values[i] belong to layer startLayer + i. */
  readonly keys: Array<Float32Array | Uint16Array>;
  readonly values: Array<Float32Array | Uint16Array>;
  /** Tokens held per layer: layers can differ when a request started inside the range. */
  readonly lengths: Int32Array;
  lastUsed: number;
  readonly bytes: number;
}

export interface KvStoreOptions {
  startLayer: number;
  endLayer: number;
  kvHeads: number;
  headDim: number;
  maxContext: number;
  elem: KvElem;
  budgetBytes: number;
  ttlMs: number;
  now?: () => number;
}

export interface KvStats {
  sessions: number;
  bytesUsed: number;
  budgetBytes: number;
  bytesPerSession: number;
  evictions: number;
}

export class KvStore {
  private readonly sessions = new Map<string, KvSession>(); // insertion order = LRU order (touch re-inserts)
  private bytesUsed = 0;
  private evictions = 0;
  readonly bytesPerSession: number;
  private readonly now: () => number;

  constructor(private readonly o: KvStoreOptions) {
    this.now = o.now ?? (() => Date.now());
    const layers = o.endLayer - o.startLayer;
    this.bytesPerSession = 2 * layers * o.maxContext * o.kvHeads * o.headDim * (o.elem === 'f16' ? 2 : 4);
  }

  /** The live session, refreshed as most recently used; undefined when unknown or expired. */
  get(id: string): KvSession | undefined {
    const s = this.sessions.get(id);
    if (!s) return undefined;
    const t = this.now();
    if (t - s.lastUsed > this.o.ttlMs) {
      this.drop(id, true);
      return undefined;
    }
    this.sessions.delete(id);
    this.sessions.set(id, s);
    s.lastUsed = t;
    return s;
  }

  /** The session, opened (and space made for it) when absent. */
  open(id: string): KvSession {
    const existing = this.get(id);
    if (existing) return existing;
    if (this.bytesPerSession > this.o.budgetBytes) {
      throw tooLargeError(`one session needs ${this.bytesPerSession} bytes of KV cache, over the budget of ${this.o.budgetBytes}`);
    }
    this.sweep();
    for (const victim of this.sessions.keys()) {
      if (this.bytesUsed + this.bytesPerSession <= this.o.budgetBytes) break;
      this.drop(victim, true);
    }
    const layers = this.o.endLayer - this.o.startLayer;
    const n = this.o.maxContext * this.o.kvHeads * this.o.headDim;
    const alloc = () => (this.o.elem === 'f16' ? new Uint16Array(n) : new Float32Array(n));
    const s: KvSession = {
      id,
      keys: Array.from({ length: layers }, alloc),
      values: Array.from({ length: layers }, alloc),
      lengths: new Int32Array(layers),
      lastUsed: this.now(),
      bytes: this.bytesPerSession,
    };
    this.sessions.set(id, s);
    this.bytesUsed += s.bytes;
    return s;
  }

  /** Drops sessions idle past the TTL. */
  sweep(): void {
    const t = this.now();
    for (const [id, s] of this.sessions) if (t - s.lastUsed > this.o.ttlMs) this.drop(id, true);
  }

  delete(id: string): boolean {
    return this.drop(id, false);
  }

  has(id: string): boolean {
    return this.sessions.has(id);
  }

  stats(): KvStats {
    return { sessions: this.sessions.size, bytesUsed: this.bytesUsed, budgetBytes: this.o.budgetBytes, bytesPerSession: this.bytesPerSession, evictions: this.evictions };
  }

  private drop(id: string, evicted: boolean): boolean {
    const s = this.sessions.get(id);
    if (!s) return false;
    this.sessions.delete(id);
    this.bytesUsed -= s.bytes;
    if (evicted) this.evictions++;
    return true;
  }
}
