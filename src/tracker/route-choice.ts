/**
 * Routes over the registry's serving nodes: the candidates routing
 * (routing.ts) searches, drawn from each model's span groups, and the pick
 * for one chat, with KV room or without; the 503 naming the missing layers
 * when no route exists, the 413 when none could ever hold the session.
 */
import { MeshError } from '../protocol/errors.ts';
import type { ModelSpec } from './model-registry.ts';
import type { NodeRecord } from './node-record.ts';
import type { TrackerOptions } from './options.ts';
import type { ModelPlacement } from './placement.ts';
import { findRoutes, formatLayers, perLayerMs, pickRoute, type RoutePlan, type ServingNode } from './routing.ts';

/** Routes kept per boundary (routing.ts) and so the nodes of one span routing needs at most. */
const ROUTES_KEPT = 16;

/** What route choice reads of the registry. */
export interface RouteSource {
  model(name: string): ModelSpec;
  placement(modelName: string): ModelPlacement<NodeRecord>;
  routable(n: NodeRecord): boolean;
  /** {@link routable} for the nodes of one pick: the same answers, with what holds for all of them asked once. */
  routableNow(): (n: NodeRecord) => boolean;
  layerMs(n: NodeRecord): number;
  kvNeed(n: NodeRecord, tokens: number): number;
  kvFree(n: NodeRecord): number;
}

export type RouteOptions = Pick<TrackerOptions, 'hopLatencyMs' | 'routeSlack' | 'random'>;

export class RouteChoice {
  constructor(
    private readonly reg: RouteSource,
    private readonly o: RouteOptions,
  ) {}

  private servingNode(n: NodeRecord): ServingNode {
    return { id: n.peerId, start: n.serving!.start, end: n.serving!.end, perLayerMs: perLayerMs(this.reg.layerMs(n), (n.stats?.queue_depth ?? 0) + n.inFlight) };
  }

  /** Nodes of `model` that serve a span now (and pass `keep`), as routing sees them. O(nodes): routing uses {@link routeCandidates}. */
  servingNodes(model: string, exclude: ReadonlySet<string> = new Set(), keep?: (n: NodeRecord) => boolean): ServingNode[] {
    const out: ServingNode[] = [];
    for (const g of this.reg.placement(model).groups.values()) {
      for (const n of g.nodes) {
        if (exclude.has(n.peerId) || !this.reg.routable(n) || (keep && !keep(n))) continue;
        out.push(this.servingNode(n));
      }
    }
    return out;
  }

  /**
   * What the K-best route search needs of the serving nodes: of each span,
   * the K cheapest per layer (layer_ms × (1 + load)) that pass `keep`. A
   * route never holds two nodes of one span (the second could not start
   * where the first ends), so a node with K cheaper ones of its span is in
   * none of the K cheapest routes: the search over these finds the same
   * routes as over every node, and costs the same with 10 or 10,000 donors.
   */
  routeCandidates(model: string, exclude?: ReadonlySet<string>, keep?: (n: NodeRecord) => boolean): ServingNode[] {
    const out: ServingNode[] = [];
    const routable = this.reg.routableNow();
    for (const g of this.reg.placement(model).groups.values()) {
      const { start, end } = g.span;
      const nodes = g.nodes;
      // Cheapest first: the first K that pass are the K cheapest that pass.
      let taken = 0;
      for (let i = 0; i < nodes.length && taken < ROUTES_KEPT; i++) {
        const n = nodes[i]!;
        if (exclude?.has(n.peerId) || !routable(n) || (keep && !keep(n))) continue;
        // The group's own copy of the node's cost: with thousands of donors, their records are mostly out of the CPU's caches.
        out.push({ id: n.peerId, start, end, perLayerMs: g.costAt(i) });
        taken++;
      }
    }
    return out;
  }

  /**
   * A route over `model` whose every node has KV room for a session of
   * `tokens` positions now; undefined when routes exist but none has room
   * (the caller waits). Throws 503 when layers are missing, and 413 when no
   * route could hold such a session even empty.
   */
  pickWithRoom(modelName: string, tokens: number, exclude?: ReadonlySet<string>): RoutePlan | undefined {
    const model = this.reg.model(modelName);
    const end = model.numLayers;
    const costs = { hopLatencyMs: this.o.hopLatencyMs, keep: ROUTES_KEPT };
    const fit = this.routeCandidates(modelName, exclude, (n) => this.reg.kvNeed(n, tokens) <= this.reg.kvFree(n));
    const plan = pickRoute(findRoutes(fit, 0, end, costs), this.o.routeSlack, this.o.random);
    if (plan) return plan;
    const all = this.routeCandidates(modelName, exclude);
    if (findRoutes(all, 0, end, costs).length === 0) throw this.noRoute(modelName, all, 0, end);
    const ever = this.routeCandidates(modelName, exclude, (n) => n.stats?.kv_budget_bytes === undefined || this.reg.kvNeed(n, tokens) <= n.stats.kv_budget_bytes);
    if (findRoutes(ever, 0, end, costs).length === 0) {
      throw new MeshError('MESH_ERR_TOO_LARGE', `a session of ${tokens} positions (prompt + max_tokens) does not fit the KV memory of any route of "${modelName}", even idle; ask for fewer tokens`, { tokens });
    }
    return undefined;
  }

  /** Routes over [from, to) of `model`, cheapest first. */
  routes(model: string, from: number, to: number, exclude?: ReadonlySet<string>): RoutePlan[] {
    return findRoutes(this.routeCandidates(model, exclude), from, to, { hopLatencyMs: this.o.hopLatencyMs, keep: ROUTES_KEPT });
  }

  /**
   * A route for one request over [from, to), picked among the near-best by
   * throughput; 503 naming the missing layers when none exists.
   */
  pick(modelName: string, exclude?: ReadonlySet<string>, from = 0, to?: number): RoutePlan {
    const model = this.reg.model(modelName);
    const end = to ?? model.numLayers;
    const serving = this.routeCandidates(modelName, exclude);
    const plan = pickRoute(findRoutes(serving, from, end, { hopLatencyMs: this.o.hopLatencyMs, keep: ROUTES_KEPT }), this.o.routeSlack, this.o.random);
    if (plan) return plan;
    throw this.noRoute(modelName, serving, from, end);
  }

  private noRoute(modelName: string, serving: readonly ServingNode[], from: number, end: number): MeshError {
    const model = this.reg.model(modelName);
    const missing = missingIn(serving, from, end);
    const loading = this.reg.placement(modelName).statusCount.loading;
    return new MeshError(
      'MESH_ERR_UNAVAILABLE',
      `no route for model "${modelName}": layers ${formatLayers(missing)} of 0-${model.numLayers - 1} are not served by any node${loading ? ` (${loading} node(s) still loading)` : ''}; add nodes or wait for them to load`,
      { missing_layers: missing },
    );
  }
}

/** Layers of [from, to) none of `nodes` holds. */
function missingIn(nodes: readonly ServingNode[], from: number, to: number): number[] {
  const held = new Uint8Array(Math.max(0, to));
  for (const n of nodes) for (let l = Math.max(from, n.start); l < Math.min(to, n.end); l++) held[l] = 1;
  const out: number[] = [];
  for (let l = from; l < to; l++) if (!held[l]) out.push(l);
  return out;
}
