/**
 * The weights of a node's span, kept in IndexedDB: fetched once by Range
 * (only the span's tensors), stored batch by batch so a reload resumes, and
 * verified against their SHA-256 each time a graph is built from them.
 */
import type { ModelConfig } from '../../model/config.ts';
import type { MeshErrorCode } from '../../protocol/errors.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR, expectedTensorShape, layerTensorNames } from '../../model/config.ts';
import type { WeightSource } from '../../model/graph.ts';
import { SafetensorsReader } from '../../model/safetensors.ts';
import { decodeTensorBytes, dtypeSize, type RawTensor } from '../../model/safetensors-format.ts';
import type { WeightLoader } from '../../shard/executor.ts';
import { QuotaError, sha256Hex, type NodeStorage, type StoredTensor } from './storage.ts';

/** Every tensor a shard of [start, end) needs, embedding and head included when it holds them. */
export function spanTensorNames(cfg: ModelConfig, startLayer: number, endLayer: number): string[] {
  const names: string[] = [];
  if (startLayer === 0) names.push(EMBED_TENSOR);
  for (let l = startLayer; l < endLayer; l++) names.push(...layerTensorNames(cfg, l));
  if (endLayer === cfg.numLayers) {
    names.push(FINAL_NORM_TENSOR);
    if (!cfg.tieWordEmbeddings) names.push(LM_HEAD_TENSOR);
    else if (startLayer !== 0) names.push(EMBED_TENSOR);
  }
  return [...new Set(names)];
}

/** A stored tensor failed verification; it has been deleted so the next attempt fetches it again. */
export class WeightIntegrityError extends Error {
  override readonly name = 'WeightIntegrityError';
  readonly code: MeshErrorCode = 'MESH_ERR_WEIGHTS_CORRUPT';
}

export interface DownloadProgress {
  /** Bytes of the span present: stored before this download plus received so far. */
  loadedBytes: number;
  totalBytes: number;
}

export interface EnsureOptions {
  fetch: typeof fetch;
  onProgress?(p: DownloadProgress): void;
  signal?: AbortSignal;
  /** Tensors per IndexedDB transaction are grouped up to this many bytes: the unit a reload resumes from. @defaultValue 8 MiB */
  batchBytes?: number;
}

export interface EnsureResult {
  /** Bytes received from the model server (0 when everything was already stored). */
  fetchedBytes: number;
  /** Bytes of the span in storage now. */
  storedBytes: number;
}

export class SpanWeights {
  readonly names: string[];

  constructor(
    private readonly storage: NodeStorage,
    /** Model base URL (the storage key). */
    readonly model: string,
    readonly config: ModelConfig,
    readonly startLayer: number,
    readonly endLayer: number,
  ) {
    this.names = spanTensorNames(config, startLayer, endLayer);
  }

  /** Drop stored tensors outside this span (another model, or layers no longer held). */
  async dropOthers(): Promise<number> {
    return this.storage.retainOnly(this.model, new Set(this.names));
  }

  async missing(): Promise<string[]> {
    const stored = await this.storage.storedNames(this.model);
    return this.names.filter((n) => !stored.has(n));
  }

  /**
   * Fetches what is missing. Opens the checkpoint (headers by Range) only
   * when something is: a node that has its whole span stored sends no request.
   */
  async ensure(opts: EnsureOptions): Promise<EnsureResult> {
    const missing = await this.missing();
    const storedBefore = await this.storage.storedBytes(this.model);
    if (missing.length === 0) return { fetchedBytes: 0, storedBytes: storedBefore };

    const reader = await SafetensorsReader.open(opts.fetch, this.model, opts.signal ? { signal: opts.signal } : {});
    for (const name of missing) {
      const info = reader.info(name);
      const want = expectedTensorShape(this.config, name);
      if (want && (want.length !== info.shape.length || want.some((d, i) => d !== info.shape[i]))) {
        throw new Error(`${name}: checkpoint shape [${info.shape.join(',')}] does not match config.json's [${want.join(',')}]`);
      }
    }
    const missingBytes = reader.tensorBytes(missing);
    const totalBytes = storedBefore + missingBytes;
    let committed = storedBefore;
    opts.onProgress?.({ loadedBytes: committed, totalBytes });

    // Batches in file order, so each batch is a few coalesced Range requests.
    const ordered = [...missing].sort((a, b) => {
      const ia = reader.info(a);
      const ib = reader.info(b);
      return ia.file === ib.file ? ia.offset - ib.offset : ia.file < ib.file ? -1 : 1;
    });
    const batchBytes = opts.batchBytes ?? 8 * 2 ** 20;
    const batches: string[][] = [];
    let cur: string[] = [];
    let curBytes = 0;
    for (const name of ordered) {
      const n = reader.info(name).byteLength;
      if (cur.length > 0 && curBytes + n > batchBytes) {
        batches.push(cur);
        cur = [];
        curBytes = 0;
      }
      cur.push(name);
      curBytes += n;
    }
    if (cur.length > 0) batches.push(cur);

    for (const batch of batches) {
      const raw = await reader.fetchTensorBytes(batch, {
        ...(opts.signal ? { signal: opts.signal } : {}),
        onProgress: (loaded) => opts.onProgress?.({ loadedBytes: committed + loaded, totalBytes }),
      });
      const records = await Promise.all(batch.map((name) => toRecord(this.model, raw.get(name)!)));
      try {
        await this.storage.putTensors(records);
      } catch (e) {
        if (e instanceof QuotaError) throw new QuotaError(totalBytes - committed, e.usage, e.quota);
        throw e;
      }
      committed += records.reduce((n, r) => n + r.bytes.byteLength, 0);
      opts.onProgress?.({ loadedBytes: committed, totalBytes });
    }
    return { fetchedBytes: reader.stats.bytesReceived, storedBytes: committed };
  }

  /**
   * The executor's WeightLoader over storage: each graph reads, verifies and
   * decodes only its own tensors. A record whose hash or size is wrong is
   * deleted and reported, so a retry fetches it again instead of failing forever.
   */
  loader(): WeightLoader {
    return async (names) => {
      const decoded = new Map<string, { shape: number[]; data: Float32Array }>();
      for (const name of names) {
        const t = await this.storage.getTensor(this.model, name);
        if (!t) throw new WeightIntegrityError(`${name} is not stored; download the span again`);
        const elems = t.shape.reduce((a, b) => a * b, 1);
        const okSize = t.bytes.byteLength === elems * dtypeSize(t.dtype);
        if (!okSize || (await sha256Hex(t.bytes)) !== t.sha256) {
          await this.storage.deleteTensor(this.model, name);
          throw new WeightIntegrityError(`stored ${name} failed verification (${okSize ? 'hash' : 'size'} mismatch) and was deleted; retry to fetch it again`);
        }
        const { shape, data } = decodeTensorBytes({ dtype: t.dtype, shape: t.shape, bytes: new Uint8Array(t.bytes) });
        decoded.set(name, { shape, data });
      }
      const source: WeightSource = (name) => {
        const w = decoded.get(name);
        if (!w) throw new Error(`tensor ${name} was not requested for this graph`);
        return w;
      };
      return source;
    };
  }
}

async function toRecord(model: string, raw: RawTensor): Promise<StoredTensor> {
  // Copy out of the download buffer: a view would keep the whole coalesced range alive in IndexedDB.
  const bytes = raw.bytes.slice().buffer;
  return { model, name: raw.name, dtype: raw.dtype, shape: raw.shape, bytes, sha256: await sha256Hex(bytes) };
}
