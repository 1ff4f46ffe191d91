/**
 * Decoder-layer graphs from onnxruntime's fused contrib operators, the way
 * onnxruntime-genai's model builder emits Llama for WebGPU: per layer
 *
 *   [Skip]SimplifiedLayerNormalization → one QKV projection (q|k|v rows
 *   packed) → GroupQueryAttention (rotary inside, cos/sin caches as
 *   initializers, past and present one preallocated buffer) → o_proj →
 *   SkipSimplifiedLayerNormalization → one gate|up projection → QuickGelu
 *   (alpha 1 is SiLU) × up → down_proj
 *
 * and the residual add folded into the next layer's SkipSimplifiedLayerNorm
 * (a final Add closes the span). Projections are MatMul over f32 weights or
 * `MatMulNBits` over 4-bit weights (quantize.ts). The plain graphs
 * (graph.ts) stay for the CPU default and the per-layer overlap protocol;
 * this kind is what a GPU runs, and what WASM runs for 4-bit weights.
 *
 * Interface of a fused span graph (batch: 1, or B sessions' one-row steps, fused-batch.ts):
 *   hidden_states          f32 [batch, seq, hidden]
 *   seqlens_k              int32 [batch]   position + seq - 1 (GQA's convention), per session
 *   total_sequence_length  int32 [1]       max(position) + seq
 *   past_key_values.N.key/value  f32 [batch, kvHeads, capacity, headDim]
 * out:
 *   hidden_states_out      f32 [batch, seq, hidden]
 *   present.N.key/value    f32 [batch, kvHeads, capacity, headDim]
 * Bind present to the same buffer as past: GroupQueryAttention then writes
 * this call's rows in place (past_present_share_buffer) and never copies
 * the cache. `capacity` ≤ the graph's `maxContext` (the rotary tables'
 * length) and may differ per session.
 */
import type { ModelConfig } from './config.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR } from './config.ts';
import { ElemType, GraphBuilder, MS_DOMAIN, writeFloats } from './onnx-builder.ts';
import { q4BlocksPerRow, q4Bytes, quantizeQ4, Q4_BLOCK, type Q4Matrix, type Q4Scheme } from './quantize.ts';
import { attentionScale, ropeAttentionFactor, ropeInvFreq } from './rope.ts';
import type { BuiltGraph, WeightSource, WeightTensor } from './graph.ts';

export const FUSED_IO = {
  hidden: 'hidden_states',
  hiddenOut: 'hidden_states_out',
  seqlensK: 'seqlens_k',
  totalSeqLen: 'total_sequence_length',
  pastKey: (layer: number) => `past_key_values.${layer}.key`,
  pastValue: (layer: number) => `past_key_values.${layer}.value`,
  presentKey: (layer: number) => `present.${layer}.key`,
  presentValue: (layer: number) => `present.${layer}.value`,
} as const;

/** How projection weights are stored: f32 MatMul, or 4-bit MatMulNBits. */
export type FusedWeights = 'f32' | 'q4';

/** Quantized projections by HF tensor name; a host may serve them from a cache instead of quantizing again. */
export type Q4Source = (name: string) => Q4Matrix;

export interface FusedGraphOptions {
  weights: FusedWeights;
  /** Positions the rotary caches cover: the largest KV capacity any session may use. */
  maxContext: number;
  /** Where quantized matrices come from (default: quantize `src` now). */
  q4?: Q4Source;
  /**
   * Weights as graph inputs, not initializers (BuiltGraph.externalWeights):
   * a captured decode session and an uncaptured one then share one copy
   * on the GPU (src/shard/capture-lane.ts).
   */
  weightsAsInputs?: boolean;
}

/** Why `cfg` cannot run as a fused graph, or null when it can (callers fall back to the plain graphs of graph.ts). */
export function fusedUnsupportedReason(cfg: ModelConfig): string | null {
  const known: readonly string[] = ['llama', 'mistral', 'qwen2', 'qwen3', 'phi3'];
  if (!known.includes(cfg.architecture)) return `architecture ${cfg.architecture}`;
  if (cfg.headDim % 16 !== 0) return `head_dim ${cfg.headDim} is not a multiple of 16`;
  // GroupQueryAttention's rotary: "cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8".
  if ((cfg.rotaryDim / 2) % 8 !== 0) return `rotary dim ${cfg.rotaryDim} is not a multiple of 16`;
  if (cfg.hiddenSize % Q4_BLOCK !== 0 || cfg.intermediateSize % Q4_BLOCK !== 0) return 'hidden or intermediate size is not a multiple of 32';
  return null;
}

function expectShape(name: string, w: WeightTensor, shape: number[]): void {
  if (w.shape.length !== shape.length || w.shape.some((d, i) => d !== shape[i])) {
    throw new RangeError(`${name}: shape [${w.shape.join(',')}], expected [${shape.join(',')}]`);
  }
}

/** The default Q4Source: quantize the checkpoint's tensor now. */
export function quantizingSource(src: WeightSource, scheme: Q4Scheme = FUSED_Q4_SCHEME): Q4Source {
  return (name) => {
    const w = src(name);
    if (w.shape.length !== 2) throw new RangeError(`${name}: a projection must be 2-D, got [${w.shape.join(',')}]`);
    return quantizeQ4(w.data, w.shape[0]!, w.shape[1]!, scheme);
  };
}

/** Symmetric: the scheme onnxruntime's WebGPU MatMulNBits fusions accept (see quantize.ts). */
export const FUSED_Q4_SCHEME: Q4Scheme = 'symmetric';

/**
 * HF names of the projections a fused layer packs, in packing order. Phi-3
 * checkpoints already hold q|k|v and gate|up packed (`cfg.packedProjections`).
 */
export function fusedProjectionNames(layer: number, cfg?: ModelConfig): { qkv: string[]; o: string; gateUp: string[]; down: string } {
  const p = `model.layers.${layer}`;
  const packed = cfg?.packedProjections === true;
  return {
    qkv: packed ? [`${p}.self_attn.qkv_proj.weight`] : ['q', 'k', 'v'].map((x) => `${p}.self_attn.${x}_proj.weight`),
    o: `${p}.self_attn.o_proj.weight`,
    gateUp: packed ? [`${p}.mlp.gate_up_proj.weight`] : [`${p}.mlp.gate_proj.weight`, `${p}.mlp.up_proj.weight`],
    down: `${p}.mlp.down_proj.weight`,
  };
}

class FusedBuilder {
  readonly g: GraphBuilder;
  private readonly q4: Q4Source;

  constructor(
    readonly cfg: ModelConfig,
    readonly src: WeightSource,
    readonly opts: FusedGraphOptions,
    name: string,
  ) {
    // 64 bytes: every weight and table; shape and scalar constants stay initializers.
    this.g = new GraphBuilder(name, opts.weightsAsInputs ? { minBytes: 64 } : undefined);
    this.q4 = opts.q4 ?? quantizingSource(src);
  }

  vector(name: string, len: number): string {
    const w = this.src(name);
    expectShape(name, w, [len]);
    return this.g.initializer(name, ElemType.FLOAT, [len], (dst) => writeFloats(dst, w.data, ElemType.FLOAT));
  }

  /** x · Wᵀ through MatMulNBits for one HF [out, in] matrix (optional bias through the op's bias input). */
  nbits(x: string, name: string, inDim: number, outDim: number, label: string, bias?: string): string {
    const m = this.q4(name);
    if (m.n !== outDim || m.k !== inDim) throw new RangeError(`${name}: quantized [${m.n}, ${m.k}], expected [${outDim}, ${inDim}]`);
    const kb = q4BlocksPerRow(inDim);
    const g = this.g;
    const b = g.initializer(`${label}.q4`, ElemType.UINT8, [outDim, kb, Q4_BLOCK / 2], (dst) => dst.set(m.packed));
    const s = g.initializer(`${label}.scales`, ElemType.FLOAT, [outDim * kb], (dst) => writeFloats(dst, m.scales, ElemType.FLOAT));
    const zp = m.zeroPoints;
    const z = zp ? g.initializer(`${label}.zero_points`, ElemType.UINT8, [zp.length], (dst) => dst.set(zp)) : '';
    const inputs = bias ? [x, b, s, z, '', bias] : zp ? [x, b, s, z] : [x, b, s];
    return g.op1('MatMulNBits', inputs, { K: inDim, N: outDim, bits: 4, block_size: Q4_BLOCK, accuracy_level: 0 }, undefined, MS_DOMAIN);
  }

  /** x · Wᵀ as one f32 MatMul over HF [out, in] matrices stacked along out. */
  packedMatMul(x: string, names: string[], inDim: number, outDims: number[], label: string): string {
    const n = outDims.reduce((a, b) => a + b, 0);
    const ws = names.map((nm, i) => {
      const w = this.src(nm);
      expectShape(nm, w, [outDims[i]!, inDim]);
      return w;
    });
    // Transposed to [in, out] row by row, straight into the model bytes.
    const wt = this.g.initializer(`${label}.weight`, ElemType.FLOAT, [inDim, n], (dst) => {
      const row = new Float32Array(n);
      for (let i = 0; i < inDim; i++) {
        let o = 0;
        for (let p = 0; p < ws.length; p++) {
          const d = ws[p]!.data;
          const out = outDims[p]!;
          for (let r = 0; r < out; r++) row[o + r] = d[r * inDim + i]!;
          o += out;
        }
        writeFloats(dst, row, ElemType.FLOAT, i * n);
      }
    });
    return this.g.op1('MatMul', [x, wt]);
  }

  /** One projection in the graph's weight format. */
  linear(x: string, name: string, inDim: number, outDim: number, label: string): string {
    return this.opts.weights === 'q4' ? this.nbits(x, name, inDim, outDim, label) : this.packedMatMul(x, [name], inDim, [outDim], label);
  }

  /** One projection's bias as an initializer. */
  bias(name: string, len: number): string {
    return this.vector(name, len);
  }

  /** Concatenated q|k|v bias as one initializer (Qwen2 and attention_bias Llamas). */
  qkvBias(layer: number, sizes: number[]): string {
    const p = `model.layers.${layer}.self_attn`;
    const parts = ['q', 'k', 'v'].map((x, i) => {
      const w = this.src(`${p}.${x}_proj.bias`);
      expectShape(`${p}.${x}_proj.bias`, w, [sizes[i]!]);
      return w.data;
    });
    const total = sizes.reduce((a, b) => a + b, 0);
    return this.g.initializer(`${p}.qkv_proj.bias`, ElemType.FLOAT, [total], (dst) => {
      let off = 0;
      for (const d of parts) {
        writeFloats(dst, d, ElemType.FLOAT, off);
        off += d.length;
      }
    });
  }

  /**
   * Qwen3's per-head q_norm / k_norm before GQA's rotary: q and k as [1, seq, heads, D],
   * SimplifiedLayerNormalization over D, back to [1, seq, heads*D]; returns separate q, k, v.
   */
  qkNorm(layer: number, qkv: string[], sizes: number[]): string[] {
    const g = this.g;
    const p = `model.layers.${layer}.self_attn`;
    let [q, k, v] = qkv as [string, string, string];
    if (!k) [q, k, v] = g.op('Split', [q, g.constI64('qkv_split', sizes)], { axis: -1 }, 3) as [string, string, string];
    const D = this.cfg.headDim;
    const heads = g.constI64('shape_heads', [0, 0, -1, D]);
    const flat = g.constI64('shape_flat', [0, 0, -1]);
    const norm = (x: string, w: string) =>
      g.op1('Reshape', [g.op1('SimplifiedLayerNormalization', [g.op1('Reshape', [x, heads]), this.vector(w, D)], { axis: -1, epsilon: { float: this.cfg.rmsNormEps }, stash_type: 1 }), flat]);
    return [norm(q, `${p}.q_norm.weight`), norm(k, `${p}.k_norm.weight`), v];
  }

  /**
   * cos/sin caches [maxContext, rotaryDim/2] from the model's (possibly scaled) rotary frequencies,
   * times longrope's attention factor; with rotaryDim < headDim GQA rotates only the leading values.
   */
  rotaryCaches(): { cos: string; sin: string } {
    const inv = ropeInvFreq(this.cfg);
    const af = ropeAttentionFactor(this.cfg);
    const half = inv.length;
    const max = this.opts.maxContext;
    const table = (fn: (a: number) => number) => (dst: Uint8Array) => {
      const row = new Float32Array(half);
      for (let p = 0; p < max; p++) {
        for (let i = 0; i < half; i++) row[i] = fn(p * inv[i]!);
        writeFloats(dst, row, ElemType.FLOAT, p * half);
      }
    };
    return {
      cos: this.g.initializer('rotary.cos_cache', ElemType.FLOAT, [max, half], table((a) => Math.cos(a) * af)),
      sin: this.g.initializer('rotary.sin_cache', ElemType.FLOAT, [max, half], table((a) => Math.sin(a) * af)),
    };
  }
}

/** One graph running decoder layers [start, end) with fused operators. */
export function buildFusedLayersGraph(cfg: ModelConfig, src: WeightSource, start: number, end: number, opts: FusedGraphOptions): BuiltGraph {
  if (!(Number.isInteger(start) && Number.isInteger(end) && 0 <= start && start < end && end <= cfg.numLayers)) {
    throw new RangeError(`layer range [${start}, ${end}) is outside 0..${cfg.numLayers}`);
  }
  const why = fusedUnsupportedReason(cfg);
  if (why) throw new RangeError(`the fused graph does not support this model: ${why}`);
  if (!(Number.isInteger(opts.maxContext) && opts.maxContext > 0)) throw new RangeError(`maxContext ${opts.maxContext} is not a positive integer`);

  const b = new FusedBuilder(cfg, src, opts, `fused_${opts.weights}_${start}_${end}`);
  const g = b.g;
  const { hiddenSize: h, numHeads: H, numKvHeads: KV, headDim: D, intermediateSize: I } = cfg;
  const eps = { float: cfg.rmsNormEps };

  const x = g.input(FUSED_IO.hidden, ElemType.FLOAT, ['batch', 'seq', h]);
  const seqlensK = g.input(FUSED_IO.seqlensK, ElemType.INT32, ['batch']);
  const totalLen = g.input(FUSED_IO.totalSeqLen, ElemType.INT32, [1]);
  const { cos, sin } = b.rotaryCaches();

  let residual = x;
  let pending: string | null = null; // the last layer's MLP output, not yet added to the residual
  for (let l = start; l < end; l++) {
    const p = `model.layers.${l}`;
    const names = fusedProjectionNames(l, cfg);
    const packed = cfg.packedProjections;
    const wIn = b.vector(`${p}.input_layernorm.weight`, h);
    const wPost = b.vector(`${p}.post_attention_layernorm.weight`, h);

    let n1: string;
    if (pending === null) {
      n1 = g.op1('SimplifiedLayerNormalization', [residual, wIn], { axis: -1, epsilon: eps, stash_type: 1 });
    } else {
      const sum = g.fresh('residual');
      n1 = g.op('SkipSimplifiedLayerNormalization', [pending, residual, wIn], { epsilon: eps }, [g.fresh('norm'), '', '', sum], MS_DOMAIN)[0]!;
      residual = sum;
    }

    const qkvSizes = [H * D, KV * D, KV * D];
    const pastK = g.input(FUSED_IO.pastKey(l), ElemType.FLOAT, ['batch', KV, 'capacity', D]);
    const pastV = g.input(FUSED_IO.pastValue(l), ElemType.FLOAT, ['batch', KV, 'capacity', D]);
    const qkvTotal = (H + 2 * KV) * D;
    let qkvInputs: string[];
    if (opts.weights === 'q4' && packed) {
      // Phi-3's qkv_proj is one tensor: one MatMulNBits, GQA takes the packed rows.
      qkvInputs = [b.nbits(n1, names.qkv[0]!, h, qkvTotal, `${p}.self_attn.qkv_proj`), '', ''];
    } else if (opts.weights === 'q4') {
      // Separate projections off one norm: the shape onnxruntime's WebGPU fusions match (MatMulNBitsQkv).
      qkvInputs = names.qkv.map((nm, i) => {
        const bias = cfg.attentionBias ? b.bias(nm.replace(/weight$/, 'bias'), qkvSizes[i]!) : undefined;
        return b.nbits(n1, nm, h, qkvSizes[i]!, nm.replace(/\.weight$/, ''), bias);
      });
    } else {
      let qkv = b.packedMatMul(n1, names.qkv, h, packed ? [qkvTotal] : qkvSizes, `${p}.self_attn.qkv_proj`);
      if (cfg.attentionBias) qkv = g.op1('Add', [qkv, b.qkvBias(l, qkvSizes)]);
      qkvInputs = [qkv, '', ''];
    }
    if (cfg.qkNorm) qkvInputs = b.qkNorm(l, qkvInputs, qkvSizes);
    // Mistral / Phi-3: local_window_size = sliding_window, as onnxruntime-genai's builder sets it.
    // Measured on the CPU kernel (test/shard/architectures.test.ts): the query then sees `sliding_window` keys, itself
    // included, which is transformers' window; sliding_window - 1 would see one fewer.
    const window: Record<string, number> = cfg.slidingWindow !== null ? { local_window_size: cfg.slidingWindow } : {};
    const [attn] = g.op(
      'GroupQueryAttention',
      [...qkvInputs, pastK, pastV, seqlensK, totalLen, cos, sin],
      { num_heads: H, kv_num_heads: KV, do_rotary: 1, rotary_interleaved: 0, scale: { float: attentionScale(cfg) }, ...window },
      [g.fresh('attn'), FUSED_IO.presentKey(l), FUSED_IO.presentValue(l)],
      MS_DOMAIN,
    ) as [string];
    g.output(FUSED_IO.presentKey(l), ElemType.FLOAT, ['batch', KV, 'capacity', D]);
    g.output(FUSED_IO.presentValue(l), ElemType.FLOAT, ['batch', KV, 'capacity', D]);

    const o = b.linear(attn, names.o, H * D, h, `${p}.self_attn.o_proj`);
    const sum2 = g.fresh('residual');
    const n2 = g.op('SkipSimplifiedLayerNormalization', [o, residual, wPost], { epsilon: eps }, [g.fresh('norm'), '', '', sum2], MS_DOMAIN)[0]!;
    residual = sum2;

    let act: string;
    if (opts.weights === 'q4' && packed) {
      const gu = b.nbits(n2, names.gateUp[0]!, h, 2 * I, `${p}.mlp.gate_up_proj`);
      const [gate, up] = g.op('Split', [gu], { axis: -1 }, 2) as [string, string];
      act = g.op1('Mul', [g.op1('Mul', [gate, g.op1('Sigmoid', [gate])]), up]);
    } else if (opts.weights === 'q4') {
      // gate * sigmoid(gate) * up over separate projections: what MatMulNBitsMlp fuses (with the norm) on WebGPU.
      const gate = b.nbits(n2, names.gateUp[0]!, h, I, `${p}.mlp.gate_proj`);
      const up = b.nbits(n2, names.gateUp[1]!, h, I, `${p}.mlp.up_proj`);
      act = g.op1('Mul', [g.op1('Mul', [gate, g.op1('Sigmoid', [gate])]), up]);
    } else {
      const gu = b.packedMatMul(n2, names.gateUp, h, packed ? [2 * I] : [I, I], `${p}.mlp.gate_up_proj`);
      const [gate, up] = g.op('Split', [gu], { axis: -1 }, 2) as [string, string];
      act = g.op1('Mul', [g.op1('QuickGelu', [gate], { alpha: { float: 1 } }, undefined, MS_DOMAIN), up]);
    }
    pending = b.linear(act, names.down, I, h, `${p}.mlp.down_proj`);
  }
  g.op1('Add', [pending!, residual], {}, FUSED_IO.hiddenOut);
  g.output(FUSED_IO.hiddenOut, ElemType.FLOAT, ['batch', 'seq', h]);
  return { bytes: g.encode(), weightBytes: g.initializerBytes(), ...(opts.weightsAsInputs ? { externalWeights: g.externalWeights() } : {}) };
}

/** Weight bytes of one fused layer as the node will hold them (what the tracker sizes spans by). */
export function fusedLayerBytes(cfg: ModelConfig, weights: FusedWeights): number {
  const { hiddenSize: h, numHeads: H, numKvHeads: KV, headDim: D, intermediateSize: I } = cfg;
  const mats: [number, number][] = [
    [(H + 2 * KV) * D, h],
    [h, H * D],
    [2 * I, h],
    [h, I],
  ];
  const proj = mats.reduce((s, [n, k]) => s + (weights === 'f32' ? n * k * 4 : q4Bytes(n, k, FUSED_Q4_SCHEME)), 0);
  const bias = cfg.attentionBias ? (H + 2 * KV) * D * 4 : 0;
  const qkNorm = cfg.qkNorm ? 2 * D * 4 : 0;
  return proj + 2 * h * 4 + bias + qkNorm;
}

export const HEAD_IO = { hidden: 'hidden_states', logits: 'logits', greedyToken: 'greedy_token', greedyLogprob: 'greedy_logprob' } as const;

/**
 * Final norm + LM head over the last row only: hidden_states f32 [batch, seq,
 * hidden] → logits f32 [batch, vocab] (a batch: one row per session), and
 * each row's greedy token (int64 [batch]) with its log-probability (f32
 * [batch]). The row is picked inside the graph so a
 * device-resident activation never comes back to the CPU for slicing; the
 * head matrix is 4-bit when the span's projections are.
 */
export function buildLastRowHeadGraph(cfg: ModelConfig, src: WeightSource, opts: Omit<FusedGraphOptions, 'maxContext'>): BuiltGraph {
  const b = new FusedBuilder(cfg, src, { ...opts, maxContext: 1 }, `head_${opts.weights}`);
  const g = b.g;
  const x = g.input(HEAD_IO.hidden, ElemType.FLOAT, ['batch', 'seq', cfg.hiddenSize]);
  const last = g.op1('Gather', [x, g.constI64('last_row', [-1], [])], { axis: 1 }); // [batch, hidden]
  const n = g.op1('SimplifiedLayerNormalization', [last, b.vector(FINAL_NORM_TENSOR, cfg.hiddenSize)], { axis: -1, epsilon: { float: cfg.rmsNormEps }, stash_type: 1 });
  const head = cfg.tieWordEmbeddings ? EMBED_TENSOR : LM_HEAD_TENSOR;
  const logits = b.linear(n, head, cfg.hiddenSize, cfg.vocabSize, 'lm_head');
  g.op1('Identity', [logits], {}, HEAD_IO.logits);
  g.output(HEAD_IO.logits, ElemType.FLOAT, ['batch', cfg.vocabSize]);
  // Greedy decoding on the device: the token (first maximum, as sampling.ts breaks ties) and its
  // log-probability are all that must leave a GPU, 12 bytes a row instead of the vocabulary's logits.
  g.op1('ArgMax', [logits], { axis: -1, keepdims: 0, select_last_index: 0 }, HEAD_IO.greedyToken);
  g.output(HEAD_IO.greedyToken, ElemType.INT64, ['batch']);
  const max = g.op1('ReduceMax', [logits], { axes: [-1], keepdims: 0 });
  const lse = g.op1('ReduceLogSumExp', [logits], { axes: [-1], keepdims: 0 });
  g.op1('Sub', [max, lse], {}, HEAD_IO.greedyLogprob);
  g.output(HEAD_IO.greedyLogprob, ElemType.FLOAT, ['batch']);
  return { bytes: g.encode(), weightBytes: g.initializerBytes() };
}
