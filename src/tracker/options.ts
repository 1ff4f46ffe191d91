import { DTYPES, isDtype, type Dtype } from '../protocol/tensor.ts';

/**
 * Every tracker knob in one place: type, default, unit. `meshnet tracker
 * --help` prints its defaults from here.
 */

export interface TrackerModelSource {
  /** Model id clients ask for (`model` in OpenAI requests, `info.model` of nodes). */
  name: string;
  /** Base URL of an HF-layout checkpoint (config.json, safetensors, tokenizer). */
  url: string;
  /** Wire dtype of this model's activations between hops; absent: TrackerOptions.wireDtype. */
  wireDtype?: Dtype;
}

export interface TrackerOptions {
  /** TCP port; 0 picks a free one. @defaultValue 8080 */
  port: number;
  /** Interface to bind. @defaultValue '127.0.0.1' */
  host: string;
  /** Relay to register with (the tracker reaches heads over its fast path); absent: direct HTTP only. */
  relayUrl: string | undefined;
  models: TrackerModelSource[];
  /**
   * Wire dtype of activations between hops, for models that name none: every
   * node of a model gets it with its assignment (a head sends it on every hop,
   * a hop refuses any other). bf16 halves the bytes; f32 makes a split run
   * give the un-split greedy tokens exactly. @defaultValue 'bf16'
   */
  wireDtype: Dtype;
  /** File holding the tracker's Ed25519 key (JWK); created when missing. Absent: a fresh key per run. */
  keyFile: string | undefined;
  /** Largest `max_tokens` a client may ask for. @defaultValue 4096 */
  maxTokensLimit: number;
  /** `max_tokens` when the client gives none (bounded by the limit). @defaultValue 256 */
  defaultMaxTokens: number;
  /** Period nodes are told to heartbeat at, ms. @defaultValue 5000 */
  heartbeatIntervalMs: number;
  /** A node missing this many heartbeat periods is removed. @defaultValue 3 */
  deadAfterMissedHeartbeats: number;
  /** Signed messages further than this from the tracker's clock are refused (replay guard), ms. @defaultValue 60000 */
  maxClockSkewMs: number;
  /** Context length each node's KV reserve is sized for, tokens (capped by the model's). @defaultValue 2048 */
  kvReserveContextTokens: number;
  /** Concurrent sessions the KV reserve is sized for. @defaultValue 1 */
  kvReserveSessions: number;
  /** Bytes per weight held in memory: the shard executor converts to f32. @defaultValue 4 */
  weightBytesPerParam: number;
  /** Assumed ms per layer per decode step for a node that has not reported stats yet. @defaultValue 5 */
  defaultLayerMs: number;
  /** Estimated network cost of one hop, ms (routing). @defaultValue 10 */
  hopLatencyMs: number;
  /** Routes costing up to (1 + slack) × the best one share traffic in proportion to their throughput. 0: always the best. @defaultValue 1 */
  routeSlack: number;
  /** How long a signed route stays valid, ms. @defaultValue 300000 */
  routeTtlMs: number;
  /** Longest silence from a head while generating (first event included), ms. @defaultValue 60000 */
  generateIdleTimeoutMs: number;
  /** Head restarts per request after the first head fails. @defaultValue 3 */
  maxHeadFailovers: number;
  /**
   * Chats waiting for KV room (no route has room for them now) in the FIFO
   * queue; one more is answered 429 with Retry-After at once. 0: no queue.
   * @defaultValue 128
   */
  queueMaxLength: number;
  /** Longest a chat waits in the queue before it is answered 429 with Retry-After, ms. @defaultValue 30000 */
  queueMaxWaitMs: number;
  /** Times one chat is routed again after nodes answer MESH_ERR_BUSY (no KV room), before it gets 429. @defaultValue 16 */
  maxBusyReroutes: number;
  /** A rebalance moves a node only when the worst layer's throughput improves below this ratio (Petals' balance_quality). @defaultValue 0.75 */
  balanceQuality: number;
  /** Largest JSON body accepted, bytes. @defaultValue 1048576 */
  maxBodyBytes: number;
  /** Routes kept for the dashboard. @defaultValue 50 */
  recentRoutes: number;
  /** /metrics has per-node series (KV, batch sizes) while at most this many nodes are registered. @defaultValue 500 */
  perNodeMetricsLimit: number;
  /** NATS servers (`nats://host:port`) of the cluster this tracker is one replica of; absent: a tracker alone, its registry in memory. */
  nats: string[] | undefined;
  /** The cluster's name: its NATS subjects and registry bucket. @defaultValue 'meshnet' */
  cluster: string;
  /** File holding the cluster operator's Ed25519 key (JWK, created when missing): the tracker certifies its own key with it at start. */
  operatorKeyFile: string | undefined;
  /** pino level. @defaultValue 'info' */
  logLevel: string;
  /** Clock, ms since epoch (tests pin it). */
  now: () => number;
  /** Randomness in [0, 1) for route picks (tests pin it). */
  random: () => number;
}

export const TRACKER_DEFAULTS: TrackerOptions = {
  port: 8080,
  host: '127.0.0.1',
  relayUrl: undefined,
  models: [],
  wireDtype: 'bf16',
  keyFile: undefined,
  maxTokensLimit: 4096,
  defaultMaxTokens: 256,
  heartbeatIntervalMs: 5000,
  deadAfterMissedHeartbeats: 3,
  maxClockSkewMs: 60_000,
  kvReserveContextTokens: 2048,
  kvReserveSessions: 1,
  weightBytesPerParam: 4,
  defaultLayerMs: 5,
  hopLatencyMs: 10,
  routeSlack: 1,
  routeTtlMs: 300_000,
  generateIdleTimeoutMs: 60_000,
  maxHeadFailovers: 3,
  queueMaxLength: 128,
  queueMaxWaitMs: 30_000,
  maxBusyReroutes: 16,
  balanceQuality: 0.75,
  maxBodyBytes: 1 << 20,
  recentRoutes: 50,
  perNodeMetricsLimit: 500,
  nats: undefined,
  cluster: 'meshnet',
  operatorKeyFile: undefined,
  logLevel: 'info',
  now: () => Date.now(),
  random: () => Math.random(),
};

/** The wire dtype of `model` (its own, else the tracker's). */
export function wireDtypeOf(o: Pick<TrackerOptions, 'models' | 'wireDtype'>, model: string): Dtype {
  return o.models.find((m) => m.name === model)?.wireDtype ?? o.wireDtype;
}

export function resolveTrackerOptions(partial: Partial<TrackerOptions>): TrackerOptions {
  const o: TrackerOptions = { ...TRACKER_DEFAULTS };
  for (const [k, v] of Object.entries(partial)) if (v !== undefined) (o as unknown as Record<string, unknown>)[k] = v;
  const positive: Array<keyof TrackerOptions> = ['maxTokensLimit', 'defaultMaxTokens', 'heartbeatIntervalMs', 'deadAfterMissedHeartbeats', 'maxClockSkewMs', 'kvReserveContextTokens', 'weightBytesPerParam', 'defaultLayerMs', 'routeTtlMs', 'generateIdleTimeoutMs', 'maxBodyBytes', 'queueMaxWaitMs'];
  for (const k of positive) {
    const v = o[k];
    if (typeof v !== 'number' || !Number.isFinite(v) || v <= 0) throw new TypeError(`tracker option ${k} must be a positive number, got ${String(v)}`);
  }
  for (const k of ['kvReserveSessions', 'hopLatencyMs', 'routeSlack', 'maxHeadFailovers', 'queueMaxLength', 'maxBusyReroutes'] as const) {
    if (!Number.isFinite(o[k]) || o[k] < 0) throw new TypeError(`tracker option ${k} must be a non-negative number, got ${o[k]}`);
  }
  if (!(o.balanceQuality > 0 && o.balanceQuality <= 1)) throw new TypeError(`tracker option balanceQuality must be in (0, 1], got ${o.balanceQuality}`);
  if (!isDtype(o.wireDtype)) throw new TypeError(`tracker option wireDtype must be one of ${DTYPES.join(', ')}, got ${String(o.wireDtype)}`);
  const names = new Set<string>();
  for (const m of o.models) {
    if (m.wireDtype !== undefined && !isDtype(m.wireDtype)) throw new TypeError(`model "${m.name}": wire dtype must be one of ${DTYPES.join(', ')}, got ${String(m.wireDtype)}`);
    if (names.has(m.name)) throw new TypeError(`model "${m.name}" is given twice`);
    names.add(m.name);
  }
  return o;
}
