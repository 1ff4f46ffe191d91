/**
 * The trust root of a cluster of trackers: an operator key. Each tracker
 * has its own route-signing key (a tracker that dies takes nothing shared
 * with it) and a certificate of that key by the operator
 * (trackerCertMessage); nodes that know the operator key accept routes
 * signed by any certified key, and no other (docs/protocol.md §9).
 *
 * Here: a tracker certifies its own key at start with the operator key file
 * it was given. An operator that keeps the key elsewhere signs the same
 * message there (`meshnet tracker --operator-key-file` is the simple way).
 */
import { encodeBase64Url } from '../../protocol/base64.ts';
import { trackerCertMessage, type TrackerCert } from '../../protocol/tracker.ts';
import { Identity } from '../../net/identity.ts';
import { FileKeyStore } from '../../host/node/key-file.ts';

/** How long a certificate made at start is valid. A tracker running longer certifies again at its next start. */
export const CERT_VALIDITY_MS = 30 * 24 * 3600_000;

/** Certify `trackerPublicKey` (base64url) with the operator key in `operatorKeyFile` (created when missing). */
export async function certifyTracker(operatorKeyFile: string, trackerPublicKey: string, now = Date.now()): Promise<TrackerCert> {
  const operator = await Identity.loadOrCreate(new FileKeyStore(operatorKeyFile));
  const expiresAt = now + CERT_VALIDITY_MS;
  const signature = await operator.sign(trackerCertMessage(trackerPublicKey, expiresAt));
  return { operator_key: encodeBase64Url(operator.publicKey), expires_at: expiresAt, signature: encodeBase64Url(signature) };
}
