/**
 * The KV ledger alone (accounting, no memory): blocks, the context cap,
 * refusals that leave every session as it was, idle room counted as free,
 * and a budget lowered under live sessions.
 */
import { describe, expect, it } from 'vitest';
import { KvBusyError, KvLedger } from '../../src/shard/kv-ledger.ts';
import type { MeshError } from '../../src/protocol/errors.ts';

function ledger(over: Partial<ConstructorParameters<typeof KvLedger>[0]> = {}, clock = { now: 0 }) {
  return new KvLedger({ budgetBytes: 1000, bytesPerToken: 10, blockTokens: 16, maxTokens: 40, idleTtlMs: 100, retryAfterMs: 1500, now: () => clock.now, ...over });
}

function thrown(f: () => unknown): MeshError {
  try {
    f();
  } catch (e) {
    return e as MeshError;
  }
  throw new Error('expected a throw');
}

describe('KvLedger', () => {
  it('grants whole blocks, never past the context', () => {
    const l = ledger();
    expect(l.admit('a', 1)).toBe(16);
    expect(l.grow('a', 17)).toBe(32);
    expect(l.grow('a', 33)).toBe(40); // the context, not a third full block
    expect(l.stats()).toMatchObject({ sessions: 1, reservedBytes: 400, freeBytes: 600 });
    expect(thrown(() => l.grow('a', 41)).code).toBe('MESH_ERR_TOO_LARGE');
  });

  it('refuses with KvBusyError and changes nothing, then admits once room is released', () => {
    const l = ledger({ budgetBytes: 480 });
    l.admit('a', 32);
    l.admit('b', 16);
    const err = thrown(() => l.admit('c', 1));
    expect(err).toBeInstanceOf(KvBusyError);
    expect(err).toMatchObject({ code: 'MESH_ERR_BUSY', status: 503 });
    expect(err.details).toEqual({ retry_after_ms: 1500, kv_needed_bytes: 160, kv_free_bytes: 0 });
    expect(thrown(() => l.grow('b', 17)).code).toBe('MESH_ERR_BUSY');
    expect(l.capacity('b')).toBe(16);
    expect(l.stats()).toMatchObject({ sessions: 2, reservedBytes: 480, refusals: 2, evictions: 0 });
    expect(l.release('a')).toBe(true);
    expect(l.release('a')).toBe(false);
    expect(l.admit('c', 1)).toBe(16);
  });

  it('counts sessions idle past the TTL as free, and drops them longest idle first only for room', () => {
    const clock = { now: 0 };
    const evicted: string[] = [];
    const l = ledger({ budgetBytes: 480 }, clock);
    l.onEvict = (id) => evicted.push(id);
    l.admit('a', 16);
    clock.now = 10;
    l.admit('b', 16);
    clock.now = 20;
    l.admit('c', 16);
    l.touch('a'); // a is now the most recent
    clock.now = 200;
    expect(l.stats()).toMatchObject({ reservedBytes: 480, idleBytes: 480, freeBytes: 480 });
    l.admit('d', 16);
    expect(evicted).toEqual(['b']);
    l.admit('e', 32);
    expect(evicted).toEqual(['b', 'c', 'a']);
    expect(l.stats()).toMatchObject({ sessions: 2, evictions: 3 });
  });

  it('keeps live sessions when the budget drops under them; new ones wait for room', () => {
    const l = ledger();
    l.admit('a', 40);
    l.setBudget(200);
    expect(l.stats()).toMatchObject({ sessions: 1, reservedBytes: 400, budgetBytes: 200, freeBytes: 0 });
    expect(thrown(() => l.admit('b', 1)).code).toBe('MESH_ERR_BUSY');
    l.release('a');
    expect(l.admit('b', 1)).toBe(16);
  });
});
