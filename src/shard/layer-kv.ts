/**
 * KV memory for fused layer graphs (fused-graph.ts): per layer one key and
 * one value buffer [kvHeads, capacity, headDim] that GroupQueryAttention
 * reads as its past and writes as its present in place. On a device backend
 * the buffers are GPU memory and never cross to the CPU; on a CPU backend
 * they are Float32Arrays.
 *
 * This is only the memory: `LayerKvStorage` is a KvStorage (kv-store.ts),
 * so the KvLedger decides who gets room — by declaration, in whole blocks,
 * refusing with 503 MESH_ERR_BUSY instead of evicting a live session — for
 * GPU caches exactly as for the CPU ones. Growing reallocates and copies
 * each head's filled rows (on the device), because capacity is the row
 * stride of the layout GroupQueryAttention expects.
 */
import type { DeviceMemory, DeviceTensor } from './backend.ts';
import { kvBytesPerToken } from './kv-store.ts';
import type { KvStorage } from './kv-store.ts';

export type KvBuffer = Float32Array | DeviceTensor;

/** One session's buffers: keys[i] / values[i] belong to layer startLayer + i. */
export interface LayerKv {
  /** Positions each buffer holds (the row stride of its heads). */
  readonly capacity: number;
  readonly keys: KvBuffer[];
  readonly values: KvBuffer[];
}

export interface LayerKvShape {
  layers: number;
  kvHeads: number;
  headDim: number;
  /** Device memory for the buffers; host Float32Arrays when absent. */
  device?: DeviceMemory;
}

/** Bytes one position costs across the layers (f32 keys and values): the ledger's unit. */
export function layerKvBytesPerToken(s: LayerKvShape): number {
  return kvBytesPerToken({ layers: s.layers, kvHeads: s.kvHeads, headDim: s.headDim, elem: 'f32' });
}

export class LayerKvStorage implements KvStorage<LayerKv> {
  constructor(private readonly s: LayerKvShape) {}

  async allocate(capacity: number): Promise<LayerKv> {
    const keys: KvBuffer[] = [];
    const values: KvBuffer[] = [];
    try {
      for (let i = 0; i < this.s.layers; i++) {
        keys.push(await this.alloc(capacity));
        values.push(await this.alloc(capacity));
      }
    } catch (e) {
      for (const b of [...keys, ...values]) dispose(b);
      throw e;
    }
    return { capacity, keys, values };
  }

  /** New buffers of `capacity` positions holding the first `keep` rows of each head; the store frees the old ones. */
  async resize(cache: LayerKv, capacity: number, keep: number): Promise<LayerKv> {
    const next = await this.allocate(capacity);
    try {
      const rows = Math.min(keep, cache.capacity);
      if (rows > 0) this.copyRows(cache, next, rows);
    } catch (e) {
      this.free(next);
      throw e;
    }
    return next;
  }

  free(cache: LayerKv): void {
    for (const b of [...cache.keys, ...cache.values]) dispose(b);
  }

  private copyRows(from: LayerKv, to: LayerKv, rows: number): void {
    const D = this.s.headDim;
    const ops: { src: DeviceTensor; srcByte: number; dst: DeviceTensor; dstByte: number; bytes: number }[] = [];
    for (let i = 0; i < this.s.layers; i++) {
      for (const [a, b] of [
        [from.keys[i]!, to.keys[i]!],
        [from.values[i]!, to.values[i]!],
      ] as const) {
        for (let h = 0; h < this.s.kvHeads; h++) {
          if (a instanceof Float32Array) (b as Float32Array).set(a.subarray(h * from.capacity * D, (h * from.capacity + rows) * D), h * to.capacity * D);
          else ops.push({ src: a, srcByte: h * from.capacity * D * 4, dst: b as DeviceTensor, dstByte: h * to.capacity * D * 4, bytes: rows * D * 4 });
        }
      }
    }
    if (ops.length > 0) this.s.device!.copy(ops);
  }

  private async alloc(capacity: number): Promise<KvBuffer> {
    if (this.s.device) return this.s.device.alloc('float32', [1, this.s.kvHeads, capacity, this.s.headDim]);
    return new Float32Array(this.s.kvHeads * capacity * this.s.headDim);
  }
}

function dispose(b: KvBuffer): void {
  if (!(b instanceof Float32Array)) b.dispose();
}
