/**
 * An OpenAI completion, in three steps that each can be tested alone:
 *
 *   parse   the body → one GenerationInput per choice (limits, defaults, stop strings),
 *           or OpenAI's 400/404 (503 for a model still loading)
 *   plan    admission (admission.ts): per choice a route with KV room for it, now or
 *           after a wait in the FIFO queue; 429 + Retry-After past the queue's limits,
 *           503 naming the missing layers when there is no route at all
 *   stream  each choice's head events (runGeneration, with head failover and re-routing
 *           after MESH_ERR_BUSY) → stop strings applied → one JSON completion, or SSE
 *           chunks of every choice as they come
 *
 * A chat has one choice; /v1/completions one per prompt (a list of prompts,
 * text or token ids), each its own generation on its own route, all at once.
 * Nothing is committed to the client until every choice's first output: a
 * request a head refuses (or that no route had room for in time) still gets
 * a plain HTTP error, not a broken stream.
 */
import { StopMatcher } from '../model/text-stream.ts';
import { MeshError } from '../protocol/errors.ts';
import { randomHex } from '../protocol/ids.ts';
import type { Lease } from './admission.ts';
import { notLoadedYet, type TrackerContext } from './context.ts';
import { runGeneration, type GenerationDeps, type GenerationEvent, type GenerationInput } from './head-proxy.ts';
import { HttpError, json, readJson, streamResponse } from './http.ts';
import { MergedChoices } from './merged-choices.ts';
import { combine } from './verify/log.ts';
import { runStrict, type StrictStats } from './verify/strict.ts';
import { chatRequestSchema, chunkObject, completionObject, completionRequestSchema, messageText, openAiError, parseOpenAi, promptsOf, sseData, SSE_DONE, tooManyRequests, usage, type ApiKind, type ChatRequest, type CompletionIds, type CompletionRequest, type FinishReason } from './openai-wire.ts';

export interface ParsedCompletion {
  model: string;
  /** One generation per choice: a chat has one; a completions request one per prompt. */
  inputs: GenerationInput[];
  stream: boolean;
  includeUsage: boolean;
  /** The caller's verification level (docs/verification.md). */
  verification: 'default' | 'checked' | 'strict';
}

/**
 * A piece of one choice's client-visible output: text, or the end. `tokenIds`
 * are the tokens generated since the choice's previous part (the `token_ids`
 * extension): text that could still start a stop string is held back, so ids
 * can arrive a part before their text.
 */
export type CompletionPart =
  | { text: string; tokenIds: number[] }
  | { finish: FinishReason; promptTokens: number; completionTokens: number; tokenIds: number[]; drafted: number; accepted: number; /** The generation's verification record, when checks are on. */ verification?: string }
  /** The head accepted the generation (its `start` event): once per choice, before any text. */
  | { started: true };

/**
 * How long after a head accepted a chat (its `start` event) the SSE headers
 * wait for the first token, ms. A refusal comes before `start`, and a busy hop
 * answers within this, so both still get a plain HTTP status; a chat that is
 * slow to its first token (a long prompt, a hop being replaced or waited
 * for) has its headers by then, never tens of seconds later.
 */
export const HEADERS_GRACE_MS = 1_000;

const utf8 = new TextEncoder();
/** Why a completion's controller is aborted when it ends: one object, not a fresh DOMException (and its stack) per request. */
const COMPLETION_OVER = new MeshError('MESH_ERR_CANCELLED', 'the completion is over');
/** Longest a `verification: "checked"` answer waits for its checks' verdicts, ms (tokens never wait). */
const VERIFY_WAIT_MS = 30_000;

/** Step 1: the request body as one generation per choice, or the OpenAI error the client gets. */
export function parseCompletion(ctx: Pick<TrackerContext, 'registry' | 'options'> & Partial<Pick<TrackerContext, 'pendingModels'>>, kind: ApiKind, body: unknown): ParsedCompletion {
  const o = ctx.options;
  const parsed = kind === 'chat' ? parseOpenAi(chatRequestSchema, body) : parseOpenAi(completionRequestSchema, body);
  const modelName = parsed.model;
  const model = ctx.registry.models.get(modelName);
  if (!model) {
    const pending = notLoadedYet(ctx.pendingModels, modelName);
    if (pending) throw openAiError(503, pending.message, { code: 'model_not_loaded', param: 'model' });
    throw openAiError(404, `The model '${modelName}' does not exist; this tracker serves: ${[...ctx.registry.models.keys()].join(', ')}`, { code: 'model_not_found', param: 'model' });
  }
  if (parsed.n != null && parsed.n !== 1) throw openAiError(400, 'n > 1 is not supported; send one request per completion', { param: 'n', code: 'unsupported_value' });
  const maxField = kind === 'chat' && 'max_completion_tokens' in parsed && parsed.max_completion_tokens != null ? 'max_completion_tokens' : 'max_tokens';
  const asked = (maxField === 'max_completion_tokens' ? (parsed as { max_completion_tokens?: number | null }).max_completion_tokens : parsed.max_tokens) ?? null;
  if (asked !== null && asked > o.maxTokensLimit) throw openAiError(400, `${maxField} is ${asked}, above this tracker's limit of ${o.maxTokensLimit}`, { param: maxField, code: 'invalid_value' });
  if (asked !== null && asked >= model.contextTokens) throw openAiError(400, `${maxField} is ${asked}, but model '${modelName}' has a context of ${model.contextTokens} tokens (prompt included)`, { param: maxField, code: 'context_length_exceeded' });
  const maxTokens = asked ?? Math.min(o.defaultMaxTokens, o.maxTokensLimit, model.contextTokens - 1);
  const stop = parsed.stop == null ? [] : typeof parsed.stop === 'string' ? [parsed.stop] : parsed.stop;
  const topP = parsed.top_p ?? 1;
  const common = {
    max_tokens: maxTokens,
    // top_p 0 means "only the likeliest token": greedy.
    temperature: topP === 0 ? 0 : (parsed.temperature ?? 1),
    top_p: topP === 0 ? 1 : topP,
    top_k: 0,
    stop,
    ...(parsed.seed != null ? { seed: parsed.seed } : {}),
    ...(parsed.speculative === false ? { speculative: false } : {}),
    ...(parsed.draft_model != null ? { draft_model: parsed.draft_model } : {}),
    ...(parsed.prediction != null ? { prediction: typeof parsed.prediction.content === 'string' ? parsed.prediction.content : parsed.prediction.content.map((p) => p.text).join('') } : {}),
  };
  let inputs: GenerationInput[];
  if (kind === 'chat') {
    const kwargs = (parsed as ChatRequest).chat_template_kwargs;
    inputs = [{ ...common, messages: (parsed as ChatRequest).messages.map((m) => ({ role: m.role, content: messageText(m.content) })), ...(kwargs ? { chat_template_kwargs: kwargs } : {}) }];
  } else {
    const prompts = promptsOf((parsed as CompletionRequest).prompt);
    for (const p of prompts) {
      if (!('prompt_token_ids' in p)) continue;
      const outside = p.prompt_token_ids.find((id) => id >= model.config.vocabSize);
      if (outside !== undefined) throw openAiError(400, `token id ${outside} is outside the vocabulary of '${modelName}' (0..${model.config.vocabSize - 1})`, { param: 'prompt', code: 'invalid_value' });
      if (p.prompt_token_ids.length + maxTokens > model.contextTokens) throw openAiError(400, `a prompt of ${p.prompt_token_ids.length} tokens plus ${maxTokens} to generate exceeds the context of ${model.contextTokens} tokens`, { param: 'prompt', code: 'context_length_exceeded' });
    }
    inputs = prompts.map((p) => ({ ...common, ...p }));
  }
  return { model: modelName, inputs, stream: parsed.stream === true, includeUsage: parsed.stream_options?.include_usage === true, verification: parsed.verification ?? 'default' };
}

/**
 * Step 2: per choice, KV room on a route for the whole generation (prompt,
 * estimated until the head counts it, + max_tokens), waiting in the
 * admission queue while every route is full. All or none: when one choice
 * is refused, the others' leases are given back. Refusals come as the
 * client sees them (completionError).
 */
export async function planCompletion(ctx: Pick<TrackerContext, 'registry' | 'admission'> & { generation: Pick<GenerationDeps, 'sizer'> }, kind: ApiKind, c: Pick<ParsedCompletion, 'model' | 'inputs'> & Partial<Pick<ParsedCompletion, 'verification'>>, signal: AbortSignal): Promise<Lease[]> {
  const context = ctx.registry.model(c.model).contextTokens;
  const acquire = async (input: GenerationInput): Promise<Lease[]> => {
    const tokens = ctx.generation.sizer.estimate(c.model, input, context);
    const first = await ctx.admission.acquire(c.model, tokens, { signal });
    if (c.verification !== 'strict') return [first];
    // Strict: a second route that shares no node with the first (docs/verification.md).
    try {
      return [first, await ctx.admission.acquire(c.model, tokens, { signal, exclude: new Set(first.plan.hops.map((h) => h.id)), front: true })];
    } catch (e) {
      first.release();
      if (e instanceof MeshError && e.code === 'MESH_ERR_UNAVAILABLE') throw new MeshError('MESH_ERR_UNAVAILABLE', `strict verification needs two routes that share no node, and the mesh has one now (${e.message})`, e.details);
      throw e;
    }
  };
  const settled = await Promise.allSettled(c.inputs.map(acquire));
  const refused = settled.find((r): r is PromiseRejectedResult => r.status === 'rejected');
  if (!refused) return settled.flatMap((r) => (r as PromiseFulfilledResult<Lease[]>).value);
  for (const r of settled) if (r.status === 'fulfilled') for (const l of r.value) l.release();
  throw completionError(ctx, kind, refused.reason);
}

/**
 * A MeshError as the client sees it: a prompt too long for the context is
 * OpenAI's 400 context_length_exceeded; no KV room in time is OpenAI's 429
 * rate_limit_exceeded with Retry-After; anything else keeps its status and code.
 */
export function completionError(ctx: Pick<TrackerContext, 'admission'>, kind: ApiKind, e: unknown): HttpError {
  if (e instanceof HttpError) return e;
  const err = e instanceof MeshError ? e : new MeshError('MESH_ERR_INTERNAL', (e as Error).message);
  if (err.code === 'MESH_ERR_TOO_LARGE') return openAiError(400, err.message, { param: kind === 'chat' ? 'messages' : 'prompt', code: 'context_length_exceeded' });
  if (err.code === 'MESH_ERR_TOO_MANY_REQUESTS') {
    const { retry_after_ms: retry, ...rest } = err.details;
    return tooManyRequests(err.message, typeof retry === 'number' ? retry : ctx.admission.retryAfterMs(), { meshnet_code: err.code, ...rest });
  }
  return openAiError(err.status, err.message, { code: err.code, extra: err.details });
}

/**
 * One choice's head events as client-visible parts: text through the stop
 * matcher, each piece with the token ids generated since the last, then one
 * finish. A stop string ends the generation at once: the head is cancelled
 * and its route released before the finish is yielded. Pull-driven, like the
 * events under it; returning early ends the generation too.
 */
export async function* completionParts(events: AsyncGenerator<GenerationEvent>, stop: readonly string[], onFirstToken: () => void): AsyncGenerator<CompletionPart> {
  const stops = new StopMatcher(stop);
  let ids: number[] = [];
  const take = (): number[] => {
    const out = ids;
    ids = [];
    return out;
  };
  let completionTokens = 0;
  let promptTokens = 0;
  let drafted = 0;
  let accepted = 0;
  let verification: string | undefined;
  const verified = () => (verification !== undefined ? { verification } : {});
  try {
    for (;;) {
      const r = await events.next();
      if (r.done) throw new MeshError('MESH_ERR_UPSTREAM', 'generation ended without a result');
      const ev = r.value;
      if (ev.type === 'start') {
        // Failovers and resumes start again: only the first start is news to the client.
        if (promptTokens === 0) yield { started: true };
        promptTokens = ev.promptTokens;
        verification = ev.verification;
        continue;
      }
      if (ev.type === 'token') {
        if (completionTokens++ === 0) onFirstToken();
        ids.push(ev.tokenId);
        drafted += ev.drafted ?? 0;
        accepted += ev.accepted ?? 0;
        const { text, stopped } = stops.push(ev.text);
        if (stopped) await events.return(undefined);
        if (text) yield { text, tokenIds: take() };
        if (stopped) {
          yield { finish: 'stop', promptTokens, completionTokens, tokenIds: take(), drafted, accepted, ...verified() };
          return;
        }
        continue;
      }
      const tail = stops.flush();
      if (tail) yield { text: tail, tokenIds: take() };
      yield { finish: ev.finish, promptTokens: ev.promptTokens, completionTokens: ev.completionTokens, tokenIds: take(), drafted, accepted, ...(ev.verification ?? verification ? { verification: ev.verification ?? verification } : {}) };
      return;
    }
  } finally {
    await events.return(undefined);
  }
}

/** A choice's first output: its first part, or (accepted by its head, but no part within the grace) the pending next part. */
type FirstOutput = { r: IteratorResult<CompletionPart> } | { pending: Promise<IteratorResult<CompletionPart>> };

async function firstOutput(choice: AsyncGenerator<CompletionPart>, graceMs: number): Promise<FirstOutput> {
  const r = await choice.next();
  if (r.done || !('started' in r.value)) return { r };
  const pending = choice.next();
  let timer: ReturnType<typeof setTimeout> | undefined;
  const grace = new Promise<undefined>((resolve) => {
    timer = setTimeout(() => resolve(undefined), graceMs);
  });
  try {
    const got = await Promise.race([pending, grace]);
    return got === undefined ? { pending } : { r: got };
  } finally {
    clearTimeout(timer);
  }
}

/** Step 3: run every choice's generation on its lease's route (others after a failover or a busy node), answering as one JSON completion or an SSE stream. */
export async function streamCompletion(ctx: TrackerContext, kind: ApiKind, c: ParsedCompletion, leases: readonly Lease[], clientSignal: AbortSignal, t0: number): Promise<Response> {
  const { metrics, logger } = ctx;
  const endpoint = kind === 'chat' ? 'chat' : 'completions';
  const ids: CompletionIds = { id: `${kind === 'chat' ? 'chatcmpl' : 'cmpl'}-${randomHex(12)}`, created: Math.floor(ctx.options.now() / 1000), model: c.model };
  const abort = new AbortController();
  clientSignal.addEventListener('abort', () => abort.abort(), { once: true });
  let firstTokenSeen = false;
  const onFirstToken = (): void => {
    if (firstTokenSeen) return;
    firstTokenSeen = true;
    metrics.firstToken.observe((performance.now() - t0) / 1000);
  };
  // Each choice is its own generation (own route, own failover), all running at once.
  // Strict: two leases per choice (disjoint routes), each token agreed by both (verify/strict.ts).
  const strict = c.verification === 'strict';
  const strictStats = c.inputs.map((): StrictStats => ({ agreed: 0, disputes: 0, records: [] }));
  const choices = c.inputs.map((input, i) =>
    completionParts(
      strict ? runStrict(ctx.generation, c.model, input, abort.signal, [leases[2 * i]!, leases[2 * i + 1]!], strictStats[i]!) : runGeneration(ctx.generation, c.model, input, abort.signal, leases[i], { verification: c.verification === 'checked' ? 'checked' : 'default' }),
      input.stop,
      onFirstToken,
    ),
  );
  /** Stop every choice and release what its generation holds. */
  const endAll = (): void => {
    abort.abort(COMPLETION_OVER);
    for (const choice of choices) void choice.return(undefined);
  };
  /** A generation error before anything was streamed: a plain HTTP error (completionError). */
  const clientError = (e: unknown): HttpError => {
    const err = completionError(ctx, kind, e);
    metrics.requests.inc({ endpoint, status: String(err.status) });
    return err;
  };
  const usageOf = (finishes: ReadonlyArray<{ promptTokens: number; completionTokens: number; drafted: number; accepted: number }>, verification?: unknown) => ({
    ...usage(
      finishes.reduce((n, f) => n + f.promptTokens, 0),
      finishes.reduce((n, f) => n + f.completionTokens, 0),
      { drafted: finishes.reduce((n, f) => n + f.drafted, 0), accepted: finishes.reduce((n, f) => n + f.accepted, 0) },
    ),
    ...(verification !== undefined ? { verification } : {}),
  });
  /** What the answer says of its checks: per choice, each node's status (waiting for the verdicts when the caller asked for checks). */
  const verificationOf = async (finishes: ReadonlyArray<{ index: number; verification?: string }>): Promise<unknown> => {
    if (strict) {
      // Every token was agreed on by two routes that share no node (a third decided any disagreement).
      const choicesOf = strictStats.map((st, index) => ({ index, status: 'clean' as const, tokens_agreed: st.agreed, disputes: st.disputes, routes: st.records.map((id) => ctx.verification.log.get(id)?.view(ctx.verification.trust, ctx.options.now(), '')).filter(Boolean) }));
      return { status: 'clean', mode: 'strict', generations: choicesOf };
    }
    if (!ctx.verification.enabled || finishes.every((f) => f.verification === undefined)) return undefined;
    const records = finishes.map((f) => ({ index: f.index, r: f.verification !== undefined ? ctx.verification.log.get(f.verification) : undefined }));
    if (c.verification === 'checked') await Promise.all(records.map(({ r }) => r?.waitSettled(VERIFY_WAIT_MS)));
    const generations = records.map(({ index, r }) => ({ index, ...(r ? r.view(ctx.verification.trust, ctx.options.now(), '') : { status: 'unchecked' as const, hops: [] }) }));
    return { status: combine(generations.map((g) => g.status)), generations };
  };

  if (!c.stream) {
    try {
      const results = await Promise.all(
        choices.map(async (choice) => {
          let text = '';
          const tokenIds: number[] = [];
          for await (const part of choice) {
            if ('started' in part) continue;
            tokenIds.push(...part.tokenIds);
            if ('text' in part) text += part.text;
            else return { text, tokenIds, finish: part.finish, promptTokens: part.promptTokens, completionTokens: part.completionTokens, drafted: part.drafted, accepted: part.accepted, ...(part.verification !== undefined ? { verification: part.verification } : {}) };
          }
          throw new MeshError('MESH_ERR_UPSTREAM', 'generation ended without a result');
        }),
      );
      metrics.generation.observe((performance.now() - t0) / 1000);
      metrics.requests.inc({ endpoint, status: '200' });
      const verification = await verificationOf(results.map((r, index) => ({ index, ...(r.verification !== undefined ? { verification: r.verification } : {}) })));
      return json(200, completionObject(kind, ids, results, usageOf(results, verification)));
    } catch (e) {
      throw clientError(e);
    } finally {
      endAll();
    }
  }

  // Wait for every choice's first output (or its head's acceptance and a short grace) before committing to a 200 stream.
  let firsts: FirstOutput[];
  try {
    firsts = await Promise.all(choices.map((choice) => firstOutput(choice, HEADERS_GRACE_MS)));
  } catch (e) {
    endAll();
    throw clientError(e);
  }
  const finishes: Array<{ index: number; promptTokens: number; completionTokens: number; drafted: number; accepted: number; verification?: string }> = [];
  const merged = new MergedChoices(choices);
  const sse = (obj: unknown): Uint8Array => utf8.encode(sseData(obj));
  // Pull-driven like the generations under it: a chunk is made when the client's socket takes the last one.
  async function* events(): AsyncGenerator<Uint8Array> {
    try {
      firsts.forEach((f, index) => ('pending' in f ? merged.await(index, f.pending) : merged.add(index, f.r)));
      for (let index = 0; index < choices.length; index++) yield sse(chunkObject(kind, ids, kind === 'chat' ? { index, role: true, text: '' } : { index, text: '' }));
      for (;;) {
        const next = await merged.next();
        if (!next) break;
        const { index, part } = next;
        if ('started' in part) continue;
        if ('text' in part) yield sse(chunkObject(kind, ids, { index, text: part.text, tokenIds: part.tokenIds }));
        else {
          finishes.push({ index, ...part });
          yield sse(chunkObject(kind, ids, kind === 'chat' ? { index, finish: part.finish, tokenIds: part.tokenIds } : { index, text: '', finish: part.finish, tokenIds: part.tokenIds }));
        }
      }
      // The final SSE field: what was checked of the nodes that computed this answer (on the usage chunk, or a chunk of its own).
      const verification = await verificationOf(finishes);
      if (c.includeUsage) yield sse(chunkObject(kind, ids, { usage: usageOf(finishes, verification), ...(verification !== undefined ? { verification } : {}) }));
      else if (verification !== undefined) yield sse(chunkObject(kind, ids, { verification }));
      metrics.generation.observe((performance.now() - t0) / 1000);
      metrics.requests.inc({ endpoint, status: '200' });
      yield utf8.encode(SSE_DONE);
    } catch (e) {
      endAll();
      const err = e instanceof MeshError ? e : new MeshError('MESH_ERR_INTERNAL', (e as Error).message);
      metrics.requests.inc({ endpoint, status: String(err.status) });
      logger.warn({ err: err.message, code: err.code }, 'stream failed');
      // OpenAI's in-stream error: one data event with an error object, then the stream ends.
      yield sse(openAiError(err.status, err.message, { code: err.code }).body);
    } finally {
      // Also when the client went away mid-stream (the host returns the source).
      endAll();
    }
  }
  return streamResponse(events(), { status: 200, headers: { 'content-type': 'text/event-stream; charset=utf-8', 'cache-control': 'no-cache', connection: 'keep-alive', 'x-accel-buffering': 'no' } }, endAll);
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
  let leases: Lease[];
  try {
    c = parseCompletion(ctx, kind, body);
    leases = await planCompletion(ctx, kind, c, req.signal);
  } catch (e) {
    count(e instanceof HttpError ? e.status : 500);
    throw e;
  }
  return streamCompletion(ctx, kind, c, leases, req.signal, t0);
}
