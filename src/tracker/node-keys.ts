/**
 * Verifying nodes' signed messages on the tracker (Node.js only), with each
 * node's key parsed once.
 *
 * signing.ts verifies with WebCrypto, importing the key on every call so
 * that browser and Node hosts share it; at a thousand signed heartbeats a
 * second that import was a large part of the tracker's CPU. Here a key is
 * turned into a node:crypto KeyObject once, and its peer id hashed once,
 * then kept (bounded) for the node's next messages. Same checks, same
 * errors as signing.ts's verifyNodeMessage / verifyTimestampedSignature.
 */
import { createHash, createPublicKey, verify, type KeyObject } from 'node:crypto';
import { MeshError } from '../protocol/errors.ts';
import { PEER_ID_BYTES } from '../protocol/ids.ts';
import { canonicalJson } from '../protocol/tracker.ts';
import type { Signed } from './signing.ts';

interface KnownKey {
  key: KeyObject;
  peerId: string;
}

/** Keys kept at most; past it the cache starts over (a key costs a few hundred bytes). */
const MAX_KEYS = 100_000;

export class NodeKeys {
  private readonly keys = new Map<string, KnownKey>();

  /** The parsed key and the peer id it hashes to; 401 when it is not a raw Ed25519 key in base64url. */
  private known(publicKey: string): KnownKey {
    const hit = this.keys.get(publicKey);
    if (hit) return hit;
    const raw = Buffer.from(publicKey, 'base64url');
    if (raw.byteLength !== 32) throw new MeshError('MESH_ERR_UNAUTHORIZED', `public_key is ${raw.byteLength} bytes, Ed25519 needs 32`);
    let key: KeyObject;
    try {
      key = createPublicKey({ key: { kty: 'OKP', crv: 'Ed25519', x: raw.toString('base64url') }, format: 'jwk' });
    } catch {
      throw new MeshError('MESH_ERR_UNAUTHORIZED', 'public_key is not an Ed25519 key');
    }
    const k = { key, peerId: createHash('sha256').update(raw).digest().subarray(0, PEER_ID_BYTES).toString('hex') };
    if (this.keys.size >= MAX_KEYS) this.keys.clear();
    this.keys.set(publicKey, k);
    return k;
  }

  /** Forget a node's key (it left). */
  forget(publicKey: string): void {
    this.keys.delete(publicKey);
  }

  /** The peer id a public key hashes to (401 for a malformed key). */
  peerIdOf(publicKey: string): string {
    return this.known(publicKey).peerId;
  }

  /** A signed register/heartbeat: key ↔ peer id (403), signature (401), timestamp within `maxSkewMs` (401). */
  verifyNodeMessage(msg: Signed<{ peer_id: string; public_key: string; timestamp: number }>, now: number, maxSkewMs: number, signedBody: unknown = msg.body): void {
    const { peerId } = this.known(msg.body.public_key);
    if (peerId !== msg.body.peer_id) {
      throw new MeshError('MESH_ERR_FORBIDDEN', `peer_id ${msg.body.peer_id} does not belong to this public key (it hashes to ${peerId}); a peer id is the SHA-256 prefix of its own key`);
    }
    this.verifyTimestamped(msg.body.public_key, msg, now, maxSkewMs, signedBody);
  }

  /** Signature over canonicalJson(signedBody) with `publicKey`, and the timestamp's freshness. */
  verifyTimestamped(publicKey: string, msg: Signed<{ timestamp: number }>, now: number, maxSkewMs: number, signedBody: unknown = msg.body): void {
    const { key } = this.known(publicKey);
    const sig = Buffer.from(msg.signature, 'base64url');
    let ok: boolean;
    try {
      ok = sig.byteLength === 64 && verify(null, Buffer.from(canonicalJson(signedBody)), key, sig);
    } catch {
      ok = false;
    }
    if (!ok) throw new MeshError('MESH_ERR_UNAUTHORIZED', 'signature does not verify: sign canonicalJson(body) with the key of public_key');
    const skew = msg.body.timestamp - now;
    if (Math.abs(skew) > maxSkewMs) {
      throw new MeshError('MESH_ERR_UNAUTHORIZED', `timestamp is ${Math.round(skew / 1000)} s off the tracker's clock (allowed ±${maxSkewMs / 1000} s); a stale or replayed message is refused — check the node's clock`, { skew_ms: skew });
    }
  }
}
