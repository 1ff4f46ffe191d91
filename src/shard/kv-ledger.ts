/**
 * KV-cache accounting, apart from the memory itself: which sessions hold how
 * many positions of room, against the node's KV budget. The storage (CPU
 * typed arrays in kv-store.ts; GPU buffers on a GPU backend) asks the ledger
 * before it allocates or grows, and frees what the ledger evicts.
 *
 *   admit(id, tokens)   a new session gets room for its declared positions
 *                       (prompt + max_tokens, which the head knows), rounded
 *                       up to whole blocks, or a KvBusyError at once
 *   grow(id, tokens)    a session that outgrows its room (or declared
 *                       nothing: an ADR-era caller) grows by whole blocks
 *                       while the budget allows, else KvBusyError
 *   touch / release     last use; the session ended
 *   shrink(id, tokens)  back to less room (a growth the storage failed)
 *
 * A live session is never evicted to make room (that turned into a storm of
 * 409 replays under load: every eviction made a head replay, and the replay
 * evicted the next session). Only sessions idle longer than `idleTtlMs` are
 * dropped, oldest first, and only when a new session or a growth needs their
 * room. As vLLM does, room comes in fixed blocks; as Petals does, a session
 * that cannot fit is refused instead of displacing another.
 */
import { MeshError } from '../protocol/errors.ts';

export interface KvLedgerOptions {
  /** Bytes the node gives KV caches (its memory budget minus the weights it holds). */
  budgetBytes: number;
  /** Bytes one position costs across every held layer, keys and values. */
  bytesPerToken: number;
  /** Room is granted in blocks of this many positions. @defaultValue 64 */
  blockTokens: number;
  /** Positions one session may ever reach (the executor's context). */
  maxTokens: number;
  /** A session idle this long may be dropped when room is needed, ms. @defaultValue 120000 */
  idleTtlMs: number;
  /** How long a refusal tells the caller to wait before trying again, ms. @defaultValue 1000 */
  retryAfterMs: number;
  now?: () => number;
}

export const KV_DEFAULTS = { blockTokens: 64, idleTtlMs: 120_000, retryAfterMs: 1_000 } as const;

export interface KvLedgerStats {
  sessions: number;
  /** Bytes granted to sessions (idle ones included). */
  reservedBytes: number;
  /** Of those, bytes of sessions idle past the TTL: dropped when room is needed. */
  idleBytes: number;
  budgetBytes: number;
  /** Budget − reserved + idle: what a new session can get now. */
  freeBytes: number;
  bytesPerToken: number;
  blockTokens: number;
  /** Positions one session may reach. */
  maxTokens: number;
  /** Idle sessions dropped to make room, since start. */
  evictions: number;
  /** Admissions and growths refused for lack of room (MESH_ERR_BUSY), since start. */
  refusals: number;
}

/** 503 MESH_ERR_BUSY: no room for this session now; nothing was evicted. Retry later or on another node. */
export class KvBusyError extends MeshError {
  constructor(message: string, details: { retry_after_ms: number; kv_needed_bytes: number; kv_free_bytes: number }) {
    super('MESH_ERR_BUSY', message, details);
  }
}

interface Entry {
  /** Positions of room granted. */
  tokens: number;
  lastUsed: number;
}

export class KvLedger {
  // Insertion order is last-use order (touch re-inserts): iteration yields the longest idle first.
  private readonly entries = new Map<string, Entry>();
  private reserved = 0;
  private evictions = 0;
  private refusals = 0;
  private readonly now: () => number;
  /** Called for each session dropped to make room, so the storage frees it. */
  onEvict: (id: string) => void = () => {};

  constructor(private readonly o: KvLedgerOptions) {
    for (const k of ['bytesPerToken', 'blockTokens', 'maxTokens'] as const) {
      if (!(Number.isInteger(o[k]) && o[k] > 0)) throw new RangeError(`KV ledger option ${k} must be a positive integer, got ${o[k]}`);
    }
    if (!(o.budgetBytes >= 0)) throw new RangeError(`KV budget must be ≥ 0 bytes, got ${o.budgetBytes}`);
    this.now = o.now ?? (() => Date.now());
  }

  get budgetBytes(): number {
    return this.o.budgetBytes;
  }

  /** A new budget (the donor moved the slider): live sessions keep their room even when it now exceeds it. */
  setBudget(bytes: number): void {
    if (!(bytes >= 0)) throw new RangeError(`KV budget must be ≥ 0 bytes, got ${bytes}`);
    this.o.budgetBytes = bytes;
  }

  has(id: string): boolean {
    return this.entries.has(id);
  }

  /** Positions of room the session holds; 0 when unknown. */
  capacity(id: string): number {
    return this.entries.get(id)?.tokens ?? 0;
  }

  /** Whole blocks covering `tokens`, never past the context. */
  roundUp(tokens: number): number {
    const b = this.o.blockTokens;
    return Math.min(this.o.maxTokens, Math.max(b, Math.ceil(tokens / b) * b));
  }

  /**
   * Room for a new session of `tokens` positions (or more room for a known
   * one); returns the positions granted. Throws KvBusyError when it does not
   * fit even after dropping idle sessions, and MESH_ERR_TOO_LARGE when it
   * could never fit this node.
   */
  admit(id: string, tokens: number): number {
    if (this.entries.has(id)) return this.grow(id, tokens);
    const want = this.roundUp(tokens);
    const need = want * this.o.bytesPerToken;
    if (need > this.o.budgetBytes) {
      throw new MeshError('MESH_ERR_TOO_LARGE', `a session of ${want} positions needs ${need} bytes of KV cache; this node's whole KV budget is ${this.o.budgetBytes}`, { kv_needed_bytes: need, kv_budget_bytes: this.o.budgetBytes });
    }
    this.makeRoom(need, undefined, () => `no KV room for a new session of ${want} positions`);
    this.entries.set(id, { tokens: want, lastUsed: this.now() });
    this.reserved += need;
    return want;
  }

  /** Room for `tokens` positions in a live session, in whole blocks; returns the positions it now holds. */
  grow(id: string, tokens: number): number {
    const e = this.entries.get(id);
    if (!e) throw new MeshError('MESH_ERR_INTERNAL', `KV ledger: grow of unknown session ${id}`);
    if (tokens <= e.tokens) return e.tokens;
    if (tokens > this.o.maxTokens) throw new MeshError('MESH_ERR_TOO_LARGE', `positions up to ${tokens} exceed the context of ${this.o.maxTokens}`);
    const want = this.roundUp(tokens);
    const need = (want - e.tokens) * this.o.bytesPerToken;
    this.makeRoom(need, id, () => `session ${id} holds ${e.tokens} positions and cannot grow to ${want}`);
    e.tokens = want;
    this.reserved += need;
    return want;
  }

  /** Back to `tokens` positions of room (a growth the storage could not carry out); never refuses. */
  shrink(id: string, tokens: number): void {
    const e = this.entries.get(id);
    if (!e || tokens >= e.tokens) return;
    this.reserved -= (e.tokens - tokens) * this.o.bytesPerToken;
    e.tokens = tokens;
  }

  touch(id: string): void {
    const e = this.entries.get(id);
    if (!e) return;
    e.lastUsed = this.now();
    this.entries.delete(id);
    this.entries.set(id, e);
  }

  release(id: string): boolean {
    const e = this.entries.get(id);
    if (!e) return false;
    this.entries.delete(id);
    this.reserved -= e.tokens * this.o.bytesPerToken;
    return true;
  }

  stats(): KvLedgerStats {
    const cutoff = this.now() - this.o.idleTtlMs;
    let idle = 0;
    for (const e of this.entries.values()) {
      if (e.lastUsed >= cutoff) break; // last-use order: the rest are newer
      idle += e.tokens * this.o.bytesPerToken;
    }
    return {
      sessions: this.entries.size,
      reservedBytes: this.reserved,
      idleBytes: idle,
      budgetBytes: this.o.budgetBytes,
      freeBytes: Math.max(0, this.o.budgetBytes - this.reserved + idle),
      bytesPerToken: this.o.bytesPerToken,
      blockTokens: this.o.blockTokens,
      maxTokens: this.o.maxTokens,
      evictions: this.evictions,
      refusals: this.refusals,
    };
  }

  /** Frees `need` bytes by dropping sessions idle past the TTL, longest idle first; refuses when that is not enough. */
  private makeRoom(need: number, keep: string | undefined, what: () => string): void {
    if (this.reserved + need <= this.o.budgetBytes) return;
    const cutoff = this.now() - this.o.idleTtlMs;
    let reclaimable = 0;
    for (const [id, e] of this.entries) {
      if (e.lastUsed >= cutoff) break;
      if (id !== keep) reclaimable += e.tokens * this.o.bytesPerToken;
    }
    if (this.reserved - reclaimable + need > this.o.budgetBytes) {
      this.refusals++;
      const free = Math.max(0, this.o.budgetBytes - this.reserved + reclaimable);
      throw new KvBusyError(`${what()}: it needs ${need} bytes, ${free} of ${this.o.budgetBytes} are free, and this node never evicts a live session; retry later or elsewhere`, {
        retry_after_ms: this.o.retryAfterMs,
        kv_needed_bytes: need,
        kv_free_bytes: free,
      });
    }
    for (const [id, e] of [...this.entries]) {
      if (this.reserved + need <= this.o.budgetBytes || e.lastUsed >= cutoff) break;
      if (id === keep) continue;
      this.release(id);
      this.evictions++;
      this.onEvict(id);
    }
  }
}
