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
   * How long a chat waits for a head it can no longer reach over the relay
   * (the relay restarting, the head reconnecting) before that counts as the
   * head failing, ms. Meanwhile the chat resumes on the same head as soon as
   * both are back (the head keeps the generation parked that long too), so
   * a short relay outage costs the client a pause, not its chat.
   * @defaultValue 10000
   */
  relayOutageBudgetMs: number;
  /**
   * Chats waiting for KV room (no route has room for them now) in the FIFO
   * queue; one more is answered 429 with Retry-After at once. 0: no queue.
   * @defaultValue 128
   */
  queueMaxLength: number;
  /** Longest a chat waits in the queue before it is answered 429 with Retry-After, ms. @defaultValue 30000 */
  queueMaxWaitMs: number;
  /**
   * For this long after the tracker starts, a chat for which no route exists
   * waits (in the queue) for nodes to register instead of getting 503 "layers
   * not served": a restarted tracker knows no node until they register again,
   * which they do within about a second of its return. 0: answer 503 at once.
   * `meshnet tracker` uses 5000. @defaultValue 0
   */
  startupWaitMs: number;
  /** Times one chat is routed again after nodes answer MESH_ERR_BUSY (no KV room), before it gets 429. @defaultValue 16 */
  maxBusyReroutes: number;
  /** A rebalance moves a node only when the worst layer's throughput improves below this ratio (Petals' balance_quality). @defaultValue 0.75 */
  balanceQuality: number;
  /**
   * A node dropped for silence (a tab closed, a laptop asleep) may come back
   * with its span and no download: for this long its layers count as held
   * when the tracker weighs moving a serving node onto them. New and idle
   * nodes still take bare layers at once; moving a node that serves others
   * is the last resort. 0: no grace. @defaultValue 30000
   */
  rejoinGraceMs: number;
  /** Largest JSON body accepted, bytes. @defaultValue 1048576 */
  maxBodyBytes: number;
  /** Routes kept for the dashboard. @defaultValue 50 */
  recentRoutes: number;
  /**
   * Spot-checks (docs/verification.md): heads check a sample of their hops by
   * re-execution on other holders, and nodes found lying are quarantined.
   * @defaultValue true
   */
  checks: boolean;
  /** Smallest share of a proven node's sessions that is still checked (BOINC's adaptive replication). @defaultValue 0.02 */
  checkMinRate: number;
  /** First quarantine of a node found lying, ms; doubled for each further offence. @defaultValue 900000 (15 min) */
  quarantineMs: number;
  /** After two head audits contradict a generation, how long the walk of its hops may take to name one before the head is convicted, ms. @defaultValue 60000 */
  auditWalkMs: number;
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
  relayOutageBudgetMs: 10_000,
  queueMaxLength: 128,
  queueMaxWaitMs: 30_000,
  startupWaitMs: 0,
  maxBusyReroutes: 16,
  balanceQuality: 0.75,
  rejoinGraceMs: 30_000,
  maxBodyBytes: 1 << 20,
  recentRoutes: 50,
  checks: true,
  checkMinRate: 0.02,
  quarantineMs: 15 * 60_000,
  auditWalkMs: 60_000,
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
  for (const k of ['kvReserveSessions', 'hopLatencyMs', 'routeSlack', 'maxHeadFailovers', 'queueMaxLength', 'maxBusyReroutes', 'relayOutageBudgetMs', 'startupWaitMs', 'rejoinGraceMs'] as const) {
    if (!Number.isFinite(o[k]) || o[k] < 0) throw new TypeError(`tracker option ${k} must be a non-negative number, got ${o[k]}`);
  }
  if (!(o.checkMinRate > 0 && o.checkMinRate <= 1)) throw new TypeError(`tracker option checkMinRate must be in (0, 1], got ${o.checkMinRate}`);
  if (!(Number.isFinite(o.quarantineMs) && o.quarantineMs >= 0)) throw new TypeError(`tracker option quarantineMs must be a non-negative number, got ${o.quarantineMs}`);
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
