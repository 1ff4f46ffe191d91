/**
 * Relay options: one place for every limit, its unit and its default.
 * The CLI's help and docs/protocol.md are written from this table.
 */
import { MAX_BEATS_PER_BATCH } from '../protocol/beat-batch.ts';

export interface RelayOptions {
  /** TCP port; 0 picks a free one. @defaultValue 8787 */
  port: number;
  /** Interface to bind. @defaultValue '127.0.0.1' */
  host: string;
  /** Base URL peers are told to use for `/rpc` (`relay_addr`). @defaultValue `ws://host:port` */
  publicUrl?: string;
  /** Largest request or response body, bytes. @defaultValue 33554432 (32 MiB) */
  maxBodyBytes: number;
  /** Requests in flight towards one peer before new ones get 503. @defaultValue 1024 */
  maxInFlightPerPeer: number;
  /** A request with no answer frame for this long gets 504. @defaultValue 30000 */
  requestTimeoutMs: number;
  /** Registered peers; more are refused at registration. @defaultValue 10000 */
  maxPeers: number;
  /** Ping period; a peer that misses one pong is dropped. @defaultValue 15000 */
  pingIntervalMs: number;
  /** Time a new `/ws` connection has to register. @defaultValue 10000 */
  registerTimeoutMs: number;
  /** A target whose socket buffers more than this gets no new requests (503). @defaultValue 8388608 (8 MiB) */
  highWaterBytes: number;
  /** A caller that lets more than this pile up unread is disconnected. @defaultValue 67108864 (64 MiB) */
  maxBufferedBytes: number;
  /** On shutdown, how long in-flight requests may still finish. @defaultValue 5000 */
  shutdownGraceMs: number;
  /**
   * How long heartbeats addressed to one tracker wait at most to leave together (beat-batch, docs/protocol.md §9.1),
   * ms, counted from the first of them; 0 turns batching off (the feature is not announced). Unset: 10 on its own,
   * 50 in a cluster (`nats`). A tracker pays about as much per message as per beat, and a cluster's tracker gets only
   * part of a relay's beats: at 10,000 donors over 3 trackers, steady, 10 ms cost 66.9 µs a beat and 50 ms 49.8; on
   * its own, one tracker's heartbeat p99 at 5,000 donors (≤ 100 ms) keeps the shorter window (docs/benchmarks.md,
   * sessions 8, 9). @defaultValue 10, or 50 with `nats`
   */
  beatBatchMs: number;
  /**
   * A tracker's queue leaves as soon as it holds this many beats (1–512), before its window is over: a busy
   * tracker's beats wait only as long as a batch takes to fill (one tracker at 5,000 donors: ~32 ms), so the long
   * window costs latency only where beats are few. @defaultValue 32
   */
  beatBatchFill: number;
  /** pino level. @defaultValue 'info' */
  logLevel: string;
  /** NATS servers of the cluster (`nats://host:port`); absent: a relay on its own, exactly as before. */
  nats?: string[];
  /** The cluster's name: relays (and trackers) of one cluster share it; subjects live under `meshnet.<cluster>.`. @defaultValue 'meshnet' */
  cluster: string;
  /** How frames cross to another relay: 'link' (a direct relay-to-relay WebSocket found through NATS; NATS until it is up) or 'nats'. @defaultValue 'link' */
  clusterPath: 'link' | 'nats';
}

export const RELAY_DEFAULTS: RelayOptions = {
  port: 8787,
  host: '127.0.0.1',
  maxBodyBytes: 32 * 1024 * 1024,
  maxInFlightPerPeer: 1024,
  requestTimeoutMs: 30_000,
  maxPeers: 10_000,
  pingIntervalMs: 15_000,
  registerTimeoutMs: 10_000,
  highWaterBytes: 8 * 1024 * 1024,
  maxBufferedBytes: 64 * 1024 * 1024,
  shutdownGraceMs: 5_000,
  beatBatchMs: 10,
  beatBatchFill: 32,
  logLevel: 'info',
  cluster: 'meshnet',
  clusterPath: 'link',
};

/** The beat window of a relay in a cluster when none is given (see beatBatchMs). */
export const CLUSTER_BEAT_BATCH_MS = 50;

export function resolveRelayOptions(partial: Partial<RelayOptions>): RelayOptions {
  const o: RelayOptions = { ...RELAY_DEFAULTS, ...(partial.nats?.length ? { beatBatchMs: CLUSTER_BEAT_BATCH_MS } : {}) };
  for (const [k, v] of Object.entries(partial)) if (v !== undefined) (o as unknown as Record<string, unknown>)[k] = v;
  for (const k of ['maxBodyBytes', 'maxInFlightPerPeer', 'requestTimeoutMs', 'maxPeers', 'pingIntervalMs', 'registerTimeoutMs', 'highWaterBytes', 'maxBufferedBytes'] as const) {
    if (!Number.isFinite(o[k]) || o[k] <= 0) throw new TypeError(`relay option ${k} must be a positive number, got ${o[k]}`);
  }
  if (!Number.isFinite(o.beatBatchMs) || o.beatBatchMs < 0 || o.beatBatchMs > 1000) throw new TypeError(`relay option beatBatchMs must be 0–1000 ms, got ${o.beatBatchMs}`);
  if (!Number.isInteger(o.beatBatchFill) || o.beatBatchFill < 1 || o.beatBatchFill > MAX_BEATS_PER_BATCH) throw new TypeError(`relay option beatBatchFill must be an integer 1–${MAX_BEATS_PER_BATCH}, got ${o.beatBatchFill}`);
  if (o.highWaterBytes > o.maxBufferedBytes) throw new TypeError('highWaterBytes must not exceed maxBufferedBytes');
  if (o.clusterPath !== 'link' && o.clusterPath !== 'nats') throw new TypeError(`relay option clusterPath must be 'link' or 'nats', got ${String(o.clusterPath)}`);
  return o;
}
