/**
 * A RelayClient's watches of other peers (`peer-watch`, docs/protocol.md §9):
 * one `watch-peer` message per watched peer however many callers watch it,
 * `unwatch-peer` when the last one stops; each caller hears how its watch
 * ended, and whether the relay said the peer is attached to it.
 */

/**
 * How a watchPeer() ended: `gone` the relay said the peer detached; `absent`
 * it was not attached to this relay when asked; `lost` this connection to the
 * relay dropped (watches go with it); `unsupported` the relay has no
 * `peer-watch`, or this client is not registered; `cancelled` the signal.
 */
export type PeerWatchEnd = 'gone' | 'absent' | 'lost' | 'unsupported' | 'cancelled';

/** One watch() call: how it ends, and whom to tell when the relay says the peer is attached. */
interface Watcher {
  done: (end: PeerWatchEnd) => void;
  onAttached?: () => void;
}

/** The relay's `peer-watch` answer or `peer-gone` notice, with a string peer_id (FrameMux's onPeerNotice). */
export interface PeerNotice {
  type: 'peer-watch' | 'peer-gone';
  peer_id: string;
  attached?: unknown;
}

export class PeerWatches {
  /**
   * The watches waiting, by the peer they watch; settled by the relay's notices or when the connection drops.
   * `attached`: the relay answered that the peer is attached to it (the watches hold until it is gone).
   */
  private readonly byPeer = new Map<string, { watchers: Set<Watcher>; attached: boolean }>();

  /** `onError`: an onAttached callback threw (it is not the relay's fault: logged, the watch goes on). */
  constructor(private readonly onError: (err: unknown) => void) {}

  /**
   * Watch `peerId` over a registered connection whose text messages go
   * through `send`; see RelayClient.watchPeer.
   */
  watch(peerId: string, send: (text: string) => void, signal?: AbortSignal, onAttached?: () => void): Promise<PeerWatchEnd> {
    if (signal?.aborted) return Promise.resolve('cancelled');
    return new Promise<PeerWatchEnd>((resolve) => {
      let entry = this.byPeer.get(peerId);
      const first = entry === undefined;
      if (entry === undefined) this.byPeer.set(peerId, (entry = { watchers: new Set(), attached: false }));
      const watcher: Watcher = {
        done: (end: PeerWatchEnd): void => {
          signal?.removeEventListener('abort', onAbort);
          resolve(end);
        },
        ...(onAttached ? { onAttached } : {}),
      };
      const onAbort = (): void => {
        const e = this.byPeer.get(peerId);
        e?.watchers.delete(watcher);
        if (e?.watchers.size === 0) {
          this.byPeer.delete(peerId);
          send(JSON.stringify({ type: 'unwatch-peer', peer_id: peerId }));
        }
        watcher.done('cancelled');
      };
      entry.watchers.add(watcher);
      signal?.addEventListener('abort', onAbort, { once: true });
      if (first) send(JSON.stringify({ type: 'watch-peer', peer_id: peerId }));
      else if (entry.attached) this.tellAttached(watcher);
    });
  }

  /** The relay's `peer-watch` / `peer-gone`: settle the watches of that peer (a peer attached here stays watched until gone). */
  onNotice(msg: PeerNotice): void {
    if (msg.type === 'peer-watch' && msg.attached !== false) {
      const entry = this.byPeer.get(msg.peer_id);
      if (entry === undefined || entry.attached) return;
      entry.attached = true;
      for (const w of entry.watchers) this.tellAttached(w);
      return;
    }
    this.settle(msg.type === 'peer-gone' ? 'gone' : 'absent', msg.peer_id);
  }

  /** End the watches of `peerId` (of every peer when undefined: the connection dropped) with `end`. */
  settle(end: PeerWatchEnd, peerId?: string): void {
    const ids = peerId === undefined ? [...this.byPeer.keys()] : [peerId];
    for (const id of ids) {
      const entry = this.byPeer.get(id);
      this.byPeer.delete(id);
      for (const w of entry?.watchers ?? []) w.done(end);
    }
  }

  private tellAttached(w: Watcher): void {
    try {
      w.onAttached?.();
    } catch (err) {
      this.onError(err);
    }
  }
}
