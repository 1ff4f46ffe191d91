/**
 * The browser node's IndexedDB: weights of the span it holds, the model's
 * small JSON files, its Ed25519 identity and the donor's settings. Written
 * with idb; one database, opened once per worker.
 *
 * Weights are stored per tensor, as the checkpoint's own bytes (bf16 stays
 * bf16: half the space of f32) with their SHA-256, so a download cut by a
 * reload resumes at the first missing tensor and a damaged record is caught
 * before it reaches a graph.
 *
 * A node on 4-bit weights also keeps each projection as it quantized it
 * (`q4`: packed nibbles + scales, keyed by model and tensor name), so a
 * reload builds its graphs without quantizing again.
 */
import type { MeshErrorCode } from '../../protocol/errors.ts';
import { openDB, type DBSchema, type IDBPDatabase } from 'idb';
import type { SafetensorsDtype } from '../../model/safetensors-format.ts';
import type { KeyStore, StoredIdentity } from '../../net/identity.ts';

export const DB_NAME = 'meshnet';
/** 2: the `q4` store (4-bit projections, so a reload does not quantize again). */
export const DB_VERSION = 2;

export interface StoredTensor {
  /** Model base URL: tensors of different models never mix. */
  model: string;
  name: string;
  dtype: SafetensorsDtype;
  shape: number[];
  bytes: ArrayBuffer;
  /** Lowercase hex SHA-256 of `bytes`, taken when they arrived. */
  sha256: string;
}

/** Small per-model files (config.json, tokenizer files), so a reload needs no network for them. */
export interface StoredModelFiles {
  model: string;
  files: Record<string, unknown>;
}

export interface Settings {
  backend?: 'auto' | 'wasm' | 'webgpu';
  memoryBudgetBytes?: number;
  weights?: 'f32' | 'f16' | 'q4';
}

/** A projection as the node quantized it (src/model/quantize.ts's Q4Matrix, symmetric when zeroPoints is null). */
export interface StoredQ4 {
  model: string;
  name: string;
  n: number;
  k: number;
  packed: ArrayBuffer;
  scales: ArrayBuffer;
  zeroPoints: ArrayBuffer | null;
}

interface MeshnetDB extends DBSchema {
  tensors: { key: [string, string]; value: StoredTensor; indexes: { byModel: string } };
  q4: { key: [string, string]; value: StoredQ4; indexes: { byModel: string } };
  models: { key: string; value: StoredModelFiles };
  kv: { key: string; value: unknown };
}

/** A storage write that failed because the origin is over its quota. */
export class QuotaError extends Error {
  override readonly name = 'QuotaError';
  readonly code: MeshErrorCode = 'MESH_ERR_QUOTA';
  constructor(
    readonly neededBytes: number,
    readonly usage: number | undefined,
    readonly quota: number | undefined,
  ) {
    super(
      `browser storage is full: the layers need ${Math.ceil(neededBytes / 2 ** 20)} MiB more` +
        (quota !== undefined ? `, this site may use ${Math.floor(quota / 2 ** 20)} MiB and uses ${Math.floor((usage ?? 0) / 2 ** 20)} MiB` : ''),
    );
  }
}

export function isQuotaError(e: unknown): boolean {
  const name = (e as { name?: unknown } | null)?.name;
  return name === 'QuotaExceededError' || name === 'QuotaError' || (e as { inner?: { name?: string } } | null)?.inner?.name === 'QuotaExceededError';
}

export async function sha256Hex(bytes: ArrayBuffer | Uint8Array): Promise<string> {
  const digest = new Uint8Array(await crypto.subtle.digest('SHA-256', bytes as BufferSource));
  let s = '';
  for (const b of digest) s += b.toString(16).padStart(2, '0');
  return s;
}

export class NodeStorage {
  private constructor(private readonly db: IDBPDatabase<MeshnetDB>) {}

  static async open(name = DB_NAME): Promise<NodeStorage> {
    const db = await openDB<MeshnetDB>(name, DB_VERSION, {
      upgrade(d, oldVersion) {
        if (oldVersion < 1) {
          const t = d.createObjectStore('tensors', { keyPath: ['model', 'name'] });
          t.createIndex('byModel', 'model');
          d.createObjectStore('models', { keyPath: 'model' });
          d.createObjectStore('kv');
        }
        if (oldVersion < 2) d.createObjectStore('q4', { keyPath: ['model', 'name'] }).createIndex('byModel', 'model');
      },
    });
    return new NodeStorage(db);
  }

  close(): void {
    this.db.close();
  }

  // ---------------------------------------------------------------- settings and identity

  async settings(): Promise<Settings> {
    return ((await this.db.get('kv', 'settings')) as Settings | undefined) ?? {};
  }

  async saveSettings(patch: Settings): Promise<Settings> {
    const next = { ...(await this.settings()), ...patch };
    await this.db.put('kv', next, 'settings');
    return next;
  }

  /** The KeyStore RelayClient's Identity uses: the same key, so the same peer id, after a reload. */
  keyStore(): KeyStore {
    return {
      load: async () => (await this.db.get('kv', 'identity')) as StoredIdentity | undefined,
      save: async (identity) => {
        await this.db.put('kv', identity, 'identity');
      },
    };
  }

  // ---------------------------------------------------------------- model files

  async modelFiles(model: string): Promise<Record<string, unknown> | undefined> {
    return (await this.db.get('models', model))?.files;
  }

  async saveModelFiles(model: string, files: Record<string, unknown>): Promise<void> {
    await this.guardQuota(0, () => this.db.put('models', { model, files }));
  }

  // ---------------------------------------------------------------- tensors

  /** Names of the tensors of `model` already stored. */
  async storedNames(model: string): Promise<Set<string>> {
    const keys = await this.db.getAllKeysFromIndex('tensors', 'byModel', model);
    return new Set(keys.map((k) => k[1]));
  }

  async getTensor(model: string, name: string): Promise<StoredTensor | undefined> {
    return this.db.get('tensors', [model, name]);
  }

  /** Stores tensors in one transaction: a reload mid-download keeps every batch that committed. */
  async putTensors(list: readonly StoredTensor[]): Promise<void> {
    const bytes = list.reduce((n, t) => n + t.bytes.byteLength, 0);
    await this.guardQuota(bytes, async () => {
      // A tensor stored anew (a new checkpoint, a damaged record fetched again) voids what was quantized from it.
      const tx = this.db.transaction(['tensors', 'q4'], 'readwrite');
      const q4 = tx.objectStore('q4');
      await Promise.all([...list.map((t) => tx.objectStore('tensors').put(t)), ...list.map((t) => q4.delete([t.model, t.name])), tx.done]);
    });
  }

  async deleteTensor(model: string, name: string): Promise<void> {
    await this.db.delete('tensors', [model, name]);
  }

  // ---------------------------------------------------------------- 4-bit projections

  async getQ4(model: string, name: string): Promise<StoredQ4 | undefined> {
    return this.db.get('q4', [model, name]);
  }

  async putQ4(record: StoredQ4): Promise<void> {
    const bytes = record.packed.byteLength + record.scales.byteLength + (record.zeroPoints?.byteLength ?? 0);
    await this.guardQuota(bytes, () => this.db.put('q4', record));
  }

  async deleteQ4(model: string, name: string): Promise<void> {
    await this.db.delete('q4', [model, name]);
  }

  /** Bytes of stored 4-bit projections of `model`. */
  async storedQ4Bytes(model: string): Promise<number> {
    let n = 0;
    const tx = this.db.transaction('q4', 'readonly');
    for await (const cursor of tx.store.index('byModel').iterate(model)) {
      const r = cursor.value;
      n += r.packed.byteLength + r.scales.byteLength + (r.zeroPoints?.byteLength ?? 0);
    }
    return n;
  }

  /**
   * Drops every tensor not in `keep` (by model, then name): the assignment
   * changed, so layers the node no longer holds free their space. Tensors a
   * new span shares with the old one stay.
   */
  async retainOnly(model: string, keep: ReadonlySet<string>): Promise<number> {
    let dropped = 0;
    const tx = this.db.transaction('tensors', 'readwrite');
    for await (const cursor of tx.store.iterate()) {
      const t = cursor.value;
      if (t.model !== model || !keep.has(t.name)) {
        dropped += t.bytes.byteLength;
        await cursor.delete();
      }
    }
    await tx.done;
    // Quantized projections follow the tensors they were made from.
    const qtx = this.db.transaction('q4', 'readwrite');
    for await (const cursor of qtx.store.iterate()) {
      const r = cursor.value;
      if (r.model !== model || !keep.has(r.name)) {
        dropped += r.packed.byteLength + r.scales.byteLength + (r.zeroPoints?.byteLength ?? 0);
        await cursor.delete();
      }
    }
    await qtx.done;
    const mtx = this.db.transaction('models', 'readwrite');
    for await (const cursor of mtx.store.iterate()) if (cursor.key !== model) await cursor.delete();
    await mtx.done;
    return dropped;
  }

  /** Bytes of stored tensors of `model` (a scan: called once per start, not per request). */
  async storedBytes(model: string): Promise<number> {
    let n = 0;
    const tx = this.db.transaction('tensors', 'readonly');
    for await (const cursor of tx.store.index('byModel').iterate(model)) n += cursor.value.bytes.byteLength;
    return n;
  }

  /** Runs a write; a quota failure becomes a QuotaError with the numbers the donor needs. */
  private async guardQuota<T>(neededBytes: number, write: () => Promise<T>): Promise<T> {
    try {
      return await write();
    } catch (e) {
      if (!isQuotaError(e)) throw e;
      const est = await navigator.storage?.estimate?.().catch(() => undefined);
      throw new QuotaError(neededBytes, est?.usage, est?.quota);
    }
  }
}
