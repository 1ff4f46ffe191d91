/**
 * The demo's memory budget per page: enough for the pages asked for to hold
 * every layer between them, as the tracker will place them (one after
 * another, each on the least-covered layers: src/tracker/assignment.ts).
 */
import { chooseSpan, coverage, type Holder } from '../tracker/assignment.ts';
import { spanBytes, type ModelSpec } from '../tracker/model-registry.ts';

const MIB = 2 ** 20;

/** Layers no page would hold when `nodes` pages of `budgetMb` each join one after another. */
export function bareLayers(model: ModelSpec, nodes: number, budgetMb: number): number[] {
  const holders: Holder[] = [];
  for (let i = 0; i < nodes; i++) {
    const span = chooseSpan(model, budgetMb * MIB, holders);
    if (!span) break;
    holders.push({ id: String(i), ...span, throughput: 1 });
  }
  return coverage(model.numLayers, holders).count.flatMap((c, layer) => (c === 0 ? [layer] : []));
}

/** The smallest whole-MiB budget with which `nodes` pages hold every layer (one page can always hold all). */
export function budgetToCover(model: ModelSpec, nodes: number): number {
  const whole = Math.ceil(spanBytes(model, 0, model.numLayers) / MIB);
  for (let mb = Math.max(1, Math.floor(whole / nodes)); mb < whole; mb++) if (bareLayers(model, nodes, mb).length === 0) return mb;
  return whole;
}

/** "3", "8–11", "2, 5–7": layer numbers as ranges. */
export function layerRanges(layers: readonly number[]): string {
  const out: string[] = [];
  for (let i = 0; i < layers.length; ) {
    let j = i;
    while (j + 1 < layers.length && layers[j + 1] === layers[j]! + 1) j++;
    out.push(i === j ? `${layers[i]}` : `${layers[i]}–${layers[j]}`);
    i = j + 1;
  }
  return out.join(', ');
}
