/**
 * The OpenAI-compatible surface: request schemas, the error shape
 * `{error:{message,type,param,code}}`, completion objects and SSE chunks
 * exactly as OpenAI sends them (`data: {json}\n\n`, last `data: [DONE]\n\n`).
 */
import { z } from 'zod';
import { MeshError } from '../protocol/errors.ts';
import type { GenerationEvent } from './head-proxy.ts';
import { HttpError } from './http.ts';

export type OpenAiErrorType = 'invalid_request_error' | 'not_found_error' | 'server_error' | 'service_unavailable' | 'rate_limit_error';

export function openAiError(status: number, message: string, opts: { type?: OpenAiErrorType; param?: string | null; code?: string | null; extra?: Record<string, unknown> } = {}): HttpError {
  const type = opts.type ?? (status === 404 ? 'not_found_error' : status >= 500 ? (status === 503 ? 'service_unavailable' : 'server_error') : 'invalid_request_error');
  return new HttpError(status, { error: { message, type, param: opts.param ?? null, code: opts.code ?? null, ...opts.extra } });
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
  user: z.string().optional(),
};

export const chatRequestSchema = z.object({
  ...common,
  messages: z.array(messageSchema).min(1).max(1000),
  max_completion_tokens: z.number().int().positive().nullish(),
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
}

export function usage(prompt: number, completion: number): Usage {
  return { prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion };
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
export function chunkObject(kind: ApiKind, ids: CompletionIds, part: { index?: number; text?: string; role?: boolean; finish?: FinishReason; usage?: Usage | null; tokenIds?: number[] }) {
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
  };
}

export function sseData(obj: unknown): string {
  return `data: ${JSON.stringify(obj)}\n\n`;
}
export const SSE_DONE = 'data: [DONE]\n\n';

/**
 * Stop strings over a stream of text pieces: text is released only once it
 * cannot be the start of a stop string, and nothing from the first match on
 * is ever released (OpenAI leaves the stop sequence out).
 */
export class StopFilter {
  private pending = '';
  private readonly holdBack: number;
  stopped = false;
  constructor(private readonly stops: readonly string[]) {
    this.holdBack = stops.reduce((m, s) => Math.max(m, s.length - 1), 0);
  }

  /** Text safe to emit now. After a match, `stopped` is true and later pushes return ''. */
  push(text: string): string {
    if (this.stopped) return '';
    this.pending += text;
    let cut = -1;
    for (const s of this.stops) {
      const i = this.pending.indexOf(s);
      if (i >= 0 && (cut < 0 || i < cut)) cut = i;
    }
    if (cut >= 0) {
      this.stopped = true;
      const out = this.pending.slice(0, cut);
      this.pending = '';
      return out;
    }
    // Keep the longest suffix that is a prefix of some stop string.
    let keep = 0;
    for (let k = Math.min(this.holdBack, this.pending.length); k > 0; k--) {
      const tail = this.pending.slice(this.pending.length - k);
      if (this.stops.some((s) => s.startsWith(tail))) {
        keep = k;
        break;
      }
    }
    const out = this.pending.slice(0, this.pending.length - keep);
    this.pending = this.pending.slice(this.pending.length - keep);
    return out;
  }

  /** What is still held back when the stream ends without a match. */
  flush(): string {
    const out = this.stopped ? '' : this.pending;
    this.pending = '';
    return out;
  }
}

// ---------------------------------------------------------------- a choice's output

/** What a client sees of one choice: text (with the tokens behind it), then the finish. */
export type ChoicePart =
  | { type: 'text'; text: string; tokenIds: number[] }
  | { type: 'finish'; finish: FinishReason; promptTokens: number; completionTokens: number; tokenIds: number[] };

/**
 * A generation's events as one choice's output: text released through the
 * stop filter, each piece with the token ids generated since the last, then
 * one finish. A stop string ends the generation at once (the head is
 * cancelled, its route released). Returning early ends the generation too.
 */
export async function* choiceParts(events: AsyncGenerator<GenerationEvent>, stop: readonly string[], onToken?: () => void): AsyncGenerator<ChoicePart> {
  const filter = new StopFilter(stop);
  let ids: number[] = [];
  const take = () => {
    const out = ids;
    ids = [];
    return out;
  };
  let promptTokens = 0;
  let completionTokens = 0;
  for await (const ev of events) {
    if (ev.type === 'start') {
      promptTokens = ev.promptTokens;
      continue;
    }
    if (ev.type === 'token') {
      onToken?.();
      completionTokens++;
      ids.push(ev.tokenId);
      const text = filter.push(ev.text);
      if (filter.stopped) {
        await events.return(undefined);
        if (text) yield { type: 'text', text, tokenIds: take() };
        yield { type: 'finish', finish: 'stop', promptTokens, completionTokens, tokenIds: take() };
        return;
      }
      if (text) yield { type: 'text', text, tokenIds: take() };
      continue;
    }
    const tail = filter.flush();
    if (tail) yield { type: 'text', text: tail, tokenIds: take() };
    yield { type: 'finish', finish: ev.finish, promptTokens: ev.promptTokens, completionTokens: ev.completionTokens, tokenIds: take() };
    return;
  }
  throw new MeshError('MESH_ERR_UPSTREAM', 'generation ended without a result');
}

/** Several choices' parts as one stream, each part as soon as it comes (a streamed request with several prompts). */
export class MergedChoices {
  private readonly queue: Array<{ index: number; part: ChoicePart }> = [];
  private readonly waiting = new Map<number, Promise<{ index: number; r: IteratorResult<ChoicePart> }>>();

  constructor(private readonly choices: ReadonlyArray<AsyncGenerator<ChoicePart>>) {}

  /** Take choice `index`'s result of next(); after a text part, its next part is awaited. */
  add(index: number, r: IteratorResult<ChoicePart>): void {
    if (r.done) throw new MeshError('MESH_ERR_UPSTREAM', 'generation ended without a result');
    this.queue.push({ index, part: r.value });
    if (r.value.type !== 'text') return;
    const pending = this.choices[index]!.next().then((next) => ({ index, r: next }));
    // Raced later; until then a failure must not count as unhandled.
    pending.catch(() => undefined);
    this.waiting.set(index, pending);
  }

  /** The next part of any choice, in the order they come; undefined once every choice has finished. */
  async next(): Promise<{ index: number; part: ChoicePart } | undefined> {
    if (this.queue.length === 0 && this.waiting.size > 0) {
      const { index, r } = await Promise.race(this.waiting.values());
      this.waiting.delete(index);
      this.add(index, r);
    }
    return this.queue.shift();
  }
}
