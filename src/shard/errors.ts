/**
 * Typed errors of the shard executor. Each carries a stable MESH_ERR_* code
 * (and so its HTTP status) from src/protocol/errors.ts, so the node's forward
 * handler turns them into 4xx bodies without string matching.
 */
import { MeshError } from '../protocol/errors.ts';

/** 409: the session's cache does not hold `position` tokens; replay from `actualLength`. */
export class PositionMismatchError extends MeshError {
  readonly actualLength: number;
  constructor(session: string, expected: number, actualLength: number) {
    super('MESH_ERR_POSITION_MISMATCH', `session ${session}: cache holds ${actualLength} tokens, request is at position ${expected}`, {
      actual_length: actualLength,
    });
    this.actualLength = actualLength;
  }
}

/** 416: the requested layers are not (all) held here, or do not start/stop on a graph boundary. */
export function layerRangeError(message: string, held: { startLayer: number; endLayer: number }): MeshError {
  return new MeshError('MESH_ERR_LAYER_RANGE', message, { start_layer: held.startLayer, end_layer: held.endLayer });
}

export function badShapeError(message: string): MeshError {
  return new MeshError('MESH_ERR_BAD_SHAPE', message);
}

export function nonFiniteError(index: number, value: number): MeshError {
  return new MeshError('MESH_ERR_NON_FINITE', `activation element ${index} is ${value}`, { index });
}

export function badRequestError(message: string): MeshError {
  return new MeshError('MESH_ERR_BAD_REQUEST', message);
}

/** 413: the call would run past the preallocated context, or one session exceeds the KV budget. */
export function tooLargeError(message: string): MeshError {
  return new MeshError('MESH_ERR_TOO_LARGE', message);
}
