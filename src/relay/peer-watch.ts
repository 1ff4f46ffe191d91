/**
 * `watch-peer` / `unwatch-peer` (PEER_WATCH_FEATURE, PEER_BACK_FEATURE,
 * docs/protocol.md §9): who asked to be told when a peer detaches from this
 * relay, and the one `peer-gone` each of them gets; who asked about a peer
 * not attached here, and the one `peer-watch` `attached: true` each of them
 * gets when it attaches. Its own module because it is bookkeeping on the side
 * of routing: the table only tells it of messages, arrivals and departures.
 */
import type { RelayMetrics } from './metrics.ts';
import type { Outbox } from './outbox.ts';
import type { PeerConn } from './peer-conn.ts';

/** How many peers one peer may watch at once, attached or not (a node watches its tracker: one, a few in a cluster). */
const MAX_WATCHES_PER_PEER = 16;

export class PeerWatch {
  /** Who watches each peer attached here: told `peer-gone` when it detaches. */
  private readonly watchers = new Map<string, Set<PeerConn>>();
  /**
   * Who watches each peer that was not attached here when asked: told
   * `peer-watch` `attached: true` when it attaches (held, so that a node whose
   * tracker is elsewhere need not ask again after every heartbeat), then
   * watched as attached.
   */
  private readonly pending = new Map<string, Set<PeerConn>>();

  constructor(
    private readonly peers: ReadonlyMap<string, PeerConn>,
    private readonly out: Outbox,
    private readonly metrics: RelayMetrics,
  ) {
    metrics.hot.watches = () => ({ attached: count(this.watchers), pending: count(this.pending) });
  }

  /**
   * `watch-peer`: tell this peer (once) when `target` detaches from this
   * relay, or, when it is not attached here now (on another relay of a
   * cluster, or gone), when it attaches; answered `peer-watch` with whether
   * it is attached here now. `unwatch-peer` forgets either.
   */
  onMessage(peer: PeerConn, type: 'watch-peer' | 'unwatch-peer', target: unknown): void {
    if (typeof target !== 'string' || !/^[0-9a-f]{32}$/.test(target)) {
      this.out.textError(peer.socket, 'MESH_ERR_BAD_REQUEST', `${type} needs peer_id: 32 lowercase hex digits`);
      return;
    }
    if (type === 'watch-peer') this.metrics.watchAsks.inc();
    if (type === 'unwatch-peer') {
      peer.watching?.delete(target);
      this.unlink(target, peer);
      return;
    }
    const attached = this.peers.has(target);
    if (!peer.watching?.has(target)) {
      if ((peer.watching?.size ?? 0) >= MAX_WATCHES_PER_PEER) {
        this.out.textError(peer.socket, 'MESH_ERR_TOO_LARGE', `a peer watches at most ${MAX_WATCHES_PER_PEER} peers`);
        return;
      }
      (peer.watching ??= new Set()).add(target);
      add(attached ? this.watchers : this.pending, target, peer);
    } else if (attached && this.pending.get(target)?.delete(peer)) {
      // Asked again (a node of an older build asks after every beat while the answer is "not attached") once the peer
      // is here but before its `registered` went (a cluster's relay waits for NATS): answered attached, so watched as such.
      if (this.pending.get(target)?.size === 0) this.pending.delete(target);
      add(this.watchers, target, peer);
    }
    this.out.sendTo(peer.socket, JSON.stringify({ type: 'peer-watch', peer_id: target, attached }));
  }

  /**
   * `id` attached here and was told so (its `registered` sent): each peer
   * that watched it while it was not hears `attached: true` once, and
   * watches it as attached from now on.
   */
  attached(id: string): void {
    const set = this.pending.get(id);
    if (set === undefined) return;
    this.pending.delete(id);
    const text = JSON.stringify({ type: 'peer-watch', peer_id: id, attached: true });
    for (const w of set) {
      add(this.watchers, id, w);
      this.out.sendTo(w.socket, text);
    }
  }

  /** `id` detached: each peer watching it hears `peer-gone` once (those still waiting for it to attach keep waiting). */
  detached(id: string): void {
    const set = this.watchers.get(id);
    if (set === undefined) return;
    this.watchers.delete(id);
    const text = JSON.stringify({ type: 'peer-gone', peer_id: id });
    for (const w of set) {
      w.watching?.delete(id);
      this.out.sendTo(w.socket, text);
    }
  }

  /** `peer`'s connection ended: it watches nothing any more, attached or not. */
  watcherGone(peer: PeerConn): void {
    if (peer.watching === undefined) return;
    for (const id of peer.watching) this.unlink(id, peer);
    peer.watching = undefined;
  }

  private unlink(id: string, peer: PeerConn): void {
    for (const map of [this.watchers, this.pending]) {
      const set = map.get(id);
      set?.delete(peer);
      if (set?.size === 0) map.delete(id);
    }
  }
}

function add(map: Map<string, Set<PeerConn>>, id: string, peer: PeerConn): void {
  let set = map.get(id);
  if (set === undefined) map.set(id, (set = new Set()));
  set.add(peer);
}

/** Watchers in a map of sets (at scrape time only). */
function count(map: ReadonlyMap<string, ReadonlySet<PeerConn>>): number {
  let n = 0;
  for (const s of map.values()) n += s.size;
  return n;
}
