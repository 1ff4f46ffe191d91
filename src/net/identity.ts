/**
 * A node's Ed25519 identity, through WebCrypto only (Node 20 and Chromium
 * both implement Ed25519 in `crypto.subtle`). The peer id is derived from the
 * public key, so keeping the key is keeping the id across restarts: the host
 * persists it through a {@link KeyStore} (a file in Node.js, IndexedDB in a
 * browser).
 */
import { decodeBase64, encodeBase64, encodeBase64Url } from '../protocol/base64.ts';
import { MeshError } from '../protocol/errors.ts';
import { peerIdFromPublicKey, registrationMessage } from '../protocol/ids.ts';

export const ED25519_PUBLIC_KEY_BYTES = 32;
export const ED25519_SIGNATURE_BYTES = 64;

/** What a host writes to storage. JWK carries both halves; PKCS#8 needs the public key beside it (WebCrypto cannot derive it). */
export type StoredIdentity =
  | { format: 'jwk'; jwk: JsonWebKey }
  | { format: 'pkcs8'; pkcs8: string; publicKey: string };

/** Host-provided persistence; `load` resolves undefined when nothing was saved yet. */
export interface KeyStore {
  load(): Promise<StoredIdentity | undefined>;
  save(identity: StoredIdentity): Promise<void>;
}

/** A KeyStore that forgets on exit: tests, and nodes that want a fresh id each run. */
export class MemoryKeyStore implements KeyStore {
  stored: StoredIdentity | undefined;
  async load(): Promise<StoredIdentity | undefined> {
    return this.stored;
  }
  async save(identity: StoredIdentity): Promise<void> {
    this.stored = identity;
  }
}

const ED25519 = { name: 'Ed25519' } as const;

function asBuffer(bytes: Uint8Array): Uint8Array<ArrayBuffer> {
  return bytes as Uint8Array<ArrayBuffer>;
}

export class Identity {
  private constructor(
    private readonly privateKey: CryptoKey,
    /** Raw 32-byte Ed25519 public key. */
    readonly publicKey: Uint8Array,
    /** Lowercase hex of SHA-256(publicKey)[0..16). */
    readonly peerId: string,
  ) {}

  static async generate(): Promise<Identity> {
    const pair = (await crypto.subtle.generateKey(ED25519, true, ['sign', 'verify'])) as CryptoKeyPair;
    const raw = new Uint8Array(await crypto.subtle.exportKey('raw', pair.publicKey));
    return new Identity(pair.privateKey, raw, await peerIdFromPublicKey(raw));
  }

  static async fromStored(stored: StoredIdentity): Promise<Identity> {
    try {
      if (stored.format === 'jwk') {
        const { jwk } = stored;
        if (jwk.kty !== 'OKP' || jwk.crv !== 'Ed25519' || typeof jwk.d !== 'string' || typeof jwk.x !== 'string') {
          throw new MeshError('MESH_ERR_BAD_REQUEST', 'stored identity is not an Ed25519 private JWK (kty OKP, crv Ed25519, d and x)');
        }
        const key = await crypto.subtle.importKey('jwk', { kty: 'OKP', crv: 'Ed25519', d: jwk.d, x: jwk.x }, ED25519, true, ['sign']);
        const raw = decodeBase64(jwk.x);
        return await Identity.checked(key, raw);
      }
      const key = await crypto.subtle.importKey('pkcs8', asBuffer(decodeBase64(stored.pkcs8)), ED25519, true, ['sign']);
      return await Identity.checked(key, decodeBase64(stored.publicKey));
    } catch (e) {
      if (e instanceof MeshError) throw e;
      throw new MeshError('MESH_ERR_BAD_REQUEST', `stored identity cannot be imported (${(e as Error).message}); delete it to start with a new peer id`);
    }
  }

  /** The stored identity, or a new one saved to the store: a node keeps its peer id across restarts. */
  static async loadOrCreate(store: KeyStore): Promise<Identity> {
    const stored = await store.load();
    if (stored !== undefined) return Identity.fromStored(stored);
    const id = await Identity.generate();
    await store.save(await id.export());
    return id;
  }

  /** A key pair whose halves do not match would register under an id it cannot sign for: check once at load. */
  private static async checked(privateKey: CryptoKey, raw: Uint8Array): Promise<Identity> {
    if (raw.byteLength !== ED25519_PUBLIC_KEY_BYTES) throw new MeshError('MESH_ERR_BAD_REQUEST', `public key is ${raw.byteLength} bytes, Ed25519 needs 32`);
    const id = new Identity(privateKey, raw, await peerIdFromPublicKey(raw));
    const probe = registrationMessage('0000000000000000');
    if (!(await verifyEd25519(raw, probe, await id.sign(probe)))) {
      throw new MeshError('MESH_ERR_BAD_REQUEST', 'stored private key does not match its public key');
    }
    return id;
  }

  async export(format: 'jwk' | 'pkcs8' = 'jwk'): Promise<StoredIdentity> {
    if (format === 'jwk') {
      const jwk = await crypto.subtle.exportKey('jwk', this.privateKey);
      return { format: 'jwk', jwk: { kty: 'OKP', crv: 'Ed25519', d: jwk.d, x: jwk.x ?? encodeBase64Url(this.publicKey) } };
    }
    const pkcs8 = new Uint8Array(await crypto.subtle.exportKey('pkcs8', this.privateKey));
    return { format: 'pkcs8', pkcs8: encodeBase64(pkcs8), publicKey: encodeBase64(this.publicKey) };
  }

  async sign(bytes: Uint8Array): Promise<Uint8Array> {
    return new Uint8Array(await crypto.subtle.sign(ED25519, this.privateKey, asBuffer(bytes)));
  }

  /** The `register` answer to a relay's challenge (PROTOCOL.md §1). */
  async registerMessage(nonce: string, info: Record<string, unknown>): Promise<{ type: 'register'; public_key: string; signature: string; info: Record<string, unknown> }> {
    const signature = await this.sign(registrationMessage(nonce));
    return { type: 'register', public_key: encodeBase64Url(this.publicKey), signature: encodeBase64Url(signature), info };
  }
}

export async function verifyEd25519(publicKey: Uint8Array, message: Uint8Array, signature: Uint8Array): Promise<boolean> {
  if (publicKey.byteLength !== ED25519_PUBLIC_KEY_BYTES || signature.byteLength !== ED25519_SIGNATURE_BYTES) return false;
  try {
    const key = await crypto.subtle.importKey('raw', asBuffer(publicKey), ED25519, false, ['verify']);
    return await crypto.subtle.verify(ED25519, key, asBuffer(signature), asBuffer(message));
  } catch {
    return false;
  }
}
