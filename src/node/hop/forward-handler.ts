/**
 * The node's HTTP surface (docs/protocol.md §5) over a shard executor, as one
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
import { SESSION_ID_RE } from '../../protocol/ids.ts';
import { decodeTensor, dtypeBytes, encodeTensor, formatShape, isDtype, parseShape, shapeElements, type Dtype } from '../../protocol/tensor.ts';
import type { ForwardRequest, SpanExecutor } from '../../shard/contract.ts';
import type { BatchStats } from '../../shard/batch-queue.ts';
import type { KvStats } from '../../shard/kv-store.ts';
import type { SamplingParams } from '../../shard/sampling.ts';
import { trace } from '../../protocol/trace.ts';
import { parseDraft } from '../../protocol/draft.ts';
import { ATTEST_HEADER, draftDigest, stepTokenBytes, tokenBytes } from '../../verify/attest.ts';
import { isStochasticDraft } from '../../shard/speculative.ts';
import { CHECK_FROM_HEADER, CHECK_RECORDS_HEADER, CHECK_TOKENS_HEADER, parseTokens, tokenCheckBytes } from '../../verify/check-wire.ts';
import { argmax, checkToken } from '../../verify/token-check.ts';
import { concatBytes } from '../../protocol/bytes.ts';
import type { Attestor } from '../../verify/attestor.ts';

/** What the handler needs of a SpanExecutor (a structural subset, so tests and hosts may wrap one). */
export type ForwardExecutor = Pick<SpanExecutor, 'config' | 'startLayer' | 'endLayer' | 'holdsEmbedding' | 'holdsHead' | 'maxContext' | 'dtype' | 'weightBytes' | 'sessionLength' | 'dropSession' | 'kvStats' | 'forward'> & {
  /** Batch sizes run so far (GET /info's `batch`); absent on an executor that does not batch. */
  batchStats?(): BatchStats;
  /** The last batch ran full: answers say so (X-Meshnet-Batch-Full) and heads stop drafting for a while. */
  batchFull?(): boolean;
};

export interface ForwardHandlerInfo {
  /** Model name or base URL, as the tracker knows it. */
  model: string;
  /** e.g. "onnxruntime-web/wasm", "onnxruntime-node/cpu". */
  backend: string;
  version?: string;
  /**
   * Token text for the last hop's JSON answer (docs/protocol.md §5's `text`); absent: "".
   * Hosts give it only to a node that holds the tokenizer anyway (a head): heads read `token_id` alone.
   */
  decode?(tokenId: number): string;
  /** True while the donor has paused the node (GET /health and /info say so; the runtime's gate refuses new sessions). */
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
  /**
   * Signs what this hop answers, per session (docs/protocol.md §11): every answer carries the latest
   * finished attestation (X-Meshnet-Attest), DELETE /sessions/<id> the final one. Absent: none.
   */
  attestor?: Attestor;
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

/** X-Meshnet-Sampling: the JSON names of docs/protocol.md §5 (snake_case), bounded before use. */
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

/** The rows an audit judges (from `x-meshnet-check-from` to the last) and the token claimed after each. */
function auditRows(h: HeaderMap, seq: number, vocab: number): { rows: number[]; claimed: number[] } {
  const from = intHeader(h, CHECK_FROM_HEADER) ?? 0;
  if (from >= seq) throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_FROM_HEADER} ${from} is past the ${seq} rows`);
  const claimed = parseTokens(h[CHECK_TOKENS_HEADER], seq - from, vocab);
  return { rows: Array.from({ length: seq - from }, (_, i) => from + i), claimed };
}

function intHeader(headers: HeaderMap, name: string): number | undefined {
  const v = headers[name];
  if (v === undefined) return undefined;
  if (!/^\d{1,9}$/.test(v.trim())) throw new MeshError('MESH_ERR_BAD_REQUEST', `${name} must be a non-negative integer, got "${v.slice(0, 32)}"`);
  return Number(v.trim());
}

export function createForwardHandler(executor: ForwardExecutor, info: ForwardHandlerInfo): (req: MeshRequest) => Promise<MeshResponse> {
  const held = { start_layer: executor.startLayer, end_layer: executor.endLayer };

  async function forward(req: MeshRequest): Promise<{ res: MeshResponse; tokens: number }> {
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
    if (session !== undefined && !SESSION_ID_RE.test(session)) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.session} must be 1-128 characters of [A-Za-z0-9._:-]`);
    if (session !== undefined && position === undefined) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.position} is required with ${H.session}`);
    if (session === undefined && position !== undefined && position !== 0) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.position} without ${H.session}: a stateless forward starts at 0`);
    const sessionTokens = intHeader(h, H.sessionTokens);
    const sampling = parseSampling(h[H.sampling]);
    const rollbackFrom = intHeader(h, H.rollback);
    // The drafts are read where the LM head runs; other hops pass them on (chain) unread.
    const draftText = endLayer === executor.config.numLayers && executor.holdsHead ? h[H.draft] : undefined;
    const draft = draftText !== undefined ? parseDraft(draftText) : undefined;

    const data = decodeTensor(req.body, dtype);
    const fr: ForwardRequest = { activation: { data, shape }, startLayer, endLayer };
    // A head audit's last hop (docs/verification.md): judge the claimed token after each row from `from` on, in this one prefill.
    const audit = session === undefined && h[CHECK_TOKENS_HEADER] !== undefined ? auditRows(h, shape[1]!, executor.config.vocabSize) : undefined;
    if (audit) {
      if (endLayer !== executor.config.numLayers || !executor.holdsHead) throw new MeshError('MESH_ERR_LAYER_RANGE', `${CHECK_TOKENS_HEADER} asks the last hop to judge tokens; this span does not end at the last layer`, held);
      const result = await executor.forward({ ...fr, logitRows: audit.rows, ...(sampling ? { sampling } : {}) });
      if (result.kind !== 'logits') throw new MeshError('MESH_ERR_INTERNAL', 'the span answered no logits for the audited rows');
      const V = executor.config.vocabSize;
      const records = audit.rows.map((row, i) => {
        const logits = result.data.subarray(i * V, (i + 1) * V);
        const t = checkToken(logits, audit.claimed[i]!, sampling ?? {}, row + 1);
        return tokenCheckBytes({ claimed: audit.claimed[i]!, sampled: t.sampled, argmax: argmax(logits), deficit: t.deficit, gap: t.gap, logprob: t.logprob });
      });
      return { res: { status: 200, headers: { 'content-type': 'application/octet-stream', [CHECK_RECORDS_HEADER]: String(records.length) }, body: concatBytes(records) }, tokens: shape[1]! };
    }
    if (session !== undefined) {
      fr.session = session;
      fr.position = position!;
      if (sessionTokens !== undefined) fr.sessionTokens = sessionTokens;
      if (rollbackFrom !== undefined) fr.rollbackFrom = rollbackFrom;
    }
    if (sampling) fr.sampling = sampling;
    if (draft) fr.draft = draft;
    trace?.('exec', session, position);
    const result = await executor.forward(fr);
    trace?.('exec-done', session, position);
    const tokens = shape[1]!;
    const full = executor.batchFull?.() === true;
    let res: MeshResponse;
    let out: Uint8Array;
    if (result.kind === 'logits') throw new MeshError('MESH_ERR_INTERNAL', 'the span answered logits to a forward that asked for none');
    if (result.kind === 'token') {
      const text = info.decode ? info.decode(result.tokenId) : '';
      // A verification: the drafts it accepted precede token_id (only ids go back).
      const spec = result.spec ? { accepted: result.spec.accepted, logprobs: result.spec.logprobs } : {};
      res = jsonReply(200, { token_id: result.tokenId, text, logprob: result.logprob, ...spec });
      // What it signs is what it answered: every token the step emitted (the accepted drafts, then token_id,
      // with the logprobs it sent; one token: tokenBytes), each judged from its row by a check — and, when a
      // sampling drafter's rule drew them, the draft it judged them against.
      const v = result.spec;
      const sampledDraft = draft && isStochasticDraft(draft, sampling ?? {}) ? draftDigest(draft) : undefined;
      out = v ? stepTokenBytes([...v.tokenIds.slice(0, v.accepted), result.tokenId].map((tokenId, i) => ({ tokenId, logprob: v.logprobs[i] ?? 0 })), sampledDraft) : tokenBytes(result.tokenId, result.logprob);
    } else {
      // Answer in the caller's dtype: the next hop expects what this one received.
      out = encodeTensor(result.data, dtype);
      res = { status: 200, headers: { 'content-type': 'application/octet-stream', [H.shape]: formatShape(result.shape), [H.dtype]: dtype }, body: out };
    }
    if (full) res.headers[H.batchFull] = '1';
    const attestor = info.attestor;
    if (attestor && session !== undefined) {
      const scope = { model: info.model, session, startLayer, endLayer, dtype, ...(result.kind === 'token' ? { sampling: h[H.sampling] ?? '' } : {}) };
      attestor.record(scope, position!, tokens, req.body, out);
      const latest = attestor.latest(session);
      if (latest !== undefined) res.headers[ATTEST_HEADER] = latest;
    }
    return { res, tokens };
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
        // The session's final attestation rides on the answer (the head's checks need every step signed).
        const final = info.attestor ? await info.attestor.finish(id) : undefined;
        const attest: HeaderMap = final !== undefined ? { [ATTEST_HEADER]: final } : {};
        if (!executor.dropSession(id)) return errorReply(new MeshError('MESH_ERR_NOT_FOUND', `no session ${id.slice(0, 128)} on this node`), attest);
        return { status: 204, headers: attest, body: new Uint8Array(0) };
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
