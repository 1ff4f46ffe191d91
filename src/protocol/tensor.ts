/**
 * Tensor codecs for activations on the wire: bf16 / f16 / f32, row-major,
 * little-endian. Conversions round to nearest-even (what torch and numpy do),
 * so a value that is already representable survives a round trip bit-exact.
 */

export const DTYPES = ['bf16', 'f16', 'f32'] as const;
export type Dtype = (typeof DTYPES)[number];

export function isDtype(s: string): s is Dtype {
  return (DTYPES as readonly string[]).includes(s);
}

export function dtypeBytes(dtype: Dtype): number {
  return dtype === 'f32' ? 4 : 2;
}

/** True on little-endian hosts, which every WebGPU/WASM target is; checked once. */
const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** float32 → bfloat16 bits, round to nearest even; NaN stays a quiet NaN. */
export function f32ToBf16Bits(x: number): number {
  f32[0] = x;
  const bits = u32[0]!;
  if ((bits & 0x7f800000) === 0x7f800000 && (bits & 0x007fffff) !== 0) {
    return ((bits >>> 16) | 0x0040) & 0xffff;
  }
  const rounding = 0x7fff + ((bits >>> 16) & 1);
  return ((bits + rounding) >>> 16) & 0xffff;
}

export function bf16BitsToF32(h: number): number {
  u32[0] = (h & 0xffff) << 16;
  return f32[0]!;
}

/** float32 → IEEE half bits, round to nearest even, overflow to ±Inf. */
export function f32ToF16Bits(x: number): number {
  f32[0] = x;
  const bits = u32[0]!;
  const sign = (bits >>> 16) & 0x8000;
  const exp = (bits >>> 23) & 0xff;
  let mant = bits & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant !== 0 ? 0x200 : 0);
  const e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    const half = 1 << (shift - 1);
    const rem = mant & ((1 << shift) - 1);
    let h = mant >>> shift;
    if (rem > half || (rem === half && (h & 1) === 1)) h += 1;
    return sign | h;
  }
  const rem = mant & 0x1fff;
  let h = (e << 10) | (mant >>> 13);
  if (rem > 0x1000 || (rem === 0x1000 && (h & 1) === 1)) h += 1; // a carry into the exponent is the correct rounding
  return sign | h;
}

export function f16BitsToF32(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 0x1f) return mant ? NaN : sign * Infinity;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}

/** Encode float32 values as `dtype` bytes (little-endian). */
export function encodeTensor(values: Float32Array, dtype: Dtype): Uint8Array {
  if (dtype === 'f32') {
    const out = new Uint8Array(values.length * 4);
    if (LITTLE_ENDIAN) out.set(new Uint8Array(values.buffer, values.byteOffset, values.byteLength));
    else {
      const dv = new DataView(out.buffer);
      for (let i = 0; i < values.length; i++) dv.setFloat32(i * 4, values[i]!, true);
    }
    return out;
  }
  const out = new Uint16Array(values.length);
  if (dtype === 'bf16') {
    // Word-level path: same rounding as f32ToBf16Bits without per-element calls.
    const src = new Uint32Array(values.buffer, values.byteOffset, values.length);
    for (let i = 0; i < src.length; i++) {
      const bits = src[i]!;
      if ((bits & 0x7f800000) === 0x7f800000 && (bits & 0x007fffff) !== 0) out[i] = ((bits >>> 16) | 0x0040) & 0xffff;
      else out[i] = ((bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16) & 0xffff;
    }
  } else {
    for (let i = 0; i < values.length; i++) out[i] = f32ToF16Bits(values[i]!);
  }
  const bytes = new Uint8Array(out.buffer);
  if (!LITTLE_ENDIAN) for (let i = 0; i < bytes.length; i += 2) [bytes[i], bytes[i + 1]] = [bytes[i + 1]!, bytes[i]!];
  return bytes;
}

/** Decode `dtype` bytes (little-endian) into float32 values. Throws on a ragged length. */
export function decodeTensor(bytes: Uint8Array, dtype: Dtype): Float32Array {
  const size = dtypeBytes(dtype);
  if (bytes.byteLength % size !== 0) {
    throw new RangeError(`tensor body of ${bytes.byteLength} bytes is not a whole number of ${dtype} elements`);
  }
  const n = bytes.byteLength / size;
  // Copy into an aligned buffer: bodies sliced out of frames start at odd offsets.
  const aligned = new Uint8Array(bytes.byteLength);
  aligned.set(bytes);
  if (!LITTLE_ENDIAN) {
    const dv = new DataView(aligned.buffer);
    const out = new Float32Array(n);
    for (let i = 0; i < n; i++) {
      out[i] = dtype === 'f32' ? dv.getFloat32(i * 4, true) : dtype === 'bf16' ? bf16BitsToF32(dv.getUint16(i * 2, true)) : f16BitsToF32(dv.getUint16(i * 2, true));
    }
    return out;
  }
  if (dtype === 'f32') return new Float32Array(aligned.buffer);
  const halfs = new Uint16Array(aligned.buffer);
  const out = new Float32Array(n);
  if (dtype === 'bf16') {
    const outBits = new Uint32Array(out.buffer);
    for (let i = 0; i < n; i++) outBits[i] = halfs[i]! << 16;
  } else {
    for (let i = 0; i < n; i++) out[i] = f16BitsToF32(halfs[i]!);
  }
  return out;
}

/** Round float32 values through `dtype` (what a hop boundary does to them). */
export function roundThrough(values: Float32Array, dtype: Dtype): Float32Array {
  return dtype === 'f32' ? values.slice() : decodeTensor(encodeTensor(values, dtype), dtype);
}

/** Index of the first NaN or ±Inf, or -1. */
export function firstNonFinite(values: Float32Array): number {
  for (let i = 0; i < values.length; i++) {
    const v = values[i]!;
    if (v - v !== 0) return i;
  }
  return -1;
}

/** Parse `X-Meshnet-Shape` ("batch,seq,hidden"); null when malformed. */
export function parseShape(text: string | undefined, rank = 3): number[] | null {
  if (text === undefined) return null;
  const parts = text.split(',');
  if (parts.length !== rank) return null;
  const dims: number[] = [];
  for (const p of parts) {
    if (!/^\d{1,9}$/.test(p.trim())) return null;
    const d = Number(p.trim());
    if (d <= 0) return null;
    dims.push(d);
  }
  return dims;
}

export function formatShape(dims: readonly number[]): string {
  return dims.join(',');
}

export function shapeElements(dims: readonly number[]): number {
  return dims.reduce((a, b) => a * b, 1);
}
