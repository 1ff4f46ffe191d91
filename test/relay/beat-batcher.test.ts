/**
 * The relay's heartbeat batches wait for their tracker's `registered`: a
 * tracker's client ignores every message before it (relay-dial.ts), so a
 * batch sent in the moment between the relay taking the tracker's key and
 * telling it so (up to a second in a cluster, while NATS learns of it) was
 * never answered, and its beats failed with a timeout 30 s later. They now
 * leave when the tracker is told, in batches of at most MAX_BEATS_PER_BATCH.
 */
import { describe, expect, it } from 'vitest';
import { MAX_BEATS_PER_BATCH } from '../../src/protocol/beat-batch.ts';
import { BeatBatcher, type BeatPeer, type BeatSocket } from '../../src/relay/beat-batcher.ts';
import { createRelayMetrics } from '../../src/relay/metrics.ts';
import { resolveRelayOptions } from '../../src/relay/options.ts';

function setup() {
  const sent = new Map<BeatSocket, string[]>();
  const socket = (): BeatSocket => {
    const s: BeatSocket = { bufferedAmount: 0 };
    sent.set(s, []);
    return s;
  };
  const tracker = { id: 'a'.repeat(32), socket: socket(), acceptsBeats: true, announced: false };
  const peers = new Map<string, BeatPeer>([[tracker.id, tracker]]);
  const host = { peers, closing: false, sendTo: (s: BeatSocket, text: string) => sent.get(s)!.push(text), now: () => Date.now() };
  const batcher = new BeatBatcher(host, { beatBatchMs: 5, requestTimeoutMs: 30_000, highWaterBytes: 1 << 30 }, createRelayMetrics());
  const node = (i: number): BeatPeer => ({ id: i.toString(16).padStart(32, '0'), socket: socket(), acceptsBeats: false, announced: true });
  const beat = (from: BeatPeer, id: number) => batcher.onBeat(from, { type: 'beat', id, to: tracker.id, body: { peer_id: from.id } }, 100);
  const batches = () => sent.get(tracker.socket)!.map((t) => JSON.parse(t) as { type: string; batch: number; beats: Array<{ from: string }> });
  return { tracker, batcher, node, beat, batches, sent };
}

const tick = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe('beats for a tracker not yet told it is registered', () => {
  it('wait for its `registered`, then leave at once, at most MAX_BEATS_PER_BATCH a message, every beat answered from its batch', async () => {
    const { tracker, batcher, node, beat, batches, sent } = setup();
    const nodes = Array.from({ length: MAX_BEATS_PER_BATCH + 3 }, (_, i) => node(i + 1));
    nodes.forEach((n, i) => beat(n, i));
    await tick(30); // several windows
    expect(batches()).toEqual([]);
    expect(batcher.inFlight).toBe(nodes.length);

    tracker.announced = true;
    batcher.announced(tracker);
    const out = batches();
    expect(out.map((b) => b.beats.length)).toEqual([MAX_BEATS_PER_BATCH, 3]);
    expect(out.flatMap((b) => b.beats.map((x) => x.from))).toEqual(nodes.map((n) => n.id));
    // The tracker's answers reach each node, as for any batch.
    for (const b of out) batcher.onAnswer(tracker, { type: 'beats-answer', batch: b.batch, answers: b.beats.map(() => ({ status: 200, body: { ok: true } })) });
    for (const [i, n] of nodes.entries()) expect(JSON.parse(sent.get(n.socket)![0]!)).toMatchObject({ type: 'beat-answer', id: i, status: 200 });
    expect(batcher.inFlight).toBe(0);

    // From then on, the window as ever.
    beat(nodes[0]!, 99);
    expect(batches()).toHaveLength(2);
    await tick(30);
    expect(batches()).toHaveLength(3);
  });

  it('fail with the tracker gone if it leaves before it is told', async () => {
    const { tracker, batcher, node, beat, batches, sent } = setup();
    const n = node(1);
    beat(n, 7);
    await tick(20);
    batcher.peerGone(tracker);
    expect(batches()).toEqual([]);
    expect(JSON.parse(sent.get(n.socket)![0]!)).toMatchObject({ type: 'beat-answer', id: 7, status: 502 });
    expect(batcher.inFlight).toBe(0);
  });
});

describe('the beat window', () => {
  it('is 10 ms, in a cluster too, unless given', () => {
    expect(resolveRelayOptions({}).beatBatchMs).toBe(10);
    expect(resolveRelayOptions({ nats: ['nats://127.0.0.1:4222'] }).beatBatchMs).toBe(10);
    expect(resolveRelayOptions({ nats: ['nats://127.0.0.1:4222'], beatBatchMs: 50 }).beatBatchMs).toBe(50);
    expect(resolveRelayOptions({ beatBatchMs: 0 }).beatBatchMs).toBe(0);
    expect(() => resolveRelayOptions({ beatBatchMs: -1 })).toThrow(/beatBatchMs/);
  });
});
