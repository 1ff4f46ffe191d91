/**
 * What the tracker shows of a model's placement (the availability map of
 * the API and the dashboard): per layer who serves it, the nodes page by
 * page, the spans with their serving and loading counts. Read from the
 * placement sums (placement.ts), so O(layers) plus the page asked for.
 */
import type { ModelSpec } from './model-registry.ts';
import { NodeStatus, nodeStatus, type NodeRecord } from './node-record.ts';
import type { ModelPlacement } from './placement.ts';

/** What the availability map reads of the registry. */
export interface AvailabilitySource {
  model(name: string): ModelSpec;
  placement(modelName: string): ModelPlacement<NodeRecord>;
  layerMs(n: NodeRecord): number;
  throughput(n: NodeRecord): number;
}

/** Per layer how many nodes serve it, and the layers none serves: O(layers). */
export function coverageOf(reg: AvailabilitySource, modelName: string): { count: number[]; throughput: number[]; missing: number[]; complete: boolean } {
  reg.model(modelName);
  const p = reg.placement(modelName);
  const missing = p.missing();
  return { count: [...p.serving.count], throughput: p.serving.throughput.map(round), missing, complete: missing.length === 0 };
}

/**
 * The availability map of one model: per layer, how many serve it and (the
 * first `idsPerLayer` of) who; the nodes, `offset`/`limit` of them.
 */
export function availability(reg: AvailabilitySource, modelName: string, page: { offset?: number; limit?: number; idsPerLayer?: number } = {}) {
  const model = reg.model(modelName);
  const p = reg.placement(modelName);
  const cov = coverageOf(reg, modelName);
  const idsPerLayer = page.idsPerLayer ?? Infinity;
  const offset = Math.max(0, page.offset ?? 0);
  const limit = Math.max(0, page.limit ?? Infinity);
  const layers = cov.count.map((count, layer) => {
    const ids: string[] = [];
    for (const g of p.groups.values()) {
      if (ids.length >= idsPerLayer) break;
      if (!(g.span.start <= layer && layer < g.span.end)) continue;
      for (const n of g.nodes) {
        if (ids.length >= idsPerLayer) break;
        ids.push(n.peerId);
      }
    }
    return { layer, nodes: ids, count, throughput: cov.throughput[layer]! };
  });
  const nodes: NodeRecord[] = [];
  let i = 0;
  for (const n of p.nodes) {
    if (nodes.length >= limit) break;
    if (i++ >= offset) nodes.push(n);
  }
  return {
    model: modelName,
    num_layers: model.numLayers,
    complete: cov.complete,
    missing_layers: cov.missing,
    nodes_total: p.size,
    layers,
    nodes: nodes.map((n) => ({
      peer_id: n.peerId,
      status: nodeStatus(n),
      assignment: n.assignment && { start_layer: n.assignment.start, end_layer: n.assignment.end },
      serving: n.serving && { start_layer: n.serving.start, end_layer: n.serving.end },
      layer_ms: round(reg.layerMs(n)),
      throughput: round(reg.throughput(n)),
      backend: n.info.backend,
      host: n.info.host,
      relay: n.relayAddr !== undefined,
      direct: n.endpoint !== undefined,
      draining: n.draining,
      draining_since: n.drainingSince ?? null,
      duty_cycle: n.info.duty_cycle ?? 1,
    })),
  };
}

/** Nodes of a model grouped by span: per span, how many serve it and how many still load it. */
export function spanGroups(reg: AvailabilitySource, modelName: string): Array<{ start_layer: number; end_layer: number; serving: number; loading: number }> {
  const bySpan = new Map<string, { start_layer: number; end_layer: number; serving: number; loading: number }>();
  for (const n of reg.placement(modelName).nodes) {
    const s = n.assignment ?? n.serving;
    if (!s) continue;
    const key = `${s.start}:${s.end}`;
    let g = bySpan.get(key);
    if (!g) bySpan.set(key, (g = { start_layer: s.start, end_layer: s.end, serving: 0, loading: 0 }));
    const st = nodeStatus(n);
    // A draining node counts as neither: it serves no new chat, and loads nothing.
    if (st === NodeStatus.Serving) g.serving++;
    else if (st === NodeStatus.Loading) g.loading++;
  }
  return [...bySpan.values()].sort((a, b) => a.start_layer - b.start_layer || a.end_layer - b.end_layer);
}

function round(x: number): number {
  return Math.round(x * 1000) / 1000;
}
