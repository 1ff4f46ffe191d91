/**
 * The signalling messages of page-to-page data channels (docs/protocol.md
 * §12): `POST /rtc/signal` from one node to another over the relay's fast
 * path. The relay writes the sender's peer id into every request it
 * forwards, so the receiver knows who signals without trusting the body;
 * what it must check is *why* that peer may connect: the offer carries a
 * route the tracker signed (the same head, route text, expiry and signature
 * a chained step carries), and both ends must be on it.
 */
import { z } from 'zod';
import type { HeaderMap } from '../protocol/headers.ts';
import { H } from '../protocol/headers.ts';

export const RTC_SIGNAL_PATH = '/rtc/signal';

/** A signed route, as proof that two peers have reason to talk (both on it: the head or a hop). */
export interface RouteProof {
  /** The head the route is signed for. */
  head: string;
  /** The route's exact JSON text, as signed. */
  route: string;
  /** ms since epoch. */
  expires: number;
  /** The tracker's Ed25519 signature, base64url. */
  signature: string;
}

const hex = (max: number) => z.string().regex(/^[0-9a-f]+$/).min(8).max(max);

const signalSchema = z.discriminatedUnion('type', [
  z.object({ type: z.enum(['offer', 'answer']), sdp: z.string().min(1).max(32_768) }),
  z.object({ type: z.literal('candidate'), candidate: z.string().max(1024), sdpMid: z.string().max(64).nullish(), sdpMLineIndex: z.number().int().min(0).max(64).nullish() }),
  z.object({ type: z.literal('close'), reason: z.string().max(256).optional() }),
]);

export const routeProofSchema = z.object({
  head: z.string().regex(/^[0-9a-f]{32}$/),
  route: z.string().min(2).max(16_384),
  expires: z.number().int().positive(),
  signature: z.string().min(1).max(256),
});

export const signalMessageSchema = z.object({
  /** The connection's id, chosen by the side that offers. */
  conn: hex(32),
  signal: signalSchema,
  /** With the offer only. */
  proof: routeProofSchema.optional(),
});

export type SignalMessage = z.infer<typeof signalMessageSchema>;

/** Largest signalling body a node reads. */
export const MAX_SIGNAL_BYTES = 64 * 1024;

/** The route proof a chained request carries in its headers (chain-hop.ts sends them on every push); undefined when it has none. */
export function proofFromHeaders(h: HeaderMap | undefined): RouteProof | undefined {
  if (!h) return undefined;
  const head = h[H.chainHead];
  const route = h[H.route];
  const expires = h[H.routeExpires];
  const signature = h[H.routeSignature];
  if (head === undefined || route === undefined || expires === undefined || signature === undefined || !/^\d{1,16}$/.test(expires.trim())) return undefined;
  return { head: head.trim(), route, expires: Number(expires.trim()), signature: signature.trim() };
}
