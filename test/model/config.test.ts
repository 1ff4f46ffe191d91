import { describe, expect, it } from 'vitest';
import { layerTensorNames, parseModelConfig, expectedTensorShape, EMBED_TENSOR } from '../../src/model/config.ts';
import { ModelFormatError } from '../../src/model/errors.ts';

// Copies of the real config.json files (trimmed of nothing we parse).
const SMOLLM2_135M = {
  architectures: ['LlamaForCausalLM'], attention_bias: false, attention_dropout: 0.0, bos_token_id: 1, eos_token_id: 2,
  hidden_act: 'silu', hidden_size: 576, initializer_range: 0.041666666666666664, intermediate_size: 1536, is_llama_config: true,
  max_position_embeddings: 8192, model_type: 'llama', num_attention_heads: 9, num_hidden_layers: 30, num_key_value_heads: 3,
  pad_token_id: 2, pretraining_tp: 1, rms_norm_eps: 1e-5, rope_interleaved: false, rope_scaling: null, rope_theta: 100000,
  tie_word_embeddings: true, torch_dtype: 'bfloat16', transformers_version: '4.42.3', use_cache: true, vocab_size: 49152,
};
const QWEN25_05B = {
  architectures: ['Qwen2ForCausalLM'], attention_dropout: 0.0, bos_token_id: 151643, eos_token_id: 151645, hidden_act: 'silu',
  hidden_size: 896, initializer_range: 0.02, intermediate_size: 4864, max_position_embeddings: 32768, max_window_layers: 21,
  model_type: 'qwen2', num_attention_heads: 14, num_hidden_layers: 24, num_key_value_heads: 2, rms_norm_eps: 1e-6,
  rope_theta: 1000000.0, sliding_window: 32768, tie_word_embeddings: true, torch_dtype: 'bfloat16', transformers_version: '4.43.1',
  use_cache: true, use_sliding_window: false, vocab_size: 151936,
};
const LLAMA32_1B = {
  architectures: ['LlamaForCausalLM'], attention_bias: false, attention_dropout: 0.0, bos_token_id: 128000,
  eos_token_id: [128001, 128008, 128009], head_dim: 64, hidden_act: 'silu', hidden_size: 2048, initializer_range: 0.02,
  intermediate_size: 8192, max_position_embeddings: 131072, mlp_bias: false, model_type: 'llama', num_attention_heads: 32,
  num_hidden_layers: 16, num_key_value_heads: 8, pretraining_tp: 1, rms_norm_eps: 1e-5,
  rope_scaling: { factor: 32.0, high_freq_factor: 4.0, low_freq_factor: 1.0, original_max_position_embeddings: 8192, rope_type: 'llama3' },
  rope_theta: 500000.0, tie_word_embeddings: true, torch_dtype: 'bfloat16', transformers_version: '4.45.0.dev0', use_cache: true, vocab_size: 128256,
};
const MISTRAL_7B = {
  architectures: ['MistralForCausalLM'], bos_token_id: 1, eos_token_id: 2, hidden_act: 'silu', hidden_size: 4096, initializer_range: 0.02,
  intermediate_size: 14336, max_position_embeddings: 32768, model_type: 'mistral', num_attention_heads: 32, num_hidden_layers: 32,
  num_key_value_heads: 8, rms_norm_eps: 1e-5, rope_theta: 10000.0, sliding_window: 4096, tie_word_embeddings: false,
  torch_dtype: 'bfloat16', transformers_version: '4.34.0.dev0', use_cache: true, vocab_size: 32000,
};

function errorOf(fn: () => unknown): ModelFormatError {
  try {
    fn();
  } catch (e) {
    expect(e).toBeInstanceOf(ModelFormatError);
    return e as ModelFormatError;
  }
  throw new Error('expected a ModelFormatError');
}

describe('parseModelConfig', () => {
  it('SmolLM2-135M: llama, tied, GQA 9/3, head_dim from hidden/heads', () => {
    const c = parseModelConfig(SMOLLM2_135M);
    expect(c).toEqual({
      architecture: 'llama', vocabSize: 49152, hiddenSize: 576, intermediateSize: 1536, numLayers: 30, numHeads: 9, numKvHeads: 3,
      headDim: 64, rmsNormEps: 1e-5, ropeTheta: 100000, ropeScaling: null, maxPositionEmbeddings: 8192, tieWordEmbeddings: true,
      rotaryDim: 64, attentionBias: false, qkNorm: false, packedProjections: false, slidingWindow: null, bosTokenId: 1, eosTokenIds: [2], torchDtype: 'bfloat16',
    });
  });

  it('Qwen2.5-0.5B: qwen2 has q/k/v bias without an attention_bias key', () => {
    const c = parseModelConfig(QWEN25_05B);
    expect(c.architecture).toBe('qwen2');
    expect(c.attentionBias).toBe(true);
    expect(c.headDim).toBe(64);
    expect(c.numKvHeads).toBe(2);
    expect(c.ropeTheta).toBe(1e6);
    expect(c.rmsNormEps).toBe(1e-6);
    expect(c.eosTokenIds).toEqual([151645]);
    const names = layerTensorNames(c, 3);
    expect(names).toContain('model.layers.3.self_attn.q_proj.bias');
    expect(names).toContain('model.layers.3.self_attn.v_proj.bias');
    expect(names).not.toContain('model.layers.3.self_attn.o_proj.bias');
    expect(names).toHaveLength(12);
  });

  it('Llama-3.2-1B: llama3 rope scaling and a list of eos ids', () => {
    const c = parseModelConfig(LLAMA32_1B);
    expect(c.ropeScaling).toEqual({ type: 'llama3', factor: 32, lowFreqFactor: 1, highFreqFactor: 4, originalMaxPositionEmbeddings: 8192 });
    expect(c.eosTokenIds).toEqual([128001, 128008, 128009]);
    expect(c.bosTokenId).toBe(128000);
    expect(c.headDim).toBe(64);
    expect(layerTensorNames(c, 0)).toEqual([
      'model.layers.0.input_layernorm.weight', 'model.layers.0.self_attn.q_proj.weight', 'model.layers.0.self_attn.k_proj.weight',
      'model.layers.0.self_attn.v_proj.weight', 'model.layers.0.self_attn.o_proj.weight', 'model.layers.0.post_attention_layernorm.weight',
      'model.layers.0.mlp.gate_proj.weight', 'model.layers.0.mlp.up_proj.weight', 'model.layers.0.mlp.down_proj.weight',
    ]);
    expect(expectedTensorShape(c, 'model.layers.0.self_attn.k_proj.weight')).toEqual([512, 2048]);
    expect(expectedTensorShape(c, EMBED_TENSOR)).toEqual([128256, 2048]);
  });

  it('Mistral-7B: mistral, untied, no bias', () => {
    const c = parseModelConfig(MISTRAL_7B);
    expect(c.architecture).toBe('mistral');
    expect(c.tieWordEmbeddings).toBe(false);
    expect(c.attentionBias).toBe(false);
    expect(c.headDim).toBe(128);
    expect(c.numKvHeads).toBe(8);
  });

  it('applies transformers defaults for absent keys', () => {
    const { rope_theta: _r, num_key_value_heads: _k, tie_word_embeddings: _t, torch_dtype: _d, ...bare } = MISTRAL_7B;
    const c = parseModelConfig(bare);
    expect(c.ropeTheta).toBe(10000);
    expect(c.numKvHeads).toBe(32);
    expect(c.tieWordEmbeddings).toBe(false);
    expect(c.torchDtype).toBe('float32');
    expect(parseModelConfig({ ...bare, dtype: 'bfloat16' }).torchDtype).toBe('bfloat16');
  });

  it('rejects an unsupported architecture by name', () => {
    const e = errorOf(() => parseModelConfig({ ...SMOLLM2_135M, architectures: ['GPT2LMHeadModel'] }, 'gpt2/config.json'));
    expect(e.file).toBe('gpt2/config.json');
    expect(e.message).toMatch(/unsupported architecture "GPT2LMHeadModel"/);
  });

  it('names the bad field', () => {
    const e = errorOf(() => parseModelConfig({ ...SMOLLM2_135M, hidden_size: 'big' }));
    expect(e.file).toBe('config.json');
    expect(e.message).toMatch(/hidden_size/);
    expect(errorOf(() => parseModelConfig({ ...SMOLLM2_135M, num_hidden_layers: undefined })).message).toMatch(/num_hidden_layers/);
    expect(errorOf(() => parseModelConfig({ ...SMOLLM2_135M, num_key_value_heads: 4 })).message).toMatch(/num_key_value_heads/);
    expect(errorOf(() => parseModelConfig({ ...SMOLLM2_135M, hidden_act: 'gelu' })).message).toMatch(/hidden_act/);
    expect(errorOf(() => parseModelConfig({ ...LLAMA32_1B, rope_scaling: { rope_type: 'yarn', factor: 4 } })).message).toMatch(/yarn/);
    expect(errorOf(() => parseModelConfig({ ...LLAMA32_1B, rope_scaling: { rope_type: 'llama3', factor: 4 } })).message).toMatch(/low_freq_factor/);
    expect(errorOf(() => parseModelConfig([1, 2])).message).toMatch(/not a JSON object/);
  });

  it('layerTensorNames refuses layers outside the model', () => {
    const c = parseModelConfig(SMOLLM2_135M);
    expect(() => layerTensorNames(c, 30)).toThrow(RangeError);
    expect(() => layerTensorNames(c, -1)).toThrow(RangeError);
  });
});
