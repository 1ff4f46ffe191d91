/**
 * A head audit (docs/verification.md), run on a head of a route that shares
 * no node with the audited generation's: `POST /audit` with a route the
 * tracker signed, and the generation's prompt, produced tokens and sampling.
 * This head re-runs the prompt plus the produced tokens in one prefill
 * through its route — every hop a stateless forward of all the rows, the
 * last hop judging the token claimed after each row — and answers one
 * record per produced token: the token this route would pick, and how far
 * the claimed one is from it (check-wire.ts TokenCheckRecord). Nothing is
 * kept on any hop.
 */
import { z } from 'zod';
import { MeshError, remoteError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import { chatTemplateKwargsSchema, type RouteHop } from '../../protocol/tracker.ts';
import { dtypeBytes, encodeTensor } from '../../protocol/tensor.ts';
import { CHECK_FROM_HEADER, CHECK_TOKENS_HEADER, formatTokens, readTokenCheck, TOKEN_CHECK_BYTES, type TokenCheckRecord } from '../../verify/check-wire.ts';
import { argmax, checkToken } from '../../verify/token-check.ts';
import type { PipelineDriver } from '../head/pipeline.ts';

export const AUDIT_PATH = '/audit';

export const auditRequestSchema = z.object({
  messages: z.array(z.object({ role: z.string(), content: z.string() })).optional(),
  chat_template_kwargs: chatTemplateKwargsSchema.optional(),
  prompt: z.string().optional(),
  prompt_token_ids: z.array(z.number().int().nonnegative()).min(1).optional(),
  /** The tokens the audited generation produced, in order. */
  token_ids: z.array(z.number().int().nonnegative()).min(1).max(65_536),
  temperature: z.number().min(0).max(2).default(0),
  top_p: z.number().gt(0).max(1).default(1),
  top_k: z.number().int().nonnegative().default(0),
  seed: z.number().int().optional(),
});
export type AuditRequest = z.infer<typeof auditRequestSchema>;

/** Re-run the audited generation through `route` (this head's layers first); one record per produced token. */
export async function runAudit(driver: PipelineDriver, headPeerId: string, req: AuditRequest, route: readonly RouteHop[], timeoutMs = 60_000): Promise<TokenCheckRecord[]> {
  const { executor: ex, tokenizer: tok, transport, wireDtype } = driver.parts;
  const plan = driver.planRoute(headPeerId, route);
  let promptIds: number[];
  if (req.messages && req.messages.length > 0) promptIds = tok.encodeChat(req.messages, req.chat_template_kwargs ? { extra: req.chat_template_kwargs } : {});
  else if (req.prompt_token_ids) promptIds = [...req.prompt_token_ids];
  else if (req.prompt !== undefined) promptIds = tok.encode(req.prompt);
  else throw new MeshError('MESH_ERR_BAD_REQUEST', 'give messages, prompt or prompt_token_ids');
  const vocab = ex.config.vocabSize;
  if ([...promptIds, ...req.token_ids].some((id) => id >= vocab)) throw new MeshError('MESH_ERR_BAD_REQUEST', `a token id is outside the vocabulary (0..${vocab - 1})`);
  // Every produced token but the last is fed; the row before each produced token judges it.
  const fed = [...promptIds, ...req.token_ids.slice(0, -1)];
  if (fed.length > ex.maxContext) throw new MeshError('MESH_ERR_TOO_LARGE', `${fed.length} rows exceed the context of ${ex.maxContext}`);
  const from = promptIds.length - 1;
  const sampling = { temperature: req.temperature, top_p: req.top_p, top_k: req.top_k, ...(req.seed !== undefined ? { seed: req.seed } : {}) };
  const params = { temperature: req.temperature, topP: req.top_p, topK: req.top_k, ...(req.seed !== undefined ? { seed: req.seed } : {}) };
  const L = ex.config.numLayers;
  const rows = Array.from({ length: req.token_ids.length }, (_, i) => from + i);

  if (plan.localEnd === L) {
    // This head holds every layer: it judges the tokens itself.
    const r = await ex.forward({ tokenIds: fed, startLayer: 0, endLayer: L, logitRows: rows, sampling: params });
    if (r.kind !== 'logits') throw new MeshError('MESH_ERR_INTERNAL', 'the head answered no logits for the audit');
    return rows.map((row, i) => {
      const logits = r.data.subarray(i * vocab, (i + 1) * vocab);
      const t = checkToken(logits, req.token_ids[i]!, params, row + 1);
      return { claimed: req.token_ids[i]!, sampled: t.sampled, argmax: argmax(logits), deficit: t.deficit, gap: t.gap, logprob: t.logprob };
    });
  }
  const local = await ex.forward({ tokenIds: fed, startLayer: 0, endLayer: plan.localEnd });
  if (local.kind !== 'activation') throw new MeshError('MESH_ERR_INTERNAL', 'the head answered no activation for the audit');
  let body = encodeTensor(local.data, wireDtype);
  const hidden = ex.config.hiddenSize;
  for (const [k, hop] of plan.hops.entries()) {
    const last = k === plan.hops.length - 1;
    const headers: Record<string, string> = {
      [H.shape]: `1,${fed.length},${hidden}`,
      [H.dtype]: wireDtype,
      [H.startLayer]: String(hop.start_layer),
      [H.endLayer]: String(hop.end_layer),
      'content-type': 'application/octet-stream',
    };
    if (last) {
      headers[H.sampling] = JSON.stringify(sampling);
      headers[CHECK_TOKENS_HEADER] = formatTokens(req.token_ids);
      headers[CHECK_FROM_HEADER] = String(from);
    }
    const reply = await transport.send(hop, { method: 'POST', path: '/forward', headers, body }, timeoutMs);
    if (reply.status !== 200) throw remoteError(reply.status, reply.body, `audit hop ${hop.peer_id}`);
    if (!last) {
      if (reply.body.byteLength !== fed.length * hidden * dtypeBytes(wireDtype)) throw new MeshError('MESH_ERR_UPSTREAM', `audit hop ${hop.peer_id} answered ${reply.body.byteLength} bytes`);
      body = reply.body;
      continue;
    }
    if (reply.body.byteLength !== rows.length * TOKEN_CHECK_BYTES) throw new MeshError('MESH_ERR_UPSTREAM', `the audit's last hop ${hop.peer_id} answered ${reply.body.byteLength} bytes, not ${rows.length} records`);
    return rows.map((_, i) => readTokenCheck(reply.body, i * TOKEN_CHECK_BYTES));
  }
  throw new MeshError('MESH_ERR_INTERNAL', 'the audit route has no last hop');
}

/** Records as the audit answer's JSON carries them. */
export function recordsJson(records: readonly TokenCheckRecord[]): Array<Record<string, number>> {
  return records.map((r) => ({ claimed: r.claimed, sampled: r.sampled, argmax: r.argmax, deficit: r.deficit, gap: r.gap, logprob: r.logprob }));
}
