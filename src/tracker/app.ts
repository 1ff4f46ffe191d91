/**
 * The tracker as a fetch-style app (no socket): control-plane API for nodes,
 * OpenAI-compatible API for clients, data for the dashboard. Routes are
 * grouped by concern, each group a module over one shared TrackerContext:
 *
 *   routes/nodes.ts         POST /api/nodes/register, /api/nodes/heartbeat
 *   routes/mesh-routes.ts   POST /api/route/replace, GET /api/route (signed routes on demand)
 *   routes/status.ts        GET /api/tracker, /api/availability, /api/dashboard, /dashboard, /healthz, /metrics
 *   routes/openai.ts        GET /v1/models, POST /v1/chat/completions, /v1/completions (completion.ts)
 *   routes/verify.ts        POST /api/checks/report, /api/checks/skipped, GET /v1/verifications/:id (verify/service.ts)
 */
import type { Logger } from 'pino';
import { decodeBase64, encodeBase64Url } from '../protocol/base64.ts';
import { MeshError } from '../protocol/errors.ts';
import { beatBatchSchema } from '../protocol/beat-batch.ts';
import { plainBeatBatch } from '../protocol/node-message-check.ts';
import type { Identity } from '../net/identity.ts';
import type { MeshResponse } from '../protocol/envelopes.ts';
import { Admission } from './admission.ts';
import type { ClusterStore } from './cluster/store.ts';
import { LoadMonitor } from './load.ts';
import { NodeKeys } from './node-keys.ts';
import type { RecentRoute, TrackerContext } from './context.ts';
import { PromptSizer, type HeadTransport } from './head-proxy.ts';
import { App, HttpError, json, meshErrorResponse } from './http.ts';
import { RouteSigner } from './route-signer.ts';
import type { TrackerMetrics } from './metrics.ts';
import type { ModelSpec, PendingModel } from './model-registry.ts';
import type { TrackerOptions } from './options.ts';
import { NodeRegistry, NodeStatus } from './registry.ts';
import type { RoutePlan } from './routing.ts';
import { nodeRoutes } from './routes/nodes.ts';
import { openAiRoutes } from './routes/openai.ts';
import { routeRoutes } from './routes/mesh-routes.ts';
import { statusRoutes } from './routes/status.ts';
import { verifyRoutes } from './routes/verify.ts';
import { VerificationService } from './verify/service.ts';
import { WatchHub } from './watch-hub.ts';

export type { RecentRoute } from './context.ts';

export interface TrackerDeps {
  options: TrackerOptions;
  models: readonly ModelSpec[];
  identity: Identity;
  transport: HeadTransport;
  logger: Logger;
  metrics: TrackerMetrics;
  /** Models configured but not loaded yet (their checkpoints are retried): 503 for them, not 404. */
  pendingModels?: ReadonlyMap<string, PendingModel>;
}

export interface Tracker {
  app: App;
  registry: NodeRegistry;
  /** The KV admission queue: chats wait here when no route has room. */
  admission: Admission;
  identity: Identity;
  publicKey: string;
  recentRoutes: RecentRoute[];
  /** Spot-checks: trust counters, quarantines, verification records (docs/verification.md). */
  verification: VerificationService;
  /** Expire silent nodes and rebalance; the server calls it every heartbeat interval. */
  sweep(): string[];
  /** Is the tracker keeping up (the server starts its timer). */
  load: LoadMonitor;
  /** A heartbeat over the relay (POST /api/nodes/beat, unsigned): `from` is the sender the relay vouches for. */
  relayBeat(from: string | undefined, body: Uint8Array): MeshResponse;
  /** A relay's `beats` message (docs/protocol.md §9.1), parsed JSON: the text of the `beats-answer` (or of an `error`) to send back. */
  relayBeats(msg: object): string;
  /** The nodes' watch streams: Node's http host serves GET /api/nodes/watch from here (server.ts). */
  watch: WatchHub;
  /** Join a cluster: from now on the registry is mirrored in `store` (server.ts starts it once the tracker listens). */
  attachCluster(store: ClusterStore): void;
  readonly cluster: ClusterStore | undefined;
}

const encoder = new TextEncoder();

/** A `beats-answer` around the JSON text of its answers (the batch number is a checked integer). */
function beatsAnswer(batch: number, answers: string): string {
  return `{"type":"beats-answer","batch":${batch},"answers":${answers}}`;
}

export function createTracker(deps: TrackerDeps): Tracker {
  const { options: o, logger, metrics, identity } = deps;
  const recentRoutes: RecentRoute[] = [];

  const load = new LoadMonitor({ baseIntervalMs: o.heartbeatIntervalMs });
  // Bound once: a batch of beats is counted ~100 times a second per relay, and inc(labels) hashes the labels each time.
  const batchesOk = metrics.beatBatches.labels({ result: 'ok' });
  // The counts the node gauge shows, per model (updateNodeGauge).
  const nodeGaugeShown = new Map<string, Record<string, number>>();
  const nodeGaugeStale = (): boolean => {
    if (nodeGaugeShown.size !== registry.models.size) return true;
    for (const m of registry.models.keys()) {
      const shown = nodeGaugeShown.get(m);
      if (!shown) return true;
      const counts = registry.statusCounts(m);
      for (const k in counts) if (counts[k as keyof typeof counts] !== shown[k]) return true;
    }
    return false;
  };
  const nodeKeys = new NodeKeys();
  const link: { cluster?: ClusterStore } = {};
  // Late time excused from nodes' deadlines: this tracker's own, and the cluster's (a tracker behind or unheard, NATS lost).
  const registry = new NodeRegistry(deps.models, { ...o, lateMs: () => load.lateMs() + (link.cluster?.lateMs() ?? 0) }, {
    onChanged(n, kind) {
      link.cluster?.onChanged(n, kind);
    },
    onRemoved(n, reason, remote) {
      link.cluster?.onRemoved(n, remote);
      metrics.removals.inc({ reason });
      nodeKeys.forget(n.publicKey);
      logger.info({ peer_id: n.peerId, model: n.info.model, reason }, 'node removed');
      // Waiting chats whose layers are now missing get their 503 now, not at their deadline.
      queueMicrotask(() => admission.kick());
    },
    onMoved(n, mv) {
      metrics.moves.inc();
      logger.info({ peer_id: n.peerId, from: mv.from, to: mv.to }, 'node reassigned');
    },
  });

  function recordRoute(kind: RecentRoute['kind'], model: string, plan: RoutePlan): void {
    recentRoutes.push({
      at: o.now(),
      kind,
      model,
      head: plan.hops[0]!.id,
      hops: plan.hops.map((h) => ({ peer_id: h.id, start_layer: h.start, end_layer: h.end })),
      cost_ms: Math.round(plan.costMs * 100) / 100,
    });
    if (recentRoutes.length > o.recentRoutes) recentRoutes.splice(0, recentRoutes.length - o.recentRoutes);
  }

  const signer = new RouteSigner(identity, o.routeTtlMs, o.now);
  const verification = new VerificationService({
    registry,
    identity,
    transport: deps.transport,
    signer,
    logger,
    options: { enabled: o.checks, minRate: o.checkMinRate, quarantineMs: o.quarantineMs, auditWalkMs: o.auditWalkMs, now: o.now, random: o.random },
    onVerdict: (v) => metrics.checks.inc({ outcome: v.outcome }),
    peerTrackerKeys: () => {
      const own = encodeBase64Url(identity.publicKey);
      return (link.cluster?.trackerKeys() ?? []).filter((k) => k.public_key !== own).map((k) => decodeBase64(k.public_key));
    },
    onTrustOutcome: (peer, outcome, now) => link.cluster?.trustOutcome(peer, outcome, now),
  });
  registry.excluded = (peer) => verification.excluded(peer);
  registry.exclusionsEnd = () => verification.exclusionsEnd();
  const publicKey = encodeBase64Url(identity.publicKey);
  const startedAt = o.now();
  const watch = new WatchHub({ hello: () => JSON.stringify({ tracker_public_key: publicKey, started_at: startedAt, heartbeat_interval_ms: o.heartbeatIntervalMs }) });
  const admission = new Admission(registry, { ...o, ...(o.startupWaitMs > 0 ? { waitForNodesUntil: o.now() + o.startupWaitMs } : {}) }, metrics);
  const ctx: TrackerContext = {
    options: o,
    registry,
    identity,
    publicKey,
    metrics,
    logger,
    startedAt,
    recentRoutes,
    pendingModels: deps.pendingModels ?? new Map(),
    recordRoute,
    load,
    nodeKeys,
    get cluster() {
      return link.cluster;
    },
    relayBeat() {
      throw new MeshError('MESH_ERR_NOT_FOUND', 'no heartbeat route');
    },
    relayBeats() {
      throw new MeshError('MESH_ERR_NOT_FOUND', 'no heartbeat route');
    },
    updateNodeGauge() {
      // From the counts the registry keeps per model (O(models)), not a walk over every node; and only when one moved:
      // it runs once per batch of beats, and a reset and a labelled set per status cost more than the comparison.
      if (!nodeGaugeStale()) return;
      metrics.nodes.reset();
      nodeGaugeShown.clear();
      for (const m of registry.models.keys()) {
        const counts = registry.statusCounts(m);
        nodeGaugeShown.set(m, { ...counts });
        for (const [status, n] of Object.entries(counts)) if (n > 0) metrics.nodes.set({ model: m, status }, n);
      }
    },
    admission,
    generation: { registry, admission, sizer: new PromptSizer(), transport: deps.transport, identity, signer, options: o, logger, metrics, onRoute: recordRoute, verification },
    verification,
    watch,
  };

  const app = new App();
  app.onError = (err) => {
    if (err instanceof HttpError) return json(err.status, err.body, err.headers);
    if (err instanceof MeshError) return meshErrorResponse(err);
    logger.error({ err }, 'unhandled error');
    return meshErrorResponse(new MeshError('MESH_ERR_INTERNAL', 'internal error; the tracker keeps serving'));
  };
  nodeRoutes(app, ctx);
  routeRoutes(app, ctx);
  statusRoutes(app, ctx);
  openAiRoutes(app, ctx);
  verifyRoutes(app, ctx);

  return {
    app,
    registry,
    admission,
    identity,
    publicKey: ctx.publicKey,
    recentRoutes,
    verification,
    load,
    watch,
    sweep() {
      // In a cluster only the leader removes and moves nodes; the others keep their sums exact.
      const removed = registry.sweep({ decide: !link.cluster || link.cluster.isLeader() });
      ctx.updateNodeGauge();
      return removed;
    },
    relayBeat(from, body) {
      try {
        return { status: 200, headers: { 'content-type': 'application/json' }, body: encoder.encode(JSON.stringify(ctx.relayBeat(from, body))) };
      } catch (e) {
        const err = e instanceof MeshError ? e : new MeshError('MESH_ERR_INTERNAL', 'internal error; the tracker keeps serving');
        if (!(e instanceof MeshError)) logger.error({ err: e }, 'relay heartbeat failed');
        return { status: err.status, headers: { 'content-type': 'application/json' }, body: encoder.encode(JSON.stringify(err.toBody())) };
      }
    },
    relayBeats(msg) {
      // The usual batch passes a hand check (node-message-check.ts); anything else, and every error, is the schema's.
      const plain = plainBeatBatch(msg);
      if (plain) {
        batchesOk.inc();
        return beatsAnswer(plain.batch, ctx.relayBeats(plain.beats));
      }
      const p = beatBatchSchema.safeParse(msg);
      if (!p.success) {
        // A relay's bug, not a node's: the whole batch is refused, the relay answers each of its beats, the connection stays.
        metrics.beatBatches.inc({ result: 'malformed' });
        const issue = p.error.issues[0]!;
        const error = { code: 'MESH_ERR_BAD_REQUEST', message: `malformed beats: ${issue.path.join('.') || 'message'}: ${issue.message}` };
        const batch = (msg as { batch?: unknown }).batch;
        logger.warn({ err: error.message }, 'malformed batch of heartbeats from the relay refused');
        return JSON.stringify(typeof batch === 'number' && Number.isInteger(batch) && batch >= 0 ? { type: 'beats-answer', batch, error } : { type: 'error', ...error });
      }
      batchesOk.inc();
      return beatsAnswer(p.data.batch, ctx.relayBeats(p.data.beats));
    },
    attachCluster(store) {
      link.cluster = store;
      admission.observer = store;
      store.onTrust = (peer, counters) => verification.trust.adopt(peer, counters);
    },
    get cluster() {
      return link.cluster;
    },
  };
}

export { NodeStatus };
