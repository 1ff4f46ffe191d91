/**
 * A heartbeat that changes nothing keeps the record's objects (registry.ts):
 * at thousands of beats a second, every beat replacing a record's info,
 * stats, span and placement share made the GC copy and promote thousands of
 * objects a second. What a beat does change still reaches routing: a node
 * that got faster moves ahead of its span's other nodes, one whose span
 * changed is counted on its new span.
 */
import { describe, expect, it } from 'vitest';
import type { NodeMessage } from '../../src/protocol/tracker.ts';
import { resolveTrackerOptions } from '../../src/tracker/options.ts';
import { sameData } from '../../src/tracker/node-record.ts';
import { NodeRegistry } from '../../src/tracker/registry.ts';
import { smallSpec } from '../helpers/tracker.ts';

const spec = smallSpec();
const L = spec.numLayers;

function message(peer: string, layerMs: number, t: number, serving = { start_layer: 0, end_layer: L }): NodeMessage {
  return {
    peer_id: peer,
    public_key: `key-${peer}`,
    relay_addr: `ws://relay.test/p/${peer}`,
    timestamp: t,
    info: { model: spec.name, backend: 'wasm', memory_budget_mb: 4096, host: 'node', version: 'test', weight_format: 'f32' },
    serving,
    stats: { rpm: 0, layer_ms: layerMs, queue_depth: 0, kv_free_bytes: 2 ** 28, tokens_served: 0, kv_budget_bytes: 2 ** 28, kv_used_bytes: 0 },
  } as NodeMessage;
}

/** A fresh copy, as each beat's JSON.parse gives. */
const parsed = (m: NodeMessage): NodeMessage => JSON.parse(JSON.stringify(m)) as NodeMessage;

describe('heartbeats that change nothing', () => {
  it('keep the record\'s objects; a faster node still moves ahead of its span, a new span is counted', () => {
    let now = 1_000;
    const reg = new NodeRegistry([spec], { ...resolveTrackerOptions({}), now: () => now });
    let t = 1;
    reg.register(parsed(message('a', 3, t++)));
    reg.register(parsed(message('b', 5, t++)));
    for (const p of ['a', 'b']) reg.heartbeat(parsed(message(p, p === 'a' ? 3 : 5, t++)));
    const b = reg.nodes.get('b')!;
    const kept = { info: b.info, stats: b.stats, serving: b.serving, share: b.contribution, relay: b.relayAddr, key: b.publicKey };
    const order = () => reg.servingNodes(spec.name).map((n) => n.id);
    expect(order()).toEqual(['a', 'b']);

    for (let i = 0; i < 20; i++) {
      now += 100;
      reg.heartbeat(parsed(message('b', 5, t++)));
    }
    expect({ info: b.info, stats: b.stats, serving: b.serving, share: b.contribution, relay: b.relayAddr, key: b.publicKey }).toStrictEqual(kept);
    expect(b.info).toBe(kept.info);
    expect(b.stats).toBe(kept.stats);
    expect(b.serving).toBe(kept.serving);
    expect(b.contribution).toBe(kept.share);
    // The history keeps its last 12 samples, in the same 12 objects once full.
    expect(b.history).toHaveLength(12);
    const samples = new Set(b.history);
    now += 100;
    reg.heartbeat(parsed(message('b', 5, t++)));
    expect(new Set(b.history)).toEqual(samples);
    expect(b.history.at(-1)).toEqual({ at: now, rpm: 0, layer_ms: 5 });
    expect(b.history.map((h) => h.at)).toEqual([...b.history.map((h) => h.at)].sort((x, y) => x - y));

    // Faster now: its stats and share change, and routing puts it first.
    for (let i = 0; i < 10; i++) reg.heartbeat(parsed(message('b', 1, t++)));
    expect(b.stats).not.toBe(kept.stats);
    expect(b.stats!.layer_ms).toBe(1);
    expect(b.contribution).not.toBe(kept.share);
    expect(order()).toEqual(['b', 'a']);

    // A node that serves another span now is counted there.
    reg.heartbeat(parsed(message('a', 3, t, { start_layer: 0, end_layer: L / 2 })));
    expect(reg.nodes.get('a')!.serving).toEqual({ start: 0, end: L / 2 });
    expect(reg.servingNodes(spec.name).find((n) => n.id === 'a')).toMatchObject({ start: 0, end: L / 2 });
    const p = reg.placement(spec.name);
    const before = { assigned: [...p.assigned.count], serving: [...p.serving.count] };
    p.recount();
    expect({ assigned: [...p.assigned.count], serving: [...p.serving.count] }).toEqual(before);
  });

  it('keep the stats of a serving node (its batch sizes, hops per path, next hop) while they say the same, and take them when a count moves', () => {
    let now = 1_000;
    const reg = new NodeRegistry([spec], { ...resolveTrackerOptions({}), now: () => now });
    const sent = (fast: number) => ({ rtc: 0, fast, rpc: 0, link: 0, direct: 0 });
    // As src/node/runtime/node-message.ts sends it once the node has sent hops.
    const serving = (t: number, fast: number): NodeMessage => {
      const m = message('c', 4, t);
      const batch = new Array<number>(17).fill(0);
      batch[1] = fast;
      return { ...m, stats: { ...m.stats!, batch_sizes: batch, hops_sent: sent(fast), hop_paths: [{ peer_id: 'd'.repeat(32), path: 'fast', rtc: 'none', sent: sent(fast) }] } } as NodeMessage;
    };
    let t = 1;
    reg.register(parsed(serving(t++, 7)));
    reg.heartbeat(parsed(serving(t++, 7)));
    const c = reg.nodes.get('c')!;
    const kept = c.stats;
    for (let i = 0; i < 5; i++) {
      now += 100;
      reg.heartbeat(parsed(serving(t++, 7)));
    }
    expect(c.stats).toBe(kept);
    // One hop more, deep in the next hop's counts: a change.
    const m = parsed(serving(t++, 7));
    m.stats!.hop_paths![0]!.sent.fast = 8;
    reg.heartbeat(m);
    expect(c.stats).not.toBe(kept);
    expect(c.stats!.hop_paths![0]!.sent.fast).toBe(8);
    // A path gone from the list is a change too.
    const fewer = parsed(serving(t, 7));
    fewer.stats!.hop_paths = [];
    reg.heartbeat(fewer);
    expect(c.stats!.hop_paths).toEqual([]);
  });

  it('compare JSON data deep: key order aside, any added, missing or changed value, at any depth, is a change', () => {
    const a = { x: 1, y: [1, { z: 'q', w: null }], v: true };
    expect(sameData(a, JSON.parse(JSON.stringify(a)))).toBe(true);
    expect(sameData(a, { v: true, y: [1, { w: null, z: 'q' }], x: 1 })).toBe(true);
    for (const b of [
      { x: 1, y: [1, { z: 'q', w: null }] },
      { x: 1, y: [1, { z: 'q', w: null }], v: true, u: 0 },
      { x: 1, y: [1, { z: 'q', w: 0 }], v: true },
      { x: 1, y: [1, { z: 'q' }], v: true },
      { x: 1, y: [1, { z: 'q', w: null }, 2], v: true },
      { x: 1, y: { 0: 1, 1: { z: 'q', w: null } }, v: true },
      { x: '1', y: [1, { z: 'q', w: null }], v: true },
    ])
      expect(sameData(a, b), JSON.stringify(b)).toBe(false);
    expect(sameData([], {})).toBe(false);
    expect(sameData(null, {})).toBe(false);
  });
});
