/**
 * What every group of tracker routes shares: options, the registry, the
 * tracker's identity, metrics, the log, recent routes for the dashboard,
 * the admission queue, and what a generation needs.
 */
import type { Logger } from 'pino';
import type { Identity } from '../node/identity.ts';
import type { Admission } from './admission.ts';
import type { GenerationDeps } from './head-proxy.ts';
import type { TrackerMetrics } from './metrics.ts';
import type { TrackerOptions } from './options.ts';
import type { NodeRegistry } from './registry.ts';
import type { RoutePlan } from './routing.ts';

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
  recordRoute(kind: RecentRoute['kind'], model: string, plan: RoutePlan): void;
  /** Node counts by model and status into the gauge. */
  updateNodeGauge(): void;
  /** The KV admission queue: chats wait here when no route has room (the same one as generation.admission). */
  admission: Admission;
  generation: GenerationDeps;
}
