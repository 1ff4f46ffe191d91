/**
 * Signatures of the tracker API (src/protocol/tracker.ts), WebCrypto only so
 * node hosts (browser or Node.js) can import the same helpers:
 *
 *   node  ── {body, signature: Ed25519(canonicalJson(body))} ──▶ tracker   register / heartbeat / route replace
 *   tracker ── X-Meshnet-Route + -Expires + -Signature ──▶ head            routeSigningMessage(head, expires, header)
 *
 * A node's key is its identity: the tracker accepts a message only when the
 * public key hashes to the claimed peer id, the signature holds, and the
 * timestamp is recent (a captured message cannot be replayed later).
 */
import { decodeBase64, encodeBase64Url } from '../protocol/base64.ts';
import { MeshError } from '../protocol/errors.ts';
import { peerIdFromPublicKey } from '../protocol/ids.ts';
import { canonicalJson, chainReplySigningMessage, routeSigningMessage, type RouteHop } from '../protocol/tracker.ts';
import { verifyEd25519, type Identity } from '../net/identity.ts';

const utf8 = new TextEncoder();

export interface Signed<T> {
  body: T;
  signature: string;
}

/** Sign a tracker API body with the node's (or head's) identity. */
export async function signBody<T>(identity: Identity, body: T): Promise<Signed<T>> {
  const sig = await identity.sign(utf8.encode(canonicalJson(body)));
  return { body, signature: encodeBase64Url(sig) };
}

function decodeKey(text: string, what: string): Uint8Array {
  try {
    return decodeBase64(text);
  } catch {
    throw new MeshError('MESH_ERR_UNAUTHORIZED', `${what} is not base64url`);
  }
}

/** Check a signature over canonicalJson(body) with a raw public key (base64url). */
export async function verifyBodySignature(publicKey: string, body: unknown, signature: string): Promise<boolean> {
  let key: Uint8Array;
  let sig: Uint8Array;
  try {
    key = decodeBase64(publicKey);
    sig = decodeBase64(signature);
  } catch {
    return false;
  }
  return verifyEd25519(key, utf8.encode(canonicalJson(body)), sig);
}

/**
 * Verify a signed node message (register / heartbeat): key ↔ peer id (403),
 * signature (401), timestamp within `maxSkewMs` of `now` (401).
 */
export async function verifyNodeMessage(msg: Signed<{ peer_id: string; public_key: string; timestamp: number }>, now: number, maxSkewMs: number, signedBody: unknown = msg.body): Promise<void> {
  const key = decodeKey(msg.body.public_key, 'public_key');
  if (key.byteLength !== 32) throw new MeshError('MESH_ERR_UNAUTHORIZED', `public_key is ${key.byteLength} bytes, Ed25519 needs 32`);
  const expected = await peerIdFromPublicKey(key);
  if (expected !== msg.body.peer_id) {
    throw new MeshError('MESH_ERR_FORBIDDEN', `peer_id ${msg.body.peer_id} does not belong to this public key (it hashes to ${expected}); a peer id is the SHA-256 prefix of its own key`);
  }
  await verifyTimestampedSignature(msg.body.public_key, msg, now, maxSkewMs, signedBody);
}

/**
 * Signature and freshness of a signed body whose key is already trusted.
 * `signedBody` is the body as it arrived (the default: the parsed one): a
 * newer node may sign fields this tracker's schema does not know and strips.
 */
export async function verifyTimestampedSignature(publicKey: string, msg: Signed<{ timestamp: number }>, now: number, maxSkewMs: number, signedBody: unknown = msg.body): Promise<void> {
  if (!(await verifyBodySignature(publicKey, signedBody, msg.signature))) {
    throw new MeshError('MESH_ERR_UNAUTHORIZED', 'signature does not verify: sign canonicalJson(body) with the key of public_key');
  }
  const skew = msg.body.timestamp - now;
  if (Math.abs(skew) > maxSkewMs) {
    throw new MeshError('MESH_ERR_UNAUTHORIZED', `timestamp is ${Math.round(skew / 1000)} s off the tracker's clock (allowed ±${maxSkewMs / 1000} s); a stale or replayed message is refused — check the node's clock`, { skew_ms: skew });
  }
}

export interface SignedRoute {
  /** The exact `X-Meshnet-Route` text the signature covers. */
  header: string;
  expiresAt: number;
  /** base64url Ed25519 over routeSigningMessage(head, expiresAt, header). */
  signature: string;
}

export async function signRoute(identity: Identity, headPeerId: string, hops: readonly RouteHop[], expiresAt: number): Promise<SignedRoute> {
  const header = JSON.stringify(hops);
  const sig = await identity.sign(routeSigningMessage(headPeerId, expiresAt, header));
  return { header, expiresAt, signature: encodeBase64Url(sig) };
}

/**
 * The head's reply address as chain hops may trust it: JSON {relay_addr?,
 * endpoint?} as the head registered them, signed for the head and the
 * route's expiry (chainReplySigningMessage). Undefined when the head
 * registered neither (then no hop could reach it, and it runs the star).
 */
export async function signChainReply(identity: Identity, headPeerId: string, head: { relayAddr?: string | undefined; endpoint?: string | undefined }, expiresAt: number): Promise<{ text: string; signature: string } | undefined> {
  if (head.relayAddr === undefined && head.endpoint === undefined) return undefined;
  const text = JSON.stringify({ ...(head.relayAddr !== undefined ? { relay_addr: head.relayAddr } : {}), ...(head.endpoint !== undefined ? { endpoint: head.endpoint } : {}) });
  const sig = await identity.sign(chainReplySigningMessage(headPeerId, expiresAt, text));
  return { text, signature: encodeBase64Url(sig) };
}

/**
 * What a head checks before following a route: the tracker's signature over
 * its own peer id, the expiry and the header's exact text, and the expiry
 * against its clock. Returns a reason when refused, null when valid.
 */
export async function verifyRoute(trackerPublicKey: string, headPeerId: string, route: { header: string; expiresAt: number; signature: string }, now = Date.now()): Promise<string | null> {
  if (!Number.isFinite(route.expiresAt)) return 'route expiry is not a number';
  if (route.expiresAt < now) return `route expired ${now - route.expiresAt} ms ago`;
  let key: Uint8Array;
  let sig: Uint8Array;
  try {
    key = decodeBase64(trackerPublicKey);
    sig = decodeBase64(route.signature);
  } catch {
    return 'route signature is not base64url';
  }
  const ok = await verifyEd25519(key, routeSigningMessage(headPeerId, route.expiresAt, route.header), sig);
  return ok ? null : 'route signature does not verify against the tracker key';
}
