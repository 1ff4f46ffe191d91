/**
 * Signed routes on demand: a head's replacement span, and a route as a head
 * would get it (debugging, benches).
 *
 *   POST /api/route/replace     signed ReplaceRequest (by a head) → ReplaceAnswer
 *   GET  /api/route?model=      a signed route, as a head would get it
 */
import { MeshError } from '../../protocol/errors.ts';
import { replaceRequestSchema, signedSchema, type ReplaceAnswer, type RouteHop } from '../../protocol/tracker.ts';
import type { TrackerContext } from '../context.ts';
import { routeHops } from '../head-proxy.ts';
import { json, readJson, type App } from '../http.ts';
import type { NodeRecord } from '../registry.ts';
import type { RoutePlan } from '../routing.ts';
import { signChainReply, signRoute } from '../signing.ts';

const replaceMessage = signedSchema(replaceRequestSchema);

/** How long the tracker waits for a failed node's `GET /health` before it counts it as still away, ms. */
const PROBE_TIMEOUT_MS = 1_000;

/** Does the node answer now? (Its endpoint, else over the tracker's relay.) False when the tracker cannot tell. */
async function reachable(ctx: TrackerContext, n: NodeRecord): Promise<boolean> {
  const probe = ctx.generation.transport.probe;
  if (!probe) return false;
  const ok = await probe({ peerId: n.peerId, ...(n.endpoint ? { endpoint: n.endpoint } : {}), ...(n.relayAddr ? { relayAddr: n.relayAddr } : {}) }, PROBE_TIMEOUT_MS);
  if (ok) ctx.registry.markReachable(n.peerId);
  else ctx.registry.markUnreachable(n.peerId, `a head reported it failed, and it did not answer GET /health within ${PROBE_TIMEOUT_MS} ms`);
  return ok;
}

export function routeRoutes(app: App, ctx: TrackerContext): void {
  const { options: o, registry, metrics, identity } = ctx;

  /** A route over [from, to) that may go through any node but the head. */
  const pickThrough = (model: string, head: string, from: number, to: number): RoutePlan | undefined => {
    try {
      return registry.pick(model, new Set([head]), from, to);
    } catch {
      return undefined;
    }
  };

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
    ctx.nodeKeys.verifyTimestamped(head.publicKey, parsed.data, o.now(), o.maxClockSkewMs, (raw as { body: unknown }).body);
    const model = registry.model(body.model);
    if (body.start_layer >= body.end_layer || body.end_layer > model.numLayers) {
      throw new MeshError('MESH_ERR_BAD_REQUEST', `span [${body.start_layer}, ${body.end_layer}) is not inside the model's 0..${model.numLayers}`);
    }
    const failed = registry.nodes.get(body.failed_peer_id);
    let plan: RoutePlan;
    let again = false;
    try {
      // The head already runs its own layers in this session; the failed node is what we replace.
      plan = registry.pick(body.model, new Set([body.head_peer_id, body.failed_peer_id]), body.start_layer, body.end_layer);
      // Against the node the head names, registered or not (a node removed meanwhile finds it when it comes back).
      registry.countFailure(body.failed_peer_id);
    } catch (e) {
      // Nobody else holds these layers: the failed node itself, if it answers now (it was away for a
      // moment: a relay restart, a network blip). Then the head resumes on it as soon as it is back,
      // instead of waiting for a spare that does not exist.
      const back = failed && (await reachable(ctx, failed)) ? pickThrough(body.model, body.head_peer_id, body.start_layer, body.end_layer) : undefined;
      if (!back) {
        registry.countFailure(body.failed_peer_id);
        metrics.replacements.inc({ result: 'unavailable' });
        throw e;
      }
      // It answers us now: the head lost its way to it for a moment (a relay restarting), not the node's failure.
      plan = back;
      again = true;
    }
    metrics.replacements.inc({ result: again ? 'same-node' : 'ok' });
    ctx.recordRoute('replace', body.model, plan);
    const picked = routeHops(registry, plan, false);
    const signed = await signRoute(identity, body.head_peer_id, picked, o.now() + o.routeTtlMs);
    const answer: ReplaceAnswer = { route: signed.header, expires_at: signed.expiresAt, signature: signed.signature, ...(again ? { failed_reachable: true } : {}) };
    const chain = body.route ? await signReplacedRoute(ctx, body.head_peer_id, head, body.route, body.failed_peer_id, picked, model.numLayers) : undefined;
    if (chain) answer.chain = chain;
    return json(200, answer);
  });

  app.get('/api/route', async ({ url }) => {
    const modelName = url.searchParams.get('model') ?? [...registry.models.keys()][0] ?? '';
    const plan = metrics.routePick.time(() => registry.pick(modelName));
    ctx.recordRoute('inspect', modelName, plan);
    const head = plan.hops[0]!.id;
    const hops = routeHops(registry, plan, true);
    const signed = await signRoute(identity, head, hops, o.now() + o.routeTtlMs);
    return json(200, { model: modelName, head, head_endpoint: registry.nodes.get(head)?.endpoint ?? null, hops, cost_ms: plan.costMs, route_header: signed.header, expires_at: signed.expiresAt, signature: signed.signature });
  });
}

/**
 * The head's whole downstream route with the failed hop swapped for the
 * replacement, signed for the head (so chained hops may push along it), or
 * undefined when the route it sent does not hold the failed hop once, does
 * not cover its layers to the model's end without a gap, or names a node this
 * tracker does not know (it vouches only for addresses it registered).
 */
async function signReplacedRoute(
  ctx: TrackerContext,
  headId: string,
  head: { relayAddr?: string | undefined; endpoint?: string | undefined },
  route: ReadonlyArray<{ peer_id: string; start_layer: number; end_layer: number }>,
  failedId: string,
  picked: RouteHop[],
  numLayers: number,
): Promise<ReplaceAnswer['chain']> {
  const at = route.findIndex((h) => h.peer_id === failedId);
  if (at < 0 || route.findIndex((h, k) => k > at && h.peer_id === failedId) >= 0) return undefined;
  const hops: RouteHop[] = [];
  for (const [k, h] of route.entries()) {
    if (k === at) {
      hops.push(...picked);
      continue;
    }
    const n = ctx.registry.nodes.get(h.peer_id);
    if (!n || h.peer_id === headId) return undefined;
    hops.push({ peer_id: h.peer_id, start_layer: h.start_layer, end_layer: h.end_layer, ...(n.endpoint ? { endpoint: n.endpoint } : {}), ...(n.relayAddr ? { relay_addr: n.relayAddr } : {}) });
  }
  let layer = hops[0]?.start_layer ?? 0;
  for (const h of hops) {
    if (h.start_layer !== layer || h.end_layer <= h.start_layer) return undefined;
    layer = h.end_layer;
  }
  if (layer !== numLayers || new Set(hops.map((h) => h.peer_id)).size !== hops.length) return undefined;
  const signed = await signRoute(ctx.identity, headId, hops, ctx.options.now() + ctx.options.routeTtlMs);
  const reply = await signChainReply(ctx.identity, headId, head, signed.expiresAt);
  return { route: signed.header, expires_at: signed.expiresAt, signature: signed.signature, ...(reply ? { reply: reply.text, reply_signature: reply.signature } : {}) };
}
