/**
 * Rotary-embedding tables for the ONNX graphs. The executor computes cos/sin
 * for the positions of one call and feeds them to every layer: one small
 * tensor per step instead of a max-context table baked into each layer.
 */
import type { ModelConfig } from './config.ts';

/** Inverse frequencies (rotaryDim/2 of them) with llama3 or longrope (short-factor) scaling, as transformers computes them. */
export function ropeInvFreq(cfg: ModelConfig): Float64Array {
  const half = cfg.rotaryDim / 2;
  const inv = new Float64Array(half);
  for (let i = 0; i < half; i++) inv[i] = 1 / Math.pow(cfg.ropeTheta, (2 * i) / cfg.rotaryDim);
  const s = cfg.ropeScaling;
  if (!s) return inv;
  if (s.type === 'longrope') {
    // Positions stay below original_max_position_embeddings (config.ts caps the context): short factors.
    for (let i = 0; i < half; i++) inv[i] = inv[i]! / s.shortFactor[i]!;
    return inv;
  }
  const lowWavelen = s.originalMaxPositionEmbeddings / s.lowFreqFactor;
  const highWavelen = s.originalMaxPositionEmbeddings / s.highFreqFactor;
  for (let i = 0; i < half; i++) {
    const f = inv[i]!;
    const wavelen = (2 * Math.PI) / f;
    if (wavelen > lowWavelen) inv[i] = f / s.factor;
    else if (wavelen >= highWavelen) {
      const smooth = (s.originalMaxPositionEmbeddings / wavelen - s.lowFreqFactor) / (s.highFreqFactor - s.lowFreqFactor);
      inv[i] = (1 - smooth) * (f / s.factor) + smooth * f;
    }
  }
  return inv;
}

/**
 * The factor transformers multiplies cos and sin by (longrope's
 * attention_factor; 1 otherwise). The graphs apply it to their cos/sin, not
 * to the softmax scale: with partial rotary only the rotated values carry it.
 */
export function ropeAttentionFactor(cfg: ModelConfig): number {
  return cfg.ropeScaling?.type === 'longrope' ? cfg.ropeScaling.attentionFactor : 1;
}

/** The softmax scale of attention scores, 1/sqrt(head_dim) (transformers' `scaling`). */
export function attentionScale(cfg: ModelConfig): number {
  return 1 / Math.sqrt(cfg.headDim);
}

/**
 * cos and signed sin for positions [start, start+count), each [count, width].
 * The sin table carries -sin on the first half so the graph computes
 * rotate_half as a swap of halves with no Neg: x*cos + swap(x)*sinSigned.
 * Rows are `width` apart (headDim for the graphs' inputs): with partial
 * rotary only the first rotaryDim values of a row are set, and the graph
 * slices them off.
 */
export function ropeTables(invFreq: Float64Array, start: number, count: number, width = invFreq.length * 2): { cos: Float32Array; sin: Float32Array } {
  const half = invFreq.length;
  const dim = width;
  const cos = new Float32Array(count * dim);
  const sin = new Float32Array(count * dim);
  for (let p = 0; p < count; p++) {
    const base = p * dim;
    for (let i = 0; i < half; i++) {
      const a = (start + p) * invFreq[i]!;
      const c = Math.cos(a);
      const s = Math.sin(a);
      cos[base + i] = c;
      cos[base + half + i] = c;
      sin[base + i] = -s;
      sin[base + half + i] = s;
    }
  }
  return { cos, sin };
}
