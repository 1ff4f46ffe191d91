/**
 * What the tracker counts of a node by peer id, beyond its record: failures
 * and quarantines outlive it (a node dropped for silence, or one that
 * registers again to wash a verdict, finds them again), and the KV bytes
 * this tracker's own generations hold on it (admission leases). Bounded
 * where keyed by peers that may never come back: the oldest entries go first.
 */
import type { NodeRecord } from './node-record.ts';

/** Peers whose failure counts (and quarantines) are kept. */
const LEDGER_PEERS = 10_000;

export class PeerLedgers {
  /** Failures by peer id, registered or not. */
  private readonly failureCounts = new Map<string, number>();
  /** Quarantines known here (judged here or by another tracker of the cluster): until when, by peer id, registered or not. */
  private readonly quarantineLedger = new Map<string, number>();
  /** KV bytes held on each node by this tracker's running generations (admission leases), by peer id. */
  private readonly kvHeld = new Map<string, number>();

  failuresOf(peerId: string): number {
    return this.failureCounts.get(peerId) ?? 0;
  }

  /** One more failure of `peerId`; returns its count. */
  countFailure(peerId: string): number {
    const n = (this.failureCounts.get(peerId) ?? 0) + 1;
    this.failureCounts.delete(peerId);
    if (this.failureCounts.size >= LEDGER_PEERS) this.failureCounts.delete(this.failureCounts.keys().next().value!);
    this.failureCounts.set(peerId, n);
    return n;
  }

  /** Until when `peerId` is quarantined as far as this tracker knows (0: never). */
  quarantinedUntil(peerId: string): number {
    return this.quarantineLedger.get(peerId) ?? 0;
  }

  /** The latest end of any quarantine noted (0: none): none is in force once it is past. */
  latestQuarantineEnd = 0;

  noteQuarantine(peerId: string, until: number): void {
    this.latestQuarantineEnd = Math.max(this.latestQuarantineEnd, until);
    this.quarantineLedger.delete(peerId);
    if (this.quarantineLedger.size >= LEDGER_PEERS) this.quarantineLedger.delete(this.quarantineLedger.keys().next().value!);
    this.quarantineLedger.set(peerId, until);
  }

  /** Nodes quarantined at `now`, with the end of it (expired entries are forgotten). */
  quarantines(now: number): Array<{ peer_id: string; until: number }> {
    const out: Array<{ peer_id: string; until: number }> = [];
    for (const [peer, until] of this.quarantineLedger) {
      if (until > now) out.push({ peer_id: peer, until });
      else this.quarantineLedger.delete(peer);
    }
    return out;
  }

  kvHeldOn(peerId: string): number {
    return this.kvHeld.get(peerId) ?? 0;
  }

  /** Add (or, negative, give back) KV bytes a generation holds on a node. */
  holdKv(peerId: string, bytes: number): void {
    const v = Math.max(0, (this.kvHeld.get(peerId) ?? 0) + bytes);
    if (v === 0) this.kvHeld.delete(peerId);
    else this.kvHeld.set(peerId, v);
  }
}

/** KV bytes a session of `tokens` positions takes on `n`, in its blocks; 0 when the node does not report its KV. */
export function kvNeed(n: NodeRecord, tokens: number): number {
  const st = n.stats;
  if (!st?.kv_bytes_per_token) return 0;
  const block = st.kv_block_tokens ?? 1;
  const t = Math.min(st.kv_max_tokens ?? Infinity, Math.max(block, Math.ceil(tokens / block) * block));
  return t * st.kv_bytes_per_token;
}

/**
 * KV bytes `n` can give a new session at `now`, as far as this tracker knows:
 * its budget, less what other callers held at its last heartbeat, less
 * `heldNow` (what this tracker's generations hold now). 0 while a
 * MESH_ERR_BUSY answer is fresh; Infinity for a node that does not report its
 * KV (older nodes).
 */
export function kvFree(n: NodeRecord, heldNow: number, now: number): number {
  if (n.busyUntil > now) return 0;
  const st = n.stats;
  if (st?.kv_budget_bytes === undefined) return Infinity;
  const usedAtBeat = st.kv_used_bytes ?? Math.max(0, st.kv_budget_bytes - st.kv_free_bytes);
  const foreign = Math.max(0, usedAtBeat - n.kvHeldAtBeat);
  return Math.max(0, st.kv_budget_bytes - foreign - heldNow);
}
