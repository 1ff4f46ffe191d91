/**
 * What every group of tracker routes shares: options, the registry, the
 * tracker's identity, metrics, the log, recent routes for the dashboard,
 * the admission queue, and what a generation needs.
 */
import type { Logger } from 'pino';
import type { Identity } from '../net/identity.ts';
import { MeshError } from '../protocol/errors.ts';
import type { Admission } from './admission.ts';
import type { LoadMonitor } from './load.ts';
import type { NodeKeys } from './node-keys.ts';
import type { ClusterStore } from './cluster/store.ts';
import type { GenerationDeps } from './head-proxy.ts';
import type { TrackerMetrics } from './metrics.ts';
import type { PendingModel } from './model-registry.ts';
import type { TrackerOptions } from './options.ts';
import type { NodeRegistry } from './registry.ts';
import type { RoutePlan } from './routing.ts';
import type { VerificationService } from './verify/service.ts';
import type { WatchHub } from './watch-hub.ts';
import type { RegisterAnswer } from '../protocol/tracker.ts';

export interface RecentRoute {
  at: number;
  kind: 'generate' | 'failover' | 'rerouted' | 'replace' | 'inspect';
  model: string;
  head: string;
  hops: Array<{ peer_id: string; start_layer: number; end_layer: number }>;
  cost_ms: number;
}

export interface TrackerContext {
  options: TrackerOptions;
  registry: NodeRegistry;
  identity: Identity;
  /** base64url of the route-signing key. */
  publicKey: string;
  metrics: TrackerMetrics;
  logger: Logger;
  /** When the tracker started (its clock). */
  startedAt: number;
  recentRoutes: RecentRoute[];
  /** Models configured but not loaded yet: their checkpoints are retried (ModelCatalog). */
  pendingModels: ReadonlyMap<string, PendingModel>;
  recordRoute(kind: RecentRoute['kind'], model: string, plan: RoutePlan): void;
  /** Node counts by model and status into the gauge. */
  updateNodeGauge(): void;
  /** Is the tracker keeping up: the heartbeat period to hand out, late time, shedding. */
  load: LoadMonitor;
  /** Nodes' keys, parsed once, for their signed messages. */
  nodeKeys: NodeKeys;
  /** A heartbeat that came over the relay from `from` (routes/nodes.ts): the answer, or a MeshError. */
  relayBeat(from: string | undefined, body: Uint8Array): RegisterAnswer;
  /** A relay's batch of heartbeats (routes/nodes.ts): the JSON text of its `answers` (one BeatAnswerEntry per beat, in order; never throws for one beat). */
  relayBeats(beats: ReadonlyArray<{ from: string; body: unknown }>): string;
  /** The cluster store when the tracker runs as one replica of several (`--nats`); undefined alone. */
  readonly cluster: ClusterStore | undefined;
  /** The KV admission queue: chats wait here when no route has room (the same one as generation.admission). */
  admission: Admission;
  generation: GenerationDeps;
  /** Spot-checks, trust counters, quarantines and each generation's verification record. */
  verification: VerificationService;
  /** The nodes' open watch streams (GET /api/nodes/watch). */
  watch: WatchHub;
}

/** 503 for a model whose checkpoint is still being retried; undefined for a model the tracker never had. */
export function notLoadedYet(pendingModels: ReadonlyMap<string, PendingModel> | undefined, model: string): MeshError | undefined {
  const p = pendingModels?.get(model);
  return p && new MeshError('MESH_ERR_UNAVAILABLE', `model "${model}" is not loaded yet: its checkpoint at ${p.url} failed (${p.lastError}); the tracker keeps retrying`);
}
