/**
 * The relay's heartbeat batches wait for their tracker's `registered`: a
 * tracker's client ignores every message before it (relay-dial.ts), so a
 * batch sent in the moment between the relay taking the tracker's key and
 * telling it so (up to a second in a cluster, while NATS learns of it) was
 * never answered, and its beats failed with a timeout 30 s later. They now
 * leave when the tracker is told, in batches of at most MAX_BEATS_PER_BATCH.
 *
 * A batch leaves when it holds `beatBatchFill` beats or its window (counted
 * from its own first beat) is over, whichever is first.
 */
import { afterEach, describe, expect, it, vi } from 'vitest';
import { MAX_BEATS_PER_BATCH } from '../../src/protocol/beat-batch.ts';
import { BeatBatcher, type BeatPeer, type BeatSocket } from '../../src/relay/beat-batcher.ts';
import { createRelayMetrics } from '../../src/relay/metrics.ts';
import { resolveRelayOptions } from '../../src/relay/options.ts';

function setup(o: { beatBatchMs?: number; beatBatchFill?: number } = {}) {
  const sent = new Map<BeatSocket, string[]>();
  const socket = (): BeatSocket => {
    const s: BeatSocket = { bufferedAmount: 0 };
    sent.set(s, []);
    return s;
  };
  const tracker = { id: 'a'.repeat(32), socket: socket(), acceptsBeats: true, announced: false };
  const other = { id: 'b'.repeat(32), socket: socket(), acceptsBeats: true, announced: true };
  const peers = new Map<string, BeatPeer>([[tracker.id, tracker], [other.id, other]]);
  const host = { peers, closing: false, sendTo: (s: BeatSocket, text: string) => sent.get(s)!.push(text), now: () => Date.now() };
  const batcher = new BeatBatcher(host, { beatBatchMs: o.beatBatchMs ?? 5, beatBatchFill: o.beatBatchFill ?? MAX_BEATS_PER_BATCH, requestTimeoutMs: 30_000, highWaterBytes: 1 << 30 }, createRelayMetrics());
  const node = (i: number): BeatPeer => ({ id: i.toString(16).padStart(32, '0'), socket: socket(), acceptsBeats: false, announced: true });
  const beat = (from: BeatPeer, id: number, to: BeatPeer = tracker) => batcher.onBeat(from, { type: 'beat', id, to: to.id, body: { peer_id: from.id } }, 100);
  const batchesOf = (t: BeatPeer) => sent.get(t.socket)!.map((x) => JSON.parse(x) as { type: string; batch: number; beats: Array<{ from: string }> });
  const batches = () => batchesOf(tracker);
  return { tracker, other, batcher, node, beat, batches, batchesOf, sent };
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

describe('a batch leaves', () => {
  afterEach(() => {
    vi.useRealTimers();
  });

  it('as soon as it holds beatBatchFill beats, long before its window is over', () => {
    vi.useFakeTimers();
    const { tracker, batcher, node, beat, batches, sent } = setup({ beatBatchMs: 1000, beatBatchFill: 4 });
    tracker.announced = true;
    const nodes = Array.from({ length: 5 }, (_, i) => node(i + 1));
    for (let i = 0; i < 3; i++) beat(nodes[i]!, i);
    vi.advanceTimersByTime(999);
    expect(batches()).toEqual([]);
    beat(nodes[3]!, 3);
    expect(batches().map((b) => b.beats.map((x) => x.from))).toEqual([nodes.slice(0, 4).map((n) => n.id)]);
    // The fifth starts a new batch, with a window of its own: not sent when the first batch's would have ended.
    beat(nodes[4]!, 4);
    vi.advanceTimersByTime(999);
    expect(batches()).toHaveLength(1);
    vi.advanceTimersByTime(1);
    expect(batches()).toHaveLength(2);
    expect(batches()[1]!.beats.map((x) => x.from)).toEqual([nodes[4]!.id]);
    // Every beat is answered from its own batch.
    for (const b of batches()) batcher.onAnswer(tracker, { type: 'beats-answer', batch: b.batch, answers: b.beats.map(() => ({ status: 200, body: {} })) });
    for (const [i, n] of nodes.entries()) expect(JSON.parse(sent.get(n.socket)![0]!)).toMatchObject({ type: 'beat-answer', id: i, status: 200 });
    expect(batcher.inFlight).toBe(0);
  });

  it("when its own window is over: a tracker's queue started later is not cut short by another's", () => {
    vi.useFakeTimers();
    const { tracker, other, node, beat, batches, batchesOf } = setup({ beatBatchMs: 40, beatBatchFill: 32 });
    tracker.announced = true;
    const a = node(1);
    const b = node(2);
    beat(a, 1, tracker);
    vi.advanceTimersByTime(25);
    beat(b, 2, other);
    vi.advanceTimersByTime(15); // the first queue's window is over
    expect(batches()).toHaveLength(1);
    expect(batchesOf(other)).toEqual([]);
    beat(a, 3, other); // joins the other's queue, which keeps its window
    vi.advanceTimersByTime(24);
    expect(batchesOf(other)).toEqual([]);
    vi.advanceTimersByTime(1);
    expect(batchesOf(other).map((x) => x.beats.map((y) => y.from))).toEqual([[b.id, a.id]]);
  });
});

describe('the beat window', () => {
  it('is 10 ms on its own, 50 ms in a cluster, and 32 beats, unless given', () => {
    expect(resolveRelayOptions({}).beatBatchMs).toBe(10);
    expect(resolveRelayOptions({}).beatBatchFill).toBe(32);
    expect(resolveRelayOptions({ nats: ['nats://127.0.0.1:4222'] }).beatBatchMs).toBe(50);
    expect(resolveRelayOptions({ nats: ['nats://127.0.0.1:4222'], beatBatchMs: 10 }).beatBatchMs).toBe(10);
    expect(resolveRelayOptions({ beatBatchMs: 10, beatBatchFill: 512 })).toMatchObject({ beatBatchMs: 10, beatBatchFill: 512 });
    expect(resolveRelayOptions({ beatBatchMs: 0 }).beatBatchMs).toBe(0);
    expect(() => resolveRelayOptions({ beatBatchMs: -1 })).toThrow(/beatBatchMs/);
    for (const bad of [0, 513, 1.5, Number.NaN]) expect(() => resolveRelayOptions({ beatBatchFill: bad })).toThrow(/beatBatchFill/);
  });
});
