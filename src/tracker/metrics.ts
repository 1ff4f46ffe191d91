import { Counter, Gauge, Histogram, Registry } from 'prom-client';

/** Tracker metrics on a registry of its own, so several trackers can share a process (tests). */
export function createTrackerMetrics() {
  const registry = new Registry();
  const nodes = new Gauge({ name: 'meshnet_tracker_nodes', help: 'Registered nodes by model and status', labelNames: ['model', 'status'] as const, registers: [registry] });
  const registrations = new Counter({ name: 'meshnet_tracker_registrations_total', help: 'Register/heartbeat messages by kind and result', labelNames: ['kind', 'result'] as const, registers: [registry] });
  const removals = new Counter({ name: 'meshnet_tracker_node_removals_total', help: 'Nodes removed, by reason', labelNames: ['reason'] as const, registers: [registry] });
  const moves = new Counter({ name: 'meshnet_tracker_reassignments_total', help: 'Nodes moved to another span by rebalancing', registers: [registry] });
  const requests = new Counter({ name: 'meshnet_tracker_requests_total', help: 'Public API requests by endpoint and status', labelNames: ['endpoint', 'status'] as const, registers: [registry] });
  const tokens = new Counter({ name: 'meshnet_tracker_tokens_total', help: 'Tokens streamed to clients', registers: [registry] });
  const failovers = new Counter({ name: 'meshnet_tracker_head_failovers_total', help: 'Generations restarted on another head', registers: [registry] });
  const hopRecoveries = new Counter({ name: 'meshnet_tracker_hop_recoveries_total', help: 'Hop failures a head recovered from (recovered events)', registers: [registry] });
  const replacements = new Counter({ name: 'meshnet_tracker_route_replacements_total', help: 'Replacement spans handed to heads, by result', labelNames: ['result'] as const, registers: [registry] });
  const generation = new Histogram({
    name: 'meshnet_tracker_generation_seconds',
    help: 'Time from a chat request to its last token',
    buckets: [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120],
    registers: [registry],
  });
  const firstToken = new Histogram({
    name: 'meshnet_tracker_first_token_seconds',
    help: 'Time from a chat request to its first token',
    buckets: [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
    registers: [registry],
  });
  const queueLength = new Gauge({ name: 'meshnet_tracker_queue_length', help: 'Chats waiting for KV room in the admission queue', registers: [registry] });
  const queueRunning = new Gauge({ name: 'meshnet_tracker_chats_running', help: 'Chats holding KV room on a route (admitted, not finished)', registers: [registry] });
  const queueWait = new Histogram({
    name: 'meshnet_tracker_queue_wait_seconds',
    help: 'Time admitted chats waited in the queue for KV room',
    buckets: [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
    registers: [registry],
  });
  const queueRejections = new Counter({ name: 'meshnet_tracker_queue_rejections_total', help: 'Chats answered 429: the queue was full or the wait passed its limit', labelNames: ['reason'] as const, registers: [registry] });
  const beatBatches = new Counter({ name: 'meshnet_tracker_beat_batches_total', help: 'Batches of heartbeats from relays (beat-batch), by result: ok, or malformed (refused whole)', labelNames: ['result'] as const, registers: [registry] });
  const busyAnswers = new Counter({ name: 'meshnet_tracker_busy_answers_total', help: 'MESH_ERR_BUSY answers (a node had no KV room); the chat was routed again', registers: [registry] });
  const nodeKv = new Gauge({
    name: 'meshnet_tracker_node_kv_bytes',
    help: 'KV cache per node: budget, used (last heartbeat), free (tracker estimate now), held (by this tracker\'s running chats)',
    labelNames: ['peer_id', 'model', 'kind'] as const,
    registers: [registry],
  });
  const nodeBatches = new Gauge({
    name: 'meshnet_tracker_node_batch_runs',
    help: 'Forward runs per node by batch size (sessions stepped in one run), from the last heartbeat: the batch size histogram',
    labelNames: ['peer_id', 'model', 'size'] as const,
    registers: [registry],
  });
  const checks = new Counter({ name: 'meshnet_tracker_checks_total', help: 'Spot-checks judged from heads\' reports, by outcome (pass, offence, checker-offence, inconclusive)', labelNames: ['outcome'] as const, registers: [registry] });
  const quarantined = new Gauge({ name: 'meshnet_tracker_quarantined_nodes', help: 'Nodes under quarantine now (found lying by a check)', registers: [registry] });
  const clusterDropped = new Counter({ name: 'meshnet_tracker_cluster_dropped_total', help: 'Malformed cluster messages (KV documents, seen batches) dropped, by kind', labelNames: ['kind'] as const, registers: [registry] });
  const clusterWrites = new Counter({ name: 'meshnet_tracker_cluster_writes_total', help: 'Registry writes to the cluster store, by kind and result (ok, conflict: lost a compare-and-swap, failed)', labelNames: ['kind', 'result'] as const, registers: [registry] });
  const pickBuckets = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1];
  const routePickWall = new Histogram({
    name: 'meshnet_tracker_route_pick_seconds',
    help: 'Time to pick a route (KV room, the K cheapest routes, the draw)',
    buckets: pickBuckets,
    registers: [registry],
  });
  const routePickCpu = new Histogram({
    name: 'meshnet_tracker_route_pick_cpu_seconds',
    help: 'CPU time the tracker process used while picking a route (all its threads): what route_pick_seconds has above it was spent waiting for a CPU',
    buckets: pickBuckets,
    registers: [registry],
  });
  const routePick = new PickTimer(routePickWall, routePickCpu);
  return { registry, checks, quarantined, clusterDropped, clusterWrites, routePick, nodeBatches, nodes, registrations, removals, moves, requests, tokens, failovers, hopRecoveries, replacements, generation, firstToken, queueLength, queueRunning, queueWait, queueRejections, busyAnswers, nodeKv, beatBatches };
}
export type TrackerMetrics = ReturnType<typeof createTrackerMetrics>;

/**
 * Times route picks twice: by the clock, and by the CPU the process used
 * meanwhile. A pick is synchronous, so on a busy machine a clock time far
 * above its CPU time is the thread waiting for a core (or for a collector's
 * other threads), not the pick's own work. getrusage costs about a
 * microsecond: small beside a pick over thousands of nodes (hundreds of
 * µs), and still a small part of one over a few nodes (~0.1 ms).
 */
export class PickTimer {
  constructor(
    readonly wall: Histogram,
    readonly cpu: Histogram,
  ) {}

  time<T>(pick: () => T): T {
    const t0 = performance.now();
    const c0 = process.cpuUsage();
    try {
      return pick();
    } finally {
      const c = process.cpuUsage(c0);
      this.wall.observe((performance.now() - t0) / 1000);
      this.cpu.observe((c.user + c.system) / 1e6);
    }
  }
}
