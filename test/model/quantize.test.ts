/**
 * The 4-bit quantizer on its own, apart from any kernel: the MatMulNBits
 * byte layout decoded by hand here, the error bound of min/max quantization,
 * exact zeros, padding, and stacking rows (packed QKV, gate/up).
 */
import { describe, expect, it } from 'vitest';
import { concatQ4Rows, dequantizeQ4, q4Bytes, quantizeQ4 } from '../../src/model/quantize.ts';

function lcg(seed: number): () => number {
  let s = seed >>> 0;
  return () => ((s = (Math.imul(s, 1664525) + 1013904223) >>> 0) / 2 ** 32) * 2 - 1;
}

describe('quantizeQ4', () => {
  it('writes the MatMulNBits layout: low nibble first, per-row blocks, packed zero points', () => {
    // One row, 64 inputs = 2 blocks. Block 0 spans [-1, 0.875] in steps of 1/8; block 1 is all 2.0.
    const row = new Float32Array(64);
    for (let i = 0; i < 32; i++) row[i] = -1 + (i % 16) * 0.125;
    row.fill(2, 32);
    const q = quantizeQ4(row, 1, 64);
    expect(q.packed.length).toBe(32);
    expect(q.scales.length).toBe(2);
    expect(q.zeroPoints!.length).toBe(1);
    // Block 0: min -1, max 0.875 → scale 0.125, zero point 8; element i quantizes to i % 16.
    expect(q.scales[0]).toBeCloseTo(0.125, 7);
    expect(q.zeroPoints![0]! & 15).toBe(8);
    expect(q.packed[0]).toBe(0 | (1 << 4));
    expect(q.packed[7]).toBe(14 | (15 << 4));
    // Block 1: range [0, 2] (zero kept inside) → scale 2/15, zero point 0, every element 15.
    expect(q.scales[1]).toBeCloseTo(2 / 15, 7);
    expect(q.zeroPoints![0]! >> 4).toBe(0);
    expect([...q.packed.subarray(16, 32)].every((b) => b === 0xff)).toBe(true);
    expect(q4Bytes(1, 64)).toBe(32 + 8 + 1);
  });

  it('dequantizes within half a step of every weight and keeps zeros exact', () => {
    const rand = lcg(7);
    const n = 12;
    const k = 96;
    const w = Float32Array.from({ length: n * k }, (_, i) => (i % 11 === 0 ? 0 : rand() * (1 + (i % 5))));
    const q = quantizeQ4(w, n, k);
    const d = dequantizeQ4(q);
    for (let r = 0; r < n; r++) {
      for (let i = 0; i < k; i++) {
        const scale = q.scales[r * 3 + Math.floor(i / 32)]!;
        expect(Math.abs(d[r * k + i]! - w[r * k + i]!)).toBeLessThanOrEqual(scale / 2 + 1e-6);
        if (w[r * k + i] === 0) expect(d[r * k + i]).toBe(0);
      }
    }
  });

  it('pads a partial last block with zeros', () => {
    const w = Float32Array.from({ length: 2 * 40 }, (_, i) => (i % 7) - 3);
    const q = quantizeQ4(w, 2, 40);
    expect(q.packed.length).toBe(2 * 2 * 16);
    const d = dequantizeQ4(q);
    expect(d.length).toBe(80);
    for (let i = 0; i < 80; i++) expect(Math.abs(d[i]! - w[i]!)).toBeLessThanOrEqual(0.5 * q.scales[Math.floor(i / 40) * 2 + Math.floor((i % 40) / 32)]! + 1e-6);
  });

  it('stacks rows without changing any of them', () => {
    const rand = lcg(3);
    const a = Float32Array.from({ length: 3 * 64 }, rand);
    const b = Float32Array.from({ length: 5 * 64 }, rand);
    const cat = concatQ4Rows([quantizeQ4(a, 3, 64), quantizeQ4(b, 5, 64)]);
    const whole = quantizeQ4(Float32Array.from([...a, ...b]), 8, 64);
    expect(cat.n).toBe(8);
    expect(cat.packed).toEqual(whole.packed);
    expect(cat.scales).toEqual(whole.scales);
    expect(cat.zeroPoints).toEqual(whole.zeroPoints);
    expect(() => concatQ4Rows([quantizeQ4(a, 3, 64), quantizeQ4(new Float32Array(32), 1, 32)])).toThrow(/differ/);
  });

  it('symmetric: no zero points, the smallest step that fits both ends of a block, nothing clipped', () => {
    const w = Float32Array.from({ length: 64 }, (_, i) => (i < 32 ? (i - 16) / 4 : (i - 40) / 10));
    const q = quantizeQ4(w, 1, 64, 'symmetric');
    expect(q.zeroPoints).toBeNull();
    expect(q4Bytes(1, 64, 'symmetric')).toBe(32 + 8);
    // Block 0 spans [-4, 3.75]: -4/8 = 0.5 < 3.75/7, so the step is 3.75/7 and 3.75 lands on +7.
    expect(q.scales[0]).toBeCloseTo(3.75 / 7, 6);
    // Block 1 spans [-0.8, 2.3]: 2.3/7 is the step.
    expect(q.scales[1]).toBeCloseTo(2.3 / 7, 6);
    const d = dequantizeQ4(q);
    expect(d[31]).toBeCloseTo(3.75, 5);
    expect(d[63]).toBeCloseTo(2.3, 5);
    for (let i = 0; i < 64; i++) expect(Math.abs(d[i]! - w[i]!)).toBeLessThanOrEqual(q.scales[i < 32 ? 0 : 1]! / 2 + 1e-6);
    // The layout decodes by hand: element 63 is the high nibble of the block's last byte, q = 15.
    expect(q.packed[31]! >> 4).toBe(15);
  });

  it('refuses non-finite weights and mismatched sizes', () => {
    expect(() => quantizeQ4(Float32Array.of(1, NaN), 1, 2)).toThrow(/non-finite/);
    expect(() => quantizeQ4(new Float32Array(3), 1, 2)).toThrow(/3 values/);
  });
});
