/**
 * Attestations: what a hop signs about what it computed (docs/protocol.md
 * §11). Per session a hop keeps a running digest over every step it ran:
 *
 *   seed  = SHA-256("meshnet-attest-v1\0" model \0 session \0 start ":" end ":" dtype [\0 sampling])
 *   acc_s = SHA-256(acc_{s-1} ‖ u32 position ‖ u32 rows ‖ SHA-256(input bytes) ‖ SHA-256(output bytes))
 *
 * and signs `attest-v1:<session>:<rows covered>:<hex acc>` with its node key.
 * One signature covers the whole history, so whoever checks it (the head,
 * the tracker) verifies one signature and needs only the per-step hashes
 * plus the few rows it compares. A checker's answer is chained the same way
 * (same seed and input hashes, its own output hashes) and signed as
 * `check-v1:<checked peer>:<session>:<rows>:<hex acc>`.
 *
 * Bytes are the wire bytes: input and output rows in the wire dtype as
 * sent; a head's own span takes token ids (u32 LE each); a last hop's output
 * is `u32 token id ‖ f64 logprob` (LE), or the tokens of a verification step
 * (stepTokenBytes); a last-hop checker's is its per-step records
 * (tokenCheckBytes), and the draft's digest after a sampled draft's.
 *
 * Host-free and synchronous: SHA-256 is @noble/hashes' pure-JS one, the same
 * on every host (WebCrypto's digest is asynchronous, costs tens of µs a call
 * in its promise alone, and is absent from pages served over plain http from
 * a LAN address). Ed25519 stays with the caller (the node's Identity).
 */
import { sha256 as nobleSha256 } from '@noble/hashes/sha2.js';
import { decodeBase64 as decodeBase64Url, encodeBase64Url } from '../protocol/base64.ts';
import { encodeDraft } from '../protocol/draft.ts';

const utf8 = new TextEncoder();
export const ATTEST_HEADER = 'x-meshnet-attest';
/** A checker's signature over its answer (POST /check). */
export const CHECK_ATTEST_HEADER = 'x-meshnet-check-attest';

/** SHA-256 of `bytes` (FIPS 180-4; the digest node:crypto and WebCrypto give). */
export function sha256(bytes: Uint8Array): Uint8Array {
  return nobleSha256(bytes);
}

/** The same SHA-256 fed in pieces (a long input hashed between other work). */
export function sha256Stream(): { update(bytes: Uint8Array): unknown; digest(): Uint8Array } {
  return nobleSha256.create();
}

export function hex(bytes: Uint8Array): string {
  let s = '';
  for (const b of bytes) s += b.toString(16).padStart(2, '0');
  return s;
}

export function fromHex(text: string): Uint8Array {
  if (!/^(?:[0-9a-f]{2})*$/.test(text)) throw new RangeError('not lowercase hex');
  const out = new Uint8Array(text.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(text.slice(2 * i, 2 * i + 2), 16);
  return out;
}

/** What a chain of step digests is bound to: nothing of another session, span, model or dtype verifies against it. */
export interface AttestScope {
  model: string;
  session: string;
  startLayer: number;
  endLayer: number;
  dtype: string;
  /** A last hop's X-Meshnet-Sampling text as it received it: the token it signs was drawn with these. */
  sampling?: string;
}

export function attestSeed(s: AttestScope): Uint8Array {
  const tail = s.sampling !== undefined ? `\0${s.sampling}` : '';
  return sha256(utf8.encode(`meshnet-attest-v1\0${s.model}\0${s.session}\0${s.startLayer}:${s.endLayer}:${s.dtype}${tail}`));
}

/** One step as the chain sees it: where it starts, how many rows, and the hashes of its input and output bytes. */
export interface StepDigest {
  position: number;
  rows: number;
  input: Uint8Array;
  output: Uint8Array;
}

/** The digest after one more step. */
export function chainStep(acc: Uint8Array, step: StepDigest): Uint8Array {
  return sha256(stepBytes(acc, step));
}

function stepBytes(acc: Uint8Array, step: StepDigest): Uint8Array {
  const buf = new Uint8Array(32 + 8 + 32 + 32);
  buf.set(acc, 0);
  const dv = new DataView(buf.buffer);
  dv.setUint32(32, step.position, true);
  dv.setUint32(36, step.rows, true);
  buf.set(step.input, 40);
  buf.set(step.output, 72);
  return buf;
}

/** The accumulated digest over `steps` from the scope's seed. */
export function chainDigest(scope: AttestScope, steps: readonly StepDigest[]): Uint8Array {
  let acc = attestSeed(scope);
  for (const s of steps) acc = chainStep(acc, s);
  return acc;
}

export function attestMessage(session: string, rows: number, acc: Uint8Array): Uint8Array {
  return utf8.encode(`attest-v1:${session}:${rows}:${hex(acc)}`);
}

export function checkMessage(checkedPeer: string, session: string, rows: number, acc: Uint8Array): Uint8Array {
  return utf8.encode(`check-v1:${checkedPeer}:${session}:${rows}:${hex(acc)}`);
}

/** A last hop's output bytes: the token id and the log-probability it answered. */
export function tokenBytes(tokenId: number, logprob: number): Uint8Array {
  const b = new Uint8Array(12);
  const dv = new DataView(b.buffer);
  dv.setUint32(0, tokenId >>> 0, true);
  dv.setFloat64(4, logprob, true);
  return b;
}

/** A draft's digest as a last hop binds it: SHA-256 of its X-Meshnet-Draft JSON in the canonical form encodeDraft writes. */
export function draftDigest(draft: Parameters<typeof encodeDraft>[0]): Uint8Array {
  return sha256(utf8.encode(encodeDraft(draft)));
}

/** Set in a step's token count when the step was judged by a sampling drafter's rule: its draft's digest follows the tokens. */
const DRAFTED = 0x8000_0000;

/**
 * A last hop's output bytes for a step: one token, `tokenBytes`; several (a
 * verification that accepted drafts: the accepted drafts, then the token
 * after them), u32 count ‖ (u32 token id ‖ f64 logprob) per token (LE). A
 * step whose draft was sampled (Leviathan's rule drew its tokens from the
 * draft's q: src/shard/speculative.ts) binds that draft too — `draft`, its
 * draftDigest: u32 (count | 0x80000000) ‖ the tokens ‖ the 32-byte digest —
 * so a check judges the tokens against the very draft the hop judged.
 */
export function stepTokenBytes(tokens: ReadonlyArray<{ tokenId: number; logprob: number }>, draft?: Uint8Array): Uint8Array {
  if (tokens.length === 1 && !draft) return tokenBytes(tokens[0]!.tokenId, tokens[0]!.logprob);
  const b = new Uint8Array(4 + 12 * tokens.length + (draft ? 32 : 0));
  const dv = new DataView(b.buffer);
  dv.setUint32(0, (tokens.length | (draft ? DRAFTED : 0)) >>> 0, true);
  tokens.forEach((t, i) => {
    dv.setUint32(4 + 12 * i, t.tokenId >>> 0, true);
    dv.setFloat64(8 + 12 * i, t.logprob, true);
  });
  if (draft) b.set(draft, 4 + 12 * tokens.length);
  return b;
}

/** stepTokenBytes read back; RangeError for bytes of another shape. */
export function readStepClaim(b: Uint8Array): { tokens: Array<{ tokenId: number; logprob: number }>; draft?: Uint8Array } {
  const dv = new DataView(b.buffer, b.byteOffset, b.byteLength);
  if (b.byteLength === 12) return { tokens: [{ tokenId: dv.getUint32(0, true), logprob: dv.getFloat64(4, true) }] };
  const head = b.byteLength >= 4 ? dv.getUint32(0, true) : 0;
  const drafted = (head & DRAFTED) !== 0;
  const n = head & ~DRAFTED;
  if (n < (drafted ? 1 : 2) || n > 1024 || b.byteLength !== 4 + 12 * n + (drafted ? 32 : 0)) {
    throw new RangeError('a step\'s tokens are 12 bytes, or a count and 12 bytes per token (and a sampled draft\'s 32-byte digest when the count says so)');
  }
  const tokens = Array.from({ length: n }, (_, i) => ({ tokenId: dv.getUint32(4 + 12 * i, true), logprob: dv.getFloat64(8 + 12 * i, true) }));
  return drafted ? { tokens, draft: b.slice(4 + 12 * n) } : { tokens };
}

/** The tokens of stepTokenBytes. */
export function readStepTokens(b: Uint8Array): Array<{ tokenId: number; logprob: number }> {
  return readStepClaim(b).tokens;
}

/** A head span's input bytes: its token ids. */
export function tokenIdBytes(ids: readonly number[]): Uint8Array {
  const b = new Uint8Array(ids.length * 4);
  const dv = new DataView(b.buffer);
  ids.forEach((id, i) => dv.setUint32(i * 4, id >>> 0, true));
  return b;
}

/** One entry of X-Meshnet-Attest: who signed, how many rows of the session it covers, the signature. */
export interface Attestation {
  peer: string;
  rows: number;
  signature: Uint8Array;
}

const ENTRY_RE = /^([0-9a-f]{32})\.(\d{1,9})\.([A-Za-z0-9_-]{86})$/;
/** Entries a header may list (a chain's hops each add one). */
const MAX_ENTRIES = 64;

export function formatAttestation(a: Attestation): string {
  return `${a.peer}.${a.rows}.${encodeBase64Url(a.signature)}`;
}

/** The entries of an X-Meshnet-Attest value; malformed entries are skipped (a hop that sends garbage attests nothing). */
export function parseAttestations(value: string | undefined): Attestation[] {
  if (!value) return [];
  const out: Attestation[] = [];
  for (const part of value.split(';').slice(0, MAX_ENTRIES)) {
    const m = ENTRY_RE.exec(part.trim());
    if (!m) continue;
    try {
      const signature = decodeBase64Url(m[3]!);
      if (signature.byteLength === 64) out.push({ peer: m[1]!, rows: Number(m[2]), signature });
    } catch {
      // not base64url: skipped
    }
  }
  return out;
}

/** Append one entry to a header value (a chain hop adds its own to what it received). */
export function appendAttestation(value: string | undefined, entry: string): string {
  return value ? `${value};${entry}` : entry;
}
