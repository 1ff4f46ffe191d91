/**
 * Which tracker keys a node takes routes from: the answering tracker's, or
 * those of its cluster that the operator certified (docs/protocol.md §9,
 * cluster trust). Host-agnostic.
 */
import { decodeBase64 as decodeBase64Url, encodeBase64Url } from '../protocol/base64.ts';
import { trackerCertMessage, type TrackerKey } from '../protocol/tracker.ts';
import { verifyEd25519 } from '../net/identity.ts';

/** The keys a node takes routes from: one tracker's, or every tracker of its cluster. */
export type TrackerKeys = Uint8Array | readonly Uint8Array[] | undefined;

/** `k` as a list (none, one key, or a cluster's). */
export function keyList(k: TrackerKeys): readonly Uint8Array[] {
  return k === undefined ? [] : k instanceof Uint8Array ? [k] : k;
}

/** True when any of `keys` verifies `sig` over `message` (a notice, a check plan: signed by one tracker of the cluster). */
export async function signedByAny(keys: TrackerKeys, message: Uint8Array, sig: Uint8Array, verify: (key: Uint8Array, message: Uint8Array, sig: Uint8Array) => Promise<boolean>): Promise<boolean> {
  for (const k of keyList(keys)) if (await verify(k, message, sig)) return true;
  return false;
}

/** Byte-for-byte equal. */
export function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a === b) return true;
  if (a.byteLength !== b.byteLength) return false;
  for (let i = 0; i < a.byteLength; i++) if (a[i] !== b[i]) return false;
  return true;
}

/**
 * The tracker keys a node takes routes from. A tracker alone: the key it
 * answers with. A cluster: every tracker's key its answers list, and, once
 * an operator key is known (configured, or pinned from the first answer
 * with a certificate), only those the operator certified. A key stays
 * usable for a while after its tracker stops being listed (routes it signed
 * live on for their TTL).
 */
export class TrackerTrust {
  private readonly keys = new Map<string, { key: Uint8Array; listedAt: number }>();
  private readonly certified = new Set<string>();
  private list: Uint8Array[] = [];
  operatorKey: string | undefined;

  constructor(
    operatorKey?: string,
    /** How long an unlisted key stays trusted, ms. */
    private readonly keepMs = 10 * 60_000,
  ) {
    this.operatorKey = operatorKey;
  }

  /** The keys to check a route against, the answering tracker's first. */
  get current(): readonly Uint8Array[] {
    return this.list;
  }

  /** Exactly this key (or none) from now on, until a tracker answers. */
  only(key: Uint8Array | undefined): void {
    this.keys.clear();
    this.list = key ? [key] : [];
    if (key) this.keys.set(encodeBase64Url(key), { key, listedAt: Date.now() });
  }

  /** What a tracker answered: its own key, and the cluster's list when it is in one. */
  async absorb(answering: string | undefined, listed: readonly TrackerKey[] | undefined, now = Date.now()): Promise<void> {
    const accepted: string[] = [];
    if (listed && listed.length > 0) {
      if (!this.operatorKey) this.operatorKey = listed.find((k) => k.cert)?.cert?.operator_key;
      for (const k of listed) if (!this.operatorKey || (await this.certifiedKey(k, now))) accepted.push(k.public_key);
      if (!this.operatorKey && answering) accepted.push(answering);
    } else if (answering && !this.operatorKey) accepted.push(answering);
    for (const k of accepted) {
      let key: Uint8Array;
      try {
        key = decodeBase64Url(k);
      } catch {
        continue;
      }
      if (key.byteLength === 32) this.keys.set(k, { key, listedAt: now });
    }
    for (const [k, v] of this.keys) if (now - v.listedAt > this.keepMs) this.keys.delete(k);
    const first = answering ? this.keys.get(answering) : undefined;
    this.list = [...(first ? [first.key] : []), ...[...this.keys.entries()].filter(([k]) => k !== answering).map(([, v]) => v.key)];
  }

  private async certifiedKey(k: TrackerKey, now: number): Promise<boolean> {
    const c = k.cert;
    if (!c || c.operator_key !== this.operatorKey || c.expires_at < now) return false;
    const id = `${k.public_key}:${c.expires_at}:${c.signature}`;
    if (this.certified.has(id)) return true;
    let op: Uint8Array;
    let sig: Uint8Array;
    try {
      op = decodeBase64Url(c.operator_key);
      sig = decodeBase64Url(c.signature);
    } catch {
      return false;
    }
    if (!(await verifyEd25519(op, trackerCertMessage(k.public_key, c.expires_at), sig))) return false;
    if (this.certified.size > 1024) this.certified.clear();
    this.certified.add(id);
    return true;
  }
}
