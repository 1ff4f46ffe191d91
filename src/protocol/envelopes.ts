/**
 * JSON messages of docs/protocol.md §1–3, as zod schemas and the types inferred
 * from them. Everything a socket receives is parsed through these before use.
 */
import { z } from 'zod';
import { decodeBase64, encodeBase64 } from './base64.ts';
import { MeshError, retryAfterHeader } from './errors.ts';
import { H, normalizeHeaders, isTextContentType, type HeaderMap } from './headers.ts';
import { concatBytes } from './bytes.ts';

const headersSchema = z.record(z.string(), z.union([z.string(), z.number(), z.boolean()]).transform(String));
const requestId = z.string().min(1).max(128);

export const challengeSchema = z.object({ type: z.literal('challenge'), nonce: z.string().regex(/^[0-9a-f]{16,128}$/) });
export const registerSchema = z.object({
  type: z.literal('register'),
  public_key: z.string().min(1).max(128),
  signature: z.string().min(1).max(256),
  info: z.record(z.string(), z.unknown()).default({}),
});
export const registeredSchema = z.object({
  type: z.literal('registered'),
  peer_id: z.string(),
  relay_addr: z.string(),
  features: z.array(z.string().max(64)).max(32).optional(),
  /** A relay in a cluster: the base URLs of its relays (itself first), where the peer may register when this one goes. */
  relays: z.array(z.string().max(500)).max(64).optional(),
});

/** The `registered` feature of a relay (or a direct link's node) that forwards one-way REQUEST frames (FLAG_ONE_WAY). */
export const ONE_WAY_FEATURE = 'one-way';

/** The `registered` feature of a relay in a cluster: peers attached to any relay of the cluster are reachable on this connection's fast path. */
export const CLUSTER_FEATURE = 'cluster';

/**
 * The `registered` feature of a relay that tells a peer when another peer it
 * watches detaches (docs/protocol.md §9): the peer sends
 * `{type:'watch-peer', peer_id}`, the relay answers `{type:'peer-watch',
 * peer_id, attached}` and, when that peer's socket closes, `{type:'peer-gone',
 * peer_id}` (once; watch again after). `{type:'unwatch-peer', peer_id}` stops it.
 */
export const PEER_WATCH_FEATURE = 'peer-watch';

/**
 * The `registered` feature of a relay that holds a watch of a peer not
 * attached to it (docs/protocol.md §9): the `peer-watch` answer says
 * `attached: false` and, when that peer attaches to this relay later, the
 * relay sends `{type:'peer-watch', peer_id, attached: true}` unasked; the
 * watch then goes on as an attached one (`peer-gone` when it detaches). A
 * peer of a relay without it asks again to learn that the peer attached.
 */
export const PEER_BACK_FEATURE = 'peer-back';

/** A register message's key and signature, decoded; or why the sender must be refused, and with which close code of §8. */
export type RegisterCredentials =
  | { ok: true; publicKey: Uint8Array; signature: Uint8Array; info: Record<string, unknown> }
  | { ok: false; close: 'policy' | 'badSignature'; reason: string };

/** The first message on `/ws` (and on a node's `/link`): parsed, base64url-decoded and length-checked; the signature is the caller's to verify. */
export function parseRegister(text: string): RegisterCredentials {
  let msg: unknown;
  try {
    msg = JSON.parse(text);
  } catch {
    return { ok: false, close: 'policy', reason: 'first message must be a JSON register message' };
  }
  const parsed = registerSchema.safeParse(msg);
  if (!parsed.success) return { ok: false, close: 'policy', reason: 'malformed register message' };
  let publicKey: Uint8Array;
  let signature: Uint8Array;
  try {
    publicKey = decodeBase64(parsed.data.public_key);
    signature = decodeBase64(parsed.data.signature);
  } catch {
    return { ok: false, close: 'badSignature', reason: 'public_key and signature must be base64url' };
  }
  if (publicKey.byteLength !== 32 || signature.byteLength !== 64) return { ok: false, close: 'badSignature', reason: 'public_key must be 32 bytes and signature 64 bytes' };
  return { ok: true, publicKey, signature, info: parsed.data.info };
}

const bodyFields = { body_base64: z.string().optional(), body: z.string().optional() };

export const relayHttpRequestSchema = z.object({
  type: z.literal('relay-http-request'),
  request_id: requestId,
  method: z.string().min(1).max(16),
  path: z.string().min(1).max(8192),
  headers: headersSchema.default({}),
  ...bodyFields,
});
export const relayHttpResponseSchema = z.object({
  type: z.literal('relay-http-response'),
  request_id: requestId,
  status: z.number().int().min(100).max(599),
  headers: headersSchema.default({}),
  ...bodyFields,
});
/** What an `/rpc` caller sends (the ADR's request, without `type`). */
export const rpcRequestSchema = z.object({
  request_id: requestId,
  method: z.string().min(1).max(16).default('POST'),
  path: z.string().min(1).max(8192),
  headers: headersSchema.default({}),
  ...bodyFields,
});
export const rpcResponseSchema = z.object({
  request_id: requestId.nullable(),
  status: z.number().int().min(100).max(599),
  headers: headersSchema.default({}),
  ...bodyFields,
});

export type ChallengeMsg = z.infer<typeof challengeSchema>;
export type RegisterMsg = z.input<typeof registerSchema>;
export type RegisteredMsg = z.infer<typeof registeredSchema>;
export type RelayHttpRequest = z.infer<typeof relayHttpRequestSchema>;
export type RelayHttpResponse = z.infer<typeof relayHttpResponseSchema>;
export type RpcRequest = z.infer<typeof rpcRequestSchema>;
export type RpcResponse = z.infer<typeof rpcResponseSchema>;

/** Any JSON message a peer may receive from the relay on `/ws`. */
export const relayToPeerSchema = z.discriminatedUnion('type', [challengeSchema, registeredSchema, relayHttpRequestSchema, z.object({ type: z.literal('error'), code: z.string(), message: z.string() })]);
export type RelayToPeer = z.infer<typeof relayToPeerSchema>;

/** A host-neutral HTTP request: what a bridge handler receives. */
export interface MeshRequest {
  method: string;
  path: string;
  headers: HeaderMap;
  body: Uint8Array;
  /** Fires when the caller cancels or its connection drops. */
  signal?: AbortSignal;
  /**
   * The sender's peer id as the connection names it: a relay writes it into
   * every REQUEST frame it forwards, a direct link or data channel the peer
   * that proved itself at its start. Absent for envelopes and HTTP (anonymous).
   */
  readonly from?: string | undefined;
}

/** A host-neutral answer. `body` may be streamed (several chunks, then end). */
export interface MeshResponse {
  status: number;
  headers: HeaderMap;
  body: Uint8Array | AsyncIterable<Uint8Array>;
}

/** A fully received answer (what a caller gets back). */
export interface MeshReply {
  status: number;
  headers: HeaderMap;
  body: Uint8Array;
}

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

/** Body of an envelope (`body_base64` or `body`) as bytes. */
export function envelopeBody(m: { body_base64?: string | undefined; body?: string | undefined }): Uint8Array {
  if (m.body_base64 !== undefined) {
    try {
      return decodeBase64(m.body_base64);
    } catch {
      throw new MeshError('MESH_ERR_BAD_REQUEST', 'body_base64 is not valid base64');
    }
  }
  if (m.body !== undefined) return utf8.encode(m.body);
  return new Uint8Array(0);
}

/** Envelope body fields for bytes: text for text content types, base64 otherwise, nothing when empty. */
export function bodyFieldsFor(body: Uint8Array, headers: HeaderMap): { body_base64?: string; body?: string } {
  if (body.byteLength === 0) return {};
  const ct = headers['content-type'] ?? headers['Content-Type'];
  if (isTextContentType(ct)) {
    try {
      return { body: new TextDecoder('utf-8', { fatal: true }).decode(body) };
    } catch {
      // not valid UTF-8 after all: fall through to base64 so no byte is lost
    }
  }
  return { body_base64: encodeBase64(body) };
}

export function meshRequestFromEnvelope(m: RelayHttpRequest | RpcRequest): MeshRequest {
  return { method: m.method.toUpperCase(), path: m.path, headers: normalizeHeaders(m.headers), body: envelopeBody(m) };
}

export function jsonReply(status: number, value: unknown, headers: HeaderMap = {}): MeshReply {
  return { status, headers: { 'content-type': 'application/json', ...headers }, body: utf8.encode(JSON.stringify(value)) };
}

/**
 * An error as an answer: its code's status and `{"error":{"code","message"}}`;
 * with `Retry-After` when the error says when to come back (`retry_after_ms`).
 */
export function errorReply(err: MeshError, headers: HeaderMap = {}): MeshReply {
  const retry = retryAfterHeader(err.details);
  return jsonReply(err.status, err.toBody(), retry !== undefined ? { [H.retryAfter]: retry, ...headers } : headers);
}

export function replyJson<T = unknown>(reply: MeshReply): T {
  return JSON.parse(utf8d.decode(reply.body)) as T;
}

/** Collect a possibly streamed body into one array. */
export async function collectBody(body: Uint8Array | AsyncIterable<Uint8Array>): Promise<Uint8Array> {
  if (body instanceof Uint8Array) return body;
  const parts: Uint8Array[] = [];
  for await (const chunk of body) parts.push(chunk);
  return parts.length === 0 ? new Uint8Array(0) : concatBytes(parts);
}
