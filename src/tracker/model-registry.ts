/**
 * The models a tracker serves, and what a span of each costs in memory.
 *
 * A node's executor holds weights converted to its weight format
 * (src/model/weight-format.ts; f32 unless the node announces f16 or q4),
 * whatever the checkpoint's dtype, so an f32 layer costs its parameter count
 * × `weightBytesPerParam`, a q4 one ~6.4x less, plus a KV reserve for
 * `kvReserveSessions` sessions of `kvReserveContextTokens` tokens. The
 * parameter counts come from the safetensors headers when the checkpoint is
 * reachable (exact, biases included), else from config.json's shapes.
 */
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR, expectedTensorShape, layerTensorNames, parseModelConfig, type ModelConfig } from '../model/config.ts';
import { openSafetensors } from '../model/safetensors.ts';
import { tensorBytesIn, type WeightFormat } from '../model/weight-format.ts';

export interface ModelSpec {
  name: string;
  /** Base URL of the checkpoint, as given (nodes fetch from it). */
  url: string;
  config: ModelConfig;
  numLayers: number;
  /** In-memory weight bytes of each decoder layer. */
  layerBytes: number[];
  /** Embedding held by the node with layer 0. */
  embedBytes: number;
  /** Final norm + LM head held by the node with the last layer. */
  headBytes: number;
  /** KV reserve per layer. */
  kvBytesPerLayer: number;
  /** Longest context the model takes (max_position_embeddings). */
  contextTokens: number;
  /** Where the parameter counts came from. */
  sizedFrom: 'safetensors' | 'config';
  /**
   * The weights in each format a node may announce (`info.weight_format`):
   * f32 is the fields above; a q4 layer is ~6.4x smaller, so the same budget
   * holds that many more layers. Absent: every node is sized as f32.
   */
  formats?: Record<WeightFormat, FormatWeights>;
}

/** One format's weight bytes: each decoder layer, the embedding, final norm + LM head. */
export interface FormatWeights {
  layerBytes: number[];
  embedBytes: number;
  headBytes: number;
}

export interface SizingOptions {
  weightBytesPerParam: number;
  kvReserveContextTokens: number;
  kvReserveSessions: number;
}

function joinUrl(base: string, file: string): string {
  return base.endsWith('/') ? base + file : `${base}/${file}`;
}

/** Sizes from a parsed config and, when known, the checkpoint's tensor shapes by name. */
export function sizeModel(name: string, url: string, config: ModelConfig, o: SizingOptions, shapes?: ReadonlyMap<string, readonly number[]>): ModelSpec {
  const shapeOf = (tensor: string): readonly number[] | null => shapes?.get(tensor) ?? expectedTensorShape(config, tensor);
  const weightsIn = (format: WeightFormat): FormatWeights => {
    const bytes = (tensor: string): number => {
      const s = shapeOf(tensor);
      return s ? tensorBytesIn(format, tensor, s, o.weightBytesPerParam) : 0;
    };
    const layerBytes: number[] = [];
    for (let l = 0; l < config.numLayers; l++) layerBytes.push(layerTensorNames(config, l).reduce((n, t) => n + bytes(t), 0));
    const embedBytes = bytes(EMBED_TENSOR);
    // A tied model's LM head is the embedding matrix: the last node holds a copy (in f32 under q4, as the embedding).
    const lmHead = config.tieWordEmbeddings ? embedBytes : bytes(LM_HEAD_TENSOR);
    return { layerBytes, embedBytes, headBytes: lmHead + bytes(FINAL_NORM_TENSOR) };
  };
  const formats: Record<WeightFormat, FormatWeights> = { f32: weightsIn('f32'), f16: weightsIn('f16'), q4: weightsIn('q4') };
  const ctx = Math.min(o.kvReserveContextTokens, config.maxPositionEmbeddings);
  const kvBytesPerLayer = 2 * ctx * config.numKvHeads * config.headDim * 4 * o.kvReserveSessions;
  return {
    name,
    url,
    config,
    numLayers: config.numLayers,
    ...formats.f32,
    kvBytesPerLayer,
    contextTokens: config.maxPositionEmbeddings,
    sizedFrom: shapes ? 'safetensors' : 'config',
    formats,
  };
}

/** `m` as a node holding `format` sees it (its layers', embedding's and head's bytes in that format). */
export function sizedFor(m: ModelSpec, format: WeightFormat | undefined): ModelSpec {
  const w = format && m.formats?.[format];
  return w ? { ...m, ...w } : m;
}

/** Memory a node needs to hold layers [start, end) of `m`, bytes. */
export function spanBytes(m: ModelSpec, start: number, end: number): number {
  let n = 0;
  for (let l = start; l < end; l++) n += m.layerBytes[l]! + m.kvBytesPerLayer;
  if (start === 0) n += m.embedBytes;
  if (end === m.numLayers) n += m.headBytes;
  return n;
}

/** Fetch config.json (and the safetensors headers when reachable) and size the model. */
export async function loadModelSpec(name: string, url: string, fetchFn: typeof fetch, o: SizingOptions): Promise<ModelSpec> {
  const cfgUrl = joinUrl(url, 'config.json');
  let res: Response;
  try {
    res = await fetchFn(cfgUrl);
  } catch (e) {
    const cause = (e as { cause?: { message?: string } }).cause?.message;
    throw new Error(`model ${name}: cannot fetch ${cfgUrl} (${cause ?? (e as Error).message})`, { cause: e });
  }
  if (!res.ok) throw new Error(`model ${name}: HTTP ${res.status} from ${cfgUrl}`);
  const config = parseModelConfig(await res.json(), cfgUrl);
  let shapes: Map<string, number[]> | undefined;
  try {
    const reader = await openSafetensors(fetchFn, url);
    shapes = new Map([...reader.tensorInfos].map(([k, v]) => [k, v.shape]));
  } catch {
    // Headers unreachable (e.g. a config-only mirror): config shapes are exact for supported architectures.
    shapes = undefined;
  }
  return sizeModel(name, url, config, o, shapes);
}

// ---------------------------------------------------------------- loading, with retries

/** Loads one model's spec from its checkpoint (loadModelSpec, or a resolver in front of it). */
export type ModelLoader = (name: string, url: string) => Promise<ModelSpec>;

export interface ModelRetryOptions {
  /** First wait after a failed load, ms; doubles per failure. @defaultValue 1000 */
  initialDelayMs: number;
  /** Longest wait between attempts, ms. @defaultValue 60000 */
  maxDelayMs: number;
}

export const MODEL_RETRY_DEFAULTS: ModelRetryOptions = { initialDelayMs: 1000, maxDelayMs: 60_000 };

export interface PendingModel {
  url: string;
  attempts: number;
  lastError: string;
}

export interface ModelCatalogEvents {
  /** A model that failed before is loaded now. */
  onLoaded?(spec: ModelSpec, attempts: number): void;
  /** A load failed; the next attempt is in `retryInMs`. */
  onError?(name: string, url: string, error: Error, attempts: number, retryInMs: number): void;
}

/**
 * The models a tracker serves, loaded from their checkpoints. Each is tried
 * once at start; one whose checkpoint cannot be read (host down, a typo in the
 * URL, not a checkpoint) is retried with exponential backoff (±20 % jitter)
 * while the others serve, and handed over by `onLoaded` once it loads.
 */
export class ModelCatalog {
  readonly pending = new Map<string, PendingModel>();
  private readonly timers = new Set<ReturnType<typeof setTimeout>>();
  private closed = false;

  constructor(
    private readonly load: ModelLoader,
    private readonly events: ModelCatalogEvents = {},
    private readonly retry: ModelRetryOptions = MODEL_RETRY_DEFAULTS,
    private readonly random: () => number = Math.random,
  ) {}

  /** Try every source once; resolves with the ones that loaded. The others keep retrying. */
  async start(sources: ReadonlyArray<{ name: string; url: string }>): Promise<ModelSpec[]> {
    const loaded = await Promise.all(sources.map((s) => this.attempt(s.name, s.url, 1, false)));
    return loaded.filter((m): m is ModelSpec => m !== undefined);
  }

  /** Stop retrying. */
  close(): void {
    this.closed = true;
    for (const t of this.timers) clearTimeout(t);
    this.timers.clear();
  }

  private async attempt(name: string, url: string, attempts: number, retrying: boolean): Promise<ModelSpec | undefined> {
    try {
      const spec = await this.load(name, url);
      this.pending.delete(name);
      if (retrying && !this.closed) this.events.onLoaded?.(spec, attempts);
      return spec;
    } catch (e) {
      const err = e instanceof Error ? e : new Error(String(e));
      const base = Math.min(this.retry.maxDelayMs, this.retry.initialDelayMs * 2 ** (attempts - 1));
      const delay = Math.round(base * (0.8 + 0.4 * this.random()));
      this.pending.set(name, { url, attempts, lastError: err.message });
      if (this.closed) return undefined;
      this.events.onError?.(name, url, err, attempts, delay);
      const t = setTimeout(() => {
        this.timers.delete(t);
        if (!this.closed) void this.attempt(name, url, attempts + 1, true);
      }, delay);
      t.unref?.();
      this.timers.add(t);
      return undefined;
    }
  }
}
