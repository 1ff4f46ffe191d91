/**
 * What a node runtime is told when it is made: where the relay and the
 * tracker are, the span (the tracker's or a static one), the donor's
 * budget and caps, and the knobs tests and benches turn. The hosts build
 * it from their own flags and settings (src/host/node, src/host/browser).
 */
import type { WeightFormat } from '../../model/weight-format.ts';
import type { RtcConfig } from './data-channels.ts';
import type { SpanSpec } from './host.ts';

export const RUNTIME_VERSION = '0.1.0';

export interface RuntimeConfig {
  /** Relay base URL; absent: no relay (a Node.js node on direct HTTP and links only). */
  relayUrl?: string;
  /** Tracker base URL: the span is the tracker's assignment. */
  trackerUrl?: string;
  /** The model's id at the tracker (absent: the tracker's first model), or a static span's name. */
  model?: string;
  /** A fixed span instead of the tracker's. */
  span?: SpanSpec;
  /** Route-signing key of a head without a tracker (tests, static meshes). */
  trackerKey?: Uint8Array;
  /** The tracker cluster's operator key (base64url): routes only from trackers it certified (docs/protocol.md §9). */
  operatorKey?: string;
  /** Memory the donor gives, bytes: the span's weights, and the KV caches get the rest (the meaning the tracker sizes spans by). */
  memoryBudgetBytes: number;
  /** Positions one session may reach (its KV cache is sized by what the head declares, up to this). @defaultValue 2048 */
  maxContext?: number;
  /** A KV session idle this long may be dropped when a new one needs its room, ms (live sessions never are). @defaultValue 120000 */
  kvIdleTtlMs?: number;
  /** Most sessions' one-token steps run as one batch (docs/architecture.md, "Batching at a hop"); 1 turns batching off. @defaultValue 16 */
  maxBatch?: number;
  hopOrder?: 'relay' | 'direct' | 'adaptive';
  /** How a head drives its pipeline: 'chain' (hops push to the next) or 'star' (every hop answers the head). @defaultValue 'chain' */
  hopMode?: 'chain' | 'star';
  /** As a head: draft with this checkpoint (whole, on the span's backend; refused when its vocabulary is not the target's). */
  draftModelUrl?: string;
  /** As a head: false never drafts (speculative decoding off). @defaultValue true */
  speculation?: boolean;
  /** Registration info's backend before a span has chosen one. */
  backendKind: string;
  /** Registration info's weight format before a span has chosen one (the tracker sizes the span by it). @defaultValue 'f32' */
  weightFormat?: WeightFormat;
  /**
   * A tracker's span that fails to load: retried at the next heartbeat while
   * the old span keeps serving (true: a daemon), or the node stops in the
   * error state until retry() (false: a donor page shows what to do). A
   * static span's failure always stops.
   */
  retryFailedLoads: boolean;
  /** Test hook: every /forward waits this long. */
  injectDelayMs?: number;
  /** While draining (paused, frozen, closing), sessions in flight may finish for this long, ms. @defaultValue 30000 */
  drainGraceMs?: number;
  /** The donor's cap on the device's busy time, in [0.05, 1]. @defaultValue 1 */
  dutyCycle?: number;
  /**
   * Sign a draining heartbeat beside each heartbeat (a 'drain-beacon' event): a page sends it when it is
   * frozen or closed. A function takes each beacon too, and the heartbeat waits (briefly) for its promise:
   * the host's proof that whoever sends the beacon holds it before the tracker sees the newer heartbeat.
   */
  drainBeacons?: boolean | ((beacon: { url: string; body: string }) => Promise<void>);
  /** A span the host keeps in its own storage (a page's IndexedDB): told to the tracker at registration, so a reload gets it back with no download. */
  storedSpan?: { model: string; startLayer: number; endLayer: number };
  /** Data channels to other nodes (data-channels.ts). */
  rtc?: RtcConfig;
}

/** A lifecycle event of the host (a browser page): frozen, back, or going away. */
export type LifecycleEvent = 'frozen' | 'resumed' | 'leaving';
