/**
 * `watch-peer` / `unwatch-peer` (PEER_WATCH_FEATURE, docs/protocol.md §9): who
 * asked to be told when a peer detaches from this relay, and the one
 * `peer-gone` each of them gets. Its own module because it is bookkeeping on
 * the side of routing: the table only tells it of messages and departures.
 */
import type { Outbox } from './outbox.ts';
import type { PeerConn } from './peer-conn.ts';

/** How many peers one peer may watch at once (a node watches its tracker: one, a few in a cluster). */
const MAX_WATCHES_PER_PEER = 16;

export class PeerWatch {
  /** Who watches each peer id: told `peer-gone` when it detaches. */
  private readonly watchers = new Map<string, Set<PeerConn>>();

  constructor(
    private readonly peers: ReadonlyMap<string, PeerConn>,
    private readonly out: Outbox,
  ) {}

  /**
   * `watch-peer`: tell this peer (once) when `target` detaches from this
   * relay; answered `peer-watch` with whether it is attached here now (a peer
   * that is not is not watched: it may be on another relay of a cluster, or gone).
   */
  onMessage(peer: PeerConn, type: 'watch-peer' | 'unwatch-peer', target: unknown): void {
    if (typeof target !== 'string' || !/^[0-9a-f]{32}$/.test(target)) {
      this.out.textError(peer.socket, 'MESH_ERR_BAD_REQUEST', `${type} needs peer_id: 32 lowercase hex digits`);
      return;
    }
    if (type === 'unwatch-peer') {
      peer.watching?.delete(target);
      this.unlink(target, peer);
      return;
    }
    const attached = this.peers.has(target);
    if (attached && !peer.watching?.has(target)) {
      if ((peer.watching?.size ?? 0) >= MAX_WATCHES_PER_PEER) {
        this.out.textError(peer.socket, 'MESH_ERR_TOO_LARGE', `a peer watches at most ${MAX_WATCHES_PER_PEER} peers`);
        return;
      }
      (peer.watching ??= new Set()).add(target);
      let set = this.watchers.get(target);
      if (set === undefined) this.watchers.set(target, (set = new Set()));
      set.add(peer);
    }
    this.out.sendTo(peer.socket, JSON.stringify({ type: 'peer-watch', peer_id: target, attached }));
  }

  /** `id` detached: each peer watching it hears `peer-gone` once. */
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

  /** `peer`'s connection ended: it watches nothing any more. */
  watcherGone(peer: PeerConn): void {
    if (peer.watching === undefined) return;
    for (const id of peer.watching) this.unlink(id, peer);
    peer.watching = undefined;
  }

  private unlink(id: string, peer: PeerConn): void {
    const set = this.watchers.get(id);
    set?.delete(peer);
    if (set?.size === 0) this.watchers.delete(id);
  }
}
