/**
 * Input buffers of an executor's batches, kept between steps.
 *
 * A batched step feeds onnxruntime tensors of ΣP rows per layer (the packed
 * pasts of packed-batch.ts, the gathered caches of fused-batch.ts on a CPU
 * backend). Fresh arrays cost a zero-filled allocation per layer per step —
 * megabytes per step at 8 chats — and the garbage collector then runs on the
 * external memory they add up to: in an 8-chat mesh that was the largest
 * cost of a hop outside onnxruntime (bench/profile-chats.ts).
 *
 * An executor runs one batch at a time (BatchQueue) and a backend reads its
 * inputs during run(), so a buffer is free again once the step it fed is
 * over. Capacity grows to half again what a step needs and shrinks when a
 * step needs under a quarter of it; a buffer no step has asked for in
 * IDLE_MS is dropped, so a burst of long chats does not pin its peak.
 * The buffers are outside the KV ledger's budget, as the per-step arrays
 * they replace were.
 */

/** A buffer unused this long is let go (ms). */
export const SCRATCH_IDLE_MS = 5_000;

type Scratch = Float32Array | Uint16Array;

export class BatchScratch {
  private readonly bufs = new Map<string, { buf: Scratch; usedAt: number }>();
  private timer: ReturnType<typeof setTimeout> | undefined;

  constructor(private readonly idleMs = SCRATCH_IDLE_MS, private readonly now: () => number = () => performance.now()) {}

  /**
   * `elems` elements of the buffer kept under `key` (16-bit storage when `f16`).
   * Its contents are stale: the caller overwrites what it reads, or the reader
   * is bounded (GQA's seqlens_k).
   */
  take(key: string, elems: number, f16: boolean): Scratch {
    let e = this.bufs.get(key);
    if (!e || e.buf instanceof Uint16Array !== f16 || e.buf.length < elems || e.buf.length > 4 * elems + 4096) {
      const cap = Math.ceil(elems * 1.5) + 1024;
      e = { buf: f16 ? new Uint16Array(cap) : new Float32Array(cap), usedAt: 0 };
      this.bufs.set(key, e);
    }
    e.usedAt = this.now();
    this.schedule();
    return e.buf.subarray(0, elems);
  }

  /** Elements held, all buffers together (tests, diagnostics). */
  get heldElements(): number {
    let n = 0;
    for (const e of this.bufs.values()) n += e.buf.length;
    return n;
  }

  /** Drops the buffers unused for `idleMs`; returns how many it dropped. */
  sweep(): number {
    const cut = this.now() - this.idleMs;
    let n = 0;
    for (const [k, e] of this.bufs) {
      if (e.usedAt <= cut) {
        this.bufs.delete(k);
        n++;
      }
    }
    return n;
  }

  /** Drops every buffer now (otherwise the idle sweep does, IDLE_MS after the last step). */
  clear(): void {
    this.bufs.clear();
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
  }

  private schedule(): void {
    if (this.timer !== undefined) return;
    this.timer = setTimeout(() => {
      this.timer = undefined;
      this.sweep();
      if (this.bufs.size > 0) this.schedule();
    }, this.idleMs);
    // Never keep a Node.js process alive for it (browsers have no unref).
    (this.timer as { unref?: () => void }).unref?.();
  }
}
