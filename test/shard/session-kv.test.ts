/**
 * SessionKv's rollback (speculative decoding): a step's rollbackFrom cuts a
 * session back to the step's position only when the cache holds at most
 * rollbackFrom rows; anything else is still the caller's 409, and
 * truncate() cuts every layer.
 */
import { describe, expect, it } from 'vitest';
import { PositionMismatchError } from '../../src/shard/errors.ts';
import { CpuKvStorage, kvBytesPerToken } from '../../src/shard/kv-store.ts';
import { SessionKv, rollBack, truncateLengths } from '../../src/shard/session-kv.ts';

const shape = { layers: 3, kvHeads: 2, headDim: 4, elem: 'f32' as const };
/** Layers [2, 5) held, as a middle hop's span. */
function sessions(): SessionKv {
  return new SessionKv({ kvBudgetBytes: 1 << 20 }, { startLayer: 2, endLayer: 5, maxContext: 64, bytesPerToken: kvBytesPerToken(shape), heldBytes: 0 }, new CpuKvStorage(shape));
}

/** A session whose cache holds `rows` rows on every layer, as after a step of that many rows. */
async function holding(kv: SessionKv, id: string, rows: number): Promise<void> {
  const s = await kv.reserve(id, 2, 5, 0, rows, 32);
  s.lengths.fill(rows);
}

describe('SessionKv rollback', () => {
  it('a step with rollbackFrom cuts rows of a verification back to its position, then runs', async () => {
    const kv = sessions();
    await holding(kv, 's', 10); // e.g. a verification fed rows 5..9 and only 5..6 were kept
    const s = await kv.reserve('s', 2, 5, 7, 4, undefined, 10);
    expect([...s.lengths]).toEqual([7, 7, 7]);
    expect(kv.length('s')).toBe(7);
  });

  it('without rollbackFrom, or when the cache holds more than rollbackFrom (a stale step), it is a 409', async () => {
    const kv = sessions();
    await holding(kv, 's', 10);
    await expect(kv.reserve('s', 2, 5, 7, 1, undefined)).rejects.toBeInstanceOf(PositionMismatchError);
    await expect(kv.reserve('s', 2, 5, 7, 1, undefined, 9)).rejects.toBeInstanceOf(PositionMismatchError);
    expect(kv.length('s')).toBe(10);
    // A step ahead of the cache (a lost step) is never "rolled back" into place.
    await expect(kv.reserve('s', 2, 5, 12, 1, undefined, 14)).rejects.toMatchObject({ actualLength: 10 });
  });

  it('a repeat of the same step is idempotent: it cuts what the first run wrote and runs again', async () => {
    const kv = sessions();
    await holding(kv, 's', 7);
    const s = await kv.reserve('s', 2, 5, 7, 3, undefined, 10);
    s.lengths.fill(10); // the step ran
    const again = await kv.reserve('s', 2, 5, 7, 3, undefined, 10);
    expect([...again.lengths]).toEqual([7, 7, 7]);
  });

  it('cuts only the layers of the call: a call over [3, 5) leaves layer 2 alone', async () => {
    const kv = sessions();
    await holding(kv, 's', 10);
    const s = await kv.reserve('s', 3, 5, 6, 1, undefined, 10);
    expect([...s.lengths]).toEqual([10, 6, 6]);
  });

  it('truncate cuts every layer to at most the length; unknown sessions and bad lengths are refused', async () => {
    const kv = sessions();
    await holding(kv, 's', 10);
    expect(kv.truncate('nope', 3)).toBe(false);
    expect(kv.truncate('s', -1)).toBe(false);
    expect(kv.truncate('s', 2.5)).toBe(false);
    expect(kv.length('s')).toBe(10);
    expect(kv.truncate('s', 4)).toBe(true);
    expect(kv.length('s', 4)).toBe(4);
    expect(kv.truncate('s', 8)).toBe(true); // never grows a session
    expect(kv.length('s')).toBe(4);
  });

  it('rollBack and truncateLengths on raw lengths', () => {
    const l = Int32Array.from([9, 8, 6, 5]);
    rollBack(l, 0, 4, 6, 8); // 9 > rollbackFrom stays; 8 cut; 6 already there; 5 short stays
    expect([...l]).toEqual([9, 6, 6, 5]);
    rollBack(l, 0, 4, 6, 6); // rollbackFrom ≤ position: nothing to cut
    expect([...l]).toEqual([9, 6, 6, 5]);
    expect(truncateLengths(l, 5)).toBe(true);
    expect([...l]).toEqual([5, 5, 5, 5]);
  });
});
