/**
 * Signed routes on demand: a head's replacement span, and a route as a head
 * would get it (debugging, benches).
 *
 *   POST /api/route/replace     signed ReplaceRequest (by a head) → ReplaceAnswer
 *   GET  /api/route?model=      a signed route, as a head would get it
 */
import { MeshError } from '../../protocol/errors.ts';
import { replaceRequestSchema, signedSchema, type ReplaceAnswer } from '../../protocol/tracker.ts';
import type { TrackerContext } from '../context.ts';
import { routeHops } from '../head-proxy.ts';
import { json, readJson, type App } from '../http.ts';
import type { RoutePlan } from '../routing.ts';
import { signRoute, verifyTimestampedSignature } from '../signing.ts';

const replaceMessage = signedSchema(replaceRequestSchema);

export function routeRoutes(app: App, ctx: TrackerContext): void {
  const { options: o, registry, metrics, identity } = ctx;

  app.post('/api/route/replace', async ({ req }) => {
    const raw = await readJson(req, o.maxBodyBytes);
    const parsed = replaceMessage.safeParse(raw);
    if (!parsed.success) {
      const issue = parsed.error.issues[0]!;
      throw new MeshError('MESH_ERR_BAD_REQUEST', `field "${issue.path.join('.') || '(root)'}": ${issue.message}; expected {body: ReplaceRequest, signature}`);
    }
    const body = parsed.data.body;
    const head = registry.nodes.get(body.head_peer_id);
    if (!head) throw new MeshError('MESH_ERR_NOT_FOUND', `head ${body.head_peer_id} is not registered here; register first`);
    await verifyTimestampedSignature(head.publicKey, parsed.data, o.now(), o.maxClockSkewMs, (raw as { body: unknown }).body);
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
    ctx.recordRoute('replace', body.model, plan);
    const signed = await signRoute(identity, body.head_peer_id, routeHops(registry, plan, false), o.now() + o.routeTtlMs);
    const answer: ReplaceAnswer = { route: signed.header, expires_at: signed.expiresAt, signature: signed.signature };
    return json(200, answer);
  });

  app.get('/api/route', async ({ url }) => {
    const modelName = url.searchParams.get('model') ?? [...registry.models.keys()][0] ?? '';
    const plan = registry.pick(modelName);
    ctx.recordRoute('inspect', modelName, plan);
    const head = plan.hops[0]!.id;
    const hops = routeHops(registry, plan, true);
    const signed = await signRoute(identity, head, hops, o.now() + o.routeTtlMs);
    return json(200, { model: modelName, head, head_endpoint: registry.nodes.get(head)?.endpoint ?? null, hops, cost_ms: plan.costMs, route_header: signed.header, expires_at: signed.expiresAt, signature: signed.signature });
  });
}
