/**
 * Builds the executor a node serves its span with, whichever graphs it
 * runs: the plain-operator ShardExecutor (executor.ts: onnxruntime-node's
 * CPU, f16 on WebGPU) or the fused-operator FusedShardExecutor
 * (fused-executor.ts: the GPU path, and 4-bit weights on WASM). Hosts say
 * which in their ChosenBackend; the runtime sees only the SpanExecutor
 * interface (contract.ts).
 */
import type { ModelConfig } from '../model/config.ts';
import type { FusedWeights } from '../model/fused-graph.ts';
import type { GraphDtype } from '../model/graph.ts';
import type { OnnxBackend } from './backend.ts';
import { ShardExecutor } from './executor.ts';
import type { SpanExecutor, WeightLoader } from './contract.ts';
import { FusedShardExecutor, type Q4Cache } from './fused-executor.ts';

/** Which graphs run a span: plain operators in a dtype, or fused operators with f32 or 4-bit projections. */
export type SpanGraphs =
  | { kind: 'plain'; dtype: GraphDtype }
  /** `graphCapture`: decode steps replay a captured GPU graph (FusedExecutorOptions.graphCapture; off unless a host asks). */
  | { kind: 'fused'; projections: FusedWeights; graphCapture?: boolean };

export interface SpanExecutorOptions {
  config: ModelConfig;
  backend: OnnxBackend;
  weights: WeightLoader;
  startLayer: number;
  endLayer: number;
  graphs: SpanGraphs;
  /** Quantized projections kept across loads (4-bit fused graphs only). */
  q4Cache?: Q4Cache;
  maxContext: number;
  memoryBudgetBytes: number;
  kvTtlMs?: number;
  /** Most sessions' one-token steps run as one batch (batch-queue.ts); 1 turns batching off. */
  maxBatch?: number;
}

export async function createSpanExecutor(o: SpanExecutorOptions): Promise<SpanExecutor> {
  const common = {
    config: o.config,
    backend: o.backend,
    weights: o.weights,
    startLayer: o.startLayer,
    endLayer: o.endLayer,
    maxContext: o.maxContext,
    memoryBudgetBytes: o.memoryBudgetBytes,
    ...(o.kvTtlMs !== undefined ? { kvTtlMs: o.kvTtlMs } : {}),
    ...(o.maxBatch !== undefined ? { maxBatch: o.maxBatch } : {}),
  };
  if (o.graphs.kind === 'plain') return ShardExecutor.create({ ...common, dtype: o.graphs.dtype });
  // One graph per layer: a request may enter or leave at any held layer (the overlap protocol),
  // and 4-bit weights are quantized layer by layer as each graph is built.
  const cuts: number[] = [];
  for (let l = o.startLayer + 1; l < o.endLayer; l++) cuts.push(l);
  return FusedShardExecutor.create({ ...common, projections: o.graphs.projections, segmentBoundaries: cuts, ...(o.q4Cache ? { q4Cache: o.q4Cache } : {}), ...(o.graphs.graphCapture ? { graphCapture: true } : {}) });
}
