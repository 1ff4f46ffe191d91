/**
 * The session and KV code both executors share (executor.ts over CPU
 * caches, fused-executor.ts over layer-kv.ts's buffers) and their batch
 * paths (packed-batch.ts, fused-batch.ts): the KV store sized from the
 * donor's budget less what the span holds, a session's room reserved and
 * checked against its position before anything runs, and what an executor
 * answers about its sessions. One place, so both executors admit, refuse
 * and count sessions alike.
 *
 * Cutting a session back (speculative decoding): a verification step
 * writes k + 1 positions and only the accepted ones stay. Caches are written
 * in place and read only up to a session's length (CPU arrays by their
 * filled prefix, GroupQueryAttention up to seqlens_k, the capture lane by
 * the owner's lengths), so cutting is setting the lengths: rows past them
 * are dead and the next step overwrites them.
 */
import { PositionMismatchError } from './errors.ts';
import { KV_DEFAULTS } from './kv-ledger.ts';
import { KvStore, type CpuKv, type KvSession, type KvStats, type KvStorage } from './kv-store.ts';

/** How an executor's caller sizes its KV store (the same options for every executor). */
export interface ExecutorKvOptions {
  /**
   * The donor's whole memory budget, bytes: the KV caches get what this
   * shard's weights leave (the meaning the tracker sizes spans by). Wins
   * over `kvBudgetBytes`.
   */
  memoryBudgetBytes?: number;
  /** Bytes for KV caches when no `memoryBudgetBytes` is given. @defaultValue 512 MiB */
  kvBudgetBytes?: number;
  /** A session idle this long may be dropped when room is needed, ms. @defaultValue 120000 (KV_DEFAULTS) */
  kvTtlMs?: number;
  /** KV room is granted in blocks of this many positions. @defaultValue 64 */
  kvBlockTokens?: number;
  /** What a MESH_ERR_BUSY refusal tells the caller to wait, ms. @defaultValue 1000 */
  kvRetryAfterMs?: number;
  now?: () => number;
}

/** What a memory budget leaves the KV caches once the shard's weights are held. */
export function kvBudgetFor(memoryBudgetBytes: number, weightBytes: number): number {
  return Math.max(0, Math.floor(memoryBudgetBytes - weightBytes));
}

export interface SessionKvSpan {
  startLayer: number;
  endLayer: number;
  /** Positions one session may reach. */
  maxContext: number;
  /** KV bytes of one position over every held layer. */
  bytesPerToken: number;
  /** Bytes the span holds besides the caches (its weights, a capture lane's buffers): the budget's share that KV cannot have. */
  heldBytes: number;
}

/** An executor's sessions: their KV store, admission and position checks. */
export class SessionKv<C = CpuKv> {
  readonly store: KvStore<C>;
  private readonly startLayer: number;
  private readonly maxContext: number;
  private readonly heldBytes: number;

  constructor(o: ExecutorKvOptions, span: SessionKvSpan, storage: KvStorage<C>) {
    this.startLayer = span.startLayer;
    this.maxContext = span.maxContext;
    this.heldBytes = span.heldBytes;
    this.store = new KvStore<C>(
      {
        layers: span.endLayer - span.startLayer,
        budgetBytes: o.memoryBudgetBytes !== undefined ? kvBudgetFor(o.memoryBudgetBytes, span.heldBytes) : (o.kvBudgetBytes ?? 512 * 2 ** 20),
        bytesPerToken: span.bytesPerToken,
        blockTokens: o.kvBlockTokens ?? KV_DEFAULTS.blockTokens,
        maxTokens: span.maxContext,
        idleTtlMs: o.kvTtlMs ?? KV_DEFAULTS.idleTtlMs,
        retryAfterMs: o.kvRetryAfterMs ?? KV_DEFAULTS.retryAfterMs,
        ...(o.now ? { now: o.now } : {}),
      },
      storage,
    );
  }

  /**
   * The session's cache for a call of `seq` rows at `position` over layers
   * [start, end): admitted by the ledger when it opens (room for what it
   * declares, or what this call needs; 503 MESH_ERR_BUSY when none), cut
   * back to `position` where it holds rows of an earlier verification up to
   * `rollbackFrom` (rollBack), checked to hold exactly `position` rows at
   * every layer of the call (409 otherwise), and grown by whole blocks to
   * hold the call.
   */
  async reserve(session: string, start: number, end: number, position: number, seq: number, declared: number | undefined, rollbackFrom?: number): Promise<KvSession<C>> {
    let s: KvSession<C> | undefined;
    if (position === 0) {
      // Admission happens here, before any compute: a refusal costs the caller one round trip.
      s = await this.store.open(session, Math.min(this.maxContext, Math.max(seq, declared ?? 0)));
      for (let l = start; l < end; l++) s.lengths[l - this.startLayer] = 0;
    } else {
      s = this.store.get(session);
      if (!s) throw new PositionMismatchError(session, position, 0);
      rollBack(s.lengths, start - this.startLayer, end - this.startLayer, position, rollbackFrom);
    }
    let actual = Infinity;
    for (let l = start; l < end; l++) actual = Math.min(actual, s.lengths[l - this.startLayer]!);
    for (let l = start; l < end; l++) if (s.lengths[l - this.startLayer] !== position) throw new PositionMismatchError(session, position, actual);
    // Past its room (an undeclared session, or one outgrowing its declaration): whole blocks more, or 503.
    await this.store.ensure(s, position + seq, Math.max(0, ...s.lengths));
    return s;
  }

  /** Tokens a session's cache holds at `layer` (default: the first held layer); 0 when unknown. */
  length(id: string, layer = this.startLayer): number {
    const s = this.store.get(id);
    return s ? s.lengths[layer - this.startLayer]! : 0;
  }

  /** Every held layer of a session cut to at most `length` (an executor's truncateSession); false for an unknown session or a bad length. */
  truncate(id: string, length: number): boolean {
    const s = this.store.get(id);
    return s !== undefined && truncateLengths(s.lengths, length);
  }

  drop(id: string): boolean {
    return this.store.delete(id);
  }

  stats(): KvStats {
    return this.store.stats();
  }

  /** The donor's budget changed: the KV caches get what the span's held bytes leave of it. Live sessions keep their room. */
  setMemoryBudget(bytes: number): void {
    this.store.setBudget(kvBudgetFor(bytes, this.heldBytes));
  }
}

/**
 * Layers [from, to) of `lengths` that hold more than `position` but at most
 * `rollbackFrom` are cut back to `position`. Any other length is left for
 * the caller's position check: one short of `position` (a lost step), or
 * past `rollbackFrom` (a stale or duplicated step), is still a 409.
 */
export function rollBack(lengths: Int32Array, from: number, to: number, position: number, rollbackFrom: number | undefined): void {
  if (rollbackFrom === undefined || !(rollbackFrom > position)) return;
  for (let i = from; i < to; i++) {
    const n = lengths[i]!;
    if (n > position && n <= rollbackFrom) lengths[i] = position;
  }
}

/** Every layer of a session cut to at most `length`; false for a negative or non-integer length. */
export function truncateLengths(lengths: Int32Array, length: number): boolean {
  if (!(Number.isInteger(length) && length >= 0)) return false;
  for (let i = 0; i < lengths.length; i++) if (lengths[i]! > length) lengths[i] = length;
  return true;
}
