/**
 * A route plan as a head receives it (the hops after the head, with each
 * node's way in), and what one generation asks of it: shared by the head
 * proxy, the routes API and head audits (verify/audit.ts), which must not
 * import one another in a circle.
 */
import type { GenerateRequest, RouteHop } from '../protocol/tracker.ts';
import type { NodeRegistry } from './registry.ts';
import type { RoutePlan } from './routing.ts';

/** What one generation asks, before the tracker adds the session and a failover's prefix. */
export type GenerationInput = Omit<GenerateRequest, 'prefix_token_ids' | 'session_id'>;

export function routeHops(registry: NodeRegistry, plan: RoutePlan, skipFirst: boolean): RouteHop[] {
  return plan.hops.slice(skipFirst ? 1 : 0).map((h) => {
    const n = registry.nodes.get(h.id);
    const hop: RouteHop = { peer_id: h.id, start_layer: h.start, end_layer: h.end };
    if (n?.endpoint) hop.endpoint = n.endpoint;
    if (n?.relayAddr) hop.relay_addr = n.relayAddr;
    return hop;
  });
}
