/**
 * The streams in flight through the relay and the indexes that find them
 * again (per target by the relay's stream id, per caller by its own id, JSON
 * envelopes by request id). Opening and forgetting a stream touches all of
 * them at once, so that no index can outlive the others; the stream table
 * decides when, this module only keeps them in step.
 */
import { randomBytes } from 'node:crypto';
import type { RelayMetrics } from './metrics.ts';
import type { Caller, PeerConn, Stream, StreamPath } from './peer-conn.ts';

export class StreamBook {
  private readonly streams = new Set<Stream>();
  private readonly jsonPending = new Map<string, Stream>();
  // Label lookups hash their label object on every call; bind the histogram's once.
  private readonly latencyBy: Record<StreamPath, { observe(v: number): void }>;

  constructor(
    private readonly requestTimeoutMs: number,
    private readonly metrics: RelayMetrics,
    private readonly now: () => number,
  ) {
    metrics.hot.inFlight = () => this.streams.size;
    this.latencyBy = { fast: metrics.latency.labels('fast'), rpc: metrics.latency.labels('rpc'), envelope: metrics.latency.labels('envelope') };
  }

  /** Requests waiting for their final answer frame. */
  get size(): number {
    return this.streams.size;
  }

  /** Every stream in flight (live: forgetting one while iterating is safe). */
  get all(): ReadonlySet<Stream> {
    return this.streams;
  }

  /** The JSON-envelope stream with the relay's `requestId`. */
  byRequestId(requestId: string): Stream | undefined {
    return this.jsonPending.get(requestId);
  }

  /** A new stream from `caller` to `target`, due within the request timeout; `json` streams get a relay request id. */
  open(caller: Caller, callerId: number | string, target: PeerConn, path: StreamPath, json: boolean): Stream {
    const now = this.now();
    const s: Stream = {
      caller,
      callerId,
      target,
      relayStreamId: target.allocStreamId(),
      relayRequestId: json ? randomBytes(12).toString('hex') : null,
      deadline: now + this.requestTimeoutMs,
      startedAt: now,
      path,
    };
    this.streams.add(s);
    target.incoming.set(s.relayStreamId, s);
    if (s.relayRequestId !== null) this.jsonPending.set(s.relayRequestId, s);
    if (caller.kind === 'rpc') caller.pending.set(callerId as string, s);
    else caller.outgoing.set(callerId as number, s);
    this.metrics.hot.hops[path]++;
    return s;
  }

  /** Forget a stream everywhere; false when it was already gone. */
  drop(s: Stream): boolean {
    if (!this.streams.delete(s)) return false;
    s.target.incoming.delete(s.relayStreamId);
    if (s.oneWay) s.target.oneWayIn--;
    if (s.relayRequestId !== null) this.jsonPending.delete(s.relayRequestId);
    if (s.caller.kind === 'rpc') s.caller.pending.delete(s.callerId as string);
    else s.caller.outgoing.delete(s.callerId as number);
    return true;
  }

  /** The stream got its final answer: forgotten, its latency observed; false when it was already gone. */
  complete(s: Stream): boolean {
    if (!this.drop(s)) return false;
    this.latencyBy[s.path].observe((this.now() - s.startedAt) / 1000);
    return true;
  }
}
