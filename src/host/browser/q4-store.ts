/**
 * The browser node's Q4Cache (src/shard/fused-executor.ts): 4-bit
 * projections kept in IndexedDB (storage.ts's `q4` store), so a reload
 * builds its graphs from what the last load quantized instead of quantizing
 * again. Counts what it served and what had to be quantized, for the page's
 * status (and the test that a reload quantizes nothing).
 *
 * A record that does not match its own shape (a damaged or foreign write) is
 * deleted and treated as missing: the executor quantizes it again. A write
 * that fails (storage full) is logged and the span serves anyway.
 */
import type { Q4Matrix } from '../../model/quantize.ts';
import { q4BlocksPerRow } from '../../model/quantize.ts';
import type { Q4Cache } from '../../shard/fused-executor.ts';
import type { NodeStorage, StoredQ4 } from './storage.ts';

export interface Q4Counters {
  /** Projections quantized in this worker (each one stored after). */
  quantized: number;
  /** Projections read back from IndexedDB. */
  loaded: number;
  /** Time spent quantizing, ms. */
  quantizeMs: number;
}

export function newQ4Counters(): Q4Counters {
  return { quantized: 0, loaded: 0, quantizeMs: 0 };
}

function validShape(r: StoredQ4): boolean {
  const kb = q4BlocksPerRow(r.k);
  return (
    Number.isInteger(r.n) && Number.isInteger(r.k) && r.n > 0 && r.k > 0 &&
    r.packed.byteLength === r.n * kb * 16 &&
    r.scales.byteLength === r.n * kb * 4 &&
    (r.zeroPoints === null || r.zeroPoints.byteLength === r.n * Math.ceil(kb / 2))
  );
}

/**
 * `counters.quantized` counts misses: the executor quantizes a projection
 * right after `get` misses and then `put`s it, so a put is one quantization.
 */
export function indexedDbQ4Cache(storage: NodeStorage, model: string, counters: Q4Counters): Q4Cache {
  let missAt = 0;
  return {
    async get(name) {
      const r = await storage.getQ4(model, name);
      if (r && validShape(r)) {
        counters.loaded++;
        return { n: r.n, k: r.k, packed: new Uint8Array(r.packed), scales: new Float32Array(r.scales), zeroPoints: r.zeroPoints ? new Uint8Array(r.zeroPoints) : null } satisfies Q4Matrix;
      }
      if (r) await storage.deleteQ4(model, name);
      missAt = performance.now();
      return undefined;
    },
    async put(name, m) {
      counters.quantized++;
      counters.quantizeMs += performance.now() - missAt;
      // Copies: the executor's arrays may be views into a larger buffer.
      try {
        await storage.putQ4({ model, name, n: m.n, k: m.k, packed: m.packed.slice().buffer, scales: m.scales.slice().buffer, zeroPoints: m.zeroPoints ? m.zeroPoints.slice().buffer : null });
      } catch (e) {
        // The matrix is in memory and serves; only the next load pays for quantizing it again.
        console.warn(`meshnet node: could not keep quantized ${name} (${(e as Error).message}); the next load quantizes it again`);
      }
    },
  };
}
