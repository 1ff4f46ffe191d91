/**
 * The sampler graph: what a device must send back for the CPU to draw a
 * token at temperature > 0 without the vocabulary's logits (a 152k vocab is
 * 594 KiB of f32 a step; the GPU path allows 64 KiB: docs/architecture.md). It runs on the head's
 * logits where they already are (a GPU buffer) and gives, per row:
 *
 *   top_values  f32   [batch, K]  the K = candidates + 1 largest logits, largest first
 *   top_ids     int64 [batch, K]  their token ids
 *   logsumexp_t f32   [batch]     log Σ_v exp((l_v − l_max) / T) over the whole vocabulary
 *   logsumexp   f32   [batch]     log Σ_v exp(l_v − l_max) (the model's log-softmax normalizer)
 *
 * from logits f32 [batch, vocab] and temperature f32 [batch, 1]. Subtracting
 * the row maximum first keeps every exponent ≤ 0: ReduceLogSumExp on WebGPU
 * sums exp(x) as it comes, which overflows f32 past x ≈ 88 (logits / 0.1).
 * The CPU side (src/shard/candidate-sampling.ts) decides from these exactly
 * what sampling.ts decides over the full logits, or says it cannot.
 */
import { ElemType, GraphBuilder } from './onnx-builder.ts';
import type { BuiltGraph } from './graph.ts';

export const SAMPLER_IO = {
  logits: 'logits',
  temperature: 'temperature',
  values: 'top_values',
  ids: 'top_ids',
  logSumExpT: 'logsumexp_t',
  logSumExp: 'logsumexp',
} as const;

/**
 * Candidates a sampled step brings back by default: 257 × 12 B ≈ 3 KiB. Covers
 * the usual top_k (20–100) exactly, and at temperature ≤ 1 most of a trained
 * model's mass.
 */
export const DEFAULT_SAMPLER_CANDIDATES = 256;

export function buildSamplerGraph(vocabSize: number, candidates = DEFAULT_SAMPLER_CANDIDATES): BuiltGraph {
  if (!(Number.isInteger(candidates) && candidates >= 1)) throw new RangeError(`sampler candidates ${candidates} must be a positive integer`);
  // One more than asked: the smallest candidate may tie with a token left out, so only those above it
  // are known to be in order (candidate-sampling.ts); this way a top_k of `candidates` is decided.
  const K = Math.min(candidates + 1, vocabSize);
  const g = new GraphBuilder('sampler');
  const logits = g.input(SAMPLER_IO.logits, ElemType.FLOAT, ['batch', vocabSize]);
  const t = g.input(SAMPLER_IO.temperature, ElemType.FLOAT, ['batch', 1]);
  // sorted: largest first; ONNX breaks ties by the lower index, but the CPU side does not rely on it.
  const [values] = g.op('TopK', [logits, g.constI64('k', [K])], { axis: -1, largest: 1, sorted: 1 }, [SAMPLER_IO.values, SAMPLER_IO.ids]);
  g.output(SAMPLER_IO.values, ElemType.FLOAT, ['batch', K]);
  g.output(SAMPLER_IO.ids, ElemType.INT64, ['batch', K]);
  const max = g.op1('Gather', [values!, g.constI64('first', [0])], { axis: 1 }); // [batch, 1]
  const shifted = g.op1('Sub', [logits, max]);
  g.op1('ReduceLogSumExp', [shifted], { axes: [-1], keepdims: 0 }, SAMPLER_IO.logSumExp);
  g.output(SAMPLER_IO.logSumExp, ElemType.FLOAT, ['batch']);
  g.op1('ReduceLogSumExp', [g.op1('Div', [shifted, t])], { axes: [-1], keepdims: 0 }, SAMPLER_IO.logSumExpT);
  g.output(SAMPLER_IO.logSumExpT, ElemType.FLOAT, ['batch']);
  return { bytes: g.encode(), weightBytes: g.initializerBytes() };
}
