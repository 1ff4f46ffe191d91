/**
 * The hand check of heartbeats (src/protocol/node-message-check.ts) may only
 * take what the zod schemas take and give back the same: over a swarm
 * donor's message, a node's, and hundreds of mutations of them (missing,
 * wrong-typed, out-of-range and unknown fields at every level), whatever the
 * hand check accepts, zod accepts with an equal result. And a malformed beat
 * inside a batch is still answered alone, with the schema's clear error.
 */
import { describe, expect, it } from 'vitest';
import { beatBatchSchema } from '../../src/protocol/beat-batch.ts';
import { plainBeatBatch, plainNodeBeat, plainNodeMessage } from '../../src/protocol/node-message-check.ts';
import { nodeBeatSchema, nodeMessageSchema } from '../../src/protocol/tracker.ts';
import { FakeNode, makeTracker } from '../helpers/tracker.ts';

const peer = 'ab'.repeat(16);
/** As bench/lib/swarm-donors.ts sends it. */
const donor = {
  peer_id: peer,
  public_key: 'k'.repeat(43),
  relay_addr: `ws://127.0.0.1:9/rpc/${peer}`,
  info: { model: 'swarm', backend: 'webgpu', memory_budget_mb: 2048, host: 'browser', version: 'swarm-sim', weight_format: 'q4' },
  stats: { rpm: 0, layer_ms: 4, queue_depth: 0, kv_free_bytes: 1e8, tokens_served: 0, kv_budget_bytes: 1e8, kv_used_bytes: 0, kv_sessions: 0, kv_bytes_per_token: 131072, kv_block_tokens: 16, kv_max_tokens: 8192 },
  serving: { start_layer: 0, end_layer: 4 },
  timestamp: 1_764_000_000_000,
};
/** A serving head's, as src/node/runtime/node-message.ts builds it once it has sent hops: every optional field. */
const node = {
  ...donor,
  endpoint: 'http://127.0.0.1:1234',
  relay_connected: true,
  draining: false,
  stored: null,
  info: { ...donor.info, host: 'node', pinned: false, duty_cycle: 0.5 },
  stats: {
    ...donor.stats,
    batch_sizes: [0, 5, 2],
    speculation: { drafted: 12, accepted: 9, trips: 4, tokens: 13 },
    hops_sent: { rtc: 1, fast: 3, rpc: 0, link: 0, direct: 0 },
    hop_paths: [
      { peer_id: 'cd'.repeat(16), path: 'fast', sent: { rtc: 0, fast: 3, rpc: 0, link: 0, direct: 0 } },
      { peer_id: 'ef'.repeat(16), path: 'rtc', rtc: 'open', sent: { rtc: 1 } },
    ],
  },
};

const BAD: unknown[] = [undefined, null, true, false, 0, -1, 0.5, 1.5, 2 ** 53, 1e300, -0.01, '', 'x', 'q4', 'node', 'a'.repeat(41), 'a'.repeat(201), 'a'.repeat(501), [], [1], {}, { start_layer: 0 }, { start_layer: 0, end_layer: 0 }, { start_layer: 1, end_layer: 2, x: 1 }];

/** Every mutation of `o` one field deep at each level: each key deleted, set to each BAD value, and an unknown key added. */
function* mutations(o: Record<string, unknown>): Generator<Record<string, unknown>> {
  for (const k of Object.keys(o)) {
    const { [k]: _gone, ...rest } = o;
    yield rest;
    for (const v of BAD) yield { ...o, [k]: v };
    const inner = o[k];
    if (Array.isArray(inner)) {
      // Each object in an array (hop_paths) mutated in place too.
      for (const [i, el] of inner.entries()) {
        if (el && typeof el === 'object') for (const m of mutations(el as Record<string, unknown>)) yield { ...o, [k]: inner.map((x, j) => (j === i ? m : x)) };
      }
    } else if (inner && typeof inner === 'object') for (const m of mutations(inner as Record<string, unknown>)) yield { ...o, [k]: m };
  }
  yield { ...o, extra: 1 };
}

describe('the hand check of heartbeats', () => {
  it('takes a donor\'s beat as is and agrees with zod on every mutation', () => {
    expect(plainNodeMessage(donor)).toBe(donor);
    expect(nodeMessageSchema.parse(donor)).toEqual(donor);
    let taken = 0;
    let total = 0;
    for (const base of [donor, node]) {
      for (const m of mutations(base)) {
        total++;
        const fast = plainNodeMessage(m);
        if (fast === undefined) continue;
        taken++;
        const z = nodeMessageSchema.safeParse(m);
        expect(z.success, JSON.stringify(m)).toBe(true);
        expect(fast).toEqual(z.data);
      }
    }
    // Some mutations are still valid (an optional field dropped, another value in range) and pass; most do not.
    expect(taken).toBeGreaterThan(10);
    expect(total).toBeGreaterThan(500);
    // A serving head's beat, with its hop paths and speculation, takes the hand check as is too.
    expect(plainNodeMessage(node)).toBe(node);
    expect(nodeMessageSchema.parse(node)).toEqual(node);
    // Past the schema's 32 hop paths, or with a speculation counter missing: the schema decides (and refuses).
    for (const m of [{ ...node, stats: { ...node.stats, hop_paths: new Array(33).fill(node.stats.hop_paths[0]) } }, { ...node, stats: { ...node.stats, speculation: { drafted: 1, accepted: 1, trips: 1 } } }]) {
      expect(plainNodeMessage(m)).toBeUndefined();
      expect(nodeMessageSchema.safeParse(m).success).toBe(false);
    }
  });

  it('takes a beat that names what it left out (same) as is and agrees with zod on every mutation', () => {
    /** `base` less `same`'s fields, naming them. */
    const less = (base: Record<string, unknown>, same: string[]): Record<string, unknown> => {
      const m: Record<string, unknown> = { ...base, same };
      for (const f of same) delete m[f];
      return m;
    };
    const idle = less(donor, ['public_key', 'info', 'relay_addr', 'stats']);
    const serving = less(node, ['public_key', 'info', 'endpoint', 'stored']);
    expect(plainNodeBeat(idle)).toBe(idle);
    expect(nodeBeatSchema.parse(idle)).toEqual(idle);
    expect(plainNodeBeat(serving)).toBe(serving);
    // A full message is a beat too; a NodeMessage never has same.
    expect(plainNodeBeat(donor)).toBe(donor);
    expect(plainNodeMessage(idle)).toBeUndefined();
    expect(nodeMessageSchema.safeParse(donor).success).toBe(true);
    let taken = 0;
    const extra: Array<Record<string, unknown>> = [
      { ...idle, same: ['info', 'info', 'public_key'] },
      { ...idle, same: ['info', 'timestamp', 'public_key'] },
      { ...idle, info: donor.info },
      { ...idle, same: ['public_key'] },
      { ...idle, same: ['info'] },
      { ...idle, same: new Array(7).fill('info') },
      { ...idle, same: 'info' },
      { ...serving, stored: null },
    ];
    for (const m of [...mutations(idle), ...mutations(serving), ...extra]) {
      const fast = plainNodeBeat(m);
      const z = nodeBeatSchema.safeParse(m);
      if (fast === undefined) continue;
      taken++;
      expect(z.success, JSON.stringify(m)).toBe(true);
      expect(fast).toEqual(z.data);
    }
    expect(taken).toBeGreaterThan(10);
    // Each malformed extra is refused by the schema (the hand check leaves it to it).
    for (const m of extra) expect(nodeBeatSchema.safeParse(m).success, JSON.stringify(m)).toBe(false);
  });

  it('takes a relay\'s usual batch as is and leaves anything else to the schema', () => {
    const good = { type: 'beats', batch: 7, beats: [{ from: peer, body: donor }, { from: peer, body: { nope: 1 } }] };
    expect(plainBeatBatch(good)).toEqual({ batch: 7, beats: good.beats });
    for (const m of [...mutations(good), { ...good, beats: [{ from: 'XYZ', body: {} }] }, { ...good, beats: [{ from: peer }] }, { ...good, beats: [{ from: peer, body: 1, x: 2 }] }, { ...good, beats: new Array(513).fill({ from: peer, body: 1 }) }, { ...good, batch: 2 ** 32 }]) {
      const fast = plainBeatBatch(m);
      if (fast === undefined) continue;
      const z = beatBatchSchema.safeParse(m);
      expect(z.success, JSON.stringify(m).slice(0, 200)).toBe(true);
      expect(fast).toEqual({ batch: z.data!.batch, beats: z.data!.beats });
    }
  });

  it('answers a malformed beat in a batch alone, with the schema\'s error, and the others as usual', async () => {
    const t = await makeTracker();
    const a = await FakeNode.create({ memory_budget_mb: 64 });
    const b = await FakeNode.create({ memory_budget_mb: 64 });
    await a.register(t, { load: true });
    await b.register(t, { load: true });
    const bad = { ...b.message(t.clock.now), timestamp: 1.5 };
    const out = JSON.parse(t.relayBeats({ type: 'beats', batch: 3, beats: [{ from: a.peerId, body: a.message(t.clock.now) }, { from: b.peerId, body: bad }, { from: b.peerId, body: { ...b.message(t.clock.now), info: { ...b.message(t.clock.now).info, extra: 'ignored' } } }] })) as { batch: number; answers: Array<{ status: number; body: { error?: { code: string; message: string }; heartbeat_interval_ms?: number } }> };
    expect(out.batch).toBe(3);
    expect(out.answers.map((x) => x.status)).toEqual([200, 400, 200]);
    expect(out.answers[1]!.body.error).toEqual({ code: 'MESH_ERR_BAD_REQUEST', message: expect.stringMatching(/^field "timestamp": .*expected a NodeMessage$/) });
    expect(out.answers[0]!.body.heartbeat_interval_ms).toBeGreaterThan(0);
    // The unknown field was stripped by the schema, as before: the record holds none of it.
    expect(JSON.stringify(t.registry.nodes.get(b.peerId)!.info)).not.toContain('ignored');
  });
});
