/**
 * What the tracker knows, for people and monitors.
 *
 *   GET /api/tracker        the tracker's public key, peer id, models and models still loading
 *   GET /api/availability   per model: layers × nodes, spans, status, throughput
 *   GET /api/dashboard      nodes, stats (KV use), the admission queue, recent routes
 *   GET /dashboard          the dashboard page over /api/dashboard (dashboard.ts)
 *   GET /healthz, GET /metrics
 */
import type { TrackerContext } from '../context.ts';
import { verificationSummary } from './verify.ts';
import { wireDtypeOf } from '../options.ts';
import { DASHBOARD_HTML } from '../dashboard.ts';
import { json, type App } from '../http.ts';
import type { NodeRecord } from '../registry.ts';

/** Nodes per page of /api/dashboard, and at most. */
const DASHBOARD_PAGE = { limit: 200, max: 1000 };
/** Nodes per page of /api/availability, and at most. */
const AVAILABILITY_PAGE = { limit: 1000, max: 10_000 };
/** Peer ids listed per layer in /api/availability (`count` is exact). */
const IDS_PER_LAYER = 256;

function pageOf(url: URL, d: { limit: number; max: number }): { offset: number; limit: number } {
  const int = (v: string | null, dflt: number) => {
    const n = v === null ? NaN : Number(v);
    return Number.isInteger(n) && n >= 0 ? n : dflt;
  };
  return { offset: int(url.searchParams.get('offset'), 0), limit: Math.min(d.max, int(url.searchParams.get('limit'), d.limit)) };
}

export function statusRoutes(app: App, ctx: TrackerContext): void {
  const { options: o, registry, metrics, identity, publicKey, admission } = ctx;

  /** A node's KV cache as the dashboard shows it; null for a node that does not report it. */
  function kvView(n: NodeRecord) {
    const st = n.stats;
    if (st?.kv_budget_bytes === undefined) return null;
    const free = registry.kvFree(n);
    return {
      budget_bytes: st.kv_budget_bytes,
      used_bytes: st.kv_used_bytes ?? Math.max(0, st.kv_budget_bytes - st.kv_free_bytes),
      sessions: st.kv_sessions ?? null,
      held_by_tracker_bytes: registry.kvHeldOn(n.peerId),
      free_estimate_bytes: Number.isFinite(free) ? free : null,
      busy: n.busyUntil > o.now(),
    };
  }

  function queueView() {
    return { length: admission.length, running: admission.running, max_length: o.queueMaxLength, max_wait_ms: o.queueMaxWaitMs, oldest_wait_ms: admission.oldestWaitMs() };
  }

  app.get('/api/tracker', () => json(200, { public_key: publicKey, peer_id: identity.peerId, models: [...registry.models.keys()], models_pending: [...ctx.pendingModels.keys()], heartbeat_interval_ms: o.heartbeatIntervalMs }));

  app.get('/api/availability', ({ url }) => {
    const only = url.searchParams.get('model');
    const names = only ? [registry.model(only).name] : [...registry.models.keys()];
    const { offset, limit } = pageOf(url, AVAILABILITY_PAGE);
    return json(200, { models: names.map((m) => registry.availability(m, { offset, limit, idsPerLayer: IDS_PER_LAYER })) });
  });

  app.get('/api/dashboard', ({ url }) => {
    const now = o.now();
    const relayUp = ctx.generation.transport.relayUp?.();
    const reach = (n: NodeRecord) => {
      const why = registry.unreachableWhy(n, relayUp);
      return why === undefined ? { reachable: true } : { reachable: false, unreachable_reason: why, ...(n.unreachable ? { unreachable_ms: now - n.unreachable.since } : {}) };
    };
    const { offset, limit } = pageOf(url, DASHBOARD_PAGE);
    const total = registry.nodes.size;
    // One page of nodes (in the order they joined); the rest is summed, so a tab open on a swarm of
    // thousands costs the tracker what it costs on a few hundred.
    const page: NodeRecord[] = [];
    const byBackend: Record<string, number> = {};
    const byHost: Record<string, number> = {};
    let i = 0;
    for (const n of registry.nodes.values()) {
      byBackend[n.info.backend] = (byBackend[n.info.backend] ?? 0) + 1;
      byHost[n.info.host] = (byHost[n.info.host] ?? 0) + 1;
      if (i++ >= offset && page.length < limit) page.push(n);
    }
    return json(200, {
      tracker: { public_key: publicKey, peer_id: identity.peerId, uptime_s: Math.round((now - ctx.startedAt) / 1000), heartbeat_interval_ms: ctx.load.intervalMs(), behind: ctx.load.current.behind },
      // How often a dashboard should ask again: every second for a small mesh, less often for a swarm.
      refresh_ms: total <= 200 ? 1000 : total <= 2000 ? 2000 : 5000,
      summary: { nodes: total, by_backend: byBackend, by_host: byHost },
      models: [...registry.models.values()].map((m) => {
        const cov = registry.coverageOf(m.name);
        return {
          name: m.name,
          url: m.url,
          num_layers: m.numLayers,
          wire_dtype: wireDtypeOf(o, m.name),
          complete: cov.complete,
          missing_layers: cov.missing,
          coverage: cov.count,
          nodes: registry.placement(m.name).size,
          status: registry.statusCounts(m.name),
          spans: registry.spanGroups(m.name),
        };
      }),
      page: { offset, limit, total },
      nodes: page.map((n) => ({
        peer_id: n.peerId,
        model: n.info.model,
        backend: n.info.backend,
        weight_format: n.info.weight_format ?? 'f32',
        host: n.info.host,
        version: n.info.version ?? null,
        memory_budget_mb: n.info.memory_budget_mb,
        status: registry.status(n),
        draining: n.draining === true,
        draining_since: n.drainingSince ?? null,
        duty_cycle: n.info.duty_cycle ?? 1,
        assignment: n.assignment && { start_layer: n.assignment.start, end_layer: n.assignment.end },
        serving: n.serving && { start_layer: n.serving.start, end_layer: n.serving.end },
        throughput: Math.round(registry.throughput(n) * 100) / 100,
        layer_ms: Math.round(registry.layerMs(n) * 1000) / 1000,
        rpm: n.stats?.rpm ?? 0,
        queue_depth: n.stats?.queue_depth ?? 0,
        kv_free_bytes: n.stats?.kv_free_bytes ?? null,
        kv: kvView(n),
        tokens_served: n.stats?.tokens_served ?? 0,
        speculation: n.stats?.speculation ?? null,
        rpm_history: n.history.map((h) => ({ at: h.at, rpm: h.rpm, layer_ms: h.layer_ms })),
        in_flight: n.inFlight,
        failures: n.failures,
        last_seen_ms_ago: now - n.lastSeen,
        endpoint: n.endpoint ?? null,
        relay_addr: n.relayAddr ?? null,
        ...reach(n),
        // Which path each of its hops takes (a data channel, the relay, a link …): null for nodes that do not report it.
        hops_sent: n.stats?.hops_sent ?? null,
        hop_paths: n.stats?.hop_paths ?? null,
      })),
      queue: queueView(),
      recent_routes: [...ctx.recentRoutes].reverse(),
      verification: verificationSummary(ctx),
    });
  });

  app.get('/dashboard', () => new Response(DASHBOARD_HTML, { status: 200, headers: { 'content-type': 'text/html; charset=utf-8', 'cache-control': 'no-cache' } }));

  // 200 while this tracker serves, from its copy of the registry even when NATS is lost (it says so): a load balancer keeps it.
  app.get('/healthz', () => json(200, { status: 'ok', nodes: registry.nodes.size, models: [...registry.models.keys()], heartbeat_interval_ms: ctx.load.intervalMs(), behind: ctx.load.current.behind, ...(ctx.cluster ? { cluster: ctx.cluster.status() } : {}) }));

  app.get('/metrics', async () => {
    ctx.updateNodeGauge();
    metrics.queueLength.set(admission.length);
    metrics.queueRunning.set(admission.running);
    metrics.nodeKv.reset();
    metrics.nodeBatches.reset();
    // Per-node series only for a mesh of a few hundred nodes: past that they are many thousands of series per scrape.
    for (const n of registry.nodes.size <= o.perNodeMetricsLimit ? registry.nodes.values() : []) {
      n.stats?.batch_sizes?.forEach((runs, size) => {
        if (size > 0 && runs > 0) metrics.nodeBatches.set({ peer_id: n.peerId, model: n.info.model, size: String(size) }, runs);
      });
      const kv = kvView(n);
      if (!kv) continue;
      const labels = { peer_id: n.peerId, model: n.info.model };
      metrics.nodeKv.set({ ...labels, kind: 'budget' }, kv.budget_bytes);
      metrics.nodeKv.set({ ...labels, kind: 'used' }, kv.used_bytes);
      metrics.nodeKv.set({ ...labels, kind: 'held' }, kv.held_by_tracker_bytes);
      if (kv.free_estimate_bytes !== null) metrics.nodeKv.set({ ...labels, kind: 'free' }, kv.free_estimate_bytes);
    }
    return new Response(await metrics.registry.metrics(), { status: 200, headers: { 'content-type': metrics.registry.contentType } });
  });
}
