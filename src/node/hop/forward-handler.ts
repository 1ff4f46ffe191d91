/**
 * The node's HTTP surface (PROTOCOL.md §5) over a shard executor, as one
 * host-neutral handler `(MeshRequest) => Promise<MeshResponse>`: the relay
 * bridge, a Node.js HTTP server and the browser worker all serve through it.
 *
 *   POST   /forward          run layers on an activation (X-Meshnet-* headers)
 *   GET    /health           liveness and whether the donor paused
 *   GET    /info             model, layer range, backend, limits
 *   DELETE /sessions/<id>    drop a session's KV cache
 *
 * Every refusal is a 4xx/5xx with `{"error":{"code","message"}}`; nothing a
 * caller sends can stop the node from serving the next request.
 */
import { z } from 'zod';
import { errorReply, jsonReply, type MeshRequest, type MeshResponse } from '../../protocol/envelopes.ts';
import { MeshError } from '../../protocol/errors.ts';
import { H, type HeaderMap } from '../../protocol/headers.ts';
import { decodeTensor, dtypeBytes, encodeTensor, formatShape, isDtype, parseShape, shapeElements, type Dtype } from '../../protocol/tensor.ts';
import type { ForwardRequest, ForwardResult, ShardExecutor } from '../../shard/executor.ts';
import type { BatchStats } from '../../shard/batch-queue.ts';
import type { KvStats } from '../../shard/kv-store.ts';
import type { SamplingParams } from '../../shard/sampling.ts';
import { trace } from '../../protocol/trace.ts';

/** What the handler needs of a ShardExecutor (a structural subset, so tests and hosts may wrap one). */
export type ForwardExecutor = Pick<ShardExecutor, 'config' | 'startLayer' | 'endLayer' | 'holdsEmbedding' | 'holdsHead' | 'maxContext' | 'dtype' | 'weightBytes' | 'sessionLength' | 'dropSession' | 'kvStats'> & {
  forward(req: ForwardRequest): Promise<ForwardResult>;
  /** Batch sizes run so far (GET /info's `batch`); absent on an executor that does not batch. */
  batchStats?(): BatchStats;
};

export interface ForwardHandlerInfo {
  /** Model name or base URL, as the tracker knows it. */
  model: string;
  /** e.g. "onnxruntime-web/wasm", "onnxruntime-node/cpu". */
  backend: string;
  version?: string;
  /**
   * Token text for the last hop's JSON answer (shared/PROTOCOL.md §5's `text`); absent: "".
   * Hosts give it only to a node that holds the tokenizer anyway (a head): heads read `token_id` alone.
   */
  decode?(tokenId: number): string;
  /** True while the donor has paused the node: /forward answers 503, the rest keeps working. */
  isPaused?(): boolean;
  /**
   * The wire dtype this hop's mesh uses (its tracker's, per model): a body in
   * another answers 400, so a misconfigured head fails loudly instead of
   * mixing roundings. Absent: any of bf16, f16, f32, answered in kind.
   */
  wireDtype?: Dtype;
  /** Extra fields merged into GET /info (peer id, adapter, …). */
  extraInfo?(): Record<string, unknown>;
  /** Called after each /forward with its outcome: the host's stats (tokens served, throughput). */
  onForward?(event: ForwardEvent): void;
  /** Unexpected (5xx) errors, for the host's log; the caller only sees a generic message. */
  onError?(err: unknown, req: MeshRequest): void;
}

export interface ForwardEvent {
  status: number;
  /** Tokens in the activation (seq); 0 when the request was refused before decoding. */
  tokens: number;
  ms: number;
}

/** The KV cache as /info shows it (snake_case, bytes). */
export function kvInfo(kv: KvStats): Record<string, number> {
  return {
    sessions: kv.sessions,
    budget_bytes: kv.budgetBytes,
    reserved_bytes: kv.reservedBytes,
    used_bytes: kv.usedBytes,
    free_bytes: kv.freeBytes,
    idle_bytes: kv.idleBytes,
    bytes_per_token: kv.bytesPerToken,
    block_tokens: kv.blockTokens,
    max_tokens: kv.maxTokens,
    evictions: kv.evictions,
    refusals: kv.refusals,
  };
}

/** Batching as /info shows it: runs by batch size (sizes[n] = runs of n sessions' steps). */
export function batchInfo(b: BatchStats): Record<string, unknown> {
  return { max_batch: b.maxBatch, runs: b.batches, requests: b.requests, sizes: b.sizes, joined: b.joined };
}

/** X-Meshnet-Sampling: the JSON names of PROTOCOL.md §5 (snake_case), bounded before use. */
const samplingSchema = z
  .object({
    temperature: z.number().min(0).max(100).optional(),
    top_p: z.number().gt(0).max(1).optional(),
    top_k: z.number().int().min(0).max(1_000_000).optional(),
    seed: z.number().int().min(0).max(2 ** 53).optional(),
  })
  .strict();

/**
 * Parsed X-Meshnet-Sampling texts: a last hop gets the same text on every step of a generation, and
 * JSON plus the schema on each, with the code cold after the span ran, cost ~40 µs a token on its
 * critical path. Frozen: every step shares the one object.
 */
const samplingCache = new Map<string, SamplingParams>();

function parseSampling(text: string | undefined): SamplingParams | undefined {
  if (text === undefined) return undefined;
  const hit = samplingCache.get(text);
  if (hit !== undefined) return hit;
  const parsed = parseSamplingText(text);
  if (parsed === undefined) return undefined;
  if (samplingCache.size >= 256) samplingCache.clear();
  samplingCache.set(text, Object.freeze(parsed));
  return parsed;
}

function parseSamplingText(text: string): SamplingParams | undefined {
  if (text.trim() === '') return undefined;
  let raw: unknown;
  try {
    raw = JSON.parse(text);
  } catch {
    throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.sampling} is not JSON`);
  }
  const p = samplingSchema.safeParse(raw);
  if (!p.success) {
    const issue = p.error.issues[0]!;
    throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.sampling}: ${issue.path.join('.') || 'value'}: ${issue.message}`);
  }
  const out: SamplingParams = {};
  if (p.data.temperature !== undefined) out.temperature = p.data.temperature;
  if (p.data.top_p !== undefined) out.topP = p.data.top_p;
  if (p.data.top_k !== undefined) out.topK = p.data.top_k;
  if (p.data.seed !== undefined) out.seed = p.data.seed;
  return out;
}

function intHeader(headers: HeaderMap, name: string): number | undefined {
  const v = headers[name];
  if (v === undefined) return undefined;
  if (!/^\d{1,9}$/.test(v.trim())) throw new MeshError('MESH_ERR_BAD_REQUEST', `${name} must be a non-negative integer, got "${v.slice(0, 32)}"`);
  return Number(v.trim());
}

/** Session ids travel in headers and paths: keep them short and printable. */
const SESSION_RE = /^[A-Za-z0-9._:-]{1,128}$/;

export function createForwardHandler(executor: ForwardExecutor, info: ForwardHandlerInfo): (req: MeshRequest) => Promise<MeshResponse> {
  const held = { start_layer: executor.startLayer, end_layer: executor.endLayer };

  async function forward(req: MeshRequest): Promise<{ res: MeshResponse; tokens: number }> {
    if (info.isPaused?.()) {
      throw new MeshError('MESH_ERR_UNAVAILABLE', 'the donor paused this node; route around it or retry later');
    }
    const h = req.headers;
    const dtypeText = (h[H.dtype] ?? 'bf16').trim().toLowerCase();
    if (!isDtype(dtypeText)) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.dtype} "${dtypeText.slice(0, 16)}" is not one of bf16, f16, f32`);
    const dtype: Dtype = dtypeText;
    if (info.wireDtype !== undefined && dtype !== info.wireDtype) {
      throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.dtype} is ${dtype}, but this hop's mesh sends ${info.wireDtype} between hops (the tracker's wire dtype for ${info.model}); send ${info.wireDtype}`);
    }
    const shape = parseShape(h[H.shape]);
    if (!shape) throw new MeshError('MESH_ERR_BAD_SHAPE', `${H.shape} must be "batch,seq,hidden" in positive decimals, got "${(h[H.shape] ?? '').slice(0, 64)}"`);
    const hidden = executor.config.hiddenSize;
    if (shape[0] !== 1 || shape[2] !== hidden) throw new MeshError('MESH_ERR_BAD_SHAPE', `shape ${formatShape(shape)} is not 1,seq,${hidden} (batch 1, this model's hidden size)`);
    // Compare before multiplying out a huge claim: the body length is what we actually hold.
    const expected = shapeElements(shape) * dtypeBytes(dtype);
    if (req.body.byteLength !== expected) {
      throw new MeshError('MESH_ERR_BAD_SHAPE', `body is ${req.body.byteLength} bytes, shape ${formatShape(shape)} in ${dtype} needs ${expected}`);
    }
    const startLayer = intHeader(h, H.startLayer) ?? executor.startLayer;
    const endLayer = intHeader(h, H.endLayer) ?? executor.endLayer;
    if (startLayer < executor.startLayer || endLayer > executor.endLayer || startLayer >= endLayer) {
      throw new MeshError('MESH_ERR_LAYER_RANGE', `layers [${startLayer}, ${endLayer}) are not within the held range [${executor.startLayer}, ${executor.endLayer})`, held);
    }
    const session = h[H.session]?.trim();
    const position = intHeader(h, H.position);
    if (session !== undefined && !SESSION_RE.test(session)) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.session} must be 1-128 characters of [A-Za-z0-9._:-]`);
    if (session !== undefined && position === undefined) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.position} is required with ${H.session}`);
    if (session === undefined && position !== undefined && position !== 0) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.position} without ${H.session}: a stateless forward starts at 0`);
    const sessionTokens = intHeader(h, H.sessionTokens);
    const sampling = parseSampling(h[H.sampling]);

    const data = decodeTensor(req.body, dtype);
    const fr: ForwardRequest = { activation: { data, shape }, startLayer, endLayer };
    if (session !== undefined) {
      fr.session = session;
      fr.position = position!;
      if (sessionTokens !== undefined) fr.sessionTokens = sessionTokens;
    }
    if (sampling) fr.sampling = sampling;
    trace?.('exec', session, position);
    const result = await executor.forward(fr);
    trace?.('exec-done', session, position);
    const tokens = shape[1]!;
    if (result.kind === 'token') {
      const text = info.decode ? info.decode(result.tokenId) : '';
      return { res: jsonReply(200, { token_id: result.tokenId, text, logprob: result.logprob }), tokens };
    }
    // Answer in the caller's dtype: the next hop expects what this one received.
    const body = encodeTensor(result.data, dtype);
    return {
      res: { status: 200, headers: { 'content-type': 'application/octet-stream', [H.shape]: formatShape(result.shape), [H.dtype]: dtype }, body },
      tokens,
    };
  }

  function infoBody(): Record<string, unknown> {
    const cfg = executor.config;
    const kv = executor.kvStats();
    return {
      model: info.model,
      architecture: cfg.architecture,
      num_layers: cfg.numLayers,
      hidden_size: cfg.hiddenSize,
      start_layer: executor.startLayer,
      end_layer: executor.endLayer,
      holds_embedding: executor.holdsEmbedding,
      holds_head: executor.holdsHead,
      backend: info.backend,
      dtype: executor.dtype,
      wire_dtypes: info.wireDtype ? [info.wireDtype] : ['bf16', 'f16', 'f32'],
      max_context: executor.maxContext,
      // The memory budget is these weights plus kv.budget_bytes.
      weight_bytes: executor.weightBytes,
      kv: kvInfo(kv),
      ...(executor.batchStats ? { batch: batchInfo(executor.batchStats()) } : {}),
      paused: info.isPaused?.() ?? false,
      ...(info.version ? { version: info.version } : {}),
      ...(info.extraInfo?.() ?? {}),
    };
  }

  return async function handle(req: MeshRequest): Promise<MeshResponse> {
    const t0 = performance.now();
    const path = req.path.split('?')[0]!;
    const method = req.method.toUpperCase();
    try {
      if (path === '/forward') {
        if (method !== 'POST') return errorReply(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', 'use POST /forward'), { allow: 'POST' });
        try {
          const { res, tokens } = await forward(req);
          info.onForward?.({ status: res.status, tokens, ms: performance.now() - t0 });
          return res;
        } catch (e) {
          info.onForward?.({ status: e instanceof MeshError ? e.status : 500, tokens: 0, ms: performance.now() - t0 });
          throw e;
        }
      }
      if (path === '/health') {
        if (method !== 'GET' && method !== 'HEAD') return errorReply(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', 'use GET /health'), { allow: 'GET' });
        return jsonReply(200, { status: info.isPaused?.() ? 'paused' : 'ok', sessions: executor.kvStats().sessions });
      }
      if (path === '/info') {
        if (method !== 'GET') return errorReply(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', 'use GET /info'), { allow: 'GET' });
        return jsonReply(200, infoBody());
      }
      const m = /^\/sessions\/([^/]+)$/.exec(path);
      if (m) {
        if (method !== 'DELETE') return errorReply(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', 'use DELETE /sessions/<id>'), { allow: 'DELETE' });
        let id: string;
        try {
          id = decodeURIComponent(m[1]!);
        } catch {
          return errorReply(new MeshError('MESH_ERR_BAD_REQUEST', 'session id is not valid percent-encoding'));
        }
        if (!executor.dropSession(id)) return errorReply(new MeshError('MESH_ERR_NOT_FOUND', `no session ${id.slice(0, 128)} on this node`));
        return { status: 204, headers: {}, body: new Uint8Array(0) };
      }
      return errorReply(new MeshError('MESH_ERR_NOT_FOUND', `no route ${method} ${path.slice(0, 256)}; this node serves POST /forward, GET /health, GET /info, DELETE /sessions/<id>`));
    } catch (e) {
      if (e instanceof MeshError) return errorReply(e);
      // Decoding a ragged body throws RangeError: the caller's fault, not ours.
      if (e instanceof RangeError) return errorReply(new MeshError('MESH_ERR_BAD_SHAPE', e.message));
      info.onError?.(e, req);
      return errorReply(new MeshError('MESH_ERR_INTERNAL', 'the node failed to run this request; it keeps serving'));
    }
  };
}
