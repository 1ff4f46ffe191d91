/**
 * Routes signed by a tracker, checked before a head or a chain hop acts on
 * them: a head sends activations only where the tracker said, and a chain's
 * reply address only where it signed. Host-agnostic.
 */
import { decodeBase64 as decodeBase64Url } from '../protocol/base64.ts';
import { MeshError } from '../protocol/errors.ts';
import { chainReplySigningMessage, routeSchema, routeSigningMessage, type RouteHop } from '../protocol/tracker.ts';
import { verifyEd25519 } from '../net/identity.ts';
import { z } from 'zod';
import { keyList, sameBytes, type TrackerKeys } from './tracker-trust.ts';

/** Verify a tracker-signed route text for `headPeerId`; returns the parsed hops or throws MESH_ERR_FORBIDDEN. */
export async function verifySignedRoute(trackerKey: TrackerKeys, headPeerId: string, routeText: string, expiresAt: number, signature: string, now: number): Promise<RouteHop[]> {
  return (await verifyRouteWith(trackerKey, headPeerId, routeText, expiresAt, signature, now)).hops;
}

/** verifySignedRoute, and which key it verified with (any tracker of the cluster may have signed). */
async function verifyRouteWith(trackerKey: TrackerKeys, headPeerId: string, routeText: string, expiresAt: number, signature: string, now: number): Promise<{ hops: RouteHop[]; key: Uint8Array }> {
  const keys = keyList(trackerKey);
  if (keys.length === 0) throw new MeshError('MESH_ERR_FORBIDDEN', 'this head has no tracker key yet (not registered with a tracker, and none configured): it accepts no route');
  if (!Number.isSafeInteger(expiresAt)) throw new MeshError('MESH_ERR_FORBIDDEN', 'route expiry is not an integer (ms since epoch)');
  if (expiresAt < now) throw new MeshError('MESH_ERR_FORBIDDEN', `the route expired ${now - expiresAt} ms ago; ask the tracker for a fresh one`);
  let sig: Uint8Array;
  try {
    sig = decodeBase64Url(signature);
  } catch {
    throw new MeshError('MESH_ERR_FORBIDDEN', 'route signature is not base64url');
  }
  const message = routeSigningMessage(headPeerId, expiresAt, routeText);
  let by: Uint8Array | undefined;
  for (const k of keys) {
    if (await verifyEd25519(k, message, sig)) {
      by = k;
      break;
    }
  }
  if (!by) throw new MeshError('MESH_ERR_FORBIDDEN', 'the route is not signed by the tracker for this head; a head accepts routes only from its tracker (or a tracker of its cluster)');
  let raw: unknown;
  try {
    raw = JSON.parse(routeText);
  } catch {
    throw new MeshError('MESH_ERR_BAD_REQUEST', 'the signed route is not JSON');
  }
  // A route whose head runs every layer itself lists no downstream hop: accept the empty list too.
  const p = (Array.isArray(raw) && raw.length === 0 ? routeSchema.or(z.array(z.never()).max(0)) : routeSchema).safeParse(raw);
  if (!p.success) throw new MeshError('MESH_ERR_BAD_REQUEST', `the signed route is not a hop list: ${p.error.issues[0]!.path.join('.')}: ${p.error.issues[0]!.message}`);
  return { hops: p.data, key: by };
}

/** A route the tracker's signature was checked on; one object per signature while it stays cached. */
export interface VerifiedRoute {
  readonly hops: readonly RouteHop[];
}

/**
 * Routes verified by signature (a head's /generate, a chain hop's steps): the
 * tracker hands the chats that start on one route within a few seconds the
 * same signed route (route-signer.ts), so the signature is checked once per
 * tracker key, head, text and expiry (an Ed25519 verification per chat or
 * step otherwise); the expiry on every call. A known route comes back synchronously (no promise,
 * no extra turn on a step's critical path).
 */
export class VerifiedRoutes {
  private readonly map = new Map<string, { key: Uint8Array; head: string; text: string; expires: number; route: VerifiedRoute }>();

  get(key: TrackerKeys, head: string, text: string, expires: number, signature: string, now: number): VerifiedRoute | Promise<VerifiedRoute> {
    const hit = this.map.get(signature);
    // Valid while the key that verified it is still one this node takes routes from.
    if (hit && hit.head === head && hit.text === text && hit.expires === expires && keyList(key).some((k) => sameBytes(hit.key, k))) {
      if (expires < now) throw new MeshError('MESH_ERR_FORBIDDEN', `the route expired ${now - expires} ms ago; ask the tracker for a fresh one`);
      return hit.route;
    }
    return this.verify(key, head, text, expires, signature, now);
  }

  private async verify(key: TrackerKeys, head: string, text: string, expires: number, signature: string, now: number): Promise<VerifiedRoute> {
    const { hops, key: by } = await verifyRouteWith(key, head, text, expires, signature, now);
    if (this.map.size >= 256) this.map.clear();
    const route: VerifiedRoute = { hops };
    this.map.set(signature, { key: by, head, text, expires, route });
    return route;
  }
}

/** True when `signature` is the tracker's over `replyText` as `headPeerId`'s reply address for a route expiring at `expiresAt` (chainReplySigningMessage). */
export async function verifyChainReply(trackerKey: TrackerKeys, headPeerId: string, expiresAt: number, replyText: string, signature: string): Promise<boolean> {
  const keys = keyList(trackerKey);
  if (keys.length === 0) return false;
  let sig: Uint8Array;
  try {
    sig = decodeBase64Url(signature);
  } catch {
    return false;
  }
  const message = chainReplySigningMessage(headPeerId, expiresAt, replyText);
  for (const k of keys) if (await verifyEd25519(k, message, sig)) return true;
  return false;
}
