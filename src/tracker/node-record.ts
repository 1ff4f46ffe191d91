/**
 * What the tracker keeps of one node (NodeRecord), the form another tracker
 * of the cluster writes it in (RemoteRecord), and what is read off records:
 * a node's status, whether the tracker can reach it, its budget, whether two
 * spans or two parsed messages say the same. What a message writes into a
 * record is node-intake.ts. The registry (registry.ts) owns the records;
 * nothing here keeps state.
 */
import type { NodeInfo, NodeStats } from '../protocol/tracker.ts';
import type { Span } from './assignment.ts';
import type { ModelSpec } from './model-registry.ts';
import type { Contribution } from './placement.ts';

export const NodeStatus = {
  /** Told what to load; not serving it yet. */
  Loading: 'loading',
  /** Serves its assignment. */
  Serving: 'serving',
  /** Its budget holds no layer of the model. */
  Idle: 'idle',
  /** Serves, but takes no new sessions (paused, frozen, closing): routes leave it out. */
  Draining: 'draining',
} as const;
export type NodeStatus = (typeof NodeStatus)[keyof typeof NodeStatus];

/** One heartbeat's figures the dashboard draws (the rest of the stats are kept only as the latest). */
export interface StatsSample {
  at: number;
  rpm: number;
  layer_ms: number;
}

export interface NodeRecord {
  peerId: string;
  publicKey: string;
  relayAddr?: string;
  endpoint?: string;
  info: NodeInfo;
  assignment: Span | null;
  serving: Span | null;
  stats?: NodeStats;
  /** Last few heartbeats' figures, oldest first (rolling view for the dashboard). */
  history: StatsSample[];
  /** Smoothed ms per layer per step (EWMA of reported layer_ms). */
  layerMsEwma: number | undefined;
  registeredAt: number;
  lastSeen: number;
  /** The heartbeat period this tracker told the node last, ms: its deadline is counted in those. */
  intervalMs: number;
  /** The tracker's own late time (RegistryOptions.lateMs) when the node was last seen: silence while the tracker lagged is not the node's. */
  lateAtSeen: number;
  /** Generations this tracker currently runs through the node (head or hop). */
  inFlight: number;
  /**
   * Failures this tracker saw the node cause: as a head (its stream broke, not a relay outage) or as a
   * hop a head reported failed. Kept by peer id beyond the record (peer-ledgers.ts): a node removed
   * for missing heartbeats (a frozen page) finds its count again when it registers.
   */
  failures: number;
  /**
   * KV bytes this tracker's generations held on the node when its last
   * heartbeat arrived: what the heartbeat's use counts beyond that belongs
   * to other callers (or to sessions idling out).
   */
  kvHeldAtBeat: number;
  /** After a MESH_ERR_BUSY answer no new session is routed here before this time, ms since epoch. */
  busyUntil: number;
  /** The node's relay connection as its last message said (undefined: it did not say). */
  relayConnected?: boolean;
  /** Since when (the tracker's clock) the tracker could not reach the node, and why; cleared when it reaches it again. */
  unreachable?: { since: number; why: string };
  /** The node takes no new sessions (its last message said `draining`): no route, replacement or failover picks it. */
  draining: boolean;
  /**
   * Until when a tracker of the cluster quarantined it (a check proved it wrong), ms since epoch; absent when
   * none did. Shared through the cluster's registry, so every tracker routes around it, not only the judge.
   */
  quarantinedUntil?: number;
  /** When this tracker saw it start draining, ms since epoch (tracker clock). */
  drainingSince: number | undefined;
  /** The newest message timestamp applied (the node's clock): older messages are ignored. */
  lastTimestamp: number;
  /** What the node adds to its model's placement sums (placement.ts); the registry's own bookkeeping. */
  contribution: Contribution | undefined;
}

/** A record as another tracker of the cluster wrote it (cluster/doc.ts reads it from the store). */
export interface RemoteRecord {
  peerId: string;
  publicKey: string;
  relayAddr?: string | undefined;
  endpoint?: string | undefined;
  info: NodeInfo;
  assignment: Span | null;
  serving: Span | null;
  stats?: NodeStats | undefined;
  layerMsEwma?: number | undefined;
  registeredAt: number;
  lastSeen: number;
  intervalMs: number;
  busyUntil: number;
  kvHeldAtBeat: number;
  draining: boolean;
  drainingSince: number | undefined;
  quarantinedUntil?: number | undefined;
}

export function nodeStatus(n: NodeRecord): NodeStatus {
  if (n.draining && n.serving) return NodeStatus.Draining;
  if (!n.assignment) return NodeStatus.Idle;
  if (n.serving && n.serving.start === n.assignment.start && n.serving.end === n.assignment.end) return NodeStatus.Serving;
  return NodeStatus.Loading;
}

/** Why the tracker cannot reach `n` now, as far as it knows (registry.unreachableWhy); undefined: it can. */
export function unreachableWhy(n: NodeRecord, trackerRelayUp: boolean | undefined): string | undefined {
  if (n.unreachable) return n.unreachable.why;
  if (n.endpoint) return undefined;
  if (n.relayAddr === undefined) return 'it has neither an endpoint nor a relay address';
  if (trackerRelayUp === false) return "the tracker's relay connection is down";
  if (n.relayConnected === false) return 'its relay connection is down (reconnecting)';
  return undefined;
}

export function sameSpan(a: Span | null | undefined, b: Span | null | undefined): boolean {
  return a === b || (!!a && !!b && a.start === b.start && a.end === b.end);
}

/**
 * The same JSON data: same keys, and each value the same primitive or, recursively, the same array or
 * object. A beat's parsed copy that says nothing new is then dropped and the record keeps its long-lived
 * object, instead of the GC promoting a fresh one every beat (a serving node's stats hold arrays and
 * objects: `batch_sizes`, `hops_sent`, `hop_paths`). Only for validated messages: they are small and acyclic.
 */
export function sameData(a: unknown, b: unknown): boolean {
  if (a === b) return true;
  if (typeof a !== 'object' || typeof b !== 'object' || a === null || b === null) return false;
  if (Array.isArray(a)) {
    if (!Array.isArray(b) || a.length !== b.length) return false;
    for (let i = 0; i < a.length; i++) if (!sameData(a[i], b[i])) return false;
    return true;
  }
  if (Array.isArray(b)) return false;
  // for-in rather than Object.keys: no key arrays made per object on every beat. A key missing on one side reads
  // undefined there, which differs from any JSON value (parsed JSON holds no undefined), and the counts catch the rest.
  let n = 0;
  for (const k in a) {
    n++;
    if (!sameData((a as Record<string, unknown>)[k], (b as Record<string, unknown>)[k])) return false;
  }
  for (const _ in b) n--;
  return n === 0;
}

export function budgetBytes(info: NodeInfo): number {
  return info.memory_budget_mb * 1024 * 1024;
}

export function validSpan(s: { start_layer: number; end_layer: number } | null | undefined, model: ModelSpec): Span | null {
  if (!s || s.start_layer >= s.end_layer || s.end_layer > model.numLayers) return null;
  return { start: s.start_layer, end: s.end_layer };
}
