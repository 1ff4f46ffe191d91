/** Header names of the node HTTP surface (PROTOCOL.md §5), lowercase. */
export const H = {
  shape: 'x-meshnet-shape',
  dtype: 'x-meshnet-dtype',
  startLayer: 'x-meshnet-start-layer',
  endLayer: 'x-meshnet-end-layer',
  session: 'x-meshnet-session',
  position: 'x-meshnet-position',
  sampling: 'x-meshnet-sampling',
  route: 'x-meshnet-route',
  routeSignature: 'x-meshnet-route-signature',
  /** ms since epoch after which a head refuses the signed route. */
  routeExpires: 'x-meshnet-route-expires',
  requestId: 'x-meshnet-request-id',
  /**
   * Positions a session will reach at most (prompt + max_tokens), sent with
   * the request that opens it (position 0): the hop reserves that much KV
   * cache up front, or answers 503 MESH_ERR_BUSY at once.
   */
  sessionTokens: 'x-meshnet-session-tokens',
  /** On 503 MESH_ERR_BUSY (and the tracker's 429): whole seconds to wait before trying again. */
  retryAfter: 'retry-after',
  /**
   * Chained hops (src/node/hop/chain-hop.ts): a /forward carrying these runs its
   * span and pushes the output on to route[index + 1] itself; the last hop
   * POSTs its token to the head's /chain/token. `chainHead` is the head the
   * route is signed for, `chainReply` JSON {relay_addr?, endpoint?} of that
   * head, `chainBudget` ms left for the rest of the chain.
   * `chainReplySignature`: the tracker's signature over chainReply for this
   * head and route expiry (chainReplySigningMessage); a hop uses a reply
   * address only when it verifies, and refuses (403) a reply it does not.
   */
  chainIndex: 'x-meshnet-chain-index',
  chainHead: 'x-meshnet-chain-head',
  chainReply: 'x-meshnet-chain-reply',
  chainReplySignature: 'x-meshnet-chain-reply-signature',
  chainBudget: 'x-meshnet-chain-budget-ms',
  /** On the last hop's POST /chain/token: the token answer JSON ({token_id, text, logprob}); the body is the rows the head files for replays. */
  chainToken: 'x-meshnet-chain-token',
  /** On a chain hop's error answer: "1" when the hop already told the head (POST /chain/failed), so its caller need not. */
  chainReported: 'x-meshnet-chain-reported',
  /** On a chain hop's answer: "1" (it took part in the chain), and on a failure the peer id of the hop that failed or refused. */
  chain: 'x-meshnet-chain',
  chainFailed: 'x-meshnet-chain-failed',
  contentType: 'content-type',
} as const;

export type HeaderMap = Record<string, string>;

/**
 * Sets a header as an own property, whatever its name: a peer may send a
 * header named `__proto__`, which plain assignment would swallow (it sets
 * the prototype, or nothing, instead of a key).
 */
export function setHeader(headers: HeaderMap, name: string, value: string): void {
  if (name === '__proto__') Object.defineProperty(headers, name, { value, enumerable: true, writable: true, configurable: true });
  else headers[name] = value;
}

/** Header names are case-insensitive on the wire; the code works on lowercase keys. */
export function normalizeHeaders(headers: Record<string, unknown> | undefined): HeaderMap {
  const out: HeaderMap = {};
  if (!headers) return out;
  for (const [k, v] of Object.entries(headers)) {
    if (v === undefined || v === null) continue;
    setHeader(out, k.toLowerCase(), Array.isArray(v) ? v.join(', ') : String(v));
  }
  return out;
}

export function isTextContentType(ct: string | undefined): boolean {
  if (!ct) return false;
  const t = ct.toLowerCase();
  return t.startsWith('text/') || t.includes('json') || t.includes('javascript') || t.includes('xml');
}
