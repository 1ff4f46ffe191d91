/**
 * The OpenAI-compatible surface: request schemas, the error shape
 * `{error:{message,type,param,code}}`, completion objects and SSE chunks
 * exactly as OpenAI sends them (`data: {json}\n\n`, last `data: [DONE]\n\n`).
 */
import { z } from 'zod';
import { HttpError } from './http.ts';
import { chatTemplateKwargsSchema } from '../protocol/tracker.ts';

export type OpenAiErrorType = 'invalid_request_error' | 'not_found_error' | 'server_error' | 'service_unavailable' | 'rate_limit_error';

export function openAiError(status: number, message: string, opts: { type?: OpenAiErrorType; param?: string | null; code?: string | null; extra?: Record<string, unknown>; headers?: Record<string, string> } = {}): HttpError {
  const type = opts.type ?? (status === 404 ? 'not_found_error' : status === 429 ? 'rate_limit_error' : status >= 500 ? (status === 503 ? 'service_unavailable' : 'server_error') : 'invalid_request_error');
  return new HttpError(status, { error: { message, type, param: opts.param ?? null, code: opts.code ?? null, ...opts.extra } }, opts.headers ?? {});
}

/**
 * A 429 as OpenAI sends it (`rate_limit_exceeded`), with `Retry-After`
 * (whole seconds) and `retry-after-ms`, both of which OpenAI's SDKs honour
 * when they retry.
 */
export function tooManyRequests(message: string, retryAfterMs: number, extra: Record<string, unknown> = {}): HttpError {
  const ms = Math.max(0, Math.round(retryAfterMs));
  return openAiError(429, message, {
    type: 'rate_limit_error',
    code: 'rate_limit_exceeded',
    extra,
    headers: { 'retry-after': String(Math.max(1, Math.ceil(ms / 1000))), 'retry-after-ms': String(ms) },
  });
}

const textPart = z.object({ type: z.literal('text'), text: z.string() });
const messageSchema = z.object({
  role: z.enum(['system', 'developer', 'user', 'assistant', 'tool']),
  content: z.union([z.string(), z.array(textPart), z.null()]),
  name: z.string().optional(),
});

const common = {
  model: z.string().min(1).max(200),
  max_tokens: z.number().int().positive().nullish(),
  temperature: z.number().min(0).max(2).nullish(),
  top_p: z.number().min(0).max(1).nullish(),
  seed: z.number().int().min(-(2 ** 53)).max(2 ** 53).nullish(),
  stop: z.union([z.string().min(1), z.array(z.string().min(1)).max(4)]).nullish(),
  stream: z.boolean().nullish(),
  stream_options: z.object({ include_usage: z.boolean().optional() }).nullish(),
  n: z.number().int().positive().nullish(),
  /**
   * How sure the caller wants to be of the mesh's honesty (docs/verification.md): 'default' (sampled
   * spot-checks; the answer says what was checked), 'checked' (every node of the generation is checked,
   * and the final usage and SSE field wait for the verdicts), 'strict' (every step on two disjoint routes).
   */
  verification: z.enum(['default', 'checked', 'strict']).nullish(),
  user: z.string().optional(),
  /** Speculative decoding: false turns it off for this request (the head drafts where it pays otherwise). An extension. */
  speculative: z.boolean().nullish(),
  /** Draft with this draft model (one its head loaded with `meshnet node --draft`). An extension. */
  draft_model: z.string().min(1).max(200).nullish(),
  /** OpenAI's Predicted Outputs: text the answer is expected to resemble, drafted from first. */
  prediction: z.object({ type: z.literal('content'), content: z.union([z.string().max(1 << 20), z.array(textPart)]) }).nullish(),
};

export const chatRequestSchema = z.object({
  ...common,
  messages: z.array(messageSchema).min(1).max(1000),
  max_completion_tokens: z.number().int().positive().nullish(),
  /** Extra chat-template variables, as vLLM takes them (Qwen3: `{"enable_thinking": false}`). */
  chat_template_kwargs: chatTemplateKwargsSchema.nullish(),
});
export type ChatRequest = z.infer<typeof chatRequestSchema>;

/** Prompts in one /v1/completions request at most (each is one choice, all generated at once). */
export const MAX_PROMPTS = 16;
const tokenIds = z.array(z.number().int().nonnegative()).min(1);

/** As OpenAI: a string, a list of strings, a list of token ids, or a list of such lists. */
export const completionRequestSchema = z.object({
  ...common,
  prompt: z.union([z.string(), z.array(z.string()).min(1).max(MAX_PROMPTS), tokenIds, z.array(tokenIds).min(1).max(MAX_PROMPTS)], {
    error: `give a string, a list of strings, a list of token ids, or a list of token-id lists (1 to ${MAX_PROMPTS} prompts, not mixed)`,
  }),
  echo: z.boolean().nullish(),
});
export type CompletionRequest = z.infer<typeof completionRequestSchema>;

/** Parse with zod, answering the first problem as OpenAI does (400, `param` = the field). */
export function parseOpenAi<T>(schema: z.ZodType<T>, body: unknown): T {
  if (typeof body !== 'object' || body === null || Array.isArray(body)) throw openAiError(400, 'the request body must be a JSON object', { code: 'invalid_request_body' });
  const r = schema.safeParse(body);
  if (r.success) return r.data;
  const issue = r.error.issues[0]!;
  const param = issue.path.map(String).join('.') || null;
  const missing = issue.code === 'invalid_type' && issue.message.includes('undefined');
  throw openAiError(400, missing ? `'${param}' is a required property` : `invalid value for '${param}': ${issue.message}`, { param, code: missing ? 'missing_required_parameter' : 'invalid_value' });
}

/** The prompts of a completions request, one per choice: text, or token ids used as they are. */
export function promptsOf(prompt: CompletionRequest['prompt']): Array<{ prompt: string } | { prompt_token_ids: number[] }> {
  if (typeof prompt === 'string') return [{ prompt }];
  if (prompt.length > 0 && typeof prompt[0] === 'number') return [{ prompt_token_ids: prompt as number[] }];
  return (prompt as Array<string | number[]>).map((p) => (typeof p === 'string' ? { prompt: p } : { prompt_token_ids: p }));
}

export function messageText(content: ChatRequest['messages'][number]['content']): string {
  if (content === null) return '';
  if (typeof content === 'string') return content;
  return content.map((p) => p.text).join('');
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  /** With speculative decoding: drafted tokens accepted and rejected (OpenAI's Predicted Outputs names). */
  completion_tokens_details?: { accepted_prediction_tokens: number; rejected_prediction_tokens: number };
  /** Whether the nodes that computed the answer were checked (docs/verification.md); absent when the tracker runs no checks. */
  verification?: unknown;
}

/** Usage; `spec` (tokens drafted and accepted) adds completion_tokens_details when anything was drafted. */
export function usage(prompt: number, completion: number, spec?: { drafted: number; accepted: number }): Usage {
  const u: Usage = { prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion };
  if (spec && spec.drafted > 0) u.completion_tokens_details = { accepted_prediction_tokens: spec.accepted, rejected_prediction_tokens: spec.drafted - spec.accepted };
  return u;
}

export type FinishReason = 'stop' | 'length';
export type ApiKind = 'chat' | 'completion';

export interface CompletionIds {
  id: string;
  created: number;
  model: string;
}

/** One finished choice of a non-streamed answer. */
export interface ChoiceResult {
  text: string;
  finish: FinishReason;
  /** Every token the choice generated (a stop string's tokens included): the `token_ids` extension. */
  tokenIds: number[];
}

export function completionObject(kind: ApiKind, ids: CompletionIds, choices: readonly ChoiceResult[], u: Usage) {
  if (kind === 'chat') {
    return {
      id: ids.id,
      object: 'chat.completion',
      created: ids.created,
      model: ids.model,
      choices: choices.map((c, index) => ({ index, message: { role: 'assistant', content: c.text, refusal: null }, logprobs: null, finish_reason: c.finish, token_ids: c.tokenIds })),
      usage: u,
      system_fingerprint: null,
    };
  }
  return {
    id: ids.id,
    object: 'text_completion',
    created: ids.created,
    model: ids.model,
    choices: choices.map((c, index) => ({ index, text: c.text, logprobs: null, finish_reason: c.finish, token_ids: c.tokenIds })),
    usage: u,
    system_fingerprint: null,
  };
}

/**
 * One streamed chunk of choice `index`: `delta` text (chat: with role on the
 * first), or the finish reason, or (choices empty) usage. `tokenIds` are the
 * tokens generated since the choice's previous chunk (the `token_ids`
 * extension): text that could still start a stop string is held back, so ids
 * can arrive a chunk before their text.
 */
export function chunkObject(kind: ApiKind, ids: CompletionIds, part: { index?: number; text?: string; role?: boolean; finish?: FinishReason; usage?: Usage | null; tokenIds?: number[]; verification?: unknown }) {
  if (part.verification !== undefined && part.usage === undefined) {
    // The final verification chunk: no choice, the verification alone (OpenAI clients skip a chunk without choices).
    return { id: ids.id, object: kind === 'chat' ? 'chat.completion.chunk' : 'text_completion', created: ids.created, model: ids.model, system_fingerprint: null, choices: [], verification: part.verification };
  }
  const finish_reason = part.finish ?? null;
  const index = part.index ?? 0;
  const tokens = part.tokenIds !== undefined ? { token_ids: part.tokenIds } : {};
  if (kind === 'chat') {
    const delta: Record<string, unknown> = {};
    if (part.role) delta.role = 'assistant';
    if (part.text !== undefined) delta.content = part.text;
    return {
      id: ids.id,
      object: 'chat.completion.chunk',
      created: ids.created,
      model: ids.model,
      system_fingerprint: null,
      choices: part.usage ? [] : [{ index, delta, logprobs: null, finish_reason, ...tokens }],
      ...(part.usage !== undefined ? { usage: part.usage } : {}),
      ...(part.verification !== undefined ? { verification: part.verification } : {}),
    };
  }
  return {
    id: ids.id,
    object: 'text_completion',
    created: ids.created,
    model: ids.model,
    system_fingerprint: null,
    choices: part.usage ? [] : [{ index, text: part.text ?? '', logprobs: null, finish_reason, ...tokens }],
    ...(part.usage !== undefined ? { usage: part.usage } : {}),
    ...(part.verification !== undefined ? { verification: part.verification } : {}),
  };
}

export function sseData(obj: unknown): string {
  return `data: ${JSON.stringify(obj)}\n\n`;
}
export const SSE_DONE = 'data: [DONE]\n\n';
