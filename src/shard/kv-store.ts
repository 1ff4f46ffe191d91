/**
 * Per-session KV caches: the sessions, their lengths per layer, and their
 * memory, sized by the KvLedger (kv-ledger.ts) rather than preallocated for
 * the whole context: a session gets room for what it declared (or one block),
 * and grows by whole blocks when it must.
 *
 * The memory itself sits behind KvStorage, so a backend can keep caches
 * where its kernels read them. CpuKvStorage holds typed arrays; per layer
 * [capacity, kvHeads, headDim], position-major, so the filled prefix is one
 * contiguous view (see src/model/graph.ts), written in place between
 * growths.
 */
import { MeshError } from '../protocol/errors.ts';
import { KvLedger, type KvLedgerOptions, type KvLedgerStats } from './kv-ledger.ts';

export type KvElem = 'f32' | 'f16';

/**
 * Where a backend keeps its caches. The store asks the ledger first and calls
 * these only for room the ledger granted, so a storage never needs its own
 * accounting. `capacity` is in positions. A device storage may allocate
 * asynchronously (GPU buffers); a rejection gives the room back.
 */
export interface KvStorage<C> {
  /** Memory for a new session holding `capacity` positions. */
  allocate(capacity: number): C | Promise<C>;
  /** The session's memory with room for `capacity` positions, its first `keep` positions unchanged. May return `cache` itself; otherwise the store frees `cache` afterwards. */
  resize(cache: C, capacity: number, keep: number): C | Promise<C>;
  /** The session ended or was evicted (a GPU storage destroys its buffers here). */
  free(cache: C): void;
}

export interface KvSession<C = CpuKv> {
  readonly id: string;
  cache: C;
  /** Positions `cache` has room for. */
  capacity: number;
  /** Tokens held per layer: layers can differ when a request started inside the range. */
  readonly lengths: Int32Array;
}

/** CPU caches: keys[i] / values[i] belong to layer startLayer + i. */
export interface CpuKv {
  keys: Array<Float32Array | Uint16Array>;
  values: Array<Float32Array | Uint16Array>;
}

export interface CpuKvShape {
  layers: number;
  kvHeads: number;
  headDim: number;
  elem: KvElem;
}

/** Bytes one position costs across `layers` layers, keys and values. */
export function kvBytesPerToken(s: CpuKvShape): number {
  return 2 * s.layers * s.kvHeads * s.headDim * (s.elem === 'f16' ? 2 : 4);
}

export class CpuKvStorage implements KvStorage<CpuKv> {
  private readonly rowElems: number;
  constructor(private readonly s: CpuKvShape) {
    this.rowElems = s.kvHeads * s.headDim;
  }
  private array(positions: number): Float32Array | Uint16Array {
    const n = positions * this.rowElems;
    return this.s.elem === 'f16' ? new Uint16Array(n) : new Float32Array(n);
  }
  allocate(capacity: number): CpuKv {
    return { keys: Array.from({ length: this.s.layers }, () => this.array(capacity)), values: Array.from({ length: this.s.layers }, () => this.array(capacity)) };
  }
  resize(cache: CpuKv, capacity: number, keep: number): CpuKv {
    const n = keep * this.rowElems;
    const grow = (a: Float32Array | Uint16Array) => {
      const b = this.array(capacity);
      (b as Float32Array).set((a as Float32Array).subarray(0, n));
      return b;
    };
    return { keys: cache.keys.map(grow), values: cache.values.map(grow) };
  }
  free(): void {
    // Typed arrays go with their last reference.
  }
}

export interface KvStoreOptions extends Omit<KvLedgerOptions, 'now'> {
  layers: number;
  now?: () => number;
}

export interface KvStats extends KvLedgerStats {
  /** Bytes of positions actually written (≤ reserved). */
  usedBytes: number;
}

export class KvStore<C = CpuKv> {
  private readonly sessions = new Map<string, KvSession<C>>();
  readonly ledger: KvLedger;

  constructor(
    o: KvStoreOptions,
    private readonly storage: KvStorage<C>,
  ) {
    this.ledger = new KvLedger(o);
    this.layers = o.layers;
    this.ledger.onEvict = (id) => this.forget(id);
  }
  private readonly layers: number;

  /** The live session, marked as used now; undefined when unknown (never opened, ended, or evicted after idling past the TTL). */
  get(id: string): KvSession<C> | undefined {
    const s = this.sessions.get(id);
    if (s) this.ledger.touch(id);
    return s;
  }

  /** The live session without marking it used (a check, not a use). */
  peek(id: string): KvSession<C> | undefined {
    return this.sessions.get(id);
  }

  /**
   * The session with room for at least `tokens` positions: opened (admitted
   * by the ledger) when absent, grown when it holds less. Throws KvBusyError
   * when there is no room; a session that exists keeps what it had.
   */
  async open(id: string, tokens: number): Promise<KvSession<C>> {
    const existing = this.get(id);
    if (existing) {
      await this.ensure(existing, tokens, Math.max(0, ...existing.lengths));
      return existing;
    }
    const capacity = this.ledger.admit(id, tokens);
    let cache: C;
    try {
      cache = await this.storage.allocate(capacity);
    } catch (e) {
      this.ledger.release(id);
      throw e;
    }
    if (!this.ledger.has(id)) {
      // Dropped (DELETE /sessions) while its memory was being allocated.
      this.storage.free(cache);
      throw new MeshError('MESH_ERR_CANCELLED', `session ${id} ended while its KV cache was being allocated`);
    }
    const s: KvSession<C> = { id, cache, capacity, lengths: new Int32Array(this.layers) };
    this.sessions.set(id, s);
    return s;
  }

  /** Room for `tokens` positions, keeping the first `keep` (grows by whole blocks; KvBusyError when it cannot). */
  async ensure(s: KvSession<C>, tokens: number, keep: number): Promise<void> {
    if (tokens <= s.capacity) return;
    const before = s.capacity;
    const capacity = this.ledger.grow(s.id, tokens);
    let cache: C;
    try {
      cache = await this.storage.resize(s.cache, capacity, keep);
    } catch (e) {
      // Give back what the storage could not take; the session keeps its old room.
      this.ledger.shrink(s.id, before);
      throw e;
    }
    if (this.sessions.get(s.id) !== s) {
      // Dropped while it grew: its old memory is freed already.
      if (cache !== s.cache) this.storage.free(cache);
      throw new MeshError('MESH_ERR_CANCELLED', `session ${s.id} ended while its KV cache was growing`);
    }
    if (cache !== s.cache) this.storage.free(s.cache);
    s.cache = cache;
    s.capacity = capacity;
  }

  delete(id: string): boolean {
    this.ledger.release(id);
    return this.forget(id);
  }

  has(id: string): boolean {
    return this.sessions.has(id);
  }

  /** Every session ended (the executor is released): their memory is freed. */
  clear(): void {
    for (const id of [...this.sessions.keys()]) this.delete(id);
  }

  setBudget(bytes: number): void {
    this.ledger.setBudget(bytes);
  }

  stats(): KvStats {
    const l = this.ledger.stats();
    const perLayerToken = l.bytesPerToken / Math.max(1, this.layers);
    let used = 0;
    for (const s of this.sessions.values()) for (const n of s.lengths) used += n * perLayerToken;
    return { ...l, usedBytes: used };
  }

  private forget(id: string): boolean {
    const s = this.sessions.get(id);
    if (!s) return false;
    this.sessions.delete(id);
    this.storage.free(s.cache);
    return true;
  }
}
