/**
 * Hugging Face `config.json` of the decoder-only families the mesh runs
 * (Llama 3.x, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Phi-3/3.5). Every field the
 * graph builders rely on is resolved here, with the same defaults
 * transformers applies, so nothing downstream reads raw JSON; anything a
 * builder cannot express is refused here, naming what is supported.
 */
import { z } from 'zod';
import { ModelFormatError } from './errors.ts';

/** transformers `_compute_llama3_parameters` (modeling_rope_utils.py). */
export interface Llama3RopeScaling {
  type: 'llama3';
  factor: number;
  lowFreqFactor: number;
  highFreqFactor: number;
  originalMaxPositionEmbeddings: number;
}

/**
 * transformers `_compute_longrope_parameters` (modeling_rope_utils.py), as
 * Phi-3/3.5 use it: inv_freq[i] = 1 / (ext[i] * theta^(2i/d)) with ext the
 * short factors while the sequence stays within
 * original_max_position_embeddings (the long ones past it), and cos/sin
 * multiplied by `attentionFactor` = sqrt(1 + ln(f) / ln(original)),
 * f = max_position_embeddings / original_max_position_embeddings.
 * We serve only the short-factor regime: the context is capped at
 * original_max_position_embeddings (see `maxPositionEmbeddings`).
 */
export interface LongRopeScaling {
  type: 'longrope';
  shortFactor: number[];
  longFactor: number[];
  originalMaxPositionEmbeddings: number;
  attentionFactor: number;
}

export type RopeScaling = Llama3RopeScaling | LongRopeScaling;

export type Architecture = 'llama' | 'qwen2' | 'qwen3' | 'mistral' | 'phi3';

export interface ModelConfig {
  architecture: Architecture;
  vocabSize: number;
  hiddenSize: number;
  intermediateSize: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  /** Leading values of each head that RoPE rotates: headDim × partial_rotary_factor (Phi-4-mini 0.75), else headDim. */
  rotaryDim: number;
  rmsNormEps: number;
  ropeTheta: number;
  ropeScaling: RopeScaling | null;
  /**
   * Positions the mesh serves. The config's own value, except for longrope
   * (Phi-3.5), where it is original_max_position_embeddings: past it
   * transformers switches every position to the long factors, which the
   * cached keys (rotated with the short ones) cannot follow.
   */
  maxPositionEmbeddings: number;
  tieWordEmbeddings: boolean;
  /** q/k/v projections carry a bias (Qwen2/2.5, always; o_proj never). */
  attentionBias: boolean;
  /** Qwen3: per-head RMSNorm of q and k over head_dim (q_norm, k_norm), before RoPE. */
  qkNorm: boolean;
  /** Phi-3: q|k|v in one `qkv_proj` and gate|up in one `gate_up_proj` tensor. */
  packedProjections: boolean;
  /**
   * Mistral / Phi-3 sliding-window attention: a query at position i sees keys
   * at positions j with i - j < slidingWindow (transformers'
   * `sliding_window_overlay`: kv_idx > q_idx - sliding_window). null: full causal.
   */
  slidingWindow: number | null;
  bosTokenId: number | null;
  eosTokenIds: number[];
  torchDtype: string;
}

export const EMBED_TENSOR = 'model.embed_tokens.weight';
export const FINAL_NORM_TENSOR = 'model.norm.weight';
export const LM_HEAD_TENSOR = 'lm_head.weight';

const ARCHITECTURES: Record<string, Architecture> = {
  LlamaForCausalLM: 'llama',
  MistralForCausalLM: 'mistral',
  Qwen2ForCausalLM: 'qwen2',
  Qwen3ForCausalLM: 'qwen3',
  Phi3ForCausalLM: 'phi3',
};
/** `model_type` of each architecture (SmolLM2 is model_type llama). */
const MODEL_TYPES: Record<string, Architecture> = { llama: 'llama', mistral: 'mistral', qwen2: 'qwen2', qwen3: 'qwen3', phi3: 'phi3' };
const ROPE_TYPES = ['default', 'llama3', 'longrope'];

const posInt = z.number().int().positive();
const tokenId = z.number().int().nonnegative();

// Unknown keys pass through: real configs carry dozens we do not need.
const RopeScalingSchema = z
  .object({
    rope_type: z.string().optional(),
    type: z.string().optional(),
    factor: z.number().positive().optional(),
    low_freq_factor: z.number().positive().optional(),
    high_freq_factor: z.number().positive().optional(),
    original_max_position_embeddings: posInt.optional(),
    short_factor: z.array(z.number().positive()).optional(),
    long_factor: z.array(z.number().positive()).optional(),
    attention_factor: z.number().positive().nullable().optional(),
  })
  .nullable()
  .optional();

const ConfigSchema = z.object({
  architectures: z.array(z.string()).min(1),
  model_type: z.string().optional(),
  vocab_size: posInt,
  hidden_size: posInt,
  intermediate_size: posInt,
  num_hidden_layers: posInt,
  num_attention_heads: posInt,
  num_key_value_heads: posInt.nullable().optional(),
  head_dim: posInt.nullable().optional(),
  rms_norm_eps: z.number().positive(),
  rope_theta: z.number().positive().optional(),
  rope_scaling: RopeScalingSchema,
  partial_rotary_factor: z.number().positive().max(1).optional(),
  max_position_embeddings: posInt,
  original_max_position_embeddings: posInt.optional(),
  sliding_window: posInt.nullable().optional(),
  use_sliding_window: z.boolean().optional(),
  tie_word_embeddings: z.boolean().optional(),
  attention_bias: z.boolean().optional(),
  mlp_bias: z.boolean().optional(),
  hidden_act: z.string().optional(),
  bos_token_id: tokenId.nullable().optional(),
  eos_token_id: z.union([tokenId, z.array(tokenId)]).nullable().optional(),
  torch_dtype: z.string().nullable().optional(),
  dtype: z.string().nullable().optional(),
});

function fail(file: string, message: string): never {
  throw new ModelFormatError(file, message);
}

/** What this build serves, for refusal messages and docs. */
export const SUPPORTED = {
  architectures: Object.keys(ARCHITECTURES),
  modelTypes: Object.keys(MODEL_TYPES),
  ropeTypes: ROPE_TYPES,
} as const;

function ropeScalingOf(c: z.infer<typeof ConfigSchema>, rotaryDim: number, file: string): RopeScaling | null {
  const r = c.rope_scaling;
  if (!r) return null;
  let kind = r.rope_type ?? r.type;
  // Early Phi-3 checkpoints name longrope "su" (transformers maps it the same way).
  if (kind === 'su') kind = 'longrope';
  if (kind === 'default' || kind === undefined) return null;
  if (kind === 'llama3') {
    if (r.factor === undefined || r.low_freq_factor === undefined || r.high_freq_factor === undefined || r.original_max_position_embeddings === undefined) {
      fail(file, 'field "rope_scaling": llama3 scaling needs factor, low_freq_factor, high_freq_factor, original_max_position_embeddings');
    }
    if (r.high_freq_factor <= r.low_freq_factor) fail(file, 'field "rope_scaling.high_freq_factor": must exceed low_freq_factor');
    return {
      type: 'llama3',
      factor: r.factor,
      lowFreqFactor: r.low_freq_factor,
      highFreqFactor: r.high_freq_factor,
      originalMaxPositionEmbeddings: r.original_max_position_embeddings,
    };
  }
  if (kind === 'longrope') {
    const half = rotaryDim / 2;
    if (!r.short_factor || !r.long_factor) fail(file, 'field "rope_scaling": longrope scaling needs short_factor and long_factor');
    if (r.short_factor.length !== half || r.long_factor.length !== half) {
      fail(file, `field "rope_scaling": longrope factors must have rotary dim/2 = ${half} entries (short ${r.short_factor.length}, long ${r.long_factor.length})`);
    }
    // As transformers: the top-level original_max_position_embeddings (Phi-3) sets the
    // factor from the ratio of the two lengths; without it, `factor` is used and the
    // original length is max_position_embeddings.
    const original = c.original_max_position_embeddings ?? r.original_max_position_embeddings ?? c.max_position_embeddings;
    const factor = c.original_max_position_embeddings !== undefined ? c.max_position_embeddings / c.original_max_position_embeddings : (r.factor ?? 1);
    const attentionFactor = r.attention_factor ?? (factor <= 1 ? 1 : Math.sqrt(1 + Math.log(factor) / Math.log(original)));
    return { type: 'longrope', shortFactor: [...r.short_factor], longFactor: [...r.long_factor], originalMaxPositionEmbeddings: original, attentionFactor };
  }
  fail(file, `field "rope_scaling.rope_type": "${kind}" is not supported (supported: ${ROPE_TYPES.join(', ')})`);
}

/**
 * Configs saved by transformers 5 carry `rope_parameters` ({rope_type, rope_theta, factor, ...})
 * instead of `rope_theta` + `rope_scaling`: mapped onto the older keys, which win when both exist.
 */
function withRopeParameters(json: Record<string, unknown>, file: string): Record<string, unknown> {
  const rp = json.rope_parameters;
  if (rp === undefined || rp === null) return json;
  if (typeof rp !== 'object' || Array.isArray(rp) || !('rope_type' in rp || 'rope_theta' in rp)) {
    fail(file, 'field "rope_parameters": per-layer-type rotary parameters are not supported');
  }
  const { rope_theta: theta, ...scaling } = rp as Record<string, unknown>;
  const out = { ...json };
  if (out.rope_theta === undefined && theta !== undefined) out.rope_theta = theta;
  if (out.rope_scaling === undefined || out.rope_scaling === null) out.rope_scaling = scaling.rope_type === 'default' ? null : scaling;
  return out;
}

export function parseModelConfig(json: unknown, file = 'config.json'): ModelConfig {
  if (typeof json !== 'object' || json === null || Array.isArray(json)) fail(file, 'not a JSON object');
  const raw = json as { architectures?: unknown; model_type?: unknown };
  const archs = raw.architectures;
  // Checked before the schema so an unsupported model gets that message, not a field complaint.
  if (typeof raw.model_type === 'string' && !(raw.model_type in MODEL_TYPES)) {
    fail(file, `unsupported model_type "${raw.model_type}" (supported: ${SUPPORTED.modelTypes.join(', ')})`);
  }
  if (Array.isArray(archs) && typeof archs[0] === 'string' && !(archs[0] in ARCHITECTURES)) {
    fail(file, `unsupported architecture "${archs[0]}" (supported: ${SUPPORTED.architectures.join(', ')})`);
  }
  const parsed = ConfigSchema.safeParse(withRopeParameters(json as Record<string, unknown>, file));
  if (!parsed.success) {
    const issue = parsed.error.issues[0]!;
    fail(file, `field "${issue.path.join('.') || '(root)'}": ${issue.message}`);
  }
  const c = parsed.data;
  const architecture = ARCHITECTURES[c.architectures[0]!]!;
  if (c.model_type !== undefined && MODEL_TYPES[c.model_type] !== architecture) {
    fail(file, `model_type "${c.model_type}" does not match architecture ${c.architectures[0]}`);
  }

  if (c.hidden_act !== undefined && c.hidden_act !== 'silu') fail(file, `field "hidden_act": "${c.hidden_act}" is not supported (only silu)`);
  if (c.mlp_bias === true) fail(file, 'field "mlp_bias": MLP biases are not supported');
  // In transformers attention_bias puts a bias on o_proj too (Llama, Qwen3), which no published
  // checkpoint of these families uses; Qwen2's q/k/v-only biases are what the graphs carry.
  if (architecture !== 'qwen2' && c.attention_bias === true) fail(file, 'field "attention_bias": attention biases are supported only as Qwen2\'s q/k/v biases');

  const numHeads = c.num_attention_heads;
  const numKvHeads = c.num_key_value_heads ?? numHeads;
  if (numHeads % numKvHeads !== 0) fail(file, `field "num_key_value_heads": ${numKvHeads} does not divide num_attention_heads ${numHeads}`);
  // Qwen3 and Mistral-Nemo style configs decouple head_dim from hidden_size / heads.
  let headDim = c.head_dim ?? null;
  if (headDim === null) {
    if (c.hidden_size % numHeads !== 0) fail(file, `field "num_attention_heads": ${numHeads} does not divide hidden_size ${c.hidden_size}`);
    headDim = c.hidden_size / numHeads;
  }
  if (headDim % 2 !== 0) fail(file, `field "head_dim": ${headDim} must be even for rotary embeddings`);
  // transformers: dim = int(head_dim * partial_rotary_factor); only the first `dim` values of each head rotate.
  const rotaryDim = Math.floor(headDim * (c.partial_rotary_factor ?? 1));
  if (rotaryDim % 2 !== 0 || rotaryDim < 2) fail(file, `field "partial_rotary_factor": rotates ${rotaryDim} of head_dim ${headDim}, which must be even and at least 2`);

  const ropeScaling = ropeScalingOf(c, rotaryDim, file);
  // Qwen2/Qwen3 carry sliding_window but apply it only with use_sliding_window (and then per layer
  // from max_window_layers on): that mode is refused rather than half-done.
  let slidingWindow: number | null = null;
  if (architecture === 'qwen2' || architecture === 'qwen3') {
    if (c.use_sliding_window === true) fail(file, 'field "use_sliding_window": Qwen sliding-window attention is not supported');
  } else if (architecture === 'mistral' || architecture === 'phi3') slidingWindow = c.sliding_window ?? null;

  const eos = c.eos_token_id;
  return {
    architecture,
    vocabSize: c.vocab_size,
    hiddenSize: c.hidden_size,
    intermediateSize: c.intermediate_size,
    numLayers: c.num_hidden_layers,
    numHeads,
    numKvHeads,
    headDim,
    rotaryDim,
    rmsNormEps: c.rms_norm_eps,
    ropeTheta: c.rope_theta ?? 10000,
    ropeScaling,
    maxPositionEmbeddings: ropeScaling?.type === 'longrope' ? Math.min(c.max_position_embeddings, ropeScaling.originalMaxPositionEmbeddings) : c.max_position_embeddings,
    // LlamaConfig, Qwen2Config, MistralConfig and Phi3Config default to untied; Qwen3Config too.
    tieWordEmbeddings: c.tie_word_embeddings ?? false,
    attentionBias: architecture === 'qwen2',
    qkNorm: architecture === 'qwen3',
    packedProjections: architecture === 'phi3',
    slidingWindow,
    bosTokenId: c.bos_token_id ?? null,
    eosTokenIds: eos === undefined || eos === null ? [] : Array.isArray(eos) ? eos : [eos],
    torchDtype: c.torch_dtype ?? c.dtype ?? 'float32',
  };
}

/** HF tensor names of one decoder layer, in execution order. */
export function layerTensorNames(cfg: ModelConfig, layer: number): string[] {
  if (!Number.isInteger(layer) || layer < 0 || layer >= cfg.numLayers) {
    throw new RangeError(`layer ${layer} is outside 0..${cfg.numLayers - 1}`);
  }
  const p = `model.layers.${layer}`;
  const names = [`${p}.input_layernorm.weight`];
  if (cfg.packedProjections) names.push(`${p}.self_attn.qkv_proj.weight`);
  else {
    for (const x of ['q', 'k', 'v']) {
      names.push(`${p}.self_attn.${x}_proj.weight`);
      if (cfg.attentionBias) names.push(`${p}.self_attn.${x}_proj.bias`);
    }
  }
  if (cfg.qkNorm) names.push(`${p}.self_attn.q_norm.weight`, `${p}.self_attn.k_norm.weight`);
  names.push(`${p}.self_attn.o_proj.weight`, `${p}.post_attention_layernorm.weight`);
  if (cfg.packedProjections) names.push(`${p}.mlp.gate_up_proj.weight`, `${p}.mlp.down_proj.weight`);
  else for (const x of ['gate', 'up', 'down']) names.push(`${p}.mlp.${x}_proj.weight`);
  return names;
}

/** The HF shape of each tensor a checkpoint of `cfg` must hold ([out, in] for projections). */
export function expectedTensorShape(cfg: ModelConfig, name: string): number[] | null {
  const h = cfg.hiddenSize;
  const q = cfg.numHeads * cfg.headDim;
  const kv = cfg.numKvHeads * cfg.headDim;
  const I = cfg.intermediateSize;
  if (name === EMBED_TENSOR || name === LM_HEAD_TENSOR) return [cfg.vocabSize, h];
  if (name === FINAL_NORM_TENSOR) return [h];
  const m = /^model\.layers\.(\d+)\.(.+)$/.exec(name);
  if (!m || Number(m[1]) >= cfg.numLayers) return null;
  const shapes: Record<string, number[]> = {
    'input_layernorm.weight': [h],
    'post_attention_layernorm.weight': [h],
    'self_attn.o_proj.weight': [h, q],
    'mlp.down_proj.weight': [h, I],
  };
  if (cfg.packedProjections) {
    // Phi3Attention: qkv_proj rows are q (heads*head_dim), then k, then v; Phi3MLP: gate rows, then up.
    shapes['self_attn.qkv_proj.weight'] = [q + 2 * kv, h];
    shapes['mlp.gate_up_proj.weight'] = [2 * I, h];
  } else {
    Object.assign(shapes, {
      'self_attn.q_proj.weight': [q, h],
      'self_attn.k_proj.weight': [kv, h],
      'self_attn.v_proj.weight': [kv, h],
      'mlp.gate_proj.weight': [I, h],
      'mlp.up_proj.weight': [I, h],
    });
  }
  if (cfg.attentionBias) {
    shapes['self_attn.q_proj.bias'] = [q];
    shapes['self_attn.k_proj.bias'] = [kv];
    shapes['self_attn.v_proj.bias'] = [kv];
  }
  if (cfg.qkNorm) {
    shapes['self_attn.q_norm.weight'] = [cfg.headDim];
    shapes['self_attn.k_norm.weight'] = [cfg.headDim];
  }
  return shapes[m[2]!] ?? null;
}

/**
 * A layer's projection as rows of a checkpoint tensor: Phi-3 keeps q, k and v
 * (and gate, up) as row ranges of one packed tensor; the others one tensor each.
 */
export interface ProjectionRows {
  tensor: string;
  row: number;
  rows: number;
}

export function projectionRows(cfg: ModelConfig, layer: number, which: 'q' | 'k' | 'v' | 'gate' | 'up'): ProjectionRows {
  const p = `model.layers.${layer}`;
  const q = cfg.numHeads * cfg.headDim;
  const kv = cfg.numKvHeads * cfg.headDim;
  const I = cfg.intermediateSize;
  if (!cfg.packedProjections) {
    const rows = { q, k: kv, v: kv, gate: I, up: I }[which];
    return { tensor: which === 'gate' || which === 'up' ? `${p}.mlp.${which}_proj.weight` : `${p}.self_attn.${which}_proj.weight`, row: 0, rows };
  }
  switch (which) {
    case 'q':
      return { tensor: `${p}.self_attn.qkv_proj.weight`, row: 0, rows: q };
    case 'k':
      return { tensor: `${p}.self_attn.qkv_proj.weight`, row: q, rows: kv };
    case 'v':
      return { tensor: `${p}.self_attn.qkv_proj.weight`, row: q + kv, rows: kv };
    case 'gate':
      return { tensor: `${p}.mlp.gate_up_proj.weight`, row: 0, rows: I };
    case 'up':
      return { tensor: `${p}.mlp.gate_up_proj.weight`, row: I, rows: I };
  }
}
