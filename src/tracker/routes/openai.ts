/**
 * The OpenAI-compatible API.
 *
 *   GET  /v1/models, /v1/models/:id
 *   POST /v1/chat/completions, /v1/completions   parse → plan → stream (completion.ts)
 */
import type { TrackerContext } from '../context.ts';
import { complete } from '../completion.ts';
import { json, type App } from '../http.ts';
import { openAiError } from '../openai-wire.ts';

export function openAiRoutes(app: App, ctx: TrackerContext): void {
  const { registry } = ctx;
  const created = () => Math.floor(ctx.startedAt / 1000);

  app.get('/v1/models', () =>
    json(200, {
      object: 'list',
      data: [...registry.models.values()].map((m) => ({
        id: m.name,
        object: 'model',
        created: created(),
        owned_by: 'meshnet',
        meshnet: { num_layers: m.numLayers, context_length: m.contextTokens, ready: registry.coverageOf(m.name).complete },
      })),
    }),
  );

  app.get('/v1/models/:id', ({ params }) => {
    const m = registry.models.get(params.id!);
    if (!m) throw openAiError(404, `The model '${params.id}' does not exist`, { code: 'model_not_found', param: 'model' });
    return json(200, { id: m.name, object: 'model', created: created(), owned_by: 'meshnet' });
  });

  app.post('/v1/chat/completions', ({ req }) => complete(ctx, 'chat', req));
  app.post('/v1/completions', ({ req }) => complete(ctx, 'completion', req));
}
