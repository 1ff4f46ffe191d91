/**
 * Generated checkpoints in exactly the Hugging Face layout, deterministic from
 * a seed. Tests, benchmarks and the offline demo run on these instead of
 * downloading real models; they exercise the same loader, tokenizer and graph
 * paths (GQA, llama3 RoPE scaling, Qwen2 q/k/v bias, sharded index), and
 * one preset per published architecture (tiny-*: the real config fields of
 * Llama 3.1, SmolLM2, Mistral, Qwen3, Phi-3.5 at reduced width and depth).
 *
 * Pure: no host API, no transcendental Math (Math.log/cos may differ between
 * engines), so the same seed gives the same bytes in Node and every browser.
 */
import { encodeTensor } from '../protocol/tensor.ts';
import { fillerCorpus, FIXTURE_CORPUS, trainBpe } from './bpe.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR, layerTensorNames, parseModelConfig, expectedTensorShape } from './config.ts';
import type { ModelConfig } from './config.ts';
import { serializeSafetensors, type TensorEntry } from './safetensors-format.ts';
import { COPY_CONFIG, copyModelTensors } from './fixture-copy.ts';
import { REAL_TOKENIZER_PACKAGE, REAL_VOCAB_PRESETS, isRealVocabPreset, realVocabSpec, type TokenizerFiles } from './fixture-real-vocab.ts';

export const FIXTURE_PRESETS = [
  'tiny', 'small', 'tiny-qwen2', 'tiny-copy',
  'tiny-llama31', 'tiny-smollm2', 'tiny-mistral', 'tiny-qwen3', 'tiny-phi3', 'tiny-phi4mini',
  ...REAL_VOCAB_PRESETS,
] as const;
export type FixturePreset = (typeof FIXTURE_PRESETS)[number];

export function isFixturePreset(s: string): s is FixturePreset {
  return (FIXTURE_PRESETS as readonly string[]).includes(s);
}

/** Bump when the generator's output changes, so cached fixture directories are remade. */
export const FIXTURE_VERSION = 2;

export const SPECIAL_TOKENS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>'] as const;

export const CHATML_TEMPLATE =
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}" +
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

interface PresetSpec {
  config: Record<string, unknown>;
  /** Number of safetensors files; >1 writes model.safetensors.index.json. */
  shards: number;
}

function presetSpec(preset: FixturePreset): PresetSpec {
  if (isRealVocabPreset(preset)) return { shards: 1, config: realVocabSpec(preset).config };
  const common = {
    attention_dropout: 0,
    hidden_act: 'silu',
    initializer_range: 0.02,
    rms_norm_eps: 1e-5,
    torch_dtype: 'bfloat16',
    transformers_version: '4.46.0',
    use_cache: true,
  };
  switch (preset) {
    case 'tiny':
      // SmolLM2-shaped: tied embeddings, ids 0/1/2 = endoftext/im_start/im_end.
      // llama3 scaling with original 256 puts head_dim-16 frequencies in all
      // three bands (kept, smoothed, divided by factor).
      return {
        shards: 1,
        config: {
          architectures: ['LlamaForCausalLM'], model_type: 'llama', ...common,
          attention_bias: false, mlp_bias: false, pretraining_tp: 1,
          vocab_size: 512, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 4,
          num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16,
          max_position_embeddings: 2048, rope_theta: 10000,
          rope_scaling: { rope_type: 'llama3', factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 256 },
          tie_word_embeddings: true, bos_token_id: 1, eos_token_id: 2,
        },
      };
    case 'small':
      // Untied lm_head so the sharded checkpoint also covers that tensor.
      return {
        shards: 3,
        config: {
          architectures: ['LlamaForCausalLM'], model_type: 'llama', ...common,
          attention_bias: false, mlp_bias: false, pretraining_tp: 1,
          vocab_size: 2048, hidden_size: 512, intermediate_size: 1536, num_hidden_layers: 12,
          num_attention_heads: 8, num_key_value_heads: 2, head_dim: 64,
          max_position_embeddings: 2048, rope_theta: 10000, rope_scaling: null,
          tie_word_embeddings: false, bos_token_id: 1, eos_token_id: 2,
        },
      };
    case 'tiny-copy':
      // Weights written by hand (fixture-copy.ts): it copies its input like an induction head.
      return {
        shards: 1,
        config: { architectures: ['LlamaForCausalLM'], model_type: 'llama', ...common, attention_bias: false, mlp_bias: false, pretraining_tp: 1, ...COPY_CONFIG },
      };
    case 'tiny-qwen2':
      // Qwen2.5-shaped: q/k/v bias, no attention_bias key, bos = endoftext.
      return {
        shards: 1,
        config: {
          architectures: ['Qwen2ForCausalLM'], model_type: 'qwen2', ...common,
          vocab_size: 512, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 4,
          num_attention_heads: 4, num_key_value_heads: 2,
          max_position_embeddings: 2048, max_window_layers: 4, rope_theta: 1000000, rope_scaling: null,
          sliding_window: 2048, use_sliding_window: false,
          tie_word_embeddings: false, bos_token_id: 0, eos_token_id: 2,
        },
      };
    case 'tiny-llama31':
      // Llama-3.1-8B-shaped: untied head, llama3 scaling (factor 8, theta 500000). The original
      // length is reduced from 8192 to 256 so head_dim 16 has frequencies in all three bands.
      return {
        shards: 1,
        config: {
          architectures: ['LlamaForCausalLM'], model_type: 'llama', ...common,
          attention_bias: false, mlp_bias: false, pretraining_tp: 1,
          vocab_size: 512, hidden_size: 64, intermediate_size: 192, num_hidden_layers: 4,
          num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16,
          max_position_embeddings: 131072, rope_theta: 500000,
          rope_scaling: { factor: 8, high_freq_factor: 4, low_freq_factor: 1, original_max_position_embeddings: 256, rope_type: 'llama3' },
          tie_word_embeddings: false, bos_token_id: 1, eos_token_id: [2, 0],
        },
      };
    case 'tiny-smollm2':
      // SmolLM2-135M-shaped: Llama layout, tied, theta 100000, no head_dim key (576/9 = 64 there, 96/3 = 32 here).
      return {
        shards: 1,
        config: {
          architectures: ['LlamaForCausalLM'], model_type: 'llama', ...common,
          attention_bias: false, mlp_bias: false, pretraining_tp: 1,
          vocab_size: 512, hidden_size: 96, intermediate_size: 256, num_hidden_layers: 4,
          num_attention_heads: 3, num_key_value_heads: 1,
          max_position_embeddings: 8192, rope_theta: 100000, rope_scaling: null,
          tie_word_embeddings: true, bos_token_id: 1, eos_token_id: 2, pad_token_id: 2,
        },
      };
    case 'tiny-mistral':
      // Mistral-7B-v0.1-shaped: sliding_window (4096 there, 16 here so a short chat crosses it).
      return {
        shards: 1,
        config: {
          architectures: ['MistralForCausalLM'], model_type: 'mistral', ...common,
          vocab_size: 512, hidden_size: 64, intermediate_size: 224, num_hidden_layers: 4,
          num_attention_heads: 4, num_key_value_heads: 1,
          max_position_embeddings: 32768, rope_theta: 10000, sliding_window: 16,
          tie_word_embeddings: false, bos_token_id: 1, eos_token_id: 2,
        },
      };
    case 'tiny-qwen3':
      // Qwen3-0.6B-shaped: head_dim 32 > hidden/heads (16), q_norm/k_norm, no biases, tied, eps 1e-6.
      return {
        shards: 1,
        config: {
          architectures: ['Qwen3ForCausalLM'], model_type: 'qwen3', ...common, rms_norm_eps: 1e-6,
          attention_bias: false, head_dim: 32,
          vocab_size: 512, hidden_size: 64, intermediate_size: 192, num_hidden_layers: 4,
          num_attention_heads: 4, num_key_value_heads: 2,
          max_position_embeddings: 40960, max_window_layers: 4, rope_theta: 1000000, rope_scaling: null,
          sliding_window: null, use_sliding_window: false,
          tie_word_embeddings: true, bos_token_id: 0, eos_token_id: 2,
        },
      };
    case 'tiny-phi3':
      // Phi-3.5-mini-shaped: packed qkv_proj/gate_up_proj, MHA, longrope. head_dim 16 takes 8
      // factors (48 in the published file; these are made up, spread wider so they matter), and
      // original/max lengths 512/2048 give attention factor sqrt(1 + ln 4 / ln 512).
      return {
        shards: 1,
        config: {
          architectures: ['Phi3ForCausalLM'], model_type: 'phi3', ...common,
          attention_bias: false, embd_pdrop: 0, resid_pdrop: 0,
          vocab_size: 512, hidden_size: 64, intermediate_size: 160, num_hidden_layers: 4,
          num_attention_heads: 4, num_key_value_heads: 4,
          max_position_embeddings: 2048, original_max_position_embeddings: 512, rope_theta: 10000,
          rope_scaling: {
            long_factor: [1.08, 1.2, 1.9, 4.5, 9.3, 17.0, 26.5, 31.0],
            short_factor: [1.0, 1.02, 1.1, 1.3, 1.6, 2.1, 2.6, 3.0],
            type: 'longrope',
          },
          sliding_window: 2047,
          tie_word_embeddings: false, bos_token_id: 1, eos_token_id: 2, pad_token_id: 2,
        },
      };
    case 'tiny-phi4mini':
      // Phi-4-mini-shaped (Phi3ForCausalLM): partial_rotary_factor 0.75 (48 of head_dim 64 rotate,
      // 96 of 128 there), GQA, tied embeddings, longrope with rotary_dim/2 = 24 factors (made up).
      return {
        shards: 1,
        config: {
          architectures: ['Phi3ForCausalLM'], model_type: 'phi3', ...common,
          attention_bias: false, embd_pdrop: 0, resid_pdrop: 0, partial_rotary_factor: 0.75,
          vocab_size: 512, hidden_size: 128, intermediate_size: 256, num_hidden_layers: 4,
          num_attention_heads: 2, num_key_value_heads: 1,
          max_position_embeddings: 2048, original_max_position_embeddings: 512, rope_theta: 10000,
          rope_scaling: {
            long_factor: Array.from({ length: 24 }, (_, i) => 1 + i * 1.25),
            short_factor: Array.from({ length: 24 }, (_, i) => 1 + i / 12),
            type: 'longrope',
          },
          sliding_window: 262144,
          tie_word_embeddings: true, bos_token_id: 1, eos_token_id: 2, pad_token_id: 2,
        },
      };
  }
}

/** The parsed config a preset produces (no weights generated). */
export function fixtureConfig(preset: FixturePreset): ModelConfig {
  return parseModelConfig(presetSpec(preset).config, `${preset}/config.json`);
}

/** A seeded uniform in [0, 1) (mulberry32): fixtures, fault injection and benches draw the same numbers for a seed. */
export function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function fnv1a(text: string, seed: number): number {
  let h = (0x811c9dc5 ^ Math.imul(seed | 0, 0x9e3779b1)) >>> 0;
  for (let i = 0; i < text.length; i++) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h;
}

const SQRT3 = Math.sqrt(3);

/**
 * Approximately N(mean, std) per element: Irwin–Hall of four uniforms. Only
 * + and × (exactly rounded everywhere), unlike Box–Muller's log/cos. Each
 * tensor has its own stream, so its bytes do not depend on the tensor order.
 */
function gaussian(name: string, seed: number, n: number, mean: number, std: number): Float32Array {
  const rand = mulberry32(fnv1a(name, seed));
  const out = new Float32Array(n);
  const k = std * SQRT3;
  for (let i = 0; i < n; i++) out[i] = mean + (rand() + rand() + rand() + rand() - 2) * k;
  return out;
}

/**
 * Init scales, chosen so that (a) the residual stream stays O(1) through every
 * layer (fan-in scaled projections, pre-norm), (b) logits spread by about 3
 * units, so greedy decoding is not one token forever. With tied embeddings
 * the input token's own embedding boosts its logit by about
 * std(logits) * |e| / |residual|: the embeddings are kept small against what
 * the layers add (the final norm's gain restores the spread), otherwise the
 * model just echoes its input token.
 */
function tensorInit(cfg: ModelConfig, name: string): { mean: number; std: number } {
  const h = cfg.hiddenSize;
  if (name === EMBED_TENSOR) return { mean: 0, std: (cfg.tieWordEmbeddings ? 1.5 : 3) / Math.sqrt(h) };
  if (name === LM_HEAD_TENSOR) return { mean: 0, std: 3 / Math.sqrt(h) };
  if (name === FINAL_NORM_TENSOR) return { mean: cfg.tieWordEmbeddings ? 2 : 1, std: 0.05 };
  if (name.endsWith('layernorm.weight') || name.endsWith('_norm.weight')) return { mean: 1, std: 0.05 };
  if (name.endsWith('.bias')) return { mean: 0, std: 0.1 };
  if (name.endsWith('o_proj.weight')) return { mean: 0, std: 1.5 / Math.sqrt(cfg.numHeads * cfg.headDim) };
  if (name.endsWith('down_proj.weight')) return { mean: 0, std: 1.5 / Math.sqrt(cfg.intermediateSize) };
  return { mean: 0, std: 1 / Math.sqrt(h) };
}

/** Tensor names of a full checkpoint, embedding first, in layer order. */
export function checkpointTensorNames(cfg: ModelConfig): string[] {
  const names = [EMBED_TENSOR];
  for (let l = 0; l < cfg.numLayers; l++) names.push(...layerTensorNames(cfg, l));
  names.push(FINAL_NORM_TENSOR);
  if (!cfg.tieWordEmbeddings) names.push(LM_HEAD_TENSOR);
  return names;
}

function byName(a: [string, TensorEntry], b: [string, TensorEntry]): number {
  return a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0;
}

function tokenizerFiles(cfg: ModelConfig, preset: FixturePreset): { tokenizer: unknown; tokenizerConfig: unknown } {
  const bpe = trainBpe([FIXTURE_CORPUS, fillerCorpus()], cfg.vocabSize - SPECIAL_TOKENS.length, [1e5, 1]);
  if (bpe.tokens.length + SPECIAL_TOKENS.length !== cfg.vocabSize) {
    throw new Error(`fixture tokenizer reached ${bpe.tokens.length + SPECIAL_TOKENS.length} tokens, config wants ${cfg.vocabSize}`);
  }
  const vocab: Record<string, number> = {};
  SPECIAL_TOKENS.forEach((t, i) => (vocab[t] = i));
  bpe.tokens.forEach((t, i) => (vocab[t] = SPECIAL_TOKENS.length + i));
  const added = SPECIAL_TOKENS.map((content, id) => ({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }));
  const byteLevel = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true };
  const tokenizer = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: added,
    normalizer: null,
    pre_tokenizer: byteLevel,
    post_processor: byteLevel,
    decoder: byteLevel,
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: false, byte_fallback: false, ignore_merges: false, vocab, merges: bpe.merges,
    },
  };
  const qwen = preset === 'tiny-qwen2' || preset === 'tiny-qwen3';
  const addedDecoder: Record<string, unknown> = {};
  for (const a of added) addedDecoder[String(a.id)] = { content: a.content, lstrip: false, normalized: false, rstrip: false, single_word: false, special: true };
  const tokenizerConfig = {
    add_bos_token: false,
    add_eos_token: false,
    add_prefix_space: false,
    added_tokens_decoder: addedDecoder,
    additional_special_tokens: ['<|im_start|>', '<|im_end|>'],
    bos_token: qwen ? null : '<|im_start|>',
    chat_template: CHATML_TEMPLATE,
    // A true here would turn " ." into "." on decode and break round trips.
    clean_up_tokenization_spaces: false,
    eos_token: '<|im_end|>',
    model_max_length: cfg.maxPositionEmbeddings,
    pad_token: qwen ? '<|endoftext|>' : '<|im_end|>',
    tokenizer_class: qwen ? 'Qwen2Tokenizer' : 'GPT2Tokenizer',
    unk_token: qwen ? null : '<|endoftext|>',
    vocab_size: cfg.vocabSize,
  };
  return { tokenizer, tokenizerConfig };
}

const json = (v: unknown): Uint8Array => new TextEncoder().encode(JSON.stringify(v, null, 2) + '\n');

/**
 * Every file of a preset checkpoint, keyed by file name: config.json,
 * generation_config.json, tokenizer.json, tokenizer_config.json,
 * model.safetensors or model-0000i-of-0000n.safetensors + index.
 */
export function makeModel(preset: FixturePreset, seed = 0, opts: { tokenizerFiles?: TokenizerFiles } = {}): Map<string, Uint8Array> {
  if (!isFixturePreset(preset)) throw new Error(`unknown fixture preset "${String(preset)}" (have: ${FIXTURE_PRESETS.join(', ')})`);
  const spec = presetSpec(preset);
  const cfg = parseModelConfig(spec.config);
  const files = new Map<string, Uint8Array>();
  files.set('config.json', json(spec.config));
  const real = isRealVocabPreset(preset) ? realVocabSpec(preset) : null;
  if (real && !opts.tokenizerFiles) throw new Error(`fixture preset "${preset}" needs the published tokenizer files (from ${REAL_TOKENIZER_PACKAGE[preset as keyof typeof REAL_TOKENIZER_PACKAGE]}/models/)`);
  files.set('generation_config.json', json(real?.generationConfig ?? { bos_token_id: spec.config.bos_token_id, eos_token_id: spec.config.eos_token_id, transformers_version: '4.46.0' }));
  const { tokenizer, tokenizerConfig } = real ? opts.tokenizerFiles! : tokenizerFiles(cfg, preset);
  files.set('tokenizer.json', json(tokenizer));
  files.set('tokenizer_config.json', json(tokenizerConfig));

  const names = checkpointTensorNames(cfg);
  const written = preset === 'tiny-copy' ? copyModelTensors(cfg, mulberry32(fnv1a('tiny-copy codes', seed))) : null;
  const tensors: Array<[string, TensorEntry]> = names.map((name) => {
    const shape = expectedTensorShape(cfg, name)!;
    const n = shape.reduce((a, b) => a * b, 1);
    const { mean, std } = tensorInit(cfg, name);
    const values = written ? written.get(name)! : gaussian(name, seed, n, mean, std);
    if (values.length !== n) throw new Error(`${preset}: ${name} has ${values.length} values, its shape ${shape.join('×')}`);
    if (real && name === EMBED_TENSOR) {
      for (const id of real.boostRows.ids) for (let j = 0; j < cfg.hiddenSize; j++) values[id * cfg.hiddenSize + j]! *= real.boostRows.factor;
    }
    return [name, { dtype: 'BF16', shape, data: encodeTensor(values, 'bf16') }];
  });

  if (spec.shards === 1) {
    // The reference writer sorts tensors by name; layers.10 lands before layers.2.
    files.set('model.safetensors', serializeSafetensors([...tensors].sort(byName)));
    return files;
  }
  // Like save_pretrained: split in state-dict order by size, then each file sorted by name.
  const total = tensors.reduce((s, [, t]) => s + t.data.byteLength, 0);
  const groups: Array<Array<[string, TensorEntry]>> = [[]];
  let acc = 0;
  for (const entry of tensors) {
    const size = entry[1].data.byteLength;
    if (acc > 0 && acc + size > (total * groups.length) / spec.shards && groups.length < spec.shards) groups.push([]);
    groups[groups.length - 1]!.push(entry);
    acc += size;
  }
  const pad = (i: number): string => String(i).padStart(5, '0');
  const weightMap: Record<string, string> = {};
  groups.forEach((group, i) => {
    const file = `model-${pad(i + 1)}-of-${pad(groups.length)}.safetensors`;
    for (const [name] of group) weightMap[name] = file;
    files.set(file, serializeSafetensors([...group].sort(byName)));
  });
  files.set('model.safetensors.index.json', json({ metadata: { total_size: total }, weight_map: weightMap }));
  return files;
}
