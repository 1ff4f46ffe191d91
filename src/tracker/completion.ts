/**
 * An OpenAI completion, in three steps that each can be tested alone:
 *
 *   parse   the body → a GenerationInput (limits, defaults, stop strings), or OpenAI's 400/404
 *   plan    admission (admission.ts): a route with KV room for the chat, now or after a
 *           wait in the FIFO queue; 429 + Retry-After past the queue's limits, 503
 *           naming the missing layers when there is no route at all
 *   stream  the head's events (runGeneration, with head failover and re-routing
 *           after MESH_ERR_BUSY) → stop strings applied → one JSON completion, or SSE chunks
 *
 * Nothing is committed to the client until the head's first output: a
 * request the head refuses (or that no route had room for in time) still
 * gets a plain HTTP error, not a broken stream.
 */
import { StopMatcher } from '../model/text-stream.ts';
import { MeshError } from '../protocol/errors.ts';
import { randomHex } from '../protocol/ids.ts';
import type { Lease } from './admission.ts';
import type { TrackerContext } from './context.ts';
import { runGeneration, type GenerationDeps, type GenerationEvent, type GenerationInput } from './head-proxy.ts';
import { HttpError, json, readJson } from './http.ts';
import { chatRequestSchema, chunkObject, completionObject, completionRequestSchema, messageText, openAiError, parseOpenAi, sseData, SSE_DONE, tooManyRequests, usage, type ApiKind, type CompletionIds, type FinishReason } from './openai.ts';

export interface ParsedCompletion {
  model: string;
  input: GenerationInput;
  stream: boolean;
  includeUsage: boolean;
}

/** A piece of client-visible output: text, or the end. */
export type CompletionPart = { text: string } | { finish: FinishReason; promptTokens: number; completionTokens: number };

const utf8 = new TextEncoder();

/** Step 1: the request body as a generation, or the OpenAI error the client gets. */
export function parseCompletion(ctx: Pick<TrackerContext, 'registry' | 'options'>, kind: ApiKind, body: unknown): ParsedCompletion {
  const o = ctx.options;
  const parsed = kind === 'chat' ? parseOpenAi(chatRequestSchema, body) : parseOpenAi(completionRequestSchema, body);
  const modelName = parsed.model;
  const model = ctx.registry.models.get(modelName);
  if (!model) throw openAiError(404, `The model '${modelName}' does not exist; this tracker serves: ${[...ctx.registry.models.keys()].join(', ')}`, { code: 'model_not_found', param: 'model' });
  if (parsed.n != null && parsed.n !== 1) throw openAiError(400, 'n > 1 is not supported; send one request per completion', { param: 'n', code: 'unsupported_value' });
  const maxField = kind === 'chat' && 'max_completion_tokens' in parsed && parsed.max_completion_tokens != null ? 'max_completion_tokens' : 'max_tokens';
  const asked = (maxField === 'max_completion_tokens' ? (parsed as { max_completion_tokens?: number | null }).max_completion_tokens : parsed.max_tokens) ?? null;
  if (asked !== null && asked > o.maxTokensLimit) throw openAiError(400, `${maxField} is ${asked}, above this tracker's limit of ${o.maxTokensLimit}`, { param: maxField, code: 'invalid_value' });
  if (asked !== null && asked >= model.contextTokens) throw openAiError(400, `${maxField} is ${asked}, but model '${modelName}' has a context of ${model.contextTokens} tokens (prompt included)`, { param: maxField, code: 'context_length_exceeded' });
  const maxTokens = asked ?? Math.min(o.defaultMaxTokens, o.maxTokensLimit, model.contextTokens - 1);
  const stop = parsed.stop == null ? [] : typeof parsed.stop === 'string' ? [parsed.stop] : parsed.stop;
  const topP = parsed.top_p ?? 1;
  const input: GenerationInput = {
    max_tokens: maxTokens,
    // top_p 0 means "only the likeliest token": greedy.
    temperature: topP === 0 ? 0 : (parsed.temperature ?? 1),
    top_p: topP === 0 ? 1 : topP,
    top_k: 0,
    stop,
    ...(parsed.seed != null ? { seed: parsed.seed } : {}),
    ...(kind === 'chat'
      ? { messages: (parsed as { messages: Array<{ role: string; content: Parameters<typeof messageText>[0] }> }).messages.map((m) => ({ role: m.role, content: messageText(m.content) })) }
      : { prompt: typeof (parsed as { prompt: string | string[] }).prompt === 'string' ? (parsed as { prompt: string }).prompt : (parsed as { prompt: string[] }).prompt[0]! }),
  };
  return { model: modelName, input, stream: parsed.stream === true, includeUsage: parsed.stream_options?.include_usage === true };
}

/**
 * Step 2: KV room on a route for the whole chat (prompt, estimated until the
 * head counts it, + max_tokens), waiting in the admission queue while every
 * route is full. Refusals come as the client sees them (completionError).
 */
export async function planCompletion(ctx: Pick<TrackerContext, 'registry' | 'admission'> & { generation: Pick<GenerationDeps, 'sizer'> }, c: Pick<ParsedCompletion, 'model' | 'input'>, signal: AbortSignal): Promise<Lease> {
  try {
    const need = ctx.generation.sizer.estimate(c.model, c.input, ctx.registry.model(c.model).contextTokens);
    return await ctx.admission.acquire(c.model, need, { signal });
  } catch (e) {
    throw completionError(ctx, e);
  }
}

/**
 * A MeshError as the client sees it: a prompt too long for the context is
 * OpenAI's 400 context_length_exceeded; no KV room in time is OpenAI's 429
 * rate_limit_exceeded with Retry-After; anything else keeps its status and code.
 */
export function completionError(ctx: Pick<TrackerContext, 'admission'>, e: unknown): HttpError {
  if (e instanceof HttpError) return e;
  const err = e instanceof MeshError ? e : new MeshError('MESH_ERR_INTERNAL', (e as Error).message);
  if (err.code === 'MESH_ERR_TOO_LARGE') return openAiError(400, err.message, { param: 'messages', code: 'context_length_exceeded' });
  if (err.code === 'MESH_ERR_TOO_MANY_REQUESTS') {
    const { retry_after_ms: retry, ...rest } = err.details;
    return tooManyRequests(err.message, typeof retry === 'number' ? retry : ctx.admission.retryAfterMs(), { meshnet_code: err.code, ...rest });
  }
  return openAiError(err.status, err.message, { code: err.code, extra: err.details });
}

/**
 * The head's events as client-visible parts: text through the stop matcher
 * (a stop ends the generation early), then one finish. Pull-driven, like
 * the events under it.
 */
export async function* completionParts(events: AsyncGenerator<GenerationEvent>, stop: readonly string[], onFirstToken: () => void): AsyncGenerator<CompletionPart> {
  const stops = new StopMatcher(stop);
  let completionTokens = 0;
  let promptTokens = 0;
  try {
    for (;;) {
      const r = await events.next();
      if (r.done) throw new MeshError('MESH_ERR_UPSTREAM', 'generation ended without a result');
      const ev = r.value;
      if (ev.type === 'start') {
        promptTokens = ev.promptTokens;
        continue;
      }
      if (ev.type === 'token') {
        if (completionTokens++ === 0) onFirstToken();
        const { text, stopped } = stops.push(ev.text);
        if (text) yield { text };
        if (stopped) {
          yield { finish: 'stop', promptTokens, completionTokens };
          return;
        }
        continue;
      }
      const tail = stops.flush();
      if (tail) yield { text: tail };
      yield { finish: ev.finish, promptTokens: ev.promptTokens, completionTokens: ev.completionTokens };
      return;
    }
  } finally {
    await events.return(undefined);
  }
}

/** Step 3: run the generation on the lease's route (and others after a failover or a busy node), answering as one JSON completion or an SSE stream. */
export async function streamCompletion(ctx: TrackerContext, kind: ApiKind, c: ParsedCompletion, lease: Lease, clientSignal: AbortSignal, t0: number): Promise<Response> {
  const { metrics, logger } = ctx;
  const endpoint = kind === 'chat' ? 'chat' : 'completions';
  const ids: CompletionIds = { id: `${kind === 'chat' ? 'chatcmpl' : 'cmpl'}-${randomHex(12)}`, created: Math.floor(ctx.options.now() / 1000), model: c.model };
  const abort = new AbortController();
  clientSignal.addEventListener('abort', () => abort.abort(), { once: true });
  const parts = completionParts(runGeneration(ctx.generation, c.model, c.input, abort.signal, lease), c.input.stop, () => metrics.firstToken.observe((performance.now() - t0) / 1000));
  const next = async (): Promise<CompletionPart> => {
    const r = await parts.next();
    if (r.done) throw new MeshError('MESH_ERR_UPSTREAM', 'generation ended without a result');
    if ('finish' in r.value) {
      metrics.generation.observe((performance.now() - t0) / 1000);
      // Ends the head's generation too when a stop string ended it early.
      void parts.return(undefined);
    }
    return r.value;
  };
  /** A generation error before anything was streamed: a plain HTTP error (completionError). */
  const clientError = (e: unknown): HttpError => {
    abort.abort();
    const err = completionError(ctx, e);
    metrics.requests.inc({ endpoint, status: String(err.status) });
    return err;
  };

  if (!c.stream) {
    let text = '';
    try {
      for (;;) {
        const part = await next();
        if ('text' in part) text += part.text;
        else {
          metrics.requests.inc({ endpoint, status: '200' });
          return json(200, completionObject(kind, ids, text, part.finish, usage(part.promptTokens, part.completionTokens)));
        }
      }
    } catch (e) {
      throw clientError(e);
    }
  }

  // Wait for the head's first output before committing to a 200 stream.
  let first: CompletionPart | undefined;
  try {
    first = await next();
  } catch (e) {
    throw clientError(e);
  }
  let sentRole = false;
  let finished = false;
  const sse = new ReadableStream<Uint8Array>({
    async pull(controller) {
      if (finished) return;
      try {
        if (!sentRole) {
          sentRole = true;
          controller.enqueue(utf8.encode(sseData(chunkObject(kind, ids, kind === 'chat' ? { role: true, text: '' } : { text: '' }))));
          return;
        }
        const part = first ?? (await next());
        first = undefined;
        if ('text' in part) {
          controller.enqueue(utf8.encode(sseData(chunkObject(kind, ids, { text: part.text }))));
          return;
        }
        finished = true;
        controller.enqueue(utf8.encode(sseData(chunkObject(kind, ids, kind === 'chat' ? { finish: part.finish } : { text: '', finish: part.finish }))));
        if (c.includeUsage) controller.enqueue(utf8.encode(sseData(chunkObject(kind, ids, { usage: usage(part.promptTokens, part.completionTokens) }))));
        controller.enqueue(utf8.encode(SSE_DONE));
        metrics.requests.inc({ endpoint, status: '200' });
        controller.close();
      } catch (e) {
        finished = true;
        const err = e instanceof MeshError ? e : new MeshError('MESH_ERR_INTERNAL', (e as Error).message);
        metrics.requests.inc({ endpoint, status: String(err.status) });
        logger.warn({ err: err.message, code: err.code }, 'stream failed');
        // OpenAI's in-stream error: one data event with an error object, then the stream ends.
        controller.enqueue(utf8.encode(sseData(openAiError(err.status, err.message, { code: err.code }).body)));
        controller.close();
      }
    },
    cancel() {
      abort.abort();
      void parts.return(undefined);
    },
  });
  return new Response(sse, { status: 200, headers: { 'content-type': 'text/event-stream; charset=utf-8', 'cache-control': 'no-cache', connection: 'keep-alive', 'x-accel-buffering': 'no' } });
}

/** POST /v1/chat/completions and /v1/completions: parse → plan (admission) → stream, each step's refusal counted. */
export async function complete(ctx: TrackerContext, kind: ApiKind, req: Request): Promise<Response> {
  const endpoint = kind === 'chat' ? 'chat' : 'completions';
  const t0 = performance.now();
  const count = (status: number): void => ctx.metrics.requests.inc({ endpoint, status: String(status) });
  let body: unknown;
  try {
    body = await readJson(req, ctx.options.maxBodyBytes);
  } catch (e) {
    count(400);
    throw openAiError(e instanceof MeshError ? e.status : 400, (e as Error).message, { code: 'invalid_request_body' });
  }
  let c: ParsedCompletion;
  let lease: Lease;
  try {
    c = parseCompletion(ctx, kind, body);
    lease = await planCompletion(ctx, c, req.signal);
  } catch (e) {
    count(e instanceof HttpError ? e.status : 500);
    throw e;
  }
  return streamCompletion(ctx, kind, c, lease, req.signal, t0);
}
