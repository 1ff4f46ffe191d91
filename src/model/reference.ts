/**
 * Float64 reference forward pass, for tests and benchmarks only. Written as
 * plain loops, independently of the ONNX graphs (its own RoPE frequencies,
 * rotate_half, repeat_kv and causal mask), so that agreement between the two
 * means something.
 */
import type { ModelConfig } from './config.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR } from './config.ts';

export interface RefTensor {
  readonly shape: readonly number[];
  readonly data: ArrayLike<number>;
}
export type RefWeightSource = (name: string) => RefTensor;

/** Per-layer key/value rows (already rotated keys), one Float64Array of kvHeads*headDim per position. */
export interface RefKvCache {
  keys: Float64Array[][];
  values: Float64Array[][];
}

export function newRefCache(cfg: ModelConfig): RefKvCache {
  return { keys: Array.from({ length: cfg.numLayers }, () => []), values: Array.from({ length: cfg.numLayers }, () => []) };
}

/** Rotary inverse frequencies: plain, llama3-scaled, or longrope's short factors (positions below the original length). */
function ropeFrequencies(cfg: ModelConfig): Float64Array {
  // Partial rotary (Phi-4-mini): frequencies over the rotated dims only.
  const dim = cfg.rotaryDim;
  const half = dim / 2;
  const out = new Float64Array(half);
  const sc = cfg.ropeScaling;
  for (let i = 0; i < half; i++) {
    const base = Math.pow(cfg.ropeTheta, -(2 * i) / dim);
    if (!sc) {
      out[i] = base;
      continue;
    }
    if (sc.type === 'longrope') {
      // transformers: inv_freq = 1 / (ext_factors * base ** (arange(0, dim, 2) / dim)).
      out[i] = 1 / (sc.shortFactor[i]! * Math.pow(cfg.ropeTheta, (2 * i) / dim));
      continue;
    }
    const wavelen = (2 * Math.PI) / base;
    const lowFreqWavelen = sc.originalMaxPositionEmbeddings / sc.lowFreqFactor;
    const highFreqWavelen = sc.originalMaxPositionEmbeddings / sc.highFreqFactor;
    if (wavelen < highFreqWavelen) out[i] = base;
    else if (wavelen > lowFreqWavelen) out[i] = base / sc.factor;
    else {
      const t = (sc.originalMaxPositionEmbeddings / wavelen - sc.lowFreqFactor) / (sc.highFreqFactor - sc.lowFreqFactor);
      out[i] = (1 - t) * (base / sc.factor) + t * base;
    }
  }
  return out;
}

export class ReferenceModel {
  private readonly freqs: Float64Array;
  /** cos and sin are multiplied by this (longrope's attention_factor), as transformers does. */
  private readonly ropeMul: number;
  private readonly w = new Map<string, Float64Array>();

  constructor(
    readonly cfg: ModelConfig,
    private readonly src: RefWeightSource,
  ) {
    this.freqs = ropeFrequencies(cfg);
    this.ropeMul = cfg.ropeScaling?.type === 'longrope' ? cfg.ropeScaling.attentionFactor : 1;
  }

  private weight(name: string): Float64Array {
    let t = this.w.get(name);
    if (!t) {
      t = Float64Array.from(this.src(name).data);
      this.w.set(name, t);
    }
    return t;
  }

  embed(ids: readonly number[]): Float64Array {
    const h = this.cfg.hiddenSize;
    const e = this.weight(EMBED_TENSOR);
    const out = new Float64Array(ids.length * h);
    ids.forEach((id, s) => {
      for (let j = 0; j < h; j++) out[s * h + j] = e[id * h + j]!;
    });
    return out;
  }

  /** RMSNorm over rows of `h` values (the hidden size, or head_dim for Qwen3's q/k norms). */
  private rmsNorm(x: Float64Array, seq: number, w: Float64Array, h = this.cfg.hiddenSize): Float64Array {
    const out = new Float64Array(x.length);
    for (let s = 0; s < seq; s++) {
      let ss = 0;
      for (let j = 0; j < h; j++) ss += x[s * h + j]! ** 2;
      const r = 1 / Math.sqrt(ss / h + this.cfg.rmsNormEps);
      for (let j = 0; j < h; j++) out[s * h + j] = x[s * h + j]! * r * w[j]!;
    }
    return out;
  }

  /** y = x W^T (+ b) with HF [out, in] weights; `row0` skips rows of a packed tensor (Phi-3 qkv_proj, gate_up_proj). */
  private linear(x: Float64Array, seq: number, w: Float64Array, inDim: number, outDim: number, b?: Float64Array, row0 = 0): Float64Array {
    const y = new Float64Array(seq * outDim);
    for (let s = 0; s < seq; s++) {
      for (let o = 0; o < outDim; o++) {
        let acc = b ? b[o]! : 0;
        const r = (row0 + o) * inDim;
        for (let i = 0; i < inDim; i++) acc += x[s * inDim + i]! * w[r + i]!;
        y[s * outDim + o] = acc;
      }
    }
    return y;
  }

  /** rotate_half RoPE on one head vector in place: its first rotaryDim values (transformers' q_rot; q_pass stays). */
  private rotate(v: Float64Array, off: number, pos: number): void {
    const half = this.cfg.rotaryDim / 2;
    for (let i = 0; i < half; i++) {
      const a = v[off + i]!;
      const b = v[off + half + i]!;
      const c = Math.cos(pos * this.freqs[i]!) * this.ropeMul;
      const s = Math.sin(pos * this.freqs[i]!) * this.ropeMul;
      v[off + i] = a * c - b * s;
      v[off + half + i] = b * c + a * s;
    }
  }

  /** One decoder layer over `seq` new tokens at `position`; appends to the cache. */
  layer(l: number, x: Float64Array, seq: number, position: number, cache: RefKvCache): Float64Array {
    const { hiddenSize: h, numHeads: H, numKvHeads: KV, headDim: D, intermediateSize: I } = this.cfg;
    const p = `model.layers.${l}`;
    const keys = cache.keys[l]!;
    const values = cache.values[l]!;
    if (keys.length !== position) throw new Error(`reference cache of layer ${l} holds ${keys.length}, not ${position}`);
    const bias = (n: string) => (this.cfg.attentionBias ? this.weight(`${p}.self_attn.${n}_proj.bias`) : undefined);

    const n1 = this.rmsNorm(x, seq, this.weight(`${p}.input_layernorm.weight`));
    let q: Float64Array, k: Float64Array, v: Float64Array;
    if (this.cfg.packedProjections) {
      // Phi3Attention: qkv = qkv_proj(x); q = qkv[..., :H*D], k = next KV*D, v = the rest.
      const w = this.weight(`${p}.self_attn.qkv_proj.weight`);
      q = this.linear(n1, seq, w, h, H * D);
      k = this.linear(n1, seq, w, h, KV * D, undefined, H * D);
      v = this.linear(n1, seq, w, h, KV * D, undefined, (H + KV) * D);
    } else {
      q = this.linear(n1, seq, this.weight(`${p}.self_attn.q_proj.weight`), h, H * D, bias('q'));
      k = this.linear(n1, seq, this.weight(`${p}.self_attn.k_proj.weight`), h, KV * D, bias('k'));
      v = this.linear(n1, seq, this.weight(`${p}.self_attn.v_proj.weight`), h, KV * D, bias('v'));
    }
    if (this.cfg.qkNorm) {
      // Qwen3Attention: q_norm / k_norm over each head's head_dim values, then RoPE.
      q = this.rmsNorm(q, seq * H, this.weight(`${p}.self_attn.q_norm.weight`), D);
      k = this.rmsNorm(k, seq * KV, this.weight(`${p}.self_attn.k_norm.weight`), D);
    }
    for (let s = 0; s < seq; s++) {
      for (let hd = 0; hd < H; hd++) this.rotate(q, s * H * D + hd * D, position + s);
      for (let hd = 0; hd < KV; hd++) this.rotate(k, s * KV * D + hd * D, position + s);
      keys.push(k.slice(s * KV * D, (s + 1) * KV * D));
      values.push(v.slice(s * KV * D, (s + 1) * KV * D));
    }

    const attn = new Float64Array(seq * H * D);
    const groups = H / KV;
    const scale = 1 / Math.sqrt(D);
    for (let s = 0; s < seq; s++) {
      const visible = position + s + 1; // causal: itself and everything before
      // Sliding window: key t is seen from query i only when i - t < window.
      const W = this.cfg.slidingWindow;
      const first = W === null ? 0 : Math.max(0, position + s - W + 1);
      for (let hd = 0; hd < H; hd++) {
        const kvh = Math.floor(hd / groups);
        const scores = new Float64Array(visible).fill(-Infinity);
        let max = -Infinity;
        for (let t = first; t < visible; t++) {
          let dot = 0;
          for (let d = 0; d < D; d++) dot += q[s * H * D + hd * D + d]! * keys[t]![kvh * D + d]!;
          scores[t] = dot * scale;
          if (scores[t]! > max) max = scores[t]!;
        }
        let sum = 0;
        for (let t = first; t < visible; t++) {
          scores[t] = Math.exp(scores[t]! - max);
          sum += scores[t]!;
        }
        for (let t = first; t < visible; t++) {
          const pr = scores[t]! / sum;
          for (let d = 0; d < D; d++) attn[s * H * D + hd * D + d] = attn[s * H * D + hd * D + d]! + pr * values[t]![kvh * D + d]!;
        }
      }
    }
    const o = this.linear(attn, seq, this.weight(`${p}.self_attn.o_proj.weight`), H * D, h);
    const x2 = x.map((xv, i) => xv + o[i]!);

    const n2 = this.rmsNorm(x2, seq, this.weight(`${p}.post_attention_layernorm.weight`));
    let gate: Float64Array, up: Float64Array;
    if (this.cfg.packedProjections) {
      // Phi3MLP: gate, up = gate_up_proj(x).chunk(2, dim=-1); up * silu(gate).
      const w = this.weight(`${p}.mlp.gate_up_proj.weight`);
      gate = this.linear(n2, seq, w, h, I);
      up = this.linear(n2, seq, w, h, I, undefined, I);
    } else {
      gate = this.linear(n2, seq, this.weight(`${p}.mlp.gate_proj.weight`), h, I);
      up = this.linear(n2, seq, this.weight(`${p}.mlp.up_proj.weight`), h, I);
    }
    const act = gate.map((gv, i) => (gv / (1 + Math.exp(-gv))) * up[i]!);
    const down = this.linear(act, seq, this.weight(`${p}.mlp.down_proj.weight`), I, h);
    return x2.map((xv, i) => xv + down[i]!);
  }

  layers(start: number, end: number, x: Float64Array, seq: number, position: number, cache: RefKvCache): Float64Array {
    let y = x;
    for (let l = start; l < end; l++) y = this.layer(l, y, seq, position, cache);
    return y;
  }

  /** Final norm + LM head: logits [seq * vocab]. */
  head(x: Float64Array, seq: number): Float64Array {
    const n = this.rmsNorm(x, seq, this.weight(FINAL_NORM_TENSOR));
    const w = this.weight(this.cfg.tieWordEmbeddings ? EMBED_TENSOR : LM_HEAD_TENSOR);
    return this.linear(n, seq, w, this.cfg.hiddenSize, this.cfg.vocabSize);
  }

  /** Whole model over new tokens at `position`: logits [seq * vocab]. */
  forward(ids: readonly number[], position: number, cache: RefKvCache): Float64Array {
    return this.head(this.layers(0, this.cfg.numLayers, this.embed(ids), ids.length, position, cache), ids.length);
  }

  /** Greedy continuation of `prompt` by `n` tokens (ties to the lowest id). */
  greedy(prompt: readonly number[], n: number): number[] {
    const cache = newRefCache(this.cfg);
    const V = this.cfg.vocabSize;
    let logits = this.forward(prompt, 0, cache);
    let last = logits.subarray((prompt.length - 1) * V);
    const out: number[] = [];
    for (let i = 0; i < n; i++) {
      let best = 0;
      for (let j = 1; j < V; j++) if (last[j]! > last[best]!) best = j;
      out.push(best);
      if (i === n - 1) break;
      logits = this.forward([best], prompt.length + i, cache);
      last = logits;
    }
    return out;
  }
}
