/**
 * The signed route and reply address a generation's head gets
 * (X-Meshnet-Route*, X-Meshnet-Chain-Reply*), shared by the chats that
 * start on the same route within a few seconds.
 *
 * Two Ed25519 signatures per chat were a large part of the tracker's CPU
 * per chat (a chat of 32 tokens paid them as ~0.02 ms per token), and each
 * fresh signature also costs every node of the route a verification (the
 * head per /generate, chain hops once per signature). A route signature
 * covers the head, the expiry and the hop list, nothing of the chat, so the
 * chats on one route can carry the same one: the expiry is rounded up to a
 * bucket (a tenth of the TTL, at most 10 s) and the signatures are kept per
 * (head, hops, reply address, expiry). A route then lives between its TTL
 * and its TTL + one bucket; what a signature allows is unchanged.
 */
import type { Identity } from '../net/identity.ts';
import type { RouteHop } from '../protocol/tracker.ts';
import { signChainReply, signRoute, type SignedRoute } from './signing.ts';

export interface SignedGeneration {
  route: SignedRoute;
  /** The head's reply address for chained hops; undefined when it registered neither a relay nor an endpoint. */
  reply: { text: string; signature: string } | undefined;
}

/** Routes kept at most; past it the cache starts over (routes are few: one per head and hop set). */
const MAX_ENTRIES = 1024;

export class RouteSigner {
  private readonly cache = new Map<string, Promise<SignedGeneration>>();
  private readonly bucketMs: number;
  private bucketExpiry = 0;

  constructor(
    private readonly identity: Identity,
    private readonly ttlMs: number,
    private readonly now: () => number,
  ) {
    this.bucketMs = Math.max(1, Math.min(10_000, Math.floor(ttlMs / 10)));
  }

  /** The route's expiry: now + TTL, rounded up to the bucket. */
  expiry(): number {
    return Math.ceil((this.now() + this.ttlMs) / this.bucketMs) * this.bucketMs;
  }

  sign(headPeerId: string, hops: readonly RouteHop[], head: { relayAddr?: string | undefined; endpoint?: string | undefined }): Promise<SignedGeneration> {
    const expiresAt = this.expiry();
    if (expiresAt !== this.bucketExpiry || this.cache.size >= MAX_ENTRIES) {
      // A new bucket: the old signatures stay valid, but nothing asks for them again.
      this.cache.clear();
      this.bucketExpiry = expiresAt;
    }
    const key = `${headPeerId}\n${head.relayAddr ?? ''}\n${head.endpoint ?? ''}\n${JSON.stringify(hops)}`;
    let signed = this.cache.get(key);
    if (!signed) {
      signed = (async () => {
        const route = await signRoute(this.identity, headPeerId, hops, expiresAt);
        return { route, reply: await signChainReply(this.identity, headPeerId, head, expiresAt) };
      })();
      this.cache.set(key, signed);
      // A failed signing is not kept.
      signed.catch(() => this.cache.get(key) === signed && this.cache.delete(key));
    }
    return signed;
  }
}
