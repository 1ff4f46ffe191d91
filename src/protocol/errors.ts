/**
 * Stable error codes shared by relay, node and tracker. Every code maps to
 * one HTTP status, so an error keeps its meaning whether it travels as a
 * fast-path frame, an `/rpc` JSON answer or a direct HTTP response.
 * docs/protocol.md lists each with one sentence.
 */
export const ERROR_STATUS = {
  MESH_ERR_BAD_REQUEST: 400,
  MESH_ERR_BAD_FRAME: 400,
  MESH_ERR_BAD_SHAPE: 400,
  MESH_ERR_NON_FINITE: 400,
  MESH_ERR_UNAUTHORIZED: 401,
  MESH_ERR_FORBIDDEN: 403,
  MESH_ERR_NO_SUCH_PEER: 404,
  MESH_ERR_NOT_FOUND: 404,
  MESH_ERR_METHOD_NOT_ALLOWED: 405,
  MESH_ERR_POSITION_MISMATCH: 409,
  MESH_ERR_TOO_LARGE: 413,
  MESH_ERR_LAYER_RANGE: 416,
  MESH_ERR_TOO_MANY_REQUESTS: 429,
  MESH_ERR_INTERNAL: 500,
  MESH_ERR_PEER_GONE: 502,
  MESH_ERR_UPSTREAM: 502,
  MESH_ERR_BACKPRESSURE: 503,
  MESH_ERR_SHUTTING_DOWN: 503,
  MESH_ERR_UNAVAILABLE: 503,
  MESH_ERR_TIMEOUT: 504,
  MESH_ERR_CANCELLED: 499,
} as const;

export type MeshErrorCode = keyof typeof ERROR_STATUS;

export interface ErrorBody {
  error: { code: string; message: string; [extra: string]: unknown };
}

export class MeshError extends Error {
  override readonly name = 'MeshError';
  readonly status: number;
  constructor(
    readonly code: MeshErrorCode,
    message: string,
    readonly details: Record<string, unknown> = {},
  ) {
    super(message);
    this.status = ERROR_STATUS[code];
  }

  toBody(): ErrorBody {
    return { error: { code: this.code, message: this.message, ...this.details } };
  }
}

export function isMeshError(e: unknown): e is MeshError {
  return e instanceof MeshError;
}

export function errorBody(code: MeshErrorCode | string, message: string, details: Record<string, unknown> = {}): ErrorBody {
  return { error: { code, message, ...details } };
}

/** The code carried by an error-shaped JSON body, if any. */
export function errorCodeOf(body: unknown): string | undefined {
  if (typeof body === 'object' && body !== null && 'error' in body) {
    const err = (body as { error: unknown }).error;
    if (typeof err === 'object' && err !== null && typeof (err as { code?: unknown }).code === 'string') {
      return (err as { code: string }).code;
    }
  }
  return undefined;
}

const utf8d = new TextDecoder();

/**
 * A remote error body (`{"error":{"code","message"}}`, as bytes) as a
 * MeshError, keeping its code when we know it.
 */
export function meshErrorFromBody(body: Uint8Array, fallback: string): MeshError {
  try {
    const v = JSON.parse(utf8d.decode(body)) as { error?: { code?: unknown; message?: unknown } };
    const code = v.error?.code;
    const message = typeof v.error?.message === 'string' ? v.error.message : fallback;
    if (typeof code === 'string' && code in ERROR_STATUS) return new MeshError(code as MeshErrorCode, message);
    return new MeshError('MESH_ERR_UPSTREAM', message, { remoteCode: code });
  } catch {
    return new MeshError('MESH_ERR_UPSTREAM', fallback);
  }
}
