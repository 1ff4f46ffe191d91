/** Peer ids: lowercase hex of the first 16 bytes of SHA-256(raw Ed25519 public key). */
export const PEER_ID_BYTES = 16;
export const PEER_ID_RE = /^[0-9a-f]{32}$/;

const HEX = Array.from({ length: 256 }, (_, i) => i.toString(16).padStart(2, '0'));

export function bytesToHex(bytes: Uint8Array): string {
  let s = '';
  for (let i = 0; i < bytes.length; i++) s += HEX[bytes[i]!];
  return s;
}

export function hexToBytes(hex: string): Uint8Array {
  if (hex.length % 2 !== 0 || !/^[0-9a-fA-F]*$/.test(hex)) throw new SyntaxError('invalid hex');
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.substr(i * 2, 2), 16);
  return out;
}

export function isPeerId(s: unknown): s is string {
  return typeof s === 'string' && PEER_ID_RE.test(s);
}

export async function peerIdFromPublicKey(rawPublicKey: Uint8Array): Promise<string> {
  const digest = new Uint8Array(await crypto.subtle.digest('SHA-256', rawPublicKey as Uint8Array<ArrayBuffer>));
  return bytesToHex(digest.subarray(0, PEER_ID_BYTES));
}

export function randomHex(bytes = 8): string {
  return bytesToHex(crypto.getRandomValues(new Uint8Array(bytes)));
}

/** The exact bytes a peer signs to register (docs/protocol.md §1). */
export function registrationMessage(nonce: string): Uint8Array {
  return new TextEncoder().encode(`meshnet-register:${nonce}`);
}

/** A KV session id (`x-meshnet-session`, `DELETE /sessions/<id>`): ids travel in headers and paths, so they are short and printable. */
export const SESSION_ID_RE = /^[A-Za-z0-9._:-]{1,128}$/;
