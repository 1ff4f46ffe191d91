/**
 * 4-bit weight quantization in onnxruntime's `MatMulNBits` layout (bits 4,
 * block 32, a scale and a zero point per block), done by the node while it
 * loads its span: bf16 checkpoint → f32 → int4, one matrix at a time.
 *
 * Layout (com.microsoft MatMulNBits, ContribOperators.md): for B of shape
 * [N, K] (the Hugging Face [out, in] layout, so no transpose):
 *   packed      uint8 [N, ceil(K/32), 16]: row n, block b, byte j holds
 *               elements 2j (low nibble) and 2j+1 (high nibble)
 *   scales      float [N * ceil(K/32)]
 *   zeroPoints  uint8 [N * ceil(ceil(K/32)/2)]: block b of row n in byte b/2,
 *               low nibble for even b
 * and w ≈ (q - zeroPoint) * scale.
 *
 * Two schemes. Asymmetric (a zero point per block): min/max per block with 0
 * kept inside the range, so a zero weight stays exactly zero (onnxruntime's
 * own quantizer does the same). Symmetric (no zero points: the kernel's
 * implicit 8): the smallest step that fits the block in [-8, 7] steps.
 * Symmetric is what onnxruntime's WebGPU fusions need (MatMulNBitsQkv folds
 * the norm and the three projections into one program, MatMulNBitsMlp the
 * norm, gate, up and SiLU): 7 programs per layer instead of 12.
 */

export const Q4_BLOCK = 32;
const BLOB = Q4_BLOCK / 2;

export interface Q4Matrix {
  /** Output features (rows of the HF weight). */
  readonly n: number;
  /** Input features. */
  readonly k: number;
  readonly packed: Uint8Array;
  readonly scales: Float32Array;
  /** null: symmetric, the kernel's default zero point 8. */
  readonly zeroPoints: Uint8Array | null;
}

export type Q4Scheme = 'asymmetric' | 'symmetric';

export function q4BlocksPerRow(k: number): number {
  return Math.ceil(k / Q4_BLOCK);
}

/** Bytes a quantized [n, k] matrix occupies (packed weights + f32 scales + zero points). */
export function q4Bytes(n: number, k: number, scheme: Q4Scheme = 'asymmetric'): number {
  const kb = q4BlocksPerRow(k);
  return n * kb * BLOB + n * kb * 4 + (scheme === 'asymmetric' ? n * Math.ceil(kb / 2) : 0);
}

/** Quantizes a row-major [n, k] float matrix. */
export function quantizeQ4(w: ArrayLike<number>, n: number, k: number, scheme: Q4Scheme = 'asymmetric'): Q4Matrix {
  if (w.length !== n * k) throw new RangeError(`quantizeQ4: ${w.length} values for [${n}, ${k}]`);
  const kb = q4BlocksPerRow(k);
  const zpRow = Math.ceil(kb / 2);
  const packed = new Uint8Array(n * kb * BLOB);
  const scales = new Float32Array(n * kb);
  const zeroPoints = scheme === 'asymmetric' ? new Uint8Array(n * zpRow) : null;
  for (let r = 0; r < n; r++) {
    const rowOff = r * k;
    for (let b = 0; b < kb; b++) {
      const from = b * Q4_BLOCK;
      const to = Math.min(k, from + Q4_BLOCK);
      let lo = 0;
      let hi = 0;
      for (let i = from; i < to; i++) {
        const v = w[rowOff + i]!;
        if (!Number.isFinite(v)) throw new RangeError(`quantizeQ4: non-finite weight ${v} at [${r}, ${i}]`);
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
      // Math.fround: the kernel multiplies by the f32 scale, so quantize against exactly that value.
      let scale: number;
      let zp = 8;
      if (zeroPoints) {
        scale = Math.fround((hi - lo) / 15);
        if (scale === 0) scale = 1;
        zp = Math.min(15, Math.max(0, Math.round(-lo / scale)));
        zeroPoints[r * zpRow + (b >> 1)]! |= (b & 1) === 0 ? zp : zp << 4;
      } else {
        // q - 8 spans [-8, 7] steps: the smallest step that fits both ends, so nothing clips.
        scale = Math.fround(Math.max(-lo / 8, hi / 7));
        if (scale === 0) scale = 1;
      }
      scales[r * kb + b] = scale;
      const blob = (r * kb + b) * BLOB;
      for (let i = from; i < to; i++) {
        const q = Math.min(15, Math.max(0, Math.round(w[rowOff + i]! / scale) + zp));
        const j = i - from;
        packed[blob + (j >> 1)]! |= (j & 1) === 0 ? q : q << 4;
      }
      // Padding past k stays q = 0; the kernel multiplies it by A's implicit zeros.
    }
  }
  return { n, k, packed, scales, zeroPoints };
}

/** The weights the kernel actually multiplies by, row-major [n, k]. */
export function dequantizeQ4(m: Q4Matrix): Float32Array {
  const { n, k } = m;
  const kb = q4BlocksPerRow(k);
  const zpRow = Math.ceil(kb / 2);
  const out = new Float32Array(n * k);
  for (let r = 0; r < n; r++) {
    for (let b = 0; b < kb; b++) {
      const zpByte = m.zeroPoints ? m.zeroPoints[r * zpRow + (b >> 1)]! : 8;
      const zp = !m.zeroPoints ? 8 : (b & 1) === 0 ? zpByte & 15 : zpByte >> 4;
      const scale = m.scales[r * kb + b]!;
      const blob = (r * kb + b) * BLOB;
      const to = Math.min(k, (b + 1) * Q4_BLOCK);
      for (let i = b * Q4_BLOCK; i < to; i++) {
        const j = i - b * Q4_BLOCK;
        const byte = m.packed[blob + (j >> 1)]!;
        const q = (j & 1) === 0 ? byte & 15 : byte >> 4;
        out[r * k + i] = Math.fround((q - zp) * scale);
      }
    }
  }
  return out;
}

/** Stacks matrices with the same k along n (packed QKV, gate/up): each row's blocks are independent. */
export function concatQ4Rows(parts: readonly Q4Matrix[]): Q4Matrix {
  if (parts.length === 0) throw new RangeError('concatQ4Rows: nothing to stack');
  const k = parts[0]!.k;
  if (parts.some((p) => p.k !== k)) throw new RangeError(`concatQ4Rows: inner dimensions ${parts.map((p) => p.k).join(', ')} differ`);
  const symmetric = parts[0]!.zeroPoints === null;
  if (parts.some((p) => (p.zeroPoints === null) !== symmetric)) throw new RangeError('concatQ4Rows: symmetric and asymmetric matrices cannot be stacked');
  const cat = <T extends Uint8Array | Float32Array>(arrays: T[], make: (len: number) => T): T => {
    const out = make(arrays.reduce((s, a) => s + a.length, 0));
    let off = 0;
    for (const a of arrays) {
      out.set(a, off);
      off += a.length;
    }
    return out;
  };
  return {
    n: parts.reduce((s, p) => s + p.n, 0),
    k,
    packed: cat(parts.map((p) => p.packed), (l) => new Uint8Array(l)),
    scales: cat(parts.map((p) => p.scales), (l) => new Float32Array(l)),
    zeroPoints: symmetric ? null : cat(parts.map((p) => p.zeroPoints!), (l) => new Uint8Array(l)),
  };
}
