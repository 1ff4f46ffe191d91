/**
 * The checks every executor applies to a ForwardRequest before it runs
 * anything: layer range, input (token ids or an activation), position,
 * declared session length and context. One place, so the plain and fused executors answer bad input with
 * the same codes and messages.
 */
import type { ModelConfig } from '../model/config.ts';
import { firstNonFinite } from '../protocol/tensor.ts';
import { badRequestError, badShapeError, layerRangeError, nonFiniteError, tooLargeError } from './errors.ts';
import { validateSampling } from './sampling.ts';
import type { ForwardRequest } from './contract.ts';

export interface HeldSpan {
  startLayer: number;
  endLayer: number;
  holdsEmbedding: boolean;
  maxContext: number;
}

export type ForwardInput =
  | { kind: 'tokens'; ids: BigInt64Array; seq: number; start: number; end: number; position: number }
  | { kind: 'activation'; data: Float32Array; seq: number; start: number; end: number; position: number };

export function checkForwardInput(cfg: ModelConfig, held: HeldSpan, req: ForwardRequest): ForwardInput {
  const span = { startLayer: held.startLayer, endLayer: held.endLayer };
  const start = req.startLayer ?? held.startLayer;
  const end = req.endLayer ?? held.endLayer;
  if (!(Number.isInteger(start) && Number.isInteger(end) && held.startLayer <= start && start < end && end <= held.endLayer)) {
    throw layerRangeError(`layers [${start}, ${end}) are not within the held range [${held.startLayer}, ${held.endLayer})`, span);
  }
  if (req.sampling) validateSampling(req.sampling);
  const position = req.position ?? 0;
  if (!(Number.isInteger(position) && position >= 0)) throw badRequestError(`position ${position} is not a non-negative integer`);
  if (req.session === undefined && position !== 0) throw badRequestError('a stateless forward (no session) starts at position 0');
  const declared = req.sessionTokens;
  if (declared !== undefined && !(Number.isInteger(declared) && declared >= 0)) throw badRequestError(`session tokens ${declared} is not a non-negative integer`);

  let input: ForwardInput;
  if (req.tokenIds !== undefined) {
    if (req.activation) throw badRequestError('give token ids or an activation, not both');
    if (!held.holdsEmbedding || start !== 0) throw layerRangeError('token ids need the embedding, held only by the shard of layer 0 starting there', span);
    const seq = req.tokenIds.length;
    if (seq === 0) throw badShapeError('no token ids');
    const ids = new BigInt64Array(seq);
    req.tokenIds.forEach((t, i) => {
      if (!(Number.isInteger(t) && t >= 0 && t < cfg.vocabSize)) throw badRequestError(`token id ${t} is outside 0..${cfg.vocabSize - 1}`);
      ids[i] = BigInt(t);
    });
    input = { kind: 'tokens', ids, seq, start, end, position };
  } else if (req.activation) {
    const { data, shape } = req.activation;
    if (shape.length !== 3 || shape[0] !== 1 || shape[2] !== cfg.hiddenSize || !Number.isInteger(shape[1]) || shape[1]! < 1) {
      throw badShapeError(`activation shape [${shape.join(',')}] is not [1, seq, ${cfg.hiddenSize}]`);
    }
    const seq = shape[1]!;
    if (data.length !== seq * cfg.hiddenSize) throw badShapeError(`activation has ${data.length} values, shape [${shape.join(',')}] needs ${seq * cfg.hiddenSize}`);
    const bad = firstNonFinite(data);
    if (bad >= 0) throw nonFiniteError(bad, data[bad]!);
    input = { kind: 'activation', data, seq, start, end, position };
  } else throw badRequestError('no input: give token ids or an activation');

  if (position + input.seq > held.maxContext) {
    throw tooLargeError(req.session === undefined ? `${input.seq} tokens exceed the context of ${held.maxContext}` : `positions up to ${position + input.seq} exceed the context of ${held.maxContext}`);
  }
  return input;
}

/** The hidden rows `rows` of [seq, hidden] gathered into one [rows.length, hidden] buffer; a bad index is the caller's error. */
export function gatherRows(hidden: Float32Array, seq: number, width: number, rows: readonly number[]): Float32Array {
  const out = new Float32Array(rows.length * width);
  rows.forEach((r, i) => {
    if (!(Number.isInteger(r) && r >= 0 && r < seq)) throw badRequestError(`logit row ${r} is outside the call's ${seq} rows`);
    out.set(hidden.subarray(r * width, (r + 1) * width), i * width);
  });
  return out;
}
