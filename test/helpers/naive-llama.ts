/**
 * Test-only float64 Llama forward with a KV cache, independent of the ONNX
 * graph builder: used to check that fixture weights give O(1) activations and
 * a non-degenerate greedy continuation.
 */
import type { ModelConfig } from '../../src/model/config.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR } from '../../src/model/config.ts';

export type Weights = ReadonlyMap<string, { shape: number[]; data: Float32Array }>;

function ropeInvFreq(cfg: ModelConfig): Float64Array {
  const half = cfg.headDim / 2;
  const inv = new Float64Array(half);
  for (let i = 0; i < half; i++) {
    let f = 1 / cfg.ropeTheta ** ((2 * i) / cfg.headDim);
    const s = cfg.ropeScaling;
    // Llama-layout presets only (the other architectures are checked against reference.ts).
    if (s?.type === 'longrope') throw new Error('naive-llama: longrope is not modelled here');
    if (s) {
      const lowWavelen = s.originalMaxPositionEmbeddings / s.lowFreqFactor;
      const highWavelen = s.originalMaxPositionEmbeddings / s.highFreqFactor;
      const wavelen = (2 * Math.PI) / f;
      if (wavelen > lowWavelen) f = f / s.factor;
      else if (wavelen >= highWavelen) {
        const smooth = (s.originalMaxPositionEmbeddings / wavelen - s.lowFreqFactor) / (s.highFreqFactor - s.lowFreqFactor);
        f = (1 - smooth) * (f / s.factor) + smooth * f;
      }
    }
    inv[i] = f;
  }
  return inv;
}

export class NaiveLlama {
  private readonly k: Float64Array[][] = [];
  private readonly v: Float64Array[][] = [];
  private readonly inv: Float64Array;
  /** RMS of the residual stream after each layer, for the last token processed. */
  lastResidualRms: number[] = [];

  constructor(private readonly cfg: ModelConfig, private readonly w: Weights) {
    this.inv = ropeInvFreq(cfg);
    for (let l = 0; l < cfg.numLayers; l++) {
      this.k.push([]);
      this.v.push([]);
    }
  }

  private t(name: string): Float32Array {
    const t = this.w.get(name);
    if (!t) throw new Error(`missing ${name}`);
    return t.data;
  }

  private matvec(name: string, x: Float64Array, out: number, bias?: string): Float64Array {
    const m = this.t(name);
    const inDim = x.length;
    const y = new Float64Array(out);
    for (let o = 0; o < out; o++) {
      let s = 0;
      const row = o * inDim;
      for (let i = 0; i < inDim; i++) s += m[row + i]! * x[i]!;
      y[o] = s;
    }
    if (bias) {
      const b = this.t(bias);
      for (let o = 0; o < out; o++) y[o]! += b[o]!;
    }
    return y;
  }

  private rmsnorm(x: Float64Array, name: string): Float64Array {
    const g = this.t(name);
    let ss = 0;
    for (const v of x) ss += v * v;
    const r = 1 / Math.sqrt(ss / x.length + this.cfg.rmsNormEps);
    return x.map((v, i) => v * r * g[i]!);
  }

  private rope(x: Float64Array, heads: number, pos: number): void {
    const d = this.cfg.headDim;
    const half = d / 2;
    for (let h = 0; h < heads; h++) {
      for (let i = 0; i < half; i++) {
        const a = pos * this.inv[i]!;
        const c = Math.cos(a);
        const s = Math.sin(a);
        const x1 = x[h * d + i]!;
        const x2 = x[h * d + half + i]!;
        x[h * d + i] = x1 * c - x2 * s;
        x[h * d + half + i] = x2 * c + x1 * s;
      }
    }
  }

  /** Feed one token at the next position; returns logits. */
  step(token: number): Float64Array {
    const cfg = this.cfg;
    const H = cfg.hiddenSize;
    const d = cfg.headDim;
    const pos = this.k[0]!.length;
    const emb = this.t(EMBED_TENSOR);
    let x = Float64Array.from(emb.subarray(token * H, (token + 1) * H));
    this.lastResidualRms = [];
    for (let l = 0; l < cfg.numLayers; l++) {
      const p = `model.layers.${l}`;
      const hn = this.rmsnorm(x, `${p}.input_layernorm.weight`);
      const bias = (n: string): string | undefined => (cfg.attentionBias ? `${p}.self_attn.${n}_proj.bias` : undefined);
      const q = this.matvec(`${p}.self_attn.q_proj.weight`, hn, cfg.numHeads * d, bias('q'));
      const k = this.matvec(`${p}.self_attn.k_proj.weight`, hn, cfg.numKvHeads * d, bias('k'));
      const v = this.matvec(`${p}.self_attn.v_proj.weight`, hn, cfg.numKvHeads * d, bias('v'));
      this.rope(q, cfg.numHeads, pos);
      this.rope(k, cfg.numKvHeads, pos);
      this.k[l]!.push(k);
      this.v[l]!.push(v);
      const att = new Float64Array(cfg.numHeads * d);
      const group = cfg.numHeads / cfg.numKvHeads;
      for (let h = 0; h < cfg.numHeads; h++) {
        const kvh = Math.floor(h / group);
        const scores = this.k[l]!.map((kk) => {
          let s = 0;
          for (let i = 0; i < d; i++) s += q[h * d + i]! * kk[kvh * d + i]!;
          return s / Math.sqrt(d);
        });
        const m = Math.max(...scores);
        const e = scores.map((s) => Math.exp(s - m));
        const z = e.reduce((a, b) => a + b, 0);
        for (let t = 0; t < e.length; t++) {
          const vv = this.v[l]![t]!;
          for (let i = 0; i < d; i++) att[h * d + i]! += (e[t]! / z) * vv[kvh * d + i]!;
        }
      }
      const o = this.matvec(`${p}.self_attn.o_proj.weight`, att, H);
      x = x.map((xv, i) => xv + o[i]!);
      const h2 = this.rmsnorm(x, `${p}.post_attention_layernorm.weight`);
      const g = this.matvec(`${p}.mlp.gate_proj.weight`, h2, cfg.intermediateSize);
      const u = this.matvec(`${p}.mlp.up_proj.weight`, h2, cfg.intermediateSize);
      const act = g.map((gv, i) => (gv / (1 + Math.exp(-gv))) * u[i]!);
      const dn = this.matvec(`${p}.mlp.down_proj.weight`, act, H);
      x = x.map((xv, i) => xv + dn[i]!);
      this.lastResidualRms.push(Math.sqrt(x.reduce((a, b) => a + b * b, 0) / H));
    }
    const fin = this.rmsnorm(x, FINAL_NORM_TENSOR);
    return this.matvec(cfg.tieWordEmbeddings ? EMBED_TENSOR : LM_HEAD_TENSOR, fin, cfg.vocabSize);
  }
}

export function argmax(x: ArrayLike<number>): number {
  let best = 0;
  for (let i = 1; i < x.length; i++) if (x[i]! > x[best]!) best = i;
  return best;
}

export function std(x: ArrayLike<number>): number {
  let m = 0;
  for (let i = 0; i < x.length; i++) m += x[i]!;
  m /= x.length;
  let v = 0;
  for (let i = 0; i < x.length; i++) v += (x[i]! - m) ** 2;
  return Math.sqrt(v / x.length);
}

/** Greedy continuation of `prompt` for `n` tokens. */
export function greedy(cfg: ModelConfig, w: Weights, prompt: readonly number[], n: number): { tokens: number[]; logitStd: number[]; residualRms: number[][] } {
  const m = new NaiveLlama(cfg, w);
  let logits: Float64Array = new Float64Array(0);
  for (const t of prompt) logits = m.step(t);
  const tokens: number[] = [];
  const logitStd: number[] = [];
  const residualRms: number[][] = [];
  for (let i = 0; i < n; i++) {
    logitStd.push(std(logits));
    const next = argmax(logits);
    tokens.push(next);
    if (i + 1 < n) {
      logits = m.step(next);
      residualRms.push(m.lastResidualRms);
    }
  }
  return { tokens, logitStd, residualRms };
}
