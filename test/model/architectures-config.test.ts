/**
 * config.json of the newer published architectures (Qwen3, Phi-3/3.5) and the
 * refusals at registration: an unsupported model_type, architecture or rope
 * type names what is supported.
 */
import { describe, expect, it } from 'vitest';
import { expectedTensorShape, layerTensorNames, parseModelConfig, SUPPORTED } from '../../src/model/config.ts';
import { ModelFormatError } from '../../src/model/errors.ts';
import { attentionScale, ropeAttentionFactor, ropeInvFreq } from '../../src/model/rope.ts';

const QWEN3_06B = {
  architectures: ['Qwen3ForCausalLM'], attention_bias: false, attention_dropout: 0.0, bos_token_id: 151643, eos_token_id: 151645,
  head_dim: 128, hidden_act: 'silu', hidden_size: 1024, initializer_range: 0.02, intermediate_size: 3072, max_position_embeddings: 40960,
  max_window_layers: 28, model_type: 'qwen3', num_attention_heads: 16, num_hidden_layers: 28, num_key_value_heads: 8, rms_norm_eps: 1e-6,
  rope_scaling: null, rope_theta: 1000000, sliding_window: null, tie_word_embeddings: true, torch_dtype: 'bfloat16',
  transformers_version: '4.51.0', use_cache: true, use_sliding_window: false, vocab_size: 151936,
};
const PHI3_MINI_4K = {
  architectures: ['Phi3ForCausalLM'], attention_dropout: 0.0, bos_token_id: 1, embd_pdrop: 0.0, eos_token_id: 32000, hidden_act: 'silu',
  hidden_size: 3072, initializer_range: 0.02, intermediate_size: 8192, max_position_embeddings: 4096, model_type: 'phi3',
  num_attention_heads: 32, num_hidden_layers: 32, num_key_value_heads: 32, original_max_position_embeddings: 4096, pad_token_id: 32000,
  resid_pdrop: 0.0, rms_norm_eps: 1e-5, rope_scaling: null, rope_theta: 10000.0, sliding_window: 2047, tie_word_embeddings: false,
  torch_dtype: 'bfloat16', transformers_version: '4.40.2', use_cache: true, attention_bias: false, vocab_size: 32064,
};
// Phi-3.5-mini-instruct's fields; its 48 factors abbreviated to a ramp of the same length and range.
const ramp = (a: number, b: number) => Array.from({ length: 48 }, (_, i) => a + ((b - a) * i) / 47);
const PHI35_MINI = {
  ...PHI3_MINI_4K, max_position_embeddings: 131072, sliding_window: 262144, transformers_version: '4.43.3',
  rope_scaling: { long_factor: ramp(1.08, 64.0), short_factor: ramp(1.0, 3.0), type: 'longrope' },
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

describe('published architectures', () => {
  it('Qwen3-0.6B: head_dim 128 apart from hidden/heads, q_norm and k_norm, no biases', () => {
    const c = parseModelConfig(QWEN3_06B);
    expect(c.architecture).toBe('qwen3');
    expect(c.headDim).toBe(128);
    expect(c.qkNorm).toBe(true);
    expect(c.attentionBias).toBe(false);
    expect(c.slidingWindow).toBeNull();
    expect(c.tieWordEmbeddings).toBe(true);
    const names = layerTensorNames(c, 5);
    expect(names).toContain('model.layers.5.self_attn.q_norm.weight');
    expect(names).toContain('model.layers.5.self_attn.k_norm.weight');
    expect(names.some((n) => n.endsWith('.bias'))).toBe(false);
    expect(expectedTensorShape(c, 'model.layers.5.self_attn.q_proj.weight')).toEqual([2048, 1024]);
    expect(expectedTensorShape(c, 'model.layers.5.self_attn.o_proj.weight')).toEqual([1024, 2048]);
    expect(expectedTensorShape(c, 'model.layers.5.self_attn.k_norm.weight')).toEqual([128]);
  });

  it('Phi-3-mini-4k: packed qkv_proj and gate_up_proj, sliding window 2047, no rope scaling', () => {
    const c = parseModelConfig(PHI3_MINI_4K);
    expect(c.architecture).toBe('phi3');
    expect(c.packedProjections).toBe(true);
    expect(c.slidingWindow).toBe(2047);
    expect(c.ropeScaling).toBeNull();
    expect(layerTensorNames(c, 0)).toEqual([
      'model.layers.0.input_layernorm.weight', 'model.layers.0.self_attn.qkv_proj.weight', 'model.layers.0.self_attn.o_proj.weight',
      'model.layers.0.post_attention_layernorm.weight', 'model.layers.0.mlp.gate_up_proj.weight', 'model.layers.0.mlp.down_proj.weight',
    ]);
    expect(expectedTensorShape(c, 'model.layers.0.self_attn.qkv_proj.weight')).toEqual([9216, 3072]);
    expect(expectedTensorShape(c, 'model.layers.0.mlp.gate_up_proj.weight')).toEqual([16384, 3072]);
    expect(expectedTensorShape(c, 'model.layers.0.self_attn.q_proj.weight')).toBeNull();
  });

  it('Phi-3.5-mini: longrope short factors, attention factor from the two lengths, context capped at the original 4096', () => {
    const c = parseModelConfig(PHI35_MINI);
    if (c.ropeScaling?.type !== 'longrope') throw new Error('expected longrope');
    // transformers: factor = 131072 / 4096 = 32, attention_factor = sqrt(1 + ln 32 / ln 4096).
    expect(c.ropeScaling.attentionFactor).toBeCloseTo(Math.sqrt(1 + Math.log(32) / Math.log(4096)), 12);
    expect(ropeAttentionFactor(c)).toBeCloseTo(1.1902380714238083, 12);
    expect(attentionScale(c)).toBeCloseTo(1 / Math.sqrt(96), 12);
    expect(c.maxPositionEmbeddings).toBe(4096);
    const inv = ropeInvFreq(c);
    expect(inv).toHaveLength(48);
    expect(inv[47]).toBeCloseTo(1 / (3.0 * 10000 ** (94 / 96)), 15);
    // An explicit attention_factor wins.
    const given = parseModelConfig({ ...PHI35_MINI, rope_scaling: { ...PHI35_MINI.rope_scaling, attention_factor: 1.5 } });
    expect(ropeAttentionFactor(given)).toBe(1.5);
  });

  it('Phi-4-mini: partial_rotary_factor 0.75 rotates 96 of head_dim 128; longrope factors cover the rotated half', () => {
    const c = parseModelConfig({
      ...PHI35_MINI, hidden_size: 3072, num_attention_heads: 24, num_key_value_heads: 8, partial_rotary_factor: 0.75, tie_word_embeddings: true, vocab_size: 200064,
      rope_scaling: { long_factor: ramp(1, 60), short_factor: ramp(1, 3), type: 'longrope' },
    });
    expect(c.headDim).toBe(128);
    expect(c.rotaryDim).toBe(96);
    expect(ropeInvFreq(c)).toHaveLength(48);
    expect(ropeInvFreq(c)[1]).toBeCloseTo(1 / ((1 + 2 / 47) * 10000 ** (2 / 96)), 15);
  });

  it('reads transformers 5 `rope_parameters` like rope_theta + rope_scaling', () => {
    const { rope_theta: _t, rope_scaling: _s, ...bare } = QWEN3_06B;
    expect(parseModelConfig({ ...bare, rope_parameters: { rope_type: 'default', rope_theta: 1000000 } }).ropeTheta).toBe(1000000);
    const llama = parseModelConfig({
      ...bare, architectures: ['LlamaForCausalLM'], model_type: 'llama',
      rope_parameters: { rope_type: 'llama3', rope_theta: 500000, factor: 32, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192 },
    });
    expect(llama.ropeTheta).toBe(500000);
    expect(llama.ropeScaling).toEqual({ type: 'llama3', factor: 32, lowFreqFactor: 1, highFreqFactor: 4, originalMaxPositionEmbeddings: 8192 });
    expect(errorOf(() => parseModelConfig({ ...bare, rope_parameters: { full_attention: { rope_type: 'default' } } })).message).toMatch(/per-layer-type/);
  });

  it('refuses what it cannot run, naming what is supported', () => {
    const mt = errorOf(() => parseModelConfig({ ...QWEN3_06B, model_type: 'gemma2', architectures: ['Gemma2ForCausalLM'] }));
    expect(mt.message).toMatch(/unsupported model_type "gemma2"/);
    for (const t of SUPPORTED.modelTypes) expect(mt.message).toContain(t);
    const arch = errorOf(() => parseModelConfig({ ...QWEN3_06B, model_type: undefined, architectures: ['Qwen3MoeForCausalLM'] }));
    expect(arch.message).toMatch(/unsupported architecture "Qwen3MoeForCausalLM" \(supported: .*Qwen3ForCausalLM.*Phi3ForCausalLM/);
    const rope = errorOf(() => parseModelConfig({ ...QWEN3_06B, rope_scaling: { rope_type: 'yarn', factor: 4, original_max_position_embeddings: 32768 } }));
    expect(rope.message).toMatch(/"yarn" is not supported \(supported: default, llama3, longrope\)/);
    expect(errorOf(() => parseModelConfig({ ...QWEN3_06B, model_type: 'llama' })).message).toMatch(/does not match/);
    expect(errorOf(() => parseModelConfig({ ...PHI35_MINI, rope_scaling: { ...PHI35_MINI.rope_scaling, short_factor: [1, 2] } })).message).toMatch(/rotary dim\/2 = 48/);
    expect(errorOf(() => parseModelConfig({ ...PHI3_MINI_4K, partial_rotary_factor: 0.7 })).message).toMatch(/partial_rotary_factor": rotates 67 of head_dim 96/);
    expect(errorOf(() => parseModelConfig({ ...QWEN3_06B, use_sliding_window: true })).message).toMatch(/use_sliding_window/);
    expect(errorOf(() => parseModelConfig({ ...QWEN3_06B, attention_bias: true })).message).toMatch(/attention_bias/);
  });
});
