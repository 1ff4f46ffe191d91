/**
 * ONNX graphs of a Llama-family model: one graph per decoder-layer range
 * (a single layer is a range of one), the embedding, and final norm + LM head.
 *
 * Interface of a layer-range graph (names are what the executor feeds):
 *   hidden_states          f32 [batch, seq, hidden]
 *   rope_cos, rope_sin     f32 [batch, seq, 1, headDim]   (see rope.ts: signed sin; partial rotary uses the first rotaryDim)
 *   attention_mask         f32 [batch, 1, groups*seq, past+seq] additive, 0 or a large negative
 *   past_key_values.N.key/value   [batch, past, kvHeads, headDim]  (f32, or f16 in the f16 variant)
 * out:
 *   hidden_states_out      f32 [batch, seq, hidden]
 *   present.N.key/value    [batch, seq, kvHeads, headDim] — only this call's rows
 *
 * A lone call has batch 1. `batch` lets several sessions' one-token steps
 * run as one call with their pasts padded to the longest (packed-batch.ts):
 * each row then attends over its own past only, not over every session's.
 *
 * The KV layout is position-major so the valid prefix of a preallocated
 * cache is one contiguous subarray: the executor hands ORT a zero-copy view
 * of exactly `past` rows and writes the returned rows in place after them.
 * Attention therefore costs O(past) per step, never O(maxContext).
 *
 * No int64 shape arithmetic at run time: every Reshape uses a constant shape
 * with 0/-1, and the sizes that vary (seq, past) reach the graph only as the
 * dims of the inputs. Rotary tables and the mask are inputs computed once per
 * call by the executor and shared by all layers.
 *
 * The f16 variant (for WebGPU with shader-f16) stores weights and the KV
 * cache in f16 and runs matmuls/attention in f16, but keeps the residual
 * stream and RMSNorm in f32: Pow(x,2) of a residual above 256 overflows f16.
 */
import type { ModelConfig } from './config.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR, expectedTensorShape, projectionRows } from './config.ts';
import { attentionScale, ropeAttentionFactor } from './rope.ts';
import { ElemType, GraphBuilder, writeFloats, type ElemTypeId, type Initializer } from './onnx-builder.ts';

export interface WeightTensor {
  readonly shape: readonly number[];
  readonly data: Float32Array;
}
/** Looks a tensor up by its Hugging Face name; throws when absent. */
export type WeightSource = (name: string) => WeightTensor;

export type GraphDtype = 'f32' | 'f16';

export const IO = {
  hidden: 'hidden_states',
  hiddenOut: 'hidden_states_out',
  ropeCos: 'rope_cos',
  ropeSin: 'rope_sin',
  mask: 'attention_mask',
  inputIds: 'input_ids',
  logits: 'logits',
  pastKey: (layer: number) => `past_key_values.${layer}.key`,
  pastValue: (layer: number) => `past_key_values.${layer}.value`,
  presentKey: (layer: number) => `present.${layer}.key`,
  presentValue: (layer: number) => `present.${layer}.value`,
} as const;

/** Additive mask value: f16 cannot hold -1e9 (it would become -inf, and -inf - -inf is NaN in a fully masked row). */
export function maskValue(dtype: GraphDtype): number {
  return dtype === 'f16' ? -1e4 : -1e9;
}

export interface BuiltGraph {
  bytes: Uint8Array;
  /** Bytes of weights the graph carries as initializers (or takes as inputs, below). */
  weightBytes: number;
  /** Weights the graph takes as inputs (FusedGraphOptions.weightsAsInputs): the caller feeds them. */
  externalWeights?: readonly Initializer[];
}

function wt(dtype: GraphDtype): ElemTypeId {
  return dtype === 'f16' ? ElemType.FLOAT16 : ElemType.FLOAT;
}

function expectShape(name: string, w: WeightTensor, shape: number[]): void {
  if (w.shape.length !== shape.length || w.shape.some((d, i) => d !== shape[i])) {
    throw new RangeError(`${name}: shape [${w.shape.join(',')}], expected [${shape.join(',')}]`);
  }
  if (w.data.length !== shape.reduce((a, b) => a * b, 1)) throw new RangeError(`${name}: ${w.data.length} values for shape [${shape.join(',')}]`);
}

/** An HF [out,in] matrix as a MatMul right operand [in,out], transposed row by row into the model bytes. */
function addMatmulWeight(g: GraphBuilder, src: WeightSource, name: string, outDim: number, inDim: number, dtype: GraphDtype, scale = 1): string {
  return addMatmulRows(g, src, name, { row: 0, rows: outDim, total: outDim }, inDim, dtype, scale, name);
}

/**
 * Rows [row, row+rows) of an HF [total, in] matrix as a MatMul operand [in, rows]:
 * how Phi-3's packed qkv_proj / gate_up_proj become separate q, k, v, gate, up weights.
 */
function addMatmulRows(
  g: GraphBuilder,
  src: WeightSource,
  name: string,
  r: { row: number; rows: number; total: number },
  inDim: number,
  dtype: GraphDtype,
  scale: number,
  label: string,
): string {
  const w = src(name);
  expectShape(name, w, [r.total, inDim]);
  const et = wt(dtype);
  const outDim = r.rows;
  return g.initializer(label, et, [inDim, outDim], (dst) => {
    const row = new Float32Array(outDim);
    const data = w.data;
    for (let i = 0; i < inDim; i++) {
      for (let o = 0; o < outDim; o++) row[o] = data[(r.row + o) * inDim + i]! * scale;
      writeFloats(dst, row, et, i * outDim);
    }
  });
}

/** One of a layer's q/k/v/gate/up projections, from its own tensor or a packed one. */
function addProjection(g: GraphBuilder, src: WeightSource, cfg: ModelConfig, layer: number, which: 'q' | 'k' | 'v' | 'gate' | 'up', dtype: GraphDtype, scale = 1): string {
  const pr = projectionRows(cfg, layer, which);
  const [total, inDim] = expectedTensorShape(cfg, pr.tensor)!;
  const label = cfg.packedProjections ? `${pr.tensor.replace(/(qkv|gate_up)_proj\.weight$/, `${which}_proj.weight`)}` : pr.tensor;
  return addMatmulRows(g, src, pr.tensor, { row: pr.row, rows: pr.rows, total: total! }, inDim!, dtype, scale, label);
}

function addVector(g: GraphBuilder, src: WeightSource, name: string, len: number, et: ElemTypeId, scale = 1): string {
  const w = src(name);
  expectShape(name, w, [len]);
  return g.initializer(name, et, [len], (dst) => writeFloats(dst, scale === 1 ? w.data : w.data.map((v) => v * scale), et));
}

/** RMSNorm as Pow → ReduceMean → Add → Sqrt → Div → Mul, the shape ORT fuses into SimplifiedLayerNormalization. */
function rmsNorm(g: GraphBuilder, x: string, weight: string, eps: string): string {
  const two = g.constF('two', [2]);
  const sq = g.op1('Pow', [x, two]);
  const mean = g.op1('ReduceMean', [sq], { axes: [-1], keepdims: 1 });
  const std = g.op1('Sqrt', [g.op1('Add', [mean, eps])]);
  return g.op1('Mul', [g.op1('Div', [x, std]), weight]);
}

function linear(g: GraphBuilder, x: string, w: string, bias?: string): string {
  const y = g.op1('MatMul', [x, w]);
  return bias ? g.op1('Add', [y, bias]) : y;
}

/** x*cos + swapHalves(x)*sinSigned over the last axis. */
function rope(g: GraphBuilder, x: string, cos: string, sin: string): string {
  const [a, b] = g.op('Split', [x], { axis: -1 }, 2) as [string, string];
  const swapped = g.op1('Concat', [b, a], { axis: -1 });
  return g.op1('Add', [g.op1('Mul', [x, cos]), g.op1('Mul', [swapped, sin])]);
}

/** RoPE on the first `rotaryDim` of `headDim` values (partial rotary), the rest passed through. */
function partialRope(g: GraphBuilder, x: string, cos: string, sin: string, rotaryDim: number, headDim: number): string {
  if (rotaryDim === headDim) return rope(g, x, cos, sin);
  const [rot, pass] = g.op('Split', [x, g.constI64('rotary_split', [rotaryDim, headDim - rotaryDim])], { axis: -1 }, 2) as [string, string];
  return g.op1('Concat', [rope(g, rot, cos, sin), pass], { axis: -1 });
}

export interface LayerGraphOptions {
  dtype?: GraphDtype;
}

/** One graph running decoder layers [start, end) in sequence. */
export function buildLayersGraph(cfg: ModelConfig, src: WeightSource, start: number, end: number, opts: LayerGraphOptions = {}): BuiltGraph {
  if (!(Number.isInteger(start) && Number.isInteger(end) && 0 <= start && start < end && end <= cfg.numLayers)) {
    throw new RangeError(`layer range [${start}, ${end}) is outside 0..${cfg.numLayers}`);
  }
  const dtype = opts.dtype ?? 'f32';
  const et = wt(dtype);
  const f16 = dtype === 'f16';
  const { hiddenSize: h, numHeads: H, numKvHeads: KV, headDim: D, intermediateSize: I } = cfg;
  const groups = H / KV;

  const g = new GraphBuilder(`layers_${start}_${end}`);
  let x = g.input(IO.hidden, ElemType.FLOAT, ['batch', 'seq', h]);
  const R = cfg.rotaryDim;
  let cos = g.input(IO.ropeCos, ElemType.FLOAT, ['batch', 'seq', 1, D]);
  let sin = g.input(IO.ropeSin, ElemType.FLOAT, ['batch', 'seq', 1, D]);
  if (R < D) {
    // Partial rotary: the tables' rows are headDim wide with the rotated half-pairs first (rope.ts).
    const slice = (t: string) => g.op1('Slice', [t, g.constI64('rot_start', [0]), g.constI64('rot_end', [R]), g.constI64('rot_axis', [-1])]);
    cos = slice(cos);
    sin = slice(sin);
  }
  const af = ropeAttentionFactor(cfg);
  if (af !== 1) {
    // longrope's attention factor on cos and sin, as transformers applies it.
    const f = g.constF('rope_factor', [af]);
    cos = g.op1('Mul', [cos, f]);
    sin = g.op1('Mul', [sin, f]);
  }
  // [batch, 1, …]: one mask per batch row, broadcast over the KV heads.
  let mask = g.input(IO.mask, ElemType.FLOAT, ['batch', 1, 'groups_seq', 'total']);
  if (f16) {
    cos = g.op1('Cast', [cos], { to: ElemType.FLOAT16 });
    sin = g.op1('Cast', [sin], { to: ElemType.FLOAT16 });
    mask = g.op1('Cast', [mask], { to: ElemType.FLOAT16 });
  }
  const eps = g.constF('eps', [cfg.rmsNormEps]);
  const toCompute = (v: string) => (f16 ? g.op1('Cast', [v], { to: ElemType.FLOAT16 }) : v);
  const toResidual = (v: string) => (f16 ? g.op1('Cast', [v], { to: ElemType.FLOAT }) : v);
  const shapeHeads = g.constI64('shape_heads', [0, 0, H, D]);
  const shapeKv = g.constI64('shape_kv', [0, 0, KV, D]);
  const shapeGroups = g.constI64('shape_groups', [0, 0, KV, groups, D]);
  const shapeRows = g.constI64('shape_rows', [0, 0, -1, D]);
  const shapeSplitRows = g.constI64('shape_split_rows', [0, 0, groups, -1, D]);
  const shapeMerge = g.constI64('shape_merge', [0, 0, -1]);
  // 1/sqrt(headDim) folded into q_proj: RoPE is linear, so scaling before it is exact and free at
  // run time. Qwen3 normalizes q after the projection, which would undo the scale there: it goes
  // into q_norm's weight instead. (longrope's attention factor multiplies cos/sin above.)
  const qScale = attentionScale(cfg);
  const shapeQkHeads = cfg.qkNorm ? g.constI64('shape_qk_heads', [0, 0, -1, D]) : '';

  for (let l = start; l < end; l++) {
    const p = `model.layers.${l}`;
    const wIn = addVector(g, src, `${p}.input_layernorm.weight`, h, ElemType.FLOAT);
    const wPost = addVector(g, src, `${p}.post_attention_layernorm.weight`, h, ElemType.FLOAT);
    const wq = addProjection(g, src, cfg, l, 'q', dtype, cfg.qkNorm ? 1 : qScale);
    const wk = addProjection(g, src, cfg, l, 'k', dtype);
    const wv = addProjection(g, src, cfg, l, 'v', dtype);
    const wo = addMatmulWeight(g, src, `${p}.self_attn.o_proj.weight`, h, H * D, dtype);
    const wg = addProjection(g, src, cfg, l, 'gate', dtype);
    const wu = addProjection(g, src, cfg, l, 'up', dtype);
    const wd = addMatmulWeight(g, src, `${p}.mlp.down_proj.weight`, h, I, dtype);
    const bq = cfg.attentionBias ? addVector(g, src, `${p}.self_attn.q_proj.bias`, H * D, et, qScale) : undefined;
    const bk = cfg.attentionBias ? addVector(g, src, `${p}.self_attn.k_proj.bias`, KV * D, et) : undefined;
    const bv = cfg.attentionBias ? addVector(g, src, `${p}.self_attn.v_proj.bias`, KV * D, et) : undefined;
    const pastK = g.input(IO.pastKey(l), et, ['batch', 'past', KV, D]);
    const pastV = g.input(IO.pastValue(l), et, ['batch', 'past', KV, D]);

    const n1 = toCompute(rmsNorm(g, x, wIn, eps));
    let q = g.op1('Reshape', [linear(g, n1, wq, bq), shapeHeads]);
    let k = g.op1('Reshape', [linear(g, n1, wk, bk), shapeKv]);
    if (cfg.qkNorm) {
      // Qwen3: RMSNorm of each head over head_dim (in f32, like the residual norms), then RoPE.
      const wqn = addVector(g, src, `${p}.self_attn.q_norm.weight`, D, ElemType.FLOAT, qScale);
      const wkn = addVector(g, src, `${p}.self_attn.k_norm.weight`, D, ElemType.FLOAT);
      q = g.op1('Reshape', [toCompute(rmsNorm(g, toResidual(q), wqn, eps)), shapeQkHeads]);
      k = g.op1('Reshape', [toCompute(rmsNorm(g, toResidual(k), wkn, eps)), shapeQkHeads]);
    }
    g.op1('Reshape', [linear(g, n1, wv, bv), shapeKv], {}, IO.presentValue(l));
    const qr = partialRope(g, q, cos, sin, R, D);
    g.op1('Identity', [partialRope(g, k, cos, sin, R, D)], {}, IO.presentKey(l));

    const kAll = g.op1('Concat', [pastK, IO.presentKey(l)], { axis: 1 });
    const vAll = g.op1('Concat', [pastV, IO.presentValue(l)], { axis: 1 });
    const kT = g.op1('Transpose', [kAll], { perm: [0, 2, 3, 1] }); // [batch, KV, D, total]
    const vT = g.op1('Transpose', [vAll], { perm: [0, 2, 1, 3] }); // [batch, KV, total, D]
    // GQA without repeating K/V: the query heads sharing a KV head become extra rows of one matmul.
    const qG = g.op1('Transpose', [g.op1('Reshape', [qr, shapeGroups])], { perm: [0, 2, 3, 1, 4] }); // [batch, KV, groups, seq, D]
    const qRows = g.op1('Reshape', [qG, shapeRows]); // [batch, KV, groups*seq, D]
    const scores = g.op1('Add', [g.op1('MatMul', [qRows, kT]), mask]);
    const probs = g.op1('Softmax', [scores], { axis: -1 });
    const ctx = g.op1('MatMul', [probs, vT]); // [batch, KV, groups*seq, D]
    const ctxT = g.op1('Transpose', [g.op1('Reshape', [ctx, shapeSplitRows])], { perm: [0, 3, 1, 2, 4] }); // [batch, seq, KV, groups, D]
    const attn = g.op1('MatMul', [g.op1('Reshape', [ctxT, shapeMerge]), wo]);
    const x2 = g.op1('Add', [x, toResidual(attn)]);

    const n2 = toCompute(rmsNorm(g, x2, wPost, eps));
    const gate = g.op1('MatMul', [n2, wg]);
    const act = g.op1('Mul', [g.op1('Mul', [gate, g.op1('Sigmoid', [gate])]), g.op1('MatMul', [n2, wu])]);
    const down = g.op1('MatMul', [act, wd]);
    x = g.op1('Add', [x2, toResidual(down)], {}, l === end - 1 ? IO.hiddenOut : undefined);

    g.output(IO.presentKey(l), et, ['batch', 'seq', KV, D]);
    g.output(IO.presentValue(l), et, ['batch', 'seq', KV, D]);
  }
  g.output(IO.hiddenOut, ElemType.FLOAT, ['batch', 'seq', h]);
  const weightBytes = g.initializerBytes();
  return { bytes: g.encode(), weightBytes };
}

/** input_ids int64 [1, seq] → hidden_states_out f32 [1, seq, hidden]. */
export function buildEmbedGraph(cfg: ModelConfig, src: WeightSource, opts: LayerGraphOptions = {}): BuiltGraph {
  const dtype = opts.dtype ?? 'f32';
  const et = wt(dtype);
  const g = new GraphBuilder('embed');
  // 'batch': the fused executor embeds B sessions' tokens as [B, 1] (fused-batch.ts); the plain graphs pass [1, seq].
  const ids = g.input(IO.inputIds, ElemType.INT64, ['batch', 'seq']);
  const w = src(EMBED_TENSOR);
  expectShape(EMBED_TENSOR, w, [cfg.vocabSize, cfg.hiddenSize]);
  const table = g.initializer(EMBED_TENSOR, et, [cfg.vocabSize, cfg.hiddenSize], (dst) => writeFloats(dst, w.data, et));
  const rows = g.op1('Gather', [table, ids], { axis: 0 }, dtype === 'f16' ? undefined : IO.hiddenOut);
  if (dtype === 'f16') g.op1('Cast', [rows], { to: ElemType.FLOAT }, IO.hiddenOut);
  g.output(IO.hiddenOut, ElemType.FLOAT, ['batch', 'seq', cfg.hiddenSize]);
  return { weightBytes: g.initializerBytes(), bytes: g.encode() };
}

/** hidden_states f32 [1, seq, hidden] → logits f32 [1, seq, vocab]; tied models read the embedding matrix. */
export function buildHeadGraph(cfg: ModelConfig, src: WeightSource, opts: LayerGraphOptions = {}): BuiltGraph {
  const dtype = opts.dtype ?? 'f32';
  const g = new GraphBuilder('lm_head');
  const x = g.input(IO.hidden, ElemType.FLOAT, [1, 'seq', cfg.hiddenSize]);
  const eps = g.constF('eps', [cfg.rmsNormEps]);
  const wNorm = addVector(g, src, FINAL_NORM_TENSOR, cfg.hiddenSize, ElemType.FLOAT);
  let n = rmsNorm(g, x, wNorm, eps);
  if (dtype === 'f16') n = g.op1('Cast', [n], { to: ElemType.FLOAT16 });
  const headName = cfg.tieWordEmbeddings ? EMBED_TENSOR : LM_HEAD_TENSOR;
  const w = addMatmulWeight(g, src, headName, cfg.vocabSize, cfg.hiddenSize, dtype);
  const logits = g.op1('MatMul', [n, w], {}, dtype === 'f16' ? undefined : IO.logits);
  if (dtype === 'f16') g.op1('Cast', [logits], { to: ElemType.FLOAT }, IO.logits);
  g.output(IO.logits, ElemType.FLOAT, [1, 'seq', cfg.vocabSize]);
  return { weightBytes: g.initializerBytes(), bytes: g.encode() };
}
