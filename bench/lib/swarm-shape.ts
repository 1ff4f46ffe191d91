/**
 * The simulated swarm's model and donors, shared by bench/swarm.ts,
 * bench/route-pick.ts and bench/beat-cost.ts so their figures describe the
 * same swarm.
 */

/** Llama-3-8B's shape: 32 layers; the tracker sizes spans from config.json alone (no weights behind it). */
export const SWARM_CONFIG = {
  architectures: ['LlamaForCausalLM'],
  vocab_size: 128256,
  hidden_size: 4096,
  intermediate_size: 14336,
  num_hidden_layers: 32,
  num_attention_heads: 32,
  num_key_value_heads: 8,
  head_dim: 128,
  max_position_embeddings: 8192,
  rms_norm_eps: 1e-5,
  rope_theta: 500000,
  tie_word_embeddings: false,
  bos_token_id: 128000,
  eos_token_id: 128001,
};

/** Donor budgets (MiB) and formats, cycled: spans of different lengths, as real donors give. */
export const SWARM_BUDGETS: ReadonlyArray<readonly [number, 'q4' | 'f16']> = [
  [1024, 'q4'],
  [2048, 'q4'],
  [3072, 'q4'],
  [4096, 'f16'],
  [6144, 'f16'],
];
