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

/**
 * The relay dialer's options: the multiplexer's limits plus connect and
 * reconnect. The schedule (reconnectDelay): the first attempt after a lost
 * connection at once, within `firstJitterMs`; then exponential backoff from
 * `minBackoffMs` with equal jitter (a delay in [ceiling/2, ceiling]), the
 * ceiling held at `outageCeilingMs` while the outage is younger than
 * `outageBudgetMs` (a short outage is caught within that of its end), and
 * doubling from there up to `maxBackoffMs` once it is older.
 */
export interface RelayClientOptions extends MuxOptions {
  /** The first reconnect after a lost connection comes within this, ms (uniform jitter: thousands of peers do not all come at once). @defaultValue 250 */
  firstJitterMs: number;
  /** The backoff's first ceiling; each failure doubles it. @defaultValue 250 */
  minBackoffMs: number;
  /** Largest backoff ceiling. @defaultValue 15000 */
  maxBackoffMs: number;
  /** Largest ceiling while the outage is younger than outageBudgetMs. @defaultValue 800 */
  outageCeilingMs: number;
  /**
   * How long a lost connection is waited out: requests made meanwhile wait
   * for the registration instead of failing (and fail with
   * MESH_ERR_UNAVAILABLE "relay … unreachable" once it is over), and the
   * reconnect attempts stay at most outageCeilingMs apart. 0: no waiting.
   * @defaultValue 10000
   */
  outageBudgetMs: number;
  /** Time from opening the socket to `registered`; then the attempt counts as failed. @defaultValue 10000 */
  registerTimeoutMs: number;
}

/** Default of RelayClientOptions.outageBudgetMs: what nodes and the tracker wait out of a relay outage (docs/architecture.md, "Restarts"). */
export const RELAY_OUTAGE_BUDGET_MS = 10_000;

export const RELAY_CLIENT_DEFAULTS: RelayClientOptions = {
  firstJitterMs: 250,
  minBackoffMs: 250,
  maxBackoffMs: 15_000,
  outageCeilingMs: 800,
  outageBudgetMs: RELAY_OUTAGE_BUDGET_MS,
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
  for (const k of ['minBackoffMs', 'maxBackoffMs', 'outageCeilingMs', 'registerTimeoutMs', 'maxConcurrentRequests', 'maxMessageBytes', 'highWaterBytes', 'maxSendWaitMs'] as const) {
    if (!Number.isFinite(o[k]) || o[k] <= 0) throw new TypeError(`relay client option ${k} must be a positive number, got ${o[k]}`);
  }
  for (const k of ['requestTimeoutMs', 'handlerTimeoutMs', 'firstJitterMs', 'outageBudgetMs'] as const) {
    if (!Number.isFinite(o[k]) || o[k] < 0) throw new TypeError(`relay client option ${k} must be 0 (disabled) or a positive number, got ${o[k]}`);
  }
  if (o.minBackoffMs > o.maxBackoffMs) throw new TypeError('minBackoffMs must not exceed maxBackoffMs');
  return o;
}

/**
 * The delay before reconnect attempt `attempt` (0 = the first after the
 * connection was lost), when the outage is `outageMs` old and
 * `pastBudget` attempts were made since it outlived outageBudgetMs;
 * `random` in [0, 1). See RelayClientOptions.
 */
export function reconnectDelay(o: Pick<RelayClientOptions, 'firstJitterMs' | 'minBackoffMs' | 'maxBackoffMs' | 'outageCeilingMs' | 'outageBudgetMs'>, attempt: number, outageMs: number, pastBudget: number, random: number): number {
  if (attempt === 0) return Math.floor(random * o.firstJitterMs);
  let ceiling = Math.min(o.maxBackoffMs, o.minBackoffMs * 2 ** Math.min(attempt - 1, 30));
  if (outageMs < o.outageBudgetMs) ceiling = Math.min(ceiling, o.outageCeilingMs);
  else ceiling = Math.min(ceiling, Math.max(o.outageCeilingMs, Math.min(o.maxBackoffMs, o.outageCeilingMs * 2 ** Math.min(pastBudget, 30))));
  return Math.floor(ceiling / 2 + (random * ceiling) / 2);
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
