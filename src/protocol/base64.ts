/**
 * Base64 for the JSON envelopes of the ADR path. Table-driven over typed
 * arrays: no per-byte string concatenation, which costs ~10x on 8 KiB
 * activations. Uses the native `Uint8Array.fromBase64/toBase64` where the host
 * has them (recent Chromium).
 */
const ALPHABET = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/';
const ENC = new Uint8Array(64);
for (let i = 0; i < 64; i++) ENC[i] = ALPHABET.charCodeAt(i);
const DEC = new Int16Array(256).fill(-1);
for (let i = 0; i < 64; i++) DEC[ALPHABET.charCodeAt(i)] = i;
DEC['-'.charCodeAt(0)] = 62; // base64url accepted on input
DEC['_'.charCodeAt(0)] = 63;

interface NativeBase64 {
  fromBase64?: (s: string) => Uint8Array;
}
const native = Uint8Array as unknown as NativeBase64;
const latin1 = new TextDecoder('latin1');

export function encodeBase64(bytes: Uint8Array): string {
  const maybe = bytes as Uint8Array & { toBase64?: () => string };
  if (typeof maybe.toBase64 === 'function') return maybe.toBase64();
  const n = bytes.length;
  const out = new Uint8Array(Math.ceil(n / 3) * 4);
  let o = 0;
  let i = 0;
  for (; i + 2 < n; i += 3) {
    const v = (bytes[i]! << 16) | (bytes[i + 1]! << 8) | bytes[i + 2]!;
    out[o++] = ENC[v >>> 18]!;
    out[o++] = ENC[(v >>> 12) & 63]!;
    out[o++] = ENC[(v >>> 6) & 63]!;
    out[o++] = ENC[v & 63]!;
  }
  if (i < n) {
    const rest = n - i;
    const v = (bytes[i]! << 16) | (rest === 2 ? bytes[i + 1]! << 8 : 0);
    out[o++] = ENC[v >>> 18]!;
    out[o++] = ENC[(v >>> 12) & 63]!;
    out[o++] = rest === 2 ? ENC[(v >>> 6) & 63]! : 61;
    out[o] = 61;
  }
  return latin1.decode(out);
}

/** Decode standard or url-safe base64; padding optional; whitespace rejected. */
export function decodeBase64(text: string): Uint8Array {
  if (typeof native.fromBase64 === 'function' && !/[-_]/.test(text)) {
    try {
      return native.fromBase64(text);
    } catch {
      throw new SyntaxError('invalid base64');
    }
  }
  let len = text.length;
  while (len > 0 && text.charCodeAt(len - 1) === 61) len--;
  if (text.length - len > 2 || len % 4 === 1) throw new SyntaxError('invalid base64 length');
  const out = new Uint8Array(Math.floor((len * 3) / 4));
  let o = 0;
  let acc = 0;
  let bits = 0;
  for (let i = 0; i < len; i++) {
    const c = text.charCodeAt(i);
    const d = c < 256 ? DEC[c]! : -1;
    if (d < 0) throw new SyntaxError(`invalid base64 character at ${i}`);
    acc = (acc << 6) | d;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out[o++] = (acc >>> bits) & 0xff;
    }
  }
  return out;
}

export function encodeBase64Url(bytes: Uint8Array): string {
  return encodeBase64(bytes).replace(/\+/g, '-').replace(/\//g, '_').replace(/=+$/, '');
}
