/**
 * Hugging Face `config.json` for the Llama family (Llama, Qwen2, Mistral,
 * SmolLM). Every field the graph builder relies on is resolved here, with the
 * same defaults transformers applies, so nothing downstream reads raw JSON.
 */
import { z } from 'zod';
import { ModelFormatError } from './errors.ts';

export interface RopeScaling {
  type: 'llama3';
  factor: number;
  lowFreqFactor: number;
  highFreqFactor: number;
  originalMaxPositionEmbeddings: number;
}

export interface ModelConfig {
  architecture: 'llama' | 'qwen2' | 'mistral';
  vocabSize: number;
  hiddenSize: number;
  intermediateSize: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  rmsNormEps: number;
  ropeTheta: number;
  ropeScaling: RopeScaling | null;
  maxPositionEmbeddings: number;
  tieWordEmbeddings: boolean;
  /** q/k/v projections carry a bias (always for Qwen2; `attention_bias` for Llama). */
  attentionBias: boolean;
  bosTokenId: number | null;
  eosTokenIds: number[];
  torchDtype: string;
}

export const EMBED_TENSOR = 'model.embed_tokens.weight';
export const FINAL_NORM_TENSOR = 'model.norm.weight';
export const LM_HEAD_TENSOR = 'lm_head.weight';

const ARCHITECTURES: Record<string, ModelConfig['architecture']> = {
  LlamaForCausalLM: 'llama',
  Qwen2ForCausalLM: 'qwen2',
  MistralForCausalLM: 'mistral',
};

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
  })
  .nullable()
  .optional();

const ConfigSchema = z.object({
  architectures: z.array(z.string()).min(1),
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
  max_position_embeddings: posInt,
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

export function parseModelConfig(json: unknown, file = 'config.json'): ModelConfig {
  if (typeof json !== 'object' || json === null || Array.isArray(json)) fail(file, 'not a JSON object');
  const archs = (json as { architectures?: unknown }).architectures;
  // Checked before the schema so an unsupported model gets that message, not a field complaint.
  if (Array.isArray(archs) && typeof archs[0] === 'string' && !(archs[0] in ARCHITECTURES)) {
    fail(file, `unsupported architecture "${archs[0]}" (supported: ${Object.keys(ARCHITECTURES).join(', ')})`);
  }
  const parsed = ConfigSchema.safeParse(json);
  if (!parsed.success) {
    const issue = parsed.error.issues[0]!;
    fail(file, `field "${issue.path.join('.') || '(root)'}": ${issue.message}`);
  }
  const c = parsed.data;
  const architecture = ARCHITECTURES[c.architectures[0]!]!;

  if (c.hidden_act !== undefined && c.hidden_act !== 'silu') fail(file, `field "hidden_act": "${c.hidden_act}" is not supported (only silu)`);
  if (c.mlp_bias === true) fail(file, 'field "mlp_bias": MLP biases are not supported');

  const numHeads = c.num_attention_heads;
  const numKvHeads = c.num_key_value_heads ?? numHeads;
  if (numHeads % numKvHeads !== 0) fail(file, `field "num_key_value_heads": ${numKvHeads} does not divide num_attention_heads ${numHeads}`);
  // Mistral-Nemo style configs decouple head_dim from hidden_size / heads.
  let headDim = c.head_dim ?? null;
  if (headDim === null) {
    if (c.hidden_size % numHeads !== 0) fail(file, `field "num_attention_heads": ${numHeads} does not divide hidden_size ${c.hidden_size}`);
    headDim = c.hidden_size / numHeads;
  }
  if (headDim % 2 !== 0) fail(file, `field "head_dim": ${headDim} must be even for rotary embeddings`);

  let ropeScaling: RopeScaling | null = null;
  if (c.rope_scaling) {
    const kind = c.rope_scaling.rope_type ?? c.rope_scaling.type;
    if (kind === 'default' || kind === undefined) ropeScaling = null;
    else if (kind === 'llama3') {
      const r = c.rope_scaling;
      if (r.factor === undefined || r.low_freq_factor === undefined || r.high_freq_factor === undefined || r.original_max_position_embeddings === undefined) {
        fail(file, 'field "rope_scaling": llama3 scaling needs factor, low_freq_factor, high_freq_factor, original_max_position_embeddings');
      }
      if (r.high_freq_factor <= r.low_freq_factor) fail(file, 'field "rope_scaling.high_freq_factor": must exceed low_freq_factor');
      ropeScaling = {
        type: 'llama3',
        factor: r.factor,
        lowFreqFactor: r.low_freq_factor,
        highFreqFactor: r.high_freq_factor,
        originalMaxPositionEmbeddings: r.original_max_position_embeddings,
      };
    } else fail(file, `field "rope_scaling.rope_type": "${kind}" is not supported (only llama3)`);
  }

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
    rmsNormEps: c.rms_norm_eps,
    ropeTheta: c.rope_theta ?? 10000,
    ropeScaling,
    maxPositionEmbeddings: c.max_position_embeddings,
    // LlamaConfig, Qwen2Config and MistralConfig all default to untied.
    tieWordEmbeddings: c.tie_word_embeddings ?? false,
    attentionBias: architecture === 'qwen2' ? true : (c.attention_bias ?? false),
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
  for (const x of ['q', 'k', 'v']) {
    names.push(`${p}.self_attn.${x}_proj.weight`);
    if (cfg.attentionBias) names.push(`${p}.self_attn.${x}_proj.bias`);
  }
  names.push(`${p}.self_attn.o_proj.weight`, `${p}.post_attention_layernorm.weight`);
  for (const x of ['gate', 'up', 'down']) names.push(`${p}.mlp.${x}_proj.weight`);
  return names;
}

/** The HF shape of each tensor a checkpoint of `cfg` must hold ([out, in] for projections). */
export function expectedTensorShape(cfg: ModelConfig, name: string): number[] | null {
  const h = cfg.hiddenSize;
  const q = cfg.numHeads * cfg.headDim;
  const kv = cfg.numKvHeads * cfg.headDim;
  if (name === EMBED_TENSOR || name === LM_HEAD_TENSOR) return [cfg.vocabSize, h];
  if (name === FINAL_NORM_TENSOR) return [h];
  const m = /^model\.layers\.(\d+)\.(.+)$/.exec(name);
  if (!m || Number(m[1]) >= cfg.numLayers) return null;
  const shapes: Record<string, number[]> = {
    'input_layernorm.weight': [h],
    'post_attention_layernorm.weight': [h],
    'self_attn.q_proj.weight': [q, h],
    'self_attn.k_proj.weight': [kv, h],
    'self_attn.v_proj.weight': [kv, h],
    'self_attn.o_proj.weight': [h, q],
    'mlp.gate_proj.weight': [cfg.intermediateSize, h],
    'mlp.up_proj.weight': [cfg.intermediateSize, h],
    'mlp.down_proj.weight': [h, cfg.intermediateSize],
  };
  if (cfg.attentionBias) {
    shapes['self_attn.q_proj.bias'] = [q];
    shapes['self_attn.k_proj.bias'] = [kv];
    shapes['self_attn.v_proj.bias'] = [kv];
  }
  return shapes[m[2]!] ?? null;
}
