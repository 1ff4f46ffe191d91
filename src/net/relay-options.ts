/**
 * Relay client options: one place for every limit, its unit and its default.
 * The CLI's help and docs/protocol.md are written from this table.
 */
/** Limits of one multiplexed connection (a relay connection or a direct link). */
export interface MuxOptions {
  /** Default time for a whole answer to an outgoing request. 0 disables. @defaultValue 30000 */
  requestTimeoutMs: number;
  /** Time the local handler has to answer an incoming request before it is aborted and answered 504. 0 disables. @defaultValue 120000 */
  handlerTimeoutMs: number;
  /** Incoming requests in flight at once; more are answered 429. @defaultValue 4096 */
  maxConcurrentRequests: number;
  /** Largest incoming frame or envelope, bytes; bigger ones are answered 413 (when their id is readable). @defaultValue 67108864 (64 MiB) */
  maxMessageBytes: number;
  /** Sends wait while the socket buffers more than this, bytes. @defaultValue 4194304 (4 MiB) */
  highWaterBytes: number;
  /** Longest a send waits for the buffer to drain before failing with MESH_ERR_BACKPRESSURE. @defaultValue 10000 */
  maxSendWaitMs: number;
}

/** The relay dialer's options: the multiplexer's limits plus connect and reconnect. */
export interface RelayClientOptions extends MuxOptions {
  /** First reconnect delay's ceiling; each failure doubles it (full jitter: the delay is uniform in [0, ceiling]). @defaultValue 250 */
  minBackoffMs: number;
  /** Largest reconnect delay ceiling. @defaultValue 15000 */
  maxBackoffMs: number;
  /** Time from opening the socket to `registered`; then the attempt counts as failed. @defaultValue 10000 */
  registerTimeoutMs: number;
}

export const RELAY_CLIENT_DEFAULTS: RelayClientOptions = {
  minBackoffMs: 250,
  maxBackoffMs: 15_000,
  registerTimeoutMs: 10_000,
  requestTimeoutMs: 30_000,
  handlerTimeoutMs: 120_000,
  maxConcurrentRequests: 4096,
  maxMessageBytes: 64 * 1024 * 1024,
  highWaterBytes: 4 * 1024 * 1024,
  maxSendWaitMs: 10_000,
};

export function resolveRelayClientOptions(partial: Partial<RelayClientOptions>): RelayClientOptions {
  const o: RelayClientOptions = { ...RELAY_CLIENT_DEFAULTS };
  for (const k of Object.keys(RELAY_CLIENT_DEFAULTS) as Array<keyof RelayClientOptions>) {
    const v = partial[k];
    if (v !== undefined) o[k] = v;
  }
  for (const k of ['minBackoffMs', 'maxBackoffMs', 'registerTimeoutMs', 'maxConcurrentRequests', 'maxMessageBytes', 'highWaterBytes', 'maxSendWaitMs'] as const) {
    if (!Number.isFinite(o[k]) || o[k] <= 0) throw new TypeError(`relay client option ${k} must be a positive number, got ${o[k]}`);
  }
  for (const k of ['requestTimeoutMs', 'handlerTimeoutMs'] as const) {
    if (!Number.isFinite(o[k]) || o[k] < 0) throw new TypeError(`relay client option ${k} must be 0 (disabled) or a positive number, got ${o[k]}`);
  }
  if (o.minBackoffMs > o.maxBackoffMs) throw new TypeError('minBackoffMs must not exceed maxBackoffMs');
  return o;
}

/** Options of an `/rpc` hop (ADR-0014 path). */
export interface RpcOptions {
  /** Time for the socket to open. @defaultValue 10000 */
  openTimeoutMs: number;
  /** Default time for an answer. 0 disables. @defaultValue 30000 */
  requestTimeoutMs: number;
  /** Sends wait while the socket buffers more than this, bytes. @defaultValue 4194304 (4 MiB) */
  highWaterBytes: number;
  /** Longest a send waits for the buffer to drain. @defaultValue 10000 */
  maxSendWaitMs: number;
}

export const RPC_DEFAULTS: RpcOptions = {
  openTimeoutMs: 10_000,
  requestTimeoutMs: 30_000,
  highWaterBytes: 4 * 1024 * 1024,
  maxSendWaitMs: 10_000,
};
