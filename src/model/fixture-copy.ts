/**
 * The `tiny-copy` fixture: a Llama checkpoint whose weights are written by
 * hand, not drawn, so that it copies its input the way an induction head
 * does. Random-weight fixtures never repeat what they were given, so
 * nothing else here shows what prompt lookup (n-gram drafting) gains on
 * input-grounded text; this model is that text's stand-in.
 *
 * What it computes (greedy): after the tokens … a b, the token that followed
 * the most recent earlier "a b" in the context (else the one after the most
 * recent "b"). Given a passage and then its first words again, it writes the
 * passage on.
 *
 * The residual stream holds five blocks of CODE dims: A the token's code
 * (a ±1 vector per id, from the embedding), B1 and B2 the codes of the one
 * and two tokens before (layer 0), O the code of the predicted token (last
 * layer), C a constant (what position-only queries and keys are made of).
 *
 * - Layer 0, two heads: head h attends from position m to m − (h + 1). RoPE
 *   makes q_m·k_n depend on n − m only; with q = (Q, 0) and k = R(δθ)(K, 0)
 *   in each of the FAST rotating pairs, the score is Σ QK cos((n − m + δ)θ),
 *   largest at n = m − δ. Its value is the A block, written into B(h+1).
 * - Last layer, head 0: query [A, B1] of position m against key [B1, B2] of
 *   position n in pairs that barely rotate (θ < 1e-5 over the context): the
 *   score counts how many of the last two tokens match the two before n (an
 *   earlier "a b" scores twice a lone "b"); one medium pair adds a small
 *   recency bias (cos of the distance times a slow θ), so the most recent
 *   match wins. Its value is n's A block, written into O.
 * - The LM head reads O against every id's code. Every other weight (the MLPs,
 *   the layers between, the unused heads) is zero: those layers pass the
 *   residual stream through, so the mesh still runs every layer for real.
 *
 * Pure like fixture.ts: only + × / and one Math.pow per frequency (the RoPE
 * tables are made with the same formula); the rotated keys are rounded to a
 * grid of 1/64 so bytes do not depend on an engine's last bit of cos/sin.
 */
import type { ModelConfig } from './config.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR } from './config.ts';

/** Dims of each block's code. */
const CODE = 64;
/** Tokens the match looks back over: after … a b c, what followed the last earlier "a b c". */
const NGRAM = 3;
const A = 0;
/** B(δ): the code of the token δ back, δ = 1 … NGRAM. */
const B = (delta: number): number => delta * CODE;
const O = (NGRAM + 1) * CODE;
const C = (NGRAM + 2) * CODE;
const HEAD_DIM = 384;
/** Rotating pairs the position-only heads use (the fastest ones). */
const FAST = 8;
/** Pair (its θ ≈ 5.6e-3 at θ-base 1e12, head_dim 384) that carries the recency bias. */
const RECENCY_PAIR = 36;

export const COPY_CONFIG = {
  vocab_size: 512, hidden_size: (NGRAM + 3) * CODE, intermediate_size: 64, num_hidden_layers: 6,
  num_attention_heads: NGRAM, num_key_value_heads: NGRAM, head_dim: HEAD_DIM,
  max_position_embeddings: 2048, rope_theta: 1e12, rope_scaling: null,
  tie_word_embeddings: false, bos_token_id: 1, eos_token_id: 2,
} as const;

/** The ±1 code of each id, from a seeded stream (same seed, same codes, everywhere). */
function codes(vocab: number, rand: () => number): Int8Array {
  const out = new Int8Array(vocab * CODE);
  for (let i = 0; i < out.length; i++) out[i] = rand() < 0.5 ? -1 : 1;
  return out;
}

/** Round to a grid of 1/64 (see above). */
const grid = (x: number): number => Math.round(x * 64) / 64;

/** cos and sin by their series (|x| ≤ 2 here): + and × only. */
function cosSin(x: number): [number, number] {
  let c = 0;
  let s = 0;
  let term = 1; // x^n / n!
  for (let n = 0; n < 30; n++) {
    const r = n % 4;
    if (r === 0) c += term;
    else if (r === 1) s += term;
    else if (r === 2) c -= term;
    else s -= term;
    term = (term * x) / (n + 1);
  }
  return [c, s];
}

/**
 * Every tensor of the checkpoint by name, f32 (the caller stores them bf16).
 * `rand`: the seeded uniform stream for the codes.
 */
export function copyModelTensors(cfg: ModelConfig, rand: () => number): Map<string, Float32Array> {
  const H = cfg.hiddenSize;
  const hd = cfg.headDim;
  const half = hd / 2;
  const heads = cfg.numHeads;
  const V = cfg.vocabSize;
  if (H !== COPY_CONFIG.hidden_size || heads !== NGRAM || cfg.numKvHeads !== NGRAM || hd !== HEAD_DIM || cfg.numLayers < 2) throw new Error('tiny-copy: the weights are written for its own config only');
  const code = codes(V, rand);
  const t = new Map<string, Float32Array>();
  const zeros = (n: number) => new Float32Array(n);

  // The embedding: A = the code, C = 1.
  const embed = zeros(V * H);
  for (let id = 0; id < V; id++) {
    for (let j = 0; j < CODE; j++) {
      embed[id * H + A + j] = code[id * CODE + j]!;
      embed[id * H + C + j] = 1;
    }
  }
  t.set(EMBED_TENSOR, embed);

  const inv = (i: number) => 1 / Math.pow(cfg.ropeTheta, (2 * i) / hd);
  // RMSNorm scales each layer's input by 1/rms: layer 0 sees A and C, the last layer every block but O.
  const rms0 = Math.sqrt(2 / (NGRAM + 3));
  const rmsL = Math.sqrt((NGRAM + 2) / (NGRAM + 3));
  const scale = Math.sqrt(hd);
  // Position-only heads: QK · Σcos over FAST pairs / √hd; the next-best offset is 1.7 QK / √hd ≈ 22 lower.
  const QK = 256;
  // Match head: q and k carry m · code, so each matching block adds 64 m² / √hd = 40 to the score
  // (three matching tokens 120, two 80, one 40; unrelated codes ± 5).
  const m = Math.sqrt((40 * scale) / CODE);
  // Recency: R² / √hd · (1 − cos(θ d)): 1.4 at d = 60 tokens, 20 at 250; it grows up to d = π/θ ≈ 560
  // (the contexts this model is for are shorter).
  const R = Math.sqrt((20 * scale) / (1 - cosSin(250 * inv(RECENCY_PAIR))[0]));

  for (let l = 0; l < cfg.numLayers; l++) {
    const p = `model.layers.${l}`;
    t.set(`${p}.input_layernorm.weight`, new Float32Array(H).fill(1));
    t.set(`${p}.post_attention_layernorm.weight`, new Float32Array(H).fill(1));
    const q = zeros(heads * hd * H);
    const k = zeros(heads * hd * H);
    const v = zeros(heads * hd * H);
    const o = zeros(H * heads * hd);
    if (l === 0) {
      // Head h looks δ = h + 1 back and writes that token's code into B(δ).
      for (let h = 0; h < heads; h++) {
        const delta = h + 1;
        for (let i = 0; i < FAST; i++) {
          const [cs, sn] = cosSin(delta * inv(i));
          // Each row sums C's 64 entries (1/rms0 each after the norm).
          for (let j = 0; j < CODE; j++) {
            q[(h * hd + i) * H + C + j] = (Math.sqrt(QK) * rms0) / CODE;
            k[(h * hd + i) * H + C + j] = grid(Math.sqrt(QK) * cs) * (rms0 / CODE);
            k[(h * hd + i + half) * H + C + j] = grid(Math.sqrt(QK) * sn) * (rms0 / CODE);
          }
        }
        for (let j = 0; j < CODE; j++) {
          v[(h * hd + j) * H + A + j] = rms0;
          o[(B(delta) + j) * heads * hd + h * hd + j] = 1;
        }
      }
    } else if (l === cfg.numLayers - 1) {
      // Head 0, the slowest pairs (half − NGRAM·CODE/2 … half − 1), both coordinates of each:
      // query block r ∈ {A, B1, …} of m against key block B(r + 1) of n.
      const first = half - (NGRAM * CODE) / 2;
      for (let r = 0; r < NGRAM; r++) {
        const qBlock = r === 0 ? A : B(r);
        for (let j = 0; j < CODE; j++) {
          const flat = r * CODE + j; // 0 … NGRAM·CODE − 1 over the pairs' first, then second coordinates
          const dim = flat < (NGRAM * CODE) / 2 ? first + flat : half + first + flat - (NGRAM * CODE) / 2;
          q[dim * H + qBlock + j] = m * rmsL;
          k[dim * H + B(r + 1) + j] = m * rmsL;
        }
      }
      for (let j = 0; j < CODE; j++) {
        q[RECENCY_PAIR * H + C + j] = (R * rmsL) / CODE;
        k[RECENCY_PAIR * H + C + j] = (R * rmsL) / CODE;
        v[j * H + A + j] = rmsL;
        o[(O + j) * heads * hd + j] = 1;
      }
    }
    t.set(`${p}.self_attn.q_proj.weight`, q);
    t.set(`${p}.self_attn.k_proj.weight`, k);
    t.set(`${p}.self_attn.v_proj.weight`, v);
    t.set(`${p}.self_attn.o_proj.weight`, o);
    t.set(`${p}.mlp.gate_proj.weight`, zeros(cfg.intermediateSize * H));
    t.set(`${p}.mlp.up_proj.weight`, zeros(cfg.intermediateSize * H));
    t.set(`${p}.mlp.down_proj.weight`, zeros(H * cfg.intermediateSize));
  }
  t.set(FINAL_NORM_TENSOR, new Float32Array(H).fill(1));
  // Logits: each id's code against O (the final norm's input has rms ≈ 1): 64 · 0.1 for the copied id, about ±0.8 for the rest.
  const head = zeros(V * H);
  for (let id = 0; id < V; id++) for (let j = 0; j < CODE; j++) head[id * H + O + j] = 0.1 * code[id * CODE + j]!;
  t.set(LM_HEAD_TENSOR, head);
  return t;
}
