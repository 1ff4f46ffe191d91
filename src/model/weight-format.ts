/**
 * The weight formats a node can hold its span in, and what a tensor costs in
 * each: what the tracker sizes spans by (src/tracker/model-registry.ts) and
 * what a node announces in its registration (`info.weight_format`).
 *
 *   f32  projections as f32 MatMul (fused graphs), or the plain graphs in f32
 *   f16  the plain graphs in f16 (a WebGPU adapter with `shader-f16`)
 *   q4   projections as 4-bit MatMulNBits (quantize.ts: block 32, symmetric,
 *        0.625 bytes a weight, ~6.4x smaller than f32); norms, biases, the
 *        embedding and a tied head stay f32
 */
import type { NodeInfo } from '../protocol/tracker.ts';
import { LM_HEAD_TENSOR } from './config.ts';
import { q4Bytes } from './quantize.ts';

export const WEIGHT_FORMATS = ['f32', 'f16', 'q4'] as const;
export type WeightFormat = (typeof WEIGHT_FORMATS)[number];

// The wire schema (src/protocol/tracker.ts) spells the same list out; this fails to compile if they drift.
type WireFormat = NonNullable<NodeInfo['weight_format']>;
const _sameFormats: [WeightFormat, WireFormat] extends [WireFormat, WeightFormat] ? true : never = true;
void _sameFormats;

/** Whether `name` is a matrix the q4 format quantizes: the layers' projections and an untied LM head. */
export function isQuantizedTensor(name: string, shape: readonly number[]): boolean {
  return shape.length === 2 && (/_proj\.weight$/.test(name) || name === LM_HEAD_TENSOR);
}

/** Bytes a node holds for one checkpoint tensor in `format` (`f32Bytes`: the tracker's f32 cost of it, params × its weightBytesPerParam). */
export function tensorBytesIn(format: WeightFormat, name: string, shape: readonly number[], f32BytesPerParam = 4): number {
  const params = shape.reduce((a, b) => a * b, 1);
  if (format === 'f32') return params * f32BytesPerParam;
  if (format === 'f16') return params * 2;
  return isQuantizedTensor(name, shape) ? q4Bytes(shape[0]!, shape[1]!, 'symmetric') : params * 4;
}
