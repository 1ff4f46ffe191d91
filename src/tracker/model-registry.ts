/**
 * The models a tracker serves, and what a span of each costs in memory.
 *
 * A node's executor holds weights converted to f32 (src/shard/executor.ts,
 * dtype 'f32' by default), whatever the checkpoint's dtype, so a layer costs
 * its parameter count × `weightBytesPerParam`, plus a KV reserve for
 * `kvReserveSessions` sessions of `kvReserveContextTokens` tokens. The
 * parameter counts come from the safetensors headers when the checkpoint is
 * reachable (exact, biases included), else from config.json's shapes.
 */
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR, expectedTensorShape, layerTensorNames, parseModelConfig, type ModelConfig } from '../model/config.ts';
import { openSafetensors } from '../model/safetensors.ts';

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
}

export interface SizingOptions {
  weightBytesPerParam: number;
  kvReserveContextTokens: number;
  kvReserveSessions: number;
}

function joinUrl(base: string, file: string): string {
  return base.endsWith('/') ? base + file : `${base}/${file}`;
}

const product = (shape: readonly number[]) => shape.reduce((a, b) => a * b, 1);

/** Sizes from a parsed config and, when known, the checkpoint's tensor shapes by name. */
export function sizeModel(name: string, url: string, config: ModelConfig, o: SizingOptions, shapes?: ReadonlyMap<string, readonly number[]>): ModelSpec {
  const params = (tensor: string): number => {
    const s = shapes?.get(tensor) ?? expectedTensorShape(config, tensor);
    return s ? product(s) : 0;
  };
  const layerBytes: number[] = [];
  for (let l = 0; l < config.numLayers; l++) {
    layerBytes.push(layerTensorNames(config, l).reduce((n, t) => n + params(t), 0) * o.weightBytesPerParam);
  }
  const embedBytes = params(EMBED_TENSOR) * o.weightBytesPerParam;
  // A tied model's LM head is the embedding matrix: the last node holds a copy.
  const lmHead = config.tieWordEmbeddings ? params(EMBED_TENSOR) : params(LM_HEAD_TENSOR);
  const headBytes = (lmHead + params(FINAL_NORM_TENSOR)) * o.weightBytesPerParam;
  const ctx = Math.min(o.kvReserveContextTokens, config.maxPositionEmbeddings);
  const kvBytesPerLayer = 2 * ctx * config.numKvHeads * config.headDim * 4 * o.kvReserveSessions;
  return {
    name,
    url,
    config,
    numLayers: config.numLayers,
    layerBytes,
    embedBytes,
    headBytes,
    kvBytesPerLayer,
    contextTokens: config.maxPositionEmbeddings,
    sizedFrom: shapes ? 'safetensors' : 'config',
  };
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
    throw new Error(`model ${name}: cannot fetch ${cfgUrl} (${(e as Error).message})`, { cause: e });
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
