/** A freshly built span's step time (device-recovery.ts: the layer_ms the tracker gets after a rebuild). */
import type { SpanExecutor } from '../../shard/contract.ts';

/**
 * Per-layer time of one-token steps on a freshly built executor, ms: the
 * layer_ms the tracker gets after a rebuild (the old backend's steps say
 * nothing about the new one). Runs a throwaway session; a backend that does
 * not work fails here, before it serves.
 */
export async function measureLayerMs(ex: SpanExecutor, steps = 2): Promise<number> {
  const session = `meshnet-measure-${Math.random().toString(36).slice(2)}`;
  const input = (position: number) =>
    ex.holdsEmbedding
      ? { tokenIds: [position % Math.max(1, ex.config.vocabSize)] }
      : { activation: { data: new Float32Array(ex.config.hiddenSize).fill(0.01), shape: [1, 1, ex.config.hiddenSize] as const } };
  try {
    await ex.forward({ session, position: 0, sessionTokens: steps + 1, ...input(0) });
    let total = 0;
    for (let i = 1; i <= steps; i++) {
      const t0 = performance.now();
      await ex.forward({ session, position: i, ...input(i) });
      total += performance.now() - t0;
    }
    return Math.round((total / steps / (ex.endLayer - ex.startLayer)) * 1000) / 1000;
  } finally {
    ex.dropSession(session);
  }
}
