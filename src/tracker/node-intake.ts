/**
 * What a message writes into a node's record: the node's own register and
 * heartbeat (its fields, addresses and stats), and another tracker's copy of
 * the record. Pure steps over one record; the registry (registry.ts) picks
 * the record, decides the span and runs a change to a placed record inside
 * its `edit` (node-shares.ts), so the sums follow.
 */
import type { NodeInfo, NodeMessage, NodeStats } from '../protocol/tracker.ts';
import type { ModelSpec } from './model-registry.ts';
import { sameData, sameSpan, validSpan, type NodeRecord, type RemoteRecord, type StatsSample } from './node-record.ts';
import type { PeerLedgers } from './peer-ledgers.ts';

/** Heartbeats whose figures a record keeps for the dashboard. */
const HISTORY = 12;
const EWMA_ALPHA = 0.3;

/** The same model, budget and weight format: the same layers fit, so the node need not be sized again. */
export function sameSizing(a: NodeInfo, b: NodeInfo): boolean {
  return a.model === b.model && a.memory_budget_mb === b.memory_budget_mb && a.weight_format === b.weight_format;
}

/**
 * A verified register message as a record: `prev`, the node's record if it has one here, or a new one;
 * its assignment left null for the registry to choose. `lateAt`: the tracker's late time now;
 * `intervalMs`: the period a new record counts in until the node is told one; `ledgers`: what outlives a record.
 */
export function registerInto(prev: NodeRecord | undefined, msg: NodeMessage, model: ModelSpec, now: number, lateAt: number, intervalMs: number, ledgers: Pick<PeerLedgers, 'failuresOf' | 'quarantinedUntil'>): NodeRecord {
  const draining = msg.draining === true;
  const wasDraining = prev?.draining === true;
  const prevDrainingSince = prev?.drainingSince;
  // The same record object when the node comes back: generations in flight hold it (inFlight).
  const rec: NodeRecord = prev ?? ({ history: [], inFlight: 0, failures: 0, busyUntil: 0, layerMsEwma: undefined, contribution: undefined } as unknown as NodeRecord);
  rec.peerId = msg.peer_id;
  rec.publicKey = msg.public_key;
  setAddresses(rec, msg);
  rec.info = msg.info;
  rec.assignment = null;
  rec.serving = validSpan(msg.serving, model);
  rec.registeredAt = now;
  rec.lastSeen = now;
  rec.lateAtSeen = lateAt;
  rec.intervalMs = rec.intervalMs ?? intervalMs;
  rec.kvHeldAtBeat = 0;
  rec.failures = ledgers.failuresOf(msg.peer_id);
  // A quarantine outlives the record: a node cannot wash it by registering again.
  const quarantined = ledgers.quarantinedUntil(msg.peer_id);
  if (quarantined > now) rec.quarantinedUntil = quarantined;
  if (msg.relay_connected !== undefined) rec.relayConnected = msg.relay_connected;
  else delete rec.relayConnected;
  delete rec.unreachable;
  rec.draining = draining;
  rec.drainingSince = draining ? (wasDraining ? prevDrainingSince : now) : undefined;
  rec.lastTimestamp = msg.timestamp;
  return rec;
}

/**
 * A verified heartbeat, newer than the last message applied and of the same sizing, into its record.
 * `lateAt`: the tracker's late time now; `kvHeld`: this tracker's KV on the node now.
 */
export function beatInto(rec: NodeRecord, msg: NodeMessage, model: ModelSpec, now: number, lateAt: number, kvHeld: number): void {
  // At an equal timestamp a drain holds: the page's beacon and the heartbeat it was signed beside may arrive in either order.
  const draining = msg.draining === true || (msg.timestamp === rec.lastTimestamp && rec.draining);
  if (draining !== rec.draining) {
    rec.draining = draining;
    rec.drainingSince = draining ? now : undefined;
  }
  rec.lastTimestamp = msg.timestamp;
  rec.lastSeen = now;
  rec.lateAtSeen = lateAt;
  // What did not change keeps its old object: a beat's parsed copies then die young instead of
  // replacing thousands of long-lived objects a second, which the GC would copy and promote.
  if (!sameData(rec.info, msg.info)) rec.info = msg.info;
  if (rec.publicKey !== msg.public_key) rec.publicKey = msg.public_key;
  setAddresses(rec, msg);
  if (msg.relay_connected !== undefined) rec.relayConnected = msg.relay_connected;
  else delete rec.relayConnected;
  // Back on its relay (it beats at once when it is): the tracker's way to it is there again.
  if (msg.relay_connected === true) delete rec.unreachable;
  if (msg.serving !== undefined) {
    const serving = validSpan(msg.serving, model);
    if (!sameSpan(rec.serving, serving)) rec.serving = serving;
  }
  if (rec.info.pinned && rec.serving) rec.assignment = rec.serving;
  absorbStats(rec, msg.stats, now, kvHeld);
}

/** A message's stats into the record: the latest, the rolling history, the smoothed layer time. `kvHeldAtBeat`: this tracker's KV on the node now. */
export function absorbStats(rec: NodeRecord, stats: NodeStats | undefined, now: number, kvHeldAtBeat: number): void {
  if (!stats) return;
  if (!rec.stats || !sameData(rec.stats, stats)) rec.stats = stats;
  rec.kvHeldAtBeat = kvHeldAtBeat;
  // The oldest sample is reused once the history is full (no new long-lived object per beat).
  const sample = rec.history.length >= HISTORY ? rec.history.shift()! : ({} as StatsSample);
  sample.at = now;
  sample.rpm = stats.rpm;
  sample.layer_ms = stats.layer_ms;
  rec.history.push(sample);
  if (rec.history.length > HISTORY) rec.history.splice(0, rec.history.length - HISTORY);
  // A node that has not run a step yet reports 0: keep the estimate until it has.
  if (stats.layer_ms > 0) rec.layerMsEwma = rec.layerMsEwma === undefined ? stats.layer_ms : rec.layerMsEwma + EWMA_ALPHA * (stats.layer_ms - rec.layerMsEwma);
}

/**
 * Another tracker's copy of a record into ours: what it decided and heard. What only this tracker counts
 * (generations in flight, failures, the stats history) stays; last seen, the period and a busy mark only grow.
 * `fresh`: ours was just made. `lateMs`: the tracker's late time now (RegistryOptions.lateMs).
 */
export function copyRemote(rec: NodeRecord, r: RemoteRecord, fresh: boolean, lateMs: () => number): void {
  rec.peerId = r.peerId;
  rec.publicKey = r.publicKey;
  if (r.relayAddr !== undefined) rec.relayAddr = r.relayAddr;
  else delete rec.relayAddr;
  if (r.endpoint !== undefined) rec.endpoint = r.endpoint;
  else delete rec.endpoint;
  rec.info = r.info;
  rec.assignment = r.assignment;
  rec.serving = r.serving;
  if (r.stats !== undefined) rec.stats = r.stats;
  if (r.layerMsEwma !== undefined) rec.layerMsEwma = r.layerMsEwma;
  rec.registeredAt = r.registeredAt;
  // Seen: the later of what we heard and what the writer heard.
  if (fresh || r.lastSeen > rec.lastSeen) {
    rec.lastSeen = Math.max(rec.lastSeen ?? 0, r.lastSeen);
    rec.lateAtSeen = lateMs();
  }
  rec.intervalMs = Math.max(rec.intervalMs ?? 0, r.intervalMs);
  rec.busyUntil = Math.max(rec.busyUntil ?? 0, r.busyUntil);
  rec.kvHeldAtBeat = r.kvHeldAtBeat;
  rec.draining = r.draining;
  rec.drainingSince = r.drainingSince;
}

export function setAddresses(rec: NodeRecord, msg: NodeMessage): void {
  if (msg.relay_addr !== undefined) {
    if (rec.relayAddr !== msg.relay_addr) rec.relayAddr = msg.relay_addr;
  } else delete rec.relayAddr;
  if (msg.endpoint !== undefined) {
    if (rec.endpoint !== msg.endpoint) rec.endpoint = msg.endpoint;
  } else delete rec.endpoint;
}
