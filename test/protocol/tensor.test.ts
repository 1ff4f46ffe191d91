import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { decodeTensor, encodeTensor, f32ToBf16Bits, f32ToF16Bits, firstNonFinite, parseShape, roundThrough } from '../../src/protocol/tensor.ts';

// Independent references: value of a bit pattern computed from the IEEE
// formula in float64, and "nearest, ties to even" checked by comparing with
// the neighbouring codes, rather than by re-running the codec's bit tricks.
function bf16Value(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 7) & 0xff;
  const mant = h & 0x7f;
  if (exp === 0xff) return mant ? NaN : sign * Infinity;
  if (exp === 0) return sign * mant * 2 ** -133;
  return sign * (1 + mant / 128) * 2 ** (exp - 127);
}
function f16Value(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0x1f) return mant ? NaN : sign * Infinity;
  if (exp === 0) return sign * mant * 2 ** -24;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}
function isNearestEven(x: number, h: number, value: (h: number) => number, maxFinite: number): boolean {
  const v = value(h);
  if (Math.abs(x) > maxFinite) return Math.abs(v) === Infinity || Math.abs(v) === maxFinite;
  const err = Math.abs(v - x);
  for (const n of [h - 1, h + 1]) {
    if (n < 0 || n > 0xffff || (n & 0x7fff) === 0x7fff) continue;
    const vn = value(n);
    if (!Number.isFinite(vn) || Math.sign(vn) !== Math.sign(v) && vn !== 0 && v !== 0) continue;
    const en = Math.abs(vn - x);
    if (en < err) return false;
    if (en === err && (h & 1) === 1) return false; // tie must go to the even code
  }
  return true;
}

const f32 = fc.float({ noNaN: true, noDefaultInfinity: true });

describe('bf16 codec', () => {
  it('rounds every float32 to the nearest bf16, ties to even', () => {
    fc.assert(fc.property(f32, (x) => isNearestEven(x, f32ToBf16Bits(x), bf16Value, 3.3895313892515355e38)), { numRuns: 20000 });
  });
  it('round-trips every bf16 value bit-exact through float32', () => {
    const all = new Uint16Array(65536).map((_, i) => i);
    const bytes = new Uint8Array(all.buffer);
    const back = encodeTensor(decodeTensor(bytes, 'bf16'), 'bf16');
    const nanCodes = [...all].filter((h) => Number.isNaN(bf16Value(h)));
    const nan = new Set(nanCodes);
    const wrong: number[] = [];
    for (let i = 0; i < 65536; i++) if (!nan.has(i) && (back[2 * i]! | (back[2 * i + 1]! << 8)) !== i) wrong.push(i);
    expect(wrong).toEqual([]);
    // NaNs stay NaN (quieted), never become Inf or a number
    for (const h of nanCodes.slice(0, 50)) expect(Number.isNaN(decodeTensor(encodeTensor(new Float32Array([bf16Value(h)]), 'bf16'), 'bf16')[0]!)).toBe(true);
  });
  it('is little-endian on the wire', () => {
    expect(Array.from(encodeTensor(new Float32Array([1.0, -2.0]), 'bf16'))).toEqual([0x80, 0x3f, 0x00, 0xc0]);
  });
});

describe('f16 codec', () => {
  it('rounds every float32 to the nearest half, ties to even, overflowing to ±Inf', () => {
    fc.assert(fc.property(f32, (x) => isNearestEven(x, f32ToF16Bits(x), f16Value, 65504)), { numRuns: 20000 });
  });
  it('decodes every half code to its IEEE value', () => {
    const codes = new Uint16Array(65536).map((_, i) => i);
    const vals = decodeTensor(new Uint8Array(codes.buffer), 'f16');
    const wrong: number[] = [];
    for (let i = 0; i < 65536; i++) {
      const ref = f16Value(i);
      if (Number.isNaN(ref) ? !Number.isNaN(vals[i]!) : vals[i] !== ref) wrong.push(i);
    }
    expect(wrong).toEqual([]);
  });
});

describe('f32 codec and helpers', () => {
  it('round-trips float32 arrays exactly, from unaligned views too', () => {
    fc.assert(fc.property(fc.float32Array({ maxLength: 64 }), (a) => {
      const bytes = encodeTensor(a, 'f32');
      const shifted = new Uint8Array(bytes.byteLength + 1);
      shifted.set(bytes, 1);
      const back = decodeTensor(shifted.subarray(1), 'f32');
      expect(Buffer.from(back.buffer).equals(Buffer.from(a.buffer, a.byteOffset, a.byteLength))).toBe(true);
    }));
  });
  it('rejects ragged bodies', () => {
    expect(() => decodeTensor(new Uint8Array(3), 'bf16')).toThrow(/whole number of bf16/);
    expect(() => decodeTensor(new Uint8Array(6), 'f32')).toThrow(/f32/);
  });
  it('finds NaN and Inf', () => {
    expect(firstNonFinite(new Float32Array([1, 2, 3]))).toBe(-1);
    expect(firstNonFinite(new Float32Array([1, NaN, 3]))).toBe(1);
    expect(firstNonFinite(new Float32Array([1, 2, -Infinity]))).toBe(2);
  });
  it('roundThrough matches encode→decode', () => {
    const a = new Float32Array([0.1, 1 / 3, -7.77, 1e-30]);
    expect(Array.from(roundThrough(a, 'bf16'))).toEqual(Array.from(decodeTensor(encodeTensor(a, 'bf16'), 'bf16')));
  });
  it('parses shapes strictly', () => {
    expect(parseShape('1,1,576')).toEqual([1, 1, 576]);
    for (const bad of ['1,1', '1,,2', '1,1,-3', '1,1,0', 'a,b,c', '1,1,1e3', undefined]) expect(parseShape(bad)).toBeNull();
  });
});
