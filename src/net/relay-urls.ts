/**
 * The relays a RelayClient may dial (docs/protocol.md §1, §4b): the ones it
 * was given, then the ones a relay of a cluster named at registration; each
 * attempt after a failure or a lost connection dials the next.
 */

/** `relayUrl` as a list of `/ws` URLs (split on commas, duplicates dropped). */
export function relayWsUrls(relayUrl: string | readonly string[]): string[] {
  const list = (typeof relayUrl === 'string' ? [relayUrl] : [...relayUrl]).flatMap((u) => u.split(',')).map((u) => u.trim()).filter((u) => u !== '');
  if (list.length === 0) throw new TypeError('no relay URL given');
  return [...new Set(list.map(relayWsUrl))];
}

/** The `/ws` endpoint for a relay base URL. */
export function relayWsUrl(relayUrl: string): string {
  const u = new URL(relayUrl);
  if (u.protocol === 'http:') u.protocol = 'ws:';
  else if (u.protocol === 'https:') u.protocol = 'wss:';
  if (u.protocol !== 'ws:' && u.protocol !== 'wss:') throw new TypeError(`relay URL must be ws(s):// or http(s)://, got ${relayUrl}`);
  if (u.pathname === '' || u.pathname === '/') u.pathname = '/ws';
  return u.toString();
}

/** At most this many relays learned from a cluster, beside the given ones. */
const MAX_LEARNED = 16;

export class RelayUrls {
  /** The given ones, then the learned ones. */
  private readonly list: string[];
  /** How many of `list` were given. */
  private readonly given: number;
  /** Which of `list` the current (or next) attempt dials. */
  private index = 0;

  constructor(relayUrl: string | readonly string[]) {
    this.list = relayWsUrls(relayUrl);
    this.given = this.list.length;
  }

  /** The `/ws` URL the current (or next) attempt dials. */
  get current(): string {
    return this.list[this.index]!;
  }

  /** The next attempt dials the next relay of the list (with one relay: the same one). */
  next(): void {
    this.index = (this.index + 1) % this.list.length;
  }

  /**
   * A relay of a cluster names its relays at registration: they join the
   * list after the given ones, so a node given one URL can fail over too
   * (at most 16 learned; a URL that is not ws(s) is ignored).
   */
  learn(relays: readonly string[] | undefined): void {
    if (!relays) return;
    for (const r of relays) {
      let ws: string;
      try {
        ws = relayWsUrl(r);
      } catch {
        continue;
      }
      if (this.list.includes(ws)) continue;
      if (this.list.length - this.given >= MAX_LEARNED) break;
      this.list.push(ws);
    }
  }
}
