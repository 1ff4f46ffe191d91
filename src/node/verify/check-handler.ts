/**
 * `POST /check` (docs/protocol.md §11): this node recomputes another hop's
 * outputs for a head that the tracker sent to it, in one stateless prefill
 * over the hop's input rows, and signs what it got. It keeps no session
 * state: the rows are in the request, nothing stays after the answer.
 *
 * Refusals keep the node serving: 403 without a plan the tracker signed for
 * this checker, these layers and this session; 416 for layers it does not
 * hold; 400 for rows that do not match their shape, steps or dtype; 503 when
 * it already runs its share of checks (the head asks the next checker).
 */
import { errorReply, type MeshRequest, type MeshResponse } from '../../protocol/envelopes.ts';
import { MeshError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import { decodeBase64 as decodeBase64Url } from '../../protocol/base64.ts';
import { concatBytes } from '../../protocol/bytes.ts';
import { decodeTensor, dtypeBytes, encodeTensor, isDtype, parseShape, type Dtype } from '../../protocol/tensor.ts';
import type { ForwardRequest, ForwardResult } from '../../shard/contract.ts';
import type { SamplingParams } from '../../shard/sampling.ts';
import { attestSeed, chainStep, checkMessage, CHECK_ATTEST_HEADER, draftDigest, formatAttestation, sha256, type AttestScope } from '../../verify/attest.ts';
import { CHECK_DRAFTS_HEADER, CHECK_PEER_HEADER, CHECK_STEPS_HEADER, CHECK_TOKENS_HEADER, parseStepDrafts, parseStepShapes, parseStepTokens, tokenCheckBytes } from '../../verify/check-wire.ts';
import { checkDraft, draftProposals, isStochasticDraft } from '../../shard/speculative.ts';
import { signedByAny, type TrackerKeys } from '../tracker-client.ts';
import { CHECK_PLAN_HEADER, CHECK_PLAN_SIGNATURE_HEADER, checkPlanMessage, checkPlanSchema, sessionOfGeneration, type CheckPlan } from '../../verify/plan.ts';
import { checkRuleToken, checkToken } from '../../verify/token-check.ts';

/** What a check needs of the span's executor: a stateless forward, and the logits of chosen rows at the last layer (ForwardRequest.logitRows). */
export interface CheckExecutor {
  readonly config: { readonly numLayers: number; readonly hiddenSize: number; readonly vocabSize: number };
  readonly startLayer: number;
  readonly endLayer: number;
  forward(req: ForwardRequest): Promise<ForwardResult>;
  /** Drops a session's KV cache (a long check's temporary one). */
  dropSession?(id: string): boolean;
}

export interface CheckHandlerInit {
  peerId: string;
  /** The model this node serves now, as the tracker names it. */
  model: string | (() => string);
  executor(): CheckExecutor | undefined;
  /** The keys check plans must be signed with (one tracker's, or every tracker's of its cluster). */
  trackerKey(): TrackerKeys;
  sign(bytes: Uint8Array): Promise<Uint8Array>;
  verify(publicKey: Uint8Array, message: Uint8Array, signature: Uint8Array): Promise<boolean>;
  /** Checks run at once at most; more are answered 503. @defaultValue 1 */
  maxConcurrent?: number;
  now?: () => number;
}

/**
 * Rows a check computes in one run. A longer check runs in chunks of this many on a session of its
 * own (dropped after): the node's own traffic, queued meanwhile, runs between the chunks instead of
 * waiting behind one long prefill.
 */
const CHUNK_ROWS = 256;

/** The same forward as `fr` (stateless, `rows` rows), in chunks of CHUNK_ROWS on a temporary session. */
async function chunked(ex: CheckExecutor, fr: ForwardRequest, rows: number, ends: readonly number[]): Promise<ForwardResult> {
  const session = `check.${Math.random().toString(36).slice(2)}`;
  const hidden = ex.config.hiddenSize;
  const parts: Float32Array[] = [];
  const logitRows: number[] = [];
  try {
    for (let p = 0; p < rows; p += CHUNK_ROWS) {
      const n = Math.min(CHUNK_ROWS, rows - p);
      const req: ForwardRequest = { session, position: p, startLayer: fr.startLayer!, endLayer: fr.endLayer!, ...(p === 0 ? { sessionTokens: rows } : {}) };
      if (fr.tokenIds) req.tokenIds = fr.tokenIds.slice(p, p + n);
      else req.activation = { data: fr.activation!.data.subarray(p * hidden, (p + n) * hidden), shape: [1, n, hidden] };
      const inChunk = fr.logitRows ? ends.filter((e) => e >= p && e < p + n).map((e) => e - p) : undefined;
      if (fr.logitRows && inChunk!.length === 0) {
        // No step ends in this chunk: its rows only fill the cache (the last layer's logits are not needed).
        const r = await ex.forward({ ...req, logitRows: [n - 1] });
        if (r.kind !== 'logits') throw new MeshError('MESH_ERR_INTERNAL', 'the span gave no logits');
        continue;
      }
      const r = await ex.forward(inChunk ? { ...req, logitRows: inChunk } : req);
      if (r.kind === 'logits') {
        parts.push(r.data);
        logitRows.push(...inChunk!.map((x) => x + p));
      } else if (r.kind === 'activation') parts.push(r.data);
      else throw new MeshError('MESH_ERR_INTERNAL', 'the span answered a token to a check');
    }
  } finally {
    ex.dropSession?.(session);
  }
  const data = new Float32Array(parts.reduce((n, x) => n + x.length, 0));
  let o = 0;
  for (const x of parts) {
    data.set(x, o);
    o += x.length;
  }
  return fr.logitRows ? { kind: 'logits', rows: logitRows, data } : { kind: 'activation', data, shape: [1, rows, hidden] };
}

/** A check may ask for this many uses of one plan entry at this checker (a retry after a lost answer). */
const USES_PER_ENTRY = 2;

const SAMPLING_KEYS = new Set(['temperature', 'top_p', 'top_k', 'seed']);

function sampling(text: string | undefined): SamplingParams {
  if (!text) return {};
  let raw: unknown;
  try {
    raw = JSON.parse(text);
  } catch {
    throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.sampling} is not JSON`);
  }
  if (typeof raw !== 'object' || raw === null || Object.keys(raw).some((k) => !SAMPLING_KEYS.has(k))) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.sampling} must be {temperature, top_p, top_k, seed}`);
  const r = raw as Record<string, unknown>;
  const num = (k: string) => (typeof r[k] === 'number' ? (r[k] as number) : undefined);
  const out: SamplingParams = {};
  if (num('temperature') !== undefined) out.temperature = num('temperature')!;
  if (num('top_p') !== undefined) out.topP = num('top_p')!;
  if (num('top_k') !== undefined) out.topK = num('top_k')!;
  if (num('seed') !== undefined) out.seed = num('seed')!;
  return out;
}

export function createCheckHandler(init: CheckHandlerInit): (req: MeshRequest) => Promise<MeshResponse> {
  const now = init.now ?? Date.now;
  const max = init.maxConcurrent ?? 1;
  let running = 0;
  /** Plans verified, by signature. */
  const plans = new Map<string, { head: string; plan: CheckPlan }>();
  /** Uses per plan signature and checked peer. */
  const uses = new Map<string, number>();

  async function planOf(h: Record<string, string>): Promise<CheckPlan> {
    const text = h[CHECK_PLAN_HEADER];
    const sig = h[CHECK_PLAN_SIGNATURE_HEADER]?.trim();
    if (text === undefined || !sig) throw new MeshError('MESH_ERR_FORBIDDEN', `a check needs the tracker's plan (${CHECK_PLAN_HEADER}, ${CHECK_PLAN_SIGNATURE_HEADER})`);
    const hit = plans.get(sig);
    if (hit && JSON.stringify(hit.plan) === text) return hit.plan;
    let plan: CheckPlan;
    try {
      plan = checkPlanSchema.parse(JSON.parse(text));
    } catch {
      throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_PLAN_HEADER} is not a check plan`);
    }
    const key = init.trackerKey();
    let sigBytes: Uint8Array;
    try {
      sigBytes = decodeBase64Url(sig);
    } catch {
      throw new MeshError('MESH_ERR_FORBIDDEN', 'the plan signature is not base64url');
    }
    if (!(await signedByAny(key, checkPlanMessage(plan.head, text), sigBytes, init.verify))) throw new MeshError('MESH_ERR_FORBIDDEN', 'the check plan is not signed by this node\'s tracker');
    if (plans.size >= 256) plans.clear();
    plans.set(sig, { head: plan.head, plan });
    return plan;
  }

  async function check(req: MeshRequest): Promise<MeshResponse> {
    const h = req.headers;
    const plan = await planOf(h);
    if (plan.expires_at < now()) throw new MeshError('MESH_ERR_FORBIDDEN', 'the check plan expired');
    const model = typeof init.model === 'string' ? init.model : init.model();
    if (plan.model !== model) throw new MeshError('MESH_ERR_FORBIDDEN', `the plan is for model ${plan.model}; this node serves ${model}`);
    const checked = h[CHECK_PEER_HEADER]?.trim() ?? '';
    const session = h[H.session]?.trim() ?? '';
    const start = Number(h[H.startLayer]);
    const end = Number(h[H.endLayer]);
    if (!sessionOfGeneration(session, plan.generation)) throw new MeshError('MESH_ERR_FORBIDDEN', `session ${session.slice(0, 128)} is not of the plan's generation`);
    const entry = plan.checks.find((e) => e.peer.peer_id === checked && e.start_layer === start && e.end_layer === end && e.checkers.some((c) => c.peer_id === init.peerId));
    if (!entry) throw new MeshError('MESH_ERR_FORBIDDEN', `the plan does not name this node to check ${checked.slice(0, 32)} on [${start}, ${end})`);
    const useKey = `${h[CHECK_PLAN_SIGNATURE_HEADER]}:${checked}:${session}`;
    const used = uses.get(useKey) ?? 0;
    if (used >= USES_PER_ENTRY) throw new MeshError('MESH_ERR_FORBIDDEN', 'this plan entry was used up at this checker');

    const ex = init.executor();
    if (!ex) throw new MeshError('MESH_ERR_UNAVAILABLE', 'this node has no span loaded');
    if (!(Number.isInteger(start) && Number.isInteger(end) && ex.startLayer <= start && start < end && end <= ex.endLayer)) {
      throw new MeshError('MESH_ERR_LAYER_RANGE', `layers [${h[H.startLayer]}, ${h[H.endLayer]}) are not within the held range [${ex.startLayer}, ${ex.endLayer})`, { start_layer: ex.startLayer, end_layer: ex.endLayer });
    }
    const shapes = parseStepShapes(h[CHECK_STEPS_HEADER]);
    const steps = shapes.rows;
    const rows = steps.reduce((a, b) => a + b, 0);
    /** Rows that stayed (a step cut back after it keeps its first `kept` rows): the sequence the prefill runs. */
    const keptRows = shapes.kept.reduce((a, b) => a + b, 0);
    const dtypeText = (h[H.dtype] ?? 'bf16').trim();
    if (!isDtype(dtypeText)) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.dtype} must be bf16, f16 or f32`);
    const dtype: Dtype = dtypeText;
    const hidden = ex.config.hiddenSize;
    const tokensIn = start === 0;
    const rowBytes = tokensIn ? 4 : hidden * dtypeBytes(dtype);
    if (!tokensIn) {
      const shape = parseShape(h[H.shape]);
      if (!shape || shape[0] !== 1 || shape[1] !== rows || shape[2] !== hidden) throw new MeshError('MESH_ERR_BAD_SHAPE', `${H.shape} must be 1,${rows},${hidden} (the steps' rows)`);
    }
    const last = end === ex.config.numLayers;
    // A last hop's drafted steps: the drafts follow the rows in the body.
    const draftBytes = h[CHECK_DRAFTS_HEADER] === undefined ? 0 : Number(h[CHECK_DRAFTS_HEADER]);
    if (!(Number.isInteger(draftBytes) && draftBytes >= 0 && draftBytes <= req.body.byteLength) || (draftBytes > 0 && !last)) throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_DRAFTS_HEADER} must count the bytes of drafts after a last hop's rows`);
    const body = req.body.subarray(0, req.body.byteLength - draftBytes);
    if (body.byteLength !== rows * rowBytes) throw new MeshError('MESH_ERR_BAD_SHAPE', `body is ${body.byteLength} bytes; ${rows} rows need ${rows * rowBytes}`);
    // Per step, the tokens the last hop emitted: judged at the step's last kept rows, one each.
    const claimed = last ? parseStepTokens(h[CHECK_TOKENS_HEADER], shapes.kept, ex.config.vocabSize) : [];
    const params = last ? sampling(h[H.sampling]) : {};
    // Per step, the draft whose rule drew its tokens (a sampling drafter's at T > 0), if any.
    const drafts = draftBytes > 0 ? parseStepDrafts(req.body.subarray(body.byteLength), steps.length) : [];
    for (const [s, d] of drafts.entries()) {
      if (!d) continue;
      if (!isStochasticDraft(d, params)) throw new MeshError('MESH_ERR_BAD_REQUEST', `step ${s}'s draft was not judged by the sampling rule (it has no q, or the sampling is greedy)`);
      checkDraft(d, steps[s]!, ex.config.vocabSize);
      if (claimed[s]!.length > d.ids.length + 1) throw new MeshError('MESH_ERR_BAD_REQUEST', `step ${s} emitted ${claimed[s]!.length} tokens from a draft of ${d.ids.length}`);
    }

    if (running >= max) throw new MeshError('MESH_ERR_BUSY', 'this node runs as many checks as it takes; ask another checker or retry later', { retry_after_ms: 1000 });
    running++;
    uses.set(useKey, used + 1);
    if (uses.size > 4096) uses.clear();
    try {
      // Each step's input as the hop received it, and the kept rows of them all (one prefill).
      const stepIn: Uint8Array[] = [];
      const keptIn: Uint8Array[] = [];
      /** Where each step starts in the kept sequence (its position in the session's chain). */
      const at: number[] = [];
      let o = 0;
      let k = 0;
      for (const [s, n] of steps.entries()) {
        stepIn.push(body.subarray(o * rowBytes, (o + n) * rowBytes));
        keptIn.push(body.subarray(o * rowBytes, (o + shapes.kept[s]!) * rowBytes));
        at.push(k);
        o += n;
        k += shapes.kept[s]!;
      }
      const input = keptRows === rows ? body : concatBytes(keptIn);
      const fr: ForwardRequest = { startLayer: start, endLayer: end };
      if (tokensIn) {
        const dv = new DataView(input.buffer, input.byteOffset, input.byteLength);
        fr.tokenIds = Array.from({ length: keptRows }, (_, i) => dv.getUint32(i * 4, true));
      } else fr.activation = { data: decodeTensor(input, dtype), shape: [1, keptRows, hidden] };
      // A last hop: the rows whose next token each step emitted (its last kept rows).
      const judged: number[] = [];
      if (last) for (const [s, g] of claimed.entries()) for (let j = 0; j < g.length; j++) judged.push(at[s]! + shapes.kept[s]! - g.length + j);
      if (last) fr.logitRows = judged;
      const result = keptRows <= CHUNK_ROWS ? await ex.forward(fr) : await chunked(ex, fr, keptRows, judged);

      // One output block per step: the kept rows the hop would have answered, or the last hop's check records.
      const outs: Uint8Array[] = [];
      if (last) {
        if (result.kind !== 'logits' || result.rows.length !== judged.length) throw new MeshError('MESH_ERR_INTERNAL', 'the span gave no logits for the steps');
        const V = ex.config.vocabSize;
        let r = 0;
        for (const [s, g] of claimed.entries()) {
          const recs: Uint8Array[] = [];
          const d = drafts[s];
          const proposed = d ? draftProposals(d) : [];
          for (const [j, id] of g.entries()) {
            const logits = result.data.subarray(r * V, (r + 1) * V);
            // A drafted row: the rule's claim is "accepted" for every token before the last, and for a last
            // token that is the accepted `next`; otherwise the last token is the residual draw after a rejection.
            const accepted = j < g.length - 1 || (d !== undefined && j === d.ids.length && id === d.next);
            const t = d && j < proposed.length ? checkRuleToken(logits, id, proposed[j]!, d.q![j]!, params, judged[r]! + 1, accepted) : checkToken(logits, id, params, judged[r]! + 1);
            recs.push(tokenCheckBytes({ claimed: id, sampled: t.sampled, argmax: argmaxOf(logits), deficit: t.deficit, gap: t.gap, logprob: t.logprob }));
            r++;
          }
          // A drafted step's records end with the digest of the draft they were judged against (what the hop signed).
          if (d) recs.push(draftDigest(d));
          outs.push(concatBytes(recs));
        }
      } else {
        if (result.kind !== 'activation') throw new MeshError('MESH_ERR_INTERNAL', 'the span answered no activation');
        const all = encodeTensor(result.data, dtype);
        const ob = hidden * dtypeBytes(dtype);
        for (const [s, p] of at.entries()) outs.push(all.subarray(p * ob, (p + shapes.kept[s]!) * ob));
      }
      // The chain: the same steps and input hashes as the checked hop's, this node's outputs.
      const scope: AttestScope = { model: plan.model, session, startLayer: start, endLayer: end, dtype, ...(last ? { sampling: h[H.sampling] ?? '' } : {}) };
      let acc = attestSeed(scope);
      for (const [s, n] of steps.entries()) acc = chainStep(acc, { position: at[s]!, rows: n, input: sha256(stepIn[s]!), output: sha256(outs[s]!) });
      const sig = await init.sign(checkMessage(checked, session, rows, acc));
      return {
        status: 200,
        headers: { 'content-type': 'application/octet-stream', [CHECK_ATTEST_HEADER]: formatAttestation({ peer: init.peerId, rows, signature: sig }), ...(last ? {} : { [H.dtype]: dtype, [H.shape]: `1,${keptRows},${hidden}` }) },
        body: concatBytes(outs),
      };
    } finally {
      running--;
    }
  }

  return async (req) => {
    if (req.method.toUpperCase() !== 'POST') return errorReply(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', 'use POST /check'), { allow: 'POST' });
    try {
      return await check(req);
    } catch (e) {
      if (e instanceof MeshError) return errorReply(e);
      if (e instanceof RangeError) return errorReply(new MeshError('MESH_ERR_BAD_SHAPE', e.message));
      return errorReply(new MeshError('MESH_ERR_INTERNAL', `the check failed: ${(e as Error).message}`));
    }
  };
}

function argmaxOf(xs: Float32Array): number {
  let b = 0;
  for (let i = 1; i < xs.length; i++) if (xs[i]! > xs[b]!) b = i;
  return b;
}

