/**
 * A RelayClient's watches of other peers (`peer-watch`, docs/protocol.md §9):
 * one `watch-peer` message per watched peer however many callers watch it,
 * `unwatch-peer` when the last one stops; each caller hears how its watch
 * ended, and whether the relay said the peer is attached to it. A relay with
 * `peer-back` holds the watch of a peer not attached to it and says when it
 * attaches: such a watch goes on (the caller is told the peer is absent,
 * then attached) instead of ending `absent`.
 */

/**
 * How a watchPeer() ended: `gone` the relay said the peer detached; `absent`
 * it was not attached to this relay when asked (a relay without `peer-back`:
 * no news will come); `lost` this connection to the relay dropped (watches
 * go with it); `unsupported` the relay has no `peer-watch`, or this client is
 * not registered; `cancelled` the signal.
 */
export type PeerWatchEnd = 'gone' | 'absent' | 'lost' | 'unsupported' | 'cancelled';

/** Whom a watch tells what the relay said, before it ends. */
export interface PeerWatchHooks {
  /** The relay says the peer is attached to it (now, or, with `peer-back`, later): the watch holds until it is gone. */
  onAttached?: () => void;
  /** The relay says the peer is not attached to it and holds the watch (`peer-back`): onAttached follows if it attaches there. */
  onAbsent?: () => void;
}

/** One watch() call: how it ends, and whom to tell what the relay said. */
interface Watcher extends PeerWatchHooks {
  done: (end: PeerWatchEnd) => void;
}

/** What the relay said of a watched peer so far: nothing yet, attached to it, or not attached (and it holds the watch). */
type Said = 'asked' | 'attached' | 'absent';

/** The relay's `peer-watch` answer or `peer-gone` notice, with a string peer_id (FrameMux's onPeerNotice). */
export interface PeerNotice {
  type: 'peer-watch' | 'peer-gone';
  peer_id: string;
  attached?: unknown;
}

export class PeerWatches {
  /**
   * The watches waiting, by the peer they watch; settled by the relay's notices or when the connection drops.
   * `held`: the relay holds a watch of a peer not attached to it (`peer-back`), so `absent` does not end it.
   */
  private readonly byPeer = new Map<string, { watchers: Set<Watcher>; said: Said; held: boolean }>();

  /** `onError`: a hook threw (it is not the relay's fault: logged, the watch goes on). */
  constructor(private readonly onError: (err: unknown) => void) {}

  /**
   * Watch `peerId` over a registered connection whose text messages go
   * through `send`; `held`: that relay announced `peer-back`. See RelayClient.watchPeer.
   */
  watch(peerId: string, send: (text: string) => void, held: boolean, signal?: AbortSignal, hooks: PeerWatchHooks = {}): Promise<PeerWatchEnd> {
    if (signal?.aborted) return Promise.resolve('cancelled');
    return new Promise<PeerWatchEnd>((resolve) => {
      let entry = this.byPeer.get(peerId);
      const first = entry === undefined;
      if (entry === undefined) this.byPeer.set(peerId, (entry = { watchers: new Set(), said: 'asked', held }));
      const watcher: Watcher = {
        done: (end: PeerWatchEnd): void => {
          signal?.removeEventListener('abort', onAbort);
          resolve(end);
        },
        ...hooks,
      };
      const onAbort = (): void => {
        const e = this.byPeer.get(peerId);
        e?.watchers.delete(watcher);
        if (e?.watchers.size === 0) {
          this.byPeer.delete(peerId);
          // Also when the relay holds it for a peer not attached there: that frees it at the relay.
          send(JSON.stringify({ type: 'unwatch-peer', peer_id: peerId }));
        }
        watcher.done('cancelled');
      };
      entry.watchers.add(watcher);
      signal?.addEventListener('abort', onAbort, { once: true });
      if (first) send(JSON.stringify({ type: 'watch-peer', peer_id: peerId }));
      else if (entry.said !== 'asked') this.tell(watcher, entry.said);
    });
  }

  /**
   * The relay's `peer-watch` / `peer-gone`: settle the watches of that peer
   * (a peer attached here stays watched until gone; with `peer-back` one not
   * attached stays watched until it attaches, then until it is gone).
   */
  onNotice(msg: PeerNotice): void {
    const entry = this.byPeer.get(msg.peer_id);
    if (msg.type === 'peer-watch') {
      const said: Said = msg.attached === false ? 'absent' : 'attached';
      // Unasked (a watch cancelled meanwhile), or said already (an answer crossing the relay's notice).
      if (entry === undefined || entry.said === said) return;
      if (said === 'absent' && !entry.held) return this.settle('absent', msg.peer_id);
      entry.said = said;
      for (const w of entry.watchers) this.tell(w, said);
      return;
    }
    this.settle('gone', msg.peer_id);
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

  private tell(w: Watcher, said: 'attached' | 'absent'): void {
    try {
      if (said === 'attached') w.onAttached?.();
      else w.onAbsent?.();
    } catch (err) {
      this.onError(err);
    }
  }
}
