/**
 * Cutting a session's KV cache back (speculative decoding): a verification
 * step writes k + 1 positions and only the accepted ones stay. Caches are
 * written in place and read only up to a session's length (CPU arrays by
 * their filled prefix, GroupQueryAttention up to seqlens_k, the capture lane
 * by the owner's lengths), so cutting is setting the lengths: rows past them
 * are dead and the next step overwrites them.
 */

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

/** Every layer of a session cut to at most `length` (an executor's truncateSession); false for a negative or non-integer length. */
export function truncateLengths(lengths: Int32Array, length: number): boolean {
  if (!(Number.isInteger(length) && length >= 0)) return false;
  for (let i = 0; i < lengths.length; i++) if (lengths[i]! > length) lengths[i] = length;
  return true;
}
