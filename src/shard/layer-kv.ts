/**
 * KV caches for fused layer graphs (fused-graph.ts): per layer one key and
 * one value buffer [kvHeads, capacity, headDim] that GroupQueryAttention
 * reads as its past and writes as its present in place. On a device backend
 * the buffers are GPU memory and never cross to the CPU; on a CPU backend
 * they are Float32Arrays.
 *
 * Reservation-shaped, so it can sit under any admission policy: a session
 * reserves what its first call needs (rounded up to a block), grows in
 * blocks when a call would run past its capacity (doubling, capped at
 * maxContext), and is released when done. Growing reallocates and copies
 * each head's filled rows, because capacity is the row stride of the layout
 * GroupQueryAttention expects.
 *
 * A byte budget bounds the caches; a reservation that does not fit first
 * drops sessions idle past the TTL, then the least recently used others.
 */
import type { DeviceMemory, DeviceTensor } from './backend.ts';
import { tooLargeError } from './errors.ts';
import type { KvStats } from './kv-store.ts';

export type KvBuffer = Float32Array | DeviceTensor;

export interface KvReservation {
  readonly id: string;
  /** Positions each buffer holds. */
  capacity: number;
  /** Tokens written per held layer (layers differ when a call started inside the span). */
  readonly lengths: Int32Array;
  keys: KvBuffer[];
  values: KvBuffer[];
  lastUsed: number;
  bytes: number;
}

export interface LayerKvOptions {
  layers: number;
  kvHeads: number;
  headDim: number;
  maxContext: number;
  budgetBytes: number;
  ttlMs: number;
  /** Capacities are multiples of this many positions; default 64. */
  block?: number;
  /** Device memory for the buffers; host Float32Arrays when absent. */
  device?: DeviceMemory;
  now?: () => number;
}

export class LayerKvPool {
  private readonly sessions = new Map<string, KvReservation>(); // insertion order = LRU order
  private bytesUsed = 0;
  private evictions = 0;
  private readonly block: number;
  private readonly now: () => number;
  private readonly rowBytes: number;

  constructor(private readonly o: LayerKvOptions) {
    this.block = o.block ?? 64;
    this.now = o.now ?? (() => Date.now());
    this.rowBytes = o.kvHeads * o.headDim * 4;
  }

  /** Bytes of a reservation of `capacity` positions (keys and values, every layer). */
  bytesFor(capacity: number): number {
    return 2 * this.o.layers * capacity * this.rowBytes;
  }

  get(id: string): KvReservation | undefined {
    const r = this.sessions.get(id);
    if (!r) return undefined;
    const t = this.now();
    if (t - r.lastUsed > this.o.ttlMs) {
      this.drop(id, true);
      return undefined;
    }
    this.sessions.delete(id);
    this.sessions.set(id, r);
    r.lastUsed = t;
    return r;
  }

  /** A fresh reservation for at least `tokens` positions (an existing one of that id is released first). */
  async reserve(id: string, tokens: number): Promise<KvReservation> {
    this.drop(id, false);
    const capacity = this.capacityFor(tokens);
    const bytes = this.bytesFor(capacity);
    this.makeRoom(bytes, id);
    const layers = this.o.layers;
    const keys: KvBuffer[] = [];
    const values: KvBuffer[] = [];
    try {
      for (let i = 0; i < layers; i++) {
        keys.push(await this.alloc(capacity));
        values.push(await this.alloc(capacity));
      }
    } catch (e) {
      for (const b of [...keys, ...values]) free(b);
      throw e;
    }
    const r: KvReservation = { id, capacity, lengths: new Int32Array(layers), keys, values, lastUsed: this.now(), bytes };
    this.sessions.set(id, r);
    this.bytesUsed += bytes;
    return r;
  }

  /** Makes `r` hold at least `tokens` positions, keeping every written row. */
  async grow(r: KvReservation, tokens: number): Promise<void> {
    if (tokens <= r.capacity) return;
    const capacity = Math.max(this.capacityFor(tokens), Math.min(this.o.maxContext, r.capacity * 2));
    const bytes = this.bytesFor(capacity);
    this.makeRoom(bytes - r.bytes, r.id);
    const next = { keys: [] as KvBuffer[], values: [] as KvBuffer[] };
    try {
      for (let i = 0; i < this.o.layers; i++) {
        next.keys.push(await this.alloc(capacity));
        next.values.push(await this.alloc(capacity));
      }
    } catch (e) {
      for (const b of [...next.keys, ...next.values]) free(b);
      throw e;
    }
    const ops: { src: DeviceTensor; srcByte: number; dst: DeviceTensor; dstByte: number; bytes: number }[] = [];
    const D = this.o.headDim;
    for (let i = 0; i < this.o.layers; i++) {
      const rows = r.lengths[i]!;
      if (rows === 0) continue;
      for (const [from, to] of [
        [r.keys[i]!, next.keys[i]!],
        [r.values[i]!, next.values[i]!],
      ] as const) {
        for (let h = 0; h < this.o.kvHeads; h++) {
          if (from instanceof Float32Array) (to as Float32Array).set(from.subarray(h * r.capacity * D, (h * r.capacity + rows) * D), h * capacity * D);
          else ops.push({ src: from, srcByte: h * r.capacity * D * 4, dst: to as DeviceTensor, dstByte: h * capacity * D * 4, bytes: rows * D * 4 });
        }
      }
    }
    this.o.device?.copy(ops);
    for (const b of [...r.keys, ...r.values]) free(b);
    r.keys = next.keys;
    r.values = next.values;
    this.bytesUsed += bytes - r.bytes;
    r.bytes = bytes;
    r.capacity = capacity;
  }

  release(id: string): boolean {
    return this.drop(id, false);
  }

  /** Frees every buffer (the executor is being released). */
  clear(): void {
    for (const id of [...this.sessions.keys()]) this.drop(id, false);
  }

  stats(): KvStats {
    return { sessions: this.sessions.size, bytesUsed: this.bytesUsed, budgetBytes: this.o.budgetBytes, bytesPerSession: this.bytesFor(this.o.maxContext), evictions: this.evictions };
  }

  private capacityFor(tokens: number): number {
    if (tokens > this.o.maxContext) throw tooLargeError(`${tokens} positions exceed the context of ${this.o.maxContext}`);
    return Math.min(this.o.maxContext, Math.max(this.block, Math.ceil(tokens / this.block) * this.block));
  }

  private makeRoom(bytes: number, keep: string): void {
    if (bytes > this.o.budgetBytes) throw tooLargeError(`one session needs ${bytes} bytes of KV cache, over the budget of ${this.o.budgetBytes}`);
    const t = this.now();
    for (const [id, r] of this.sessions) if (id !== keep && t - r.lastUsed > this.o.ttlMs) this.drop(id, true);
    for (const id of [...this.sessions.keys()]) {
      if (this.bytesUsed + bytes <= this.o.budgetBytes) break;
      if (id !== keep) this.drop(id, true);
    }
    if (this.bytesUsed + bytes > this.o.budgetBytes) throw tooLargeError(`${bytes} more bytes of KV cache do not fit the budget of ${this.o.budgetBytes}`);
  }

  private async alloc(capacity: number): Promise<KvBuffer> {
    const dims = [1, this.o.kvHeads, capacity, this.o.headDim];
    if (this.o.device) return this.o.device.alloc('float32', dims);
    return new Float32Array(this.o.kvHeads * capacity * this.o.headDim);
  }

  private drop(id: string, evicted: boolean): boolean {
    const r = this.sessions.get(id);
    if (!r) return false;
    this.sessions.delete(id);
    this.bytesUsed -= r.bytes;
    for (const b of [...r.keys, ...r.values]) free(b);
    if (evicted) this.evictions++;
    return true;
  }
}

function free(b: KvBuffer): void {
  if (!(b instanceof Float32Array)) b.dispose();
}
