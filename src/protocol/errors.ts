/**
 * Stable error codes shared by relay, node, tracker and the donor page.
 * Every code maps to one HTTP status — an answer's status is always its
 * code's — so an error keeps its meaning whether it travels as a fast-path
 * frame, an `/rpc` JSON answer, a direct HTTP response or a page's status.
 * docs/protocol.md §6 lists each with one sentence (a test holds the two
 * tables equal).
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
  MESH_ERR_MISDIRECTED: 421,
  MESH_ERR_MODEL_FORMAT: 422,
  MESH_ERR_TOO_MANY_REQUESTS: 429,
  MESH_ERR_INTERNAL: 500,
  MESH_ERR_PEER_GONE: 502,
  MESH_ERR_UPSTREAM: 502,
  MESH_ERR_MODEL_FETCH: 502,
  MESH_ERR_WEIGHTS_CORRUPT: 502,
  MESH_ERR_BACKPRESSURE: 503,
  MESH_ERR_BUSY: 503,
  MESH_ERR_SHUTTING_DOWN: 503,
  MESH_ERR_UNAVAILABLE: 503,
  MESH_ERR_TIMEOUT: 504,
  MESH_ERR_QUOTA: 507,
  MESH_ERR_DEVICE_MEMORY: 507,
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

export function isMeshErrorCode(code: unknown): code is MeshErrorCode {
  return typeof code === 'string' && Object.prototype.hasOwnProperty.call(ERROR_STATUS, code);
}

/**
 * `Retry-After` (whole seconds, at least 1) for an error whose details carry
 * `retry_after_ms`; undefined for any other error.
 */
export function retryAfterHeader(details: Record<string, unknown>): string | undefined {
  const ms = details.retry_after_ms;
  if (typeof ms !== 'number' || !Number.isFinite(ms) || ms < 0) return undefined;
  return String(Math.max(1, Math.ceil(ms / 1000)));
}

/** The generic code of each status, for an error answer that names no code we know. */
const STATUS_CODE: Readonly<Record<number, MeshErrorCode>> = {
  400: 'MESH_ERR_BAD_REQUEST',
  401: 'MESH_ERR_UNAUTHORIZED',
  403: 'MESH_ERR_FORBIDDEN',
  404: 'MESH_ERR_NOT_FOUND',
  405: 'MESH_ERR_METHOD_NOT_ALLOWED',
  409: 'MESH_ERR_POSITION_MISMATCH',
  413: 'MESH_ERR_TOO_LARGE',
  416: 'MESH_ERR_LAYER_RANGE',
  421: 'MESH_ERR_MISDIRECTED',
  422: 'MESH_ERR_MODEL_FORMAT',
  429: 'MESH_ERR_TOO_MANY_REQUESTS',
  499: 'MESH_ERR_CANCELLED',
  503: 'MESH_ERR_UNAVAILABLE',
  504: 'MESH_ERR_TIMEOUT',
  507: 'MESH_ERR_QUOTA',
};

/** The code a bare status means; any other status is the far side's failure, MESH_ERR_UPSTREAM. */
export function codeForStatus(status: number): MeshErrorCode {
  return STATUS_CODE[status] ?? 'MESH_ERR_UPSTREAM';
}

const utf8d = new TextDecoder();

/**
 * The one decoder of remote errors: an error answer from a relay, a node, a
 * head or the tracker — `{"error":{"code","message"}}` as bytes or already
 * parsed — with the status it came with (none for a streamed answer's
 * error frame or a generate error event).
 *
 * A code we know is kept, and with it its own status (`remote_status` says
 * when the answer came with another); an unknown or missing code is read
 * from the status (`remote_code` keeps an unknown one); no status either:
 * MESH_ERR_UPSTREAM. `context` is put before the message ("context: message").
 * A numeric `retry_after_ms` in the body is kept in the details.
 */
export function remoteError(status: number | undefined, body: unknown, context = ''): MeshError {
  let parsed = body;
  if (body instanceof Uint8Array) {
    try {
      parsed = body.byteLength === 0 ? undefined : JSON.parse(utf8d.decode(body));
    } catch {
      parsed = undefined;
    }
  }
  const err = typeof parsed === 'object' && parsed !== null ? (parsed as { error?: unknown }).error : undefined;
  const code = typeof err === 'object' && err !== null ? (err as { code?: unknown }).code : undefined;
  const remoteMessage = typeof err === 'object' && err !== null ? (err as { message?: unknown }).message : undefined;
  const text = typeof remoteMessage === 'string' ? remoteMessage : status !== undefined ? `HTTP ${status}` : 'an error without a message';
  const message = context ? `${context}: ${text}` : text;
  const details: Record<string, unknown> = {};
  // A refusal that says when to come back (MESH_ERR_BUSY) keeps saying so one hop further.
  const retryMs = typeof err === 'object' && err !== null ? (err as { retry_after_ms?: unknown }).retry_after_ms : undefined;
  if (typeof retryMs === 'number' && Number.isFinite(retryMs) && retryMs >= 0) details.retry_after_ms = retryMs;
  if (isMeshErrorCode(code)) {
    if (status !== undefined && status !== ERROR_STATUS[code]) details.remote_status = status;
    return new MeshError(code, message, details);
  }
  if (code !== undefined) details.remote_code = code;
  if (status !== undefined) details.remote_status = status;
  return new MeshError(status !== undefined ? codeForStatus(status) : 'MESH_ERR_UPSTREAM', message, details);
}
