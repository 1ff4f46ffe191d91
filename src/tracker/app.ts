/**
 * The tracker as a fetch-style app (no socket): control-plane API for nodes,
 * OpenAI-compatible API for clients, data for the dashboard.
 *
 *   POST /api/nodes/register    signed NodeMessage → RegisterAnswer (assignment)
 *   POST /api/nodes/heartbeat   signed NodeMessage → RegisterAnswer; 404 when unknown (register again)
 *   POST /api/route/replace     signed ReplaceRequest (by a head) → ReplaceAnswer
 *   GET  /api/route?model=      a signed route, as a head would get it (debugging, benches)
 *   GET  /api/availability      per model: layers × nodes, spans, status, throughput
 *   GET  /api/dashboard         nodes, stats, recent routes
 *   GET  /dashboard             the dashboard page over /api/dashboard (dashboard.ts)
 *   GET  /api/tracker           the tracker's public key
 *   GET  /v1/models, POST /v1/chat/completions, POST /v1/completions
 *   GET  /metrics, GET /healthz
 */
import type { Logger } from 'pino';
import { encodeBase64Url } from '../protocol/base64.ts';
import { MeshError, errorBody } from '../protocol/errors.ts';
import { nodeMessageSchema, replaceRequestSchema, signedSchema, type NodeMessage, type RegisterAnswer, type ReplaceAnswer } from '../protocol/tracker.ts';
import type { Identity } from '../node/identity.ts';
import { randomHex } from '../protocol/ids.ts';
import { DASHBOARD_HTML } from './dashboard.ts';
import { App, HttpError, json, readJson, type RouteContext } from './http.ts';
import { routeHops, runGeneration, type GenerationDeps, type GenerationInput, type HeadTransport } from './head-proxy.ts';
import type { TrackerMetrics } from './metrics.ts';
import type { ModelSpec } from './model-registry.ts';
import { chatRequestSchema, choiceParts, chunkObject, completionObject, completionRequestSchema, messageText, openAiError, parseOpenAi, promptsOf, sseData, SSE_DONE, usage, type ApiKind, type ChatRequest, type ChoicePart, type CompletionIds, type CompletionRequest, MergedChoices } from './openai.ts';
import type { TrackerOptions } from './options.ts';
import { NodeRegistry, NodeStatus, type NodeRecord } from './registry.ts';
import type { RoutePlan } from './routing.ts';
import { signRoute, verifyNodeMessage, verifyTimestampedSignature } from './signing.ts';

export interface TrackerDeps {
  options: TrackerOptions;
  models: readonly ModelSpec[];
  identity: Identity;
  transport: HeadTransport;
  logger: Logger;
  metrics: TrackerMetrics;
  /** Models configured but not loaded yet (their checkpoints are retried): 503 for them, not 404. */
  pendingModels?: ReadonlyMap<string, { url: string; lastError: string }>;
}

export interface RecentRoute {
  at: number;
  kind: 'generate' | 'failover' | 'replace' | 'inspect';
  model: string;
  head: string;
  hops: Array<{ peer_id: string; start_layer: number; end_layer: number }>;
  cost_ms: number;
}

export interface Tracker {
  app: App;
  registry: NodeRegistry;
  identity: Identity;
  publicKey: string;
  recentRoutes: RecentRoute[];
  /** Expire silent nodes and rebalance; the server calls it every heartbeat interval. */
  sweep(): string[];
}

const nodeMessage = signedSchema(nodeMessageSchema);
const replaceMessage = signedSchema(replaceRequestSchema);
const utf8 = new TextEncoder();

export function createTracker(deps: TrackerDeps): Tracker {
  const { options: o, logger, metrics, identity } = deps;
  const publicKey = encodeBase64Url(identity.publicKey);
  const recentRoutes: RecentRoute[] = [];
  const startedAt = o.now();

  const registry = new NodeRegistry(deps.models, o, {
    onRemoved(n, reason) {
      metrics.removals.inc({ reason });
      logger.info({ peer_id: n.peerId, model: n.info.model, reason }, 'node removed');
    },
    onMoved(n, mv) {
      metrics.moves.inc();
      logger.info({ peer_id: n.peerId, from: mv.from, to: mv.to }, 'node reassigned');
    },
  });

  function recordRoute(kind: RecentRoute['kind'], model: string, plan: RoutePlan): void {
    recentRoutes.push({
      at: o.now(),
      kind,
      model,
      head: plan.hops[0]!.id,
      hops: plan.hops.map((h) => ({ peer_id: h.id, start_layer: h.start, end_layer: h.end })),
      cost_ms: Math.round(plan.costMs * 100) / 100,
    });
    if (recentRoutes.length > o.recentRoutes) recentRoutes.splice(0, recentRoutes.length - o.recentRoutes);
  }

  const genDeps: GenerationDeps = { registry, transport: deps.transport, identity, options: o, logger, metrics, onRoute: (kind, model, plan) => recordRoute(kind, model, plan) };

  function updateNodeGauge(): void {
    metrics.nodes.reset();
    for (const n of registry.nodes.values()) metrics.nodes.inc({ model: n.info.model, status: registry.status(n) });
  }

  function answerFor(n: NodeRecord): RegisterAnswer {
    const model = registry.models.get(n.info.model)!;
    return {
      assignment: n.assignment && { model: model.name, start_layer: n.assignment.start, end_layer: n.assignment.end, model_url: model.url },
      heartbeat_interval_ms: o.heartbeatIntervalMs,
      tracker_public_key: publicKey,
    };
  }

  /** 503 for a model whose checkpoint is still being retried. */
  function notLoadedYet(model: string): MeshError | undefined {
    const p = deps.pendingModels?.get(model);
    return p && new MeshError('MESH_ERR_UNAVAILABLE', `model "${model}" is not loaded yet: its checkpoint at ${p.url} failed (${p.lastError}); the tracker keeps retrying`);
  }

  async function signedNodeMessage(req: Request, kind: 'register' | 'heartbeat'): Promise<NodeMessage> {
    const parsed = nodeMessage.safeParse(await readJson(req, o.maxBodyBytes));
    if (!parsed.success) {
      metrics.registrations.inc({ kind, result: 'malformed' });
      const issue = parsed.error.issues[0]!;
      throw new MeshError('MESH_ERR_BAD_REQUEST', `field "${issue.path.join('.') || '(root)'}": ${issue.message}; expected {body: NodeMessage, signature}`);
    }
    try {
      await verifyNodeMessage(parsed.data, o.now(), o.maxClockSkewMs);
    } catch (e) {
      metrics.registrations.inc({ kind, result: 'refused' });
      logger.warn({ peer_id: parsed.data.body.peer_id, kind, err: (e as Error).message }, 'signed node message refused');
      throw e;
    }
    return parsed.data.body;
  }

  const app = new App();
  app.onError = (err) => {
    if (err instanceof HttpError) return json(err.status, err.body);
    if (err instanceof MeshError) return json(err.status, err.toBody());
    logger.error({ err }, 'unhandled error');
    return json(500, errorBody('MESH_ERR_INTERNAL', 'internal error; the tracker keeps serving'));
  };

  // ------------------------------------------------------------ nodes

  app.post('/api/nodes/register', async ({ req }) => {
    const msg = await signedNodeMessage(req, 'register');
    if (!registry.models.has(msg.info.model)) {
      const pending = notLoadedYet(msg.info.model);
      if (pending) throw pending;
    }
    const n = registry.register(msg);
    metrics.registrations.inc({ kind: 'register', result: 'ok' });
    logger.info({ peer_id: n.peerId, model: n.info.model, budget_mb: n.info.memory_budget_mb, assignment: n.assignment, serving: n.serving }, 'node registered');
    updateNodeGauge();
    return json(200, answerFor(n));
  });

  app.post('/api/nodes/heartbeat', async ({ req }) => {
    const msg = await signedNodeMessage(req, 'heartbeat');
    let n: NodeRecord;
    try {
      n = registry.heartbeat(msg);
    } catch (e) {
      metrics.registrations.inc({ kind: 'heartbeat', result: 'unknown' });
      throw e;
    }
    metrics.registrations.inc({ kind: 'heartbeat', result: 'ok' });
    updateNodeGauge();
    return json(200, answerFor(n));
  });

  app.post('/api/route/replace', async ({ req }) => {
    const parsed = replaceMessage.safeParse(await readJson(req, o.maxBodyBytes));
    if (!parsed.success) {
      const issue = parsed.error.issues[0]!;
      throw new MeshError('MESH_ERR_BAD_REQUEST', `field "${issue.path.join('.') || '(root)'}": ${issue.message}; expected {body: ReplaceRequest, signature}`);
    }
    const body = parsed.data.body;
    const head = registry.nodes.get(body.head_peer_id);
    if (!head) throw new MeshError('MESH_ERR_NOT_FOUND', `head ${body.head_peer_id} is not registered here; register first`);
    await verifyTimestampedSignature(head.publicKey, parsed.data, o.now(), o.maxClockSkewMs);
    const model = registry.model(body.model);
    if (body.start_layer >= body.end_layer || body.end_layer > model.numLayers) {
      throw new MeshError('MESH_ERR_BAD_REQUEST', `span [${body.start_layer}, ${body.end_layer}) is not inside the model's 0..${model.numLayers}`);
    }
    const failed = registry.nodes.get(body.failed_peer_id);
    if (failed) failed.failures++;
    let plan: RoutePlan;
    try {
      // The head already runs its own layers in this session; the failed node is what we replace.
      plan = registry.pick(body.model, new Set([body.head_peer_id, body.failed_peer_id]), body.start_layer, body.end_layer);
    } catch (e) {
      metrics.replacements.inc({ result: 'unavailable' });
      throw e;
    }
    metrics.replacements.inc({ result: 'ok' });
    recordRoute('replace', body.model, plan);
    const signed = await signRoute(identity, body.head_peer_id, routeHops(registry, plan, false), o.now() + o.routeTtlMs);
    const answer: ReplaceAnswer = { route: signed.header, expires_at: signed.expiresAt, signature: signed.signature };
    return json(200, answer);
  });

  app.get('/api/route', async ({ url }) => {
    const modelName = url.searchParams.get('model') ?? deps.models[0]?.name ?? '';
    const plan = registry.pick(modelName);
    recordRoute('inspect', modelName, plan);
    const head = plan.hops[0]!.id;
    const hops = routeHops(registry, plan, true);
    const signed = await signRoute(identity, head, hops, o.now() + o.routeTtlMs);
    return json(200, { model: modelName, head, head_endpoint: registry.nodes.get(head)?.endpoint ?? null, hops, cost_ms: plan.costMs, route_header: signed.header, expires_at: signed.expiresAt, signature: signed.signature });
  });

  app.get('/api/tracker', () => json(200, { public_key: publicKey, peer_id: identity.peerId, models: [...registry.models.keys()], models_pending: [...(deps.pendingModels?.keys() ?? [])], heartbeat_interval_ms: o.heartbeatIntervalMs }));

  app.get('/api/availability', ({ url }) => {
    const only = url.searchParams.get('model');
    const names = only ? [registry.model(only).name] : [...registry.models.keys()];
    return json(200, { models: names.map((m) => registry.availability(m)) });
  });

  app.get('/api/dashboard', () => {
    const now = o.now();
    return json(200, {
      tracker: { public_key: publicKey, peer_id: identity.peerId, uptime_s: Math.round((now - startedAt) / 1000) },
      models: [...registry.models.values()].map((m) => {
        const a = registry.availability(m.name);
        return { name: m.name, url: m.url, num_layers: m.numLayers, complete: a.complete, missing_layers: a.missing_layers, coverage: a.layers.map((l) => l.count) };
      }),
      nodes: [...registry.nodes.values()].map((n) => ({
        peer_id: n.peerId,
        model: n.info.model,
        backend: n.info.backend,
        host: n.info.host,
        version: n.info.version ?? null,
        memory_budget_mb: n.info.memory_budget_mb,
        status: registry.status(n),
        assignment: n.assignment && { start_layer: n.assignment.start, end_layer: n.assignment.end },
        serving: n.serving && { start_layer: n.serving.start, end_layer: n.serving.end },
        throughput: Math.round(registry.throughput(n) * 100) / 100,
        layer_ms: Math.round(registry.layerMs(n) * 1000) / 1000,
        rpm: n.stats?.rpm ?? 0,
        queue_depth: n.stats?.queue_depth ?? 0,
        kv_free_bytes: n.stats?.kv_free_bytes ?? null,
        tokens_served: n.stats?.tokens_served ?? 0,
        rpm_history: n.history.map((h) => ({ at: h.at, rpm: h.stats.rpm, layer_ms: h.stats.layer_ms })),
        in_flight: n.inFlight,
        failures: n.failures,
        last_seen_ms_ago: now - n.lastSeen,
        endpoint: n.endpoint ?? null,
        relay_addr: n.relayAddr ?? null,
      })),
      recent_routes: [...recentRoutes].reverse(),
    });
  });

  app.get('/dashboard', () => new Response(DASHBOARD_HTML, { status: 200, headers: { 'content-type': 'text/html; charset=utf-8', 'cache-control': 'no-cache' } }));

  app.get('/healthz', () => json(200, { status: 'ok', nodes: registry.nodes.size, models: [...registry.models.keys()] }));

  app.get('/metrics', async () => {
    updateNodeGauge();
    return new Response(await metrics.registry.metrics(), { status: 200, headers: { 'content-type': metrics.registry.contentType } });
  });

  // ------------------------------------------------------------ OpenAI API

  app.get('/v1/models', () =>
    json(200, {
      object: 'list',
      data: [...registry.models.values()].map((m) => ({
        id: m.name,
        object: 'model',
        created: Math.floor(startedAt / 1000),
        owned_by: 'meshnet',
        meshnet: { num_layers: m.numLayers, context_length: m.contextTokens, ready: registry.availability(m.name).complete },
      })),
    }),
  );

  app.get('/v1/models/:id', ({ params }) => {
    const m = registry.models.get(params.id!);
    if (!m) throw openAiError(404, `The model '${params.id}' does not exist`, { code: 'model_not_found', param: 'model' });
    return json(200, { id: m.name, object: 'model', created: Math.floor(startedAt / 1000), owned_by: 'meshnet' });
  });

  app.post('/v1/chat/completions', (ctx) => complete(ctx, 'chat'));
  app.post('/v1/completions', (ctx) => complete(ctx, 'completion'));

  async function complete({ req }: RouteContext, kind: ApiKind): Promise<Response> {
    const endpoint = kind === 'chat' ? 'chat' : 'completions';
    const t0 = performance.now();
    let body: unknown;
    try {
      body = await readJson(req, o.maxBodyBytes);
    } catch (e) {
      metrics.requests.inc({ endpoint, status: '400' });
      throw openAiError(e instanceof MeshError ? e.status : 400, (e as Error).message, { code: 'invalid_request_body' });
    }
    // One input per choice: a chat has one; a completions request one per prompt.
    let inputs: GenerationInput[];
    let modelName: string;
    let stream: boolean;
    let includeUsage: boolean;
    try {
      const parsed = kind === 'chat' ? parseOpenAi(chatRequestSchema, body) : parseOpenAi(completionRequestSchema, body);
      modelName = parsed.model;
      const model = registry.models.get(modelName);
      if (!model) {
        const pending = notLoadedYet(modelName);
        if (pending) throw openAiError(503, pending.message, { code: 'model_not_loaded', param: 'model' });
        throw openAiError(404, `The model '${modelName}' does not exist; this tracker serves: ${[...registry.models.keys()].join(', ')}`, { code: 'model_not_found', param: 'model' });
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
      };
      if (kind === 'chat') {
        inputs = [{ ...common, messages: (parsed as ChatRequest).messages.map((m) => ({ role: m.role, content: messageText(m.content) })) }];
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
      stream = parsed.stream === true;
      includeUsage = parsed.stream_options?.include_usage === true;
    } catch (e) {
      metrics.requests.inc({ endpoint, status: String(e instanceof HttpError ? e.status : 500) });
      throw e;
    }

    let plans: RoutePlan[];
    try {
      plans = inputs.map(() => registry.pick(modelName));
    } catch (e) {
      metrics.requests.inc({ endpoint, status: '503' });
      if (e instanceof MeshError) throw openAiError(e.status, e.message, { code: e.code, extra: e.details });
      throw e;
    }

    const ids: CompletionIds = { id: `${kind === 'chat' ? 'chatcmpl' : 'cmpl'}-${randomHex(12)}`, created: Math.floor(o.now() / 1000), model: modelName };
    const abort = new AbortController();
    req.signal.addEventListener('abort', () => abort.abort(), { once: true });
    let firstTokenSeen = false;
    const onToken = () => {
      if (firstTokenSeen) return;
      firstTokenSeen = true;
      metrics.firstToken.observe((performance.now() - t0) / 1000);
    };
    // Each choice is its own generation (own route, own failover), all running at once.
    const choices = inputs.map((input, i) => choiceParts(runGeneration(genDeps, modelName, input, plans[i]!, abort.signal), input.stop, onToken));
    /** Stop every choice and release what its generation holds. */
    const endAll = () => {
      abort.abort();
      for (const c of choices) void c.return(undefined);
    };

    /** A generation error as the client sees it: a prompt too long for the context is OpenAI's 400 context_length_exceeded. */
    const clientError = (e: unknown): HttpError => {
      const err = e instanceof MeshError ? e : new MeshError('MESH_ERR_INTERNAL', (e as Error).message);
      metrics.requests.inc({ endpoint, status: String(err.code === 'MESH_ERR_TOO_LARGE' ? 400 : err.status) });
      if (err.code === 'MESH_ERR_TOO_LARGE') return openAiError(400, err.message, { param: kind === 'chat' ? 'messages' : 'prompt', code: 'context_length_exceeded' });
      return openAiError(err.status, err.message, { code: err.code, extra: err.details });
    };
    const usageOf = (finishes: ReadonlyArray<{ promptTokens: number; completionTokens: number }>) =>
      usage(
        finishes.reduce((n, f) => n + f.promptTokens, 0),
        finishes.reduce((n, f) => n + f.completionTokens, 0),
      );

    if (!stream) {
      try {
        const results = await Promise.all(
          choices.map(async (c) => {
            let text = '';
            const tokenIds: number[] = [];
            for await (const part of c) {
              tokenIds.push(...part.tokenIds);
              if (part.type === 'text') text += part.text;
              else return { text, tokenIds, finish: part.finish, promptTokens: part.promptTokens, completionTokens: part.completionTokens };
            }
            throw new MeshError('MESH_ERR_UPSTREAM', 'generation ended without a result');
          }),
        );
        metrics.generation.observe((performance.now() - t0) / 1000);
        metrics.requests.inc({ endpoint, status: '200' });
        return json(200, completionObject(kind, ids, results, usageOf(results)));
      } catch (e) {
        throw clientError(e);
      } finally {
        endAll();
      }
    }

    // Wait for every choice's first output before committing to a 200 stream:
    // a request a head refuses (or no head at all) still gets a plain HTTP error.
    let firsts: Array<IteratorResult<ChoicePart>>;
    try {
      firsts = await Promise.all(choices.map((c) => c.next()));
    } catch (e) {
      endAll();
      throw clientError(e);
    }
    const finishes: Array<{ promptTokens: number; completionTokens: number }> = [];
    const merged = new MergedChoices(choices);
    let started = false;
    let finished = false;
    const sse = new ReadableStream<Uint8Array>({
      async pull(controller) {
        if (finished) return;
        const send = (obj: unknown) => controller.enqueue(utf8.encode(sseData(obj)));
        try {
          if (!started) {
            started = true;
            firsts.forEach((r, index) => merged.add(index, r));
            for (let index = 0; index < choices.length; index++) send(chunkObject(kind, ids, kind === 'chat' ? { index, role: true, text: '' } : { index, text: '' }));
            return;
          }
          const next = await merged.next();
          if (next) {
            const { index, part } = next;
            if (part.type === 'text') send(chunkObject(kind, ids, { index, text: part.text, tokenIds: part.tokenIds }));
            else {
              finishes.push(part);
              send(chunkObject(kind, ids, kind === 'chat' ? { index, finish: part.finish, tokenIds: part.tokenIds } : { index, text: '', finish: part.finish, tokenIds: part.tokenIds }));
            }
            return;
          }
          finished = true;
          if (includeUsage) send(chunkObject(kind, ids, { usage: usageOf(finishes) }));
          controller.enqueue(utf8.encode(SSE_DONE));
          metrics.generation.observe((performance.now() - t0) / 1000);
          metrics.requests.inc({ endpoint, status: '200' });
          controller.close();
          endAll();
        } catch (e) {
          finished = true;
          endAll();
          const err = e instanceof MeshError ? e : new MeshError('MESH_ERR_INTERNAL', (e as Error).message);
          metrics.requests.inc({ endpoint, status: String(err.status) });
          logger.warn({ err: err.message, code: err.code }, 'stream failed');
          // OpenAI's in-stream error: one data event with an error object, then the stream ends.
          send(openAiError(err.status, err.message, { code: err.code }).body);
          controller.close();
        }
      },
      cancel() {
        finished = true;
        endAll();
      },
    });
    return new Response(sse, { status: 200, headers: { 'content-type': 'text/event-stream; charset=utf-8', 'cache-control': 'no-cache', connection: 'keep-alive', 'x-accel-buffering': 'no' } });
  }

  return {
    app,
    registry,
    identity,
    publicKey,
    recentRoutes,
    sweep() {
      const removed = registry.sweep();
      updateNodeGauge();
      return removed;
    },
  };
}

export { NodeStatus };
