/**
 * The hand check of a cluster's `seen` batches (cluster/doc.ts plainSeen)
 * takes only what seenSchema takes and gives it back unchanged; anything
 * else it leaves to the schema. The usual batch must pass it (else every
 * batch pays zod again).
 */
import { describe, expect, it } from 'vitest';
import { plainSeen, seenSchema } from '../../src/tracker/cluster/doc.ts';

const id = (i: number) => i.toString(16).padStart(32, '0');
const good = () => ({ v: 1, by: 'a'.repeat(32), interval_ms: 5000, behind: false, ids: Array.from({ length: 50 }, (_, i) => id(i)) });

describe('plainSeen', () => {
  it('passes the usual batch (empty too) as the schema gives it', () => {
    for (const b of [good(), { ...good(), ids: [] }, { ...good(), behind: true, interval_ms: 7500.5 }]) {
      const s = plainSeen(b);
      expect(s).toBeDefined();
      expect(s).toEqual(seenSchema.parse(b));
    }
  });

  it('leaves anything unusual to the schema, and never takes what it refuses', () => {
    const mutations: Array<Record<string, unknown>> = [
      { ...good(), extra: 1 },
      { ...good(), v: 2 },
      { ...good(), by: 'A'.repeat(32) },
      { ...good(), by: 'a'.repeat(31) },
      { ...good(), interval_ms: 0 },
      { ...good(), interval_ms: -5 },
      { ...good(), interval_ms: Infinity },
      { ...good(), interval_ms: '5000' },
      { ...good(), behind: 'no' },
      { ...good(), ids: 'x' },
      { ...good(), ids: [id(1), 7] },
      { ...good(), ids: [id(1), 'g'.repeat(32)] },
      { ...good(), ids: Array.from({ length: 100_001 }, () => id(1)) },
      (({ behind: _, ...rest }) => rest)(good()),
      (({ ids: _, ...rest }) => ({ ...rest, other: [] }))(good()),
    ];
    for (const m of mutations) {
      expect(plainSeen(m)).toBeUndefined();
      const z = seenSchema.safeParse(m);
      // What the hand check leaves is the schema's to judge: here the schema refuses all but the extra key (stripped).
      expect(z.success).toBe(Object.hasOwn(m, 'extra'));
    }
    for (const x of [null, [], 'seen', 1]) expect(plainSeen(x)).toBeUndefined();
  });
});
