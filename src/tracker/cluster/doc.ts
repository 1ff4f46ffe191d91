/**
 * What trackers of one cluster keep in the shared registry (a JetStream KV
 * bucket), one JSON document per key:
 *
 *   node.<peer_id>     a node: what it announced, what it was assigned, what it serves, its stats
 *                      (with `vacated_until`: a node dropped for silence, kept through its rejoin grace)
 *   route.<lease_id>   a chat running on a route: the KV bytes it holds on each node of it
 *   tracker.<peer_id>  a tracker of the cluster: its route-signing key (and the operator's certificate)
 *   lease.leader       the one tracker that removes silent nodes and moves nodes (renewed, taken over when stale)
 *
 * Documents are validated on the way in: one another process wrote is a
 * message from outside. A malformed one is dropped and counted, never
 * applied. Fields this version does not know are kept (`loose`) so a newer
 * tracker's additions survive an older one's rewrite.
 *
 * A new NodeRecord field that every tracker must see goes here, in
 * {@link nodeDocOf} and in {@link remoteOf}.
 */
import { z } from 'zod';
import { nodeInfoSchema, nodeStatsSchema } from '../../protocol/tracker.ts';
import { sameData, sameSpan } from '../node-record.ts';
import type { NodeRecord, RemoteRecord } from '../registry.ts';

const count = z.number().int().nonnegative();
const trustCountersSchema = z.object({ consecutive: count, checks: count, passes: count, offences: count, inconclusive: count, refusals: count, force_next: z.boolean() });

const span = z.object({ start: z.number().int().nonnegative(), end: z.number().int().positive() }).nullable();
const peerId = z.string().regex(/^[0-9a-f]{32}$/);

export const nodeDocSchema = z
  .object({
    v: z.literal(1),
    peer_id: peerId,
    public_key: z.string().min(40).max(64),
    relay_addr: z.string().max(500).optional(),
    endpoint: z.string().max(500).optional(),
    info: nodeInfoSchema,
    stats: nodeStatsSchema.optional(),
    assignment: span,
    serving: span,
    layer_ms_ewma: z.number().nonnegative().optional(),
    registered_at: z.number(),
    last_seen: z.number(),
    interval_ms: z.number().positive(),
    busy_until: z.number(),
    kv_held_at_beat: z.number().nonnegative(),
    /** It takes no new sessions (docs/protocol.md §9 "Draining"), since when (the writer's clock). */
    draining: z.boolean().optional(),
    draining_since: z.number().optional(),
    /** A tracker of the cluster quarantined it until then (docs/verification.md): every tracker routes around it. */
    quarantined_until: z.number().optional(),
    /**
     * The leader dropped it for silence and keeps its layers from moves until then (its rejoin grace): the
     * document stays, as a tombstone, so a leader elected meanwhile knows the grace; no tracker routes to it or
     * counts it as registered; it is deleted when the grace ends, or rewritten live when the node registers again.
     */
    vacated_until: z.number().optional(),
    /** Its check counters, summed over every tracker's judgements (verify/trust.ts): a node proven on one tracker is proven on all. */
    trust: trustCountersSchema.optional(),
    /** The tracker that wrote this version. */
    by: z.string().max(64),
  })
  .loose();
export type NodeDoc = z.infer<typeof nodeDocSchema>;

export function nodeDocOf(n: NodeRecord, by: string): NodeDoc {
  return {
    v: 1,
    peer_id: n.peerId,
    public_key: n.publicKey,
    ...(n.relayAddr !== undefined ? { relay_addr: n.relayAddr } : {}),
    ...(n.endpoint !== undefined ? { endpoint: n.endpoint } : {}),
    info: n.info,
    ...(n.stats !== undefined ? { stats: n.stats } : {}),
    assignment: n.assignment && { start: n.assignment.start, end: n.assignment.end },
    serving: n.serving && { start: n.serving.start, end: n.serving.end },
    ...(n.layerMsEwma !== undefined ? { layer_ms_ewma: n.layerMsEwma } : {}),
    registered_at: n.registeredAt,
    last_seen: n.lastSeen,
    interval_ms: n.intervalMs,
    busy_until: n.busyUntil,
    kv_held_at_beat: n.kvHeldAtBeat,
    ...(n.draining ? { draining: true, ...(n.drainingSince !== undefined ? { draining_since: n.drainingSince } : {}) } : {}),
    ...(n.quarantinedUntil !== undefined ? { quarantined_until: n.quarantinedUntil } : {}),
    by,
  };
}

/** The fields of a node document the registry's copy is made of (a parsed document, or what node-docs.ts keeps of one: stored-doc.ts). */
export type RemoteFields = Pick<
  NodeDoc,
  'peer_id' | 'public_key' | 'relay_addr' | 'endpoint' | 'info' | 'assignment' | 'serving' | 'stats' | 'layer_ms_ewma' | 'registered_at' | 'last_seen' | 'interval_ms' | 'busy_until' | 'kv_held_at_beat' | 'draining' | 'draining_since' | 'quarantined_until'
>;

export function remoteOf(d: RemoteFields): RemoteRecord {
  return {
    peerId: d.peer_id,
    publicKey: d.public_key,
    relayAddr: d.relay_addr,
    endpoint: d.endpoint,
    info: d.info,
    assignment: d.assignment,
    serving: d.serving,
    stats: d.stats,
    layerMsEwma: d.layer_ms_ewma,
    registeredAt: d.registered_at,
    lastSeen: d.last_seen,
    intervalMs: d.interval_ms,
    busyUntil: d.busy_until,
    kvHeldAtBeat: d.kv_held_at_beat,
    draining: d.draining === true,
    drainingSince: d.draining ? d.draining_since : undefined,
    quarantinedUntil: d.quarantined_until,
  };
}

/** A chat's hold on KV room: bytes per node of its route, owned by the tracker running it. */
export const routeDocSchema = z.object({
  v: z.literal(1),
  by: peerId,
  model: z.string().max(200),
  hops: z.array(z.tuple([peerId, z.number().nonnegative()])).max(256),
});
export type RouteDoc = z.infer<typeof routeDocSchema>;

/** A tracker of the cluster as the others (and, through answers, the nodes) know it. */
export const trackerDocSchema = z
  .object({
    v: z.literal(1),
    peer_id: peerId,
    /** base64url raw Ed25519 key it signs routes with. */
    public_key: z.string().min(40).max(64),
    /** Its own HTTP base URL. */
    url: z.string().max(500),
    /** The relay it is attached to (the base of its relay address): nodes of that relay beat to it over the socket. */
    relay: z.string().max(500).optional(),
    /** The operator's certificate of `public_key` (docs/protocol.md §9), when the cluster has an operator key. */
    cert: z.object({ operator_key: z.string().min(40).max(64), expires_at: z.number().int(), signature: z.string().min(40).max(200) }).optional(),
    started_at: z.number(),
  })
  .loose();
export type TrackerDoc = z.infer<typeof trackerDocSchema>;

/** The leader lease: who holds it. Its age is measured by each tracker's own clock from the revision it last saw change. */
export const leaseDocSchema = z.object({ v: z.literal(1), by: peerId, at: z.number() });
export type LeaseDoc = z.infer<typeof leaseDocSchema>;

/** A batch of peers a tracker heard from (published every second; also the tracker's sign of life). */
export const seenSchema = z.object({
  v: z.literal(1),
  by: peerId,
  /** The heartbeat period it hands out now, ms. */
  interval_ms: z.number().positive(),
  /** It is behind (its own load monitor): heartbeats may wait in its backlog, so nobody should be removed now. */
  behind: z.boolean(),
  ids: z.array(peerId).max(100_000),
});
export type Seen = z.infer<typeof seenSchema>;

const PEER_ID = /^[0-9a-f]{32}$/;

/**
 * A `seen` batch as {@link seenSchema} would give it, checked by hand; undefined when the schema must
 * decide (anything unusual: a key it does not know, a wrong type), whose verdict then stands. Every
 * tracker checks each other tracker's batch every second, thousands of peer ids, and zod's walk of them
 * cost as much as applying them (test/tracker/seen-check.test.ts holds the two to the same answers).
 */
export function plainSeen(raw: unknown): Seen | undefined {
  if (typeof raw !== 'object' || raw === null || Array.isArray(raw)) return undefined;
  const r = raw as Record<string, unknown>;
  let keys = 0;
  for (const k in r) {
    if (!Object.hasOwn(r, k)) return undefined;
    keys++;
  }
  const { v, by, interval_ms: interval, behind, ids } = r;
  if (keys !== 5 || v !== 1 || typeof by !== 'string' || !PEER_ID.test(by) || typeof behind !== 'boolean') return undefined;
  if (typeof interval !== 'number' || !Number.isFinite(interval) || interval <= 0) return undefined;
  if (!Array.isArray(ids) || ids.length > 100_000) return undefined;
  for (const id of ids) if (typeof id !== 'string' || !PEER_ID.test(id)) return undefined;
  return r as Seen;
}

/** KV keys of the registry bucket. */
export const keys = {
  node: (peer: string) => `node.${peer}`,
  route: (id: string) => `route.${id}`,
  tracker: (peer: string) => `tracker.${peer}`,
  leader: 'lease.leader',
};

/** Does the stored document miss something routing reads from `n` (so a heartbeat must be written)? */
export function beatNeedsWrite(n: NodeRecord, d: Pick<NodeDoc, 'serving' | 'public_key' | 'relay_addr' | 'endpoint' | 'info' | 'draining' | 'last_seen' | 'stats' | 'layer_ms_ewma'> | undefined, now: number, refreshMs: number): boolean {
  if (!d) return true;
  if (!sameSpan(n.serving, d.serving) || n.publicKey !== d.public_key || n.relayAddr !== d.relay_addr || n.endpoint !== d.endpoint) return true;
  // NodeInfo is flat: compared field by field, not as two JSON strings made on every beat.
  if (!sameData(n.info, d.info) || n.draining !== (d.draining === true)) return true;
  if (now - d.last_seen > refreshMs) return true;
  const a = n.stats;
  const b = d.stats;
  if (!a !== !b) return true;
  if (a && b) {
    if (a.queue_depth !== b.queue_depth || (a.kv_sessions ?? 0) !== (b.kv_sessions ?? 0) || a.kv_budget_bytes !== b.kv_budget_bytes || a.kv_bytes_per_token !== b.kv_bytes_per_token) return true;
    const scale = Math.max(1, a.kv_budget_bytes ?? a.kv_free_bytes);
    if (Math.abs((a.kv_used_bytes ?? 0) - (b.kv_used_bytes ?? 0)) > 0.05 * scale || Math.abs(a.kv_free_bytes - b.kv_free_bytes) > 0.05 * scale) return true;
  }
  const e1 = n.layerMsEwma;
  const e2 = d.layer_ms_ewma;
  if ((e1 === undefined) !== (e2 === undefined)) return true;
  return e1 !== undefined && e2 !== undefined && Math.abs(e1 - e2) > 0.2 * e2;
}
