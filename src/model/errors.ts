import type { MeshErrorCode } from '../protocol/errors.ts';

/**
 * A checkpoint that cannot be used as-is. Always names the file (and the
 * tensor when one is at fault): "bad model" with no location is useless to a
 * volunteer staring at a stuck download.
 */
export class ModelFormatError extends Error {
  readonly code: MeshErrorCode = 'MESH_ERR_MODEL_FORMAT';
  readonly file: string;
  readonly tensor: string | undefined;

  constructor(file: string, message: string, tensor?: string) {
    super(`${file}${tensor !== undefined ? ` [${tensor}]` : ''}: ${message}`);
    this.name = 'ModelFormatError';
    this.file = file;
    this.tensor = tensor;
  }
}

/**
 * A checkpoint file could not be fetched (HTTP error, connection cut
 * mid-body). Unlike ModelFormatError, retrying or another mirror may help.
 */
export class ModelFetchError extends Error {
  readonly code: MeshErrorCode = 'MESH_ERR_MODEL_FETCH';
  readonly file: string;
  /** The model host's HTTP status, when it answered. */
  readonly status: number | null;

  constructor(file: string, message: string, status: number | null = null) {
    super(`${file}: ${message}`);
    this.name = 'ModelFetchError';
    this.file = file;
    this.status = status;
  }
}
