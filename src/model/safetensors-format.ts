/**
 * The safetensors format: an 8-byte little-endian header length, a JSON
 * header (name → dtype, shape, byte offsets), then the raw tensor bytes.
 * Writing it (fixtures), parsing headers, and decoding a tensor's bytes;
 * safetensors.ts reads files over HTTP Range with these.
 */
import { z } from 'zod';
import { decodeTensor } from '../protocol/tensor.ts';
import type { Dtype } from '../protocol/tensor.ts';
import { ModelFormatError } from './errors.ts';

export type SafetensorsDtype = 'BF16' | 'F16' | 'F32';

export interface TensorEntry {
  dtype: SafetensorsDtype;
  shape: number[];
  /** Bytes of this tensor's data, already little-endian in `dtype`. */
  data: Uint8Array;
}

export function dtypeSize(dtype: SafetensorsDtype): number {
  return dtype === 'F32' ? 4 : 2;
}

/**
 * Serialize tensors in the order given (safetensors itself sorts by name; the
 * caller decides). The header is padded with spaces to a multiple of 8 bytes,
 * as the reference writer does, so every tensor starts aligned.
 */
export function serializeSafetensors(tensors: ReadonlyArray<[string, TensorEntry]>, metadata: Record<string, string> = { format: 'pt' }): Uint8Array {
  const header: Record<string, unknown> = { __metadata__: metadata };
  let offset = 0;
  for (const [name, t] of tensors) {
    const n = t.shape.reduce((a, b) => a * b, 1);
    if (n * dtypeSize(t.dtype) !== t.data.byteLength) {
      throw new RangeError(`${name}: ${t.data.byteLength} bytes do not hold shape [${t.shape}] of ${t.dtype}`);
    }
    header[name] = { dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + t.data.byteLength] };
    offset += t.data.byteLength;
  }
  const json = JSON.stringify(header);
  const enc = new TextEncoder();
  const unpadded = enc.encode(json).byteLength;
  const headerBytes = enc.encode(json + ' '.repeat((8 - (unpadded % 8)) % 8));
  const out = new Uint8Array(8 + headerBytes.byteLength + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(headerBytes.byteLength), true);
  out.set(headerBytes, 8);
  let pos = 8 + headerBytes.byteLength;
  for (const [, t] of tensors) {
    out.set(t.data, pos);
    pos += t.data.byteLength;
  }
  return out;
}

// ---------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------

/** The reference implementation refuses headers over 100 MB; so do we. */
export const MAX_HEADER_BYTES = 100_000_000;
export const INDEX_FILE = 'model.safetensors.index.json';
export const SINGLE_FILE = 'model.safetensors';

const SUPPORTED: readonly string[] = ['BF16', 'F16', 'F32'];
/** Sizes of every safetensors dtype, so byte lengths are checked even for tensors we cannot decode. */
const DTYPE_SIZES: Record<string, number> = {
  BOOL: 1, U8: 1, I8: 1, F8_E5M2: 1, F8_E4M3: 1, I16: 2, U16: 2, F16: 2, BF16: 2, I32: 4, U32: 4, F32: 4, F64: 8, I64: 8, U64: 8,
};

export interface TensorInfo {
  name: string;
  file: string;
  /** As written in the header; may be a dtype we cannot decode (checked at load). */
  dtype: string;
  shape: number[];
  /** Absolute byte offset of the tensor's data in `file`. */
  offset: number;
  byteLength: number;
}

export interface RawTensor {
  name: string;
  file: string;
  dtype: SafetensorsDtype;
  shape: number[];
  /** Little-endian bytes as stored; a view into a larger download buffer. */
  bytes: Uint8Array;
}

export interface LoadedTensor {
  dtype: SafetensorsDtype;
  shape: number[];
  data: Float32Array;
}

export interface LoadOptions {
  /** Bytes of the planned ranges received so far / in total (gaps included). */
  onProgress?(loadedBytes: number, totalBytes: number): void;
  signal?: AbortSignal;
  /**
   * Tensors separated by at most this many unwanted bytes share one request:
   * a round trip costs about as much as a few hundred KB of transfer.
   */
  maxGapBytes?: number;
}

export interface OpenOptions {
  signal?: AbortSignal;
  /** Bytes requested up front for each header; a bigger header costs a second request. */
  headerPrefetchBytes?: number;
  /** Skip discovery: the safetensors files to open (relative to the base URL). */
  files?: string[];
}

const EntrySchema = z.object({
  dtype: z.string(),
  shape: z.array(z.number().int().nonnegative()),
  data_offsets: z.tuple([z.number().int().nonnegative(), z.number().int().nonnegative()]),
});

export const IndexSchema = z.object({
  metadata: z.record(z.string(), z.unknown()).optional(),
  weight_map: z.record(z.string(), z.string()),
});

/**
 * Parse and validate a header. `headerLength` is the value of the 8-byte
 * prefix; `fileSize` (when known) bounds every tensor's data.
 */
export function parseSafetensorsHeader(headerJson: Uint8Array, file: string, fileSize: number | null = null): Map<string, TensorInfo> {
  let raw: unknown;
  try {
    raw = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(headerJson));
  } catch (e) {
    throw new ModelFormatError(file, `header is not valid JSON (${(e as Error).message})`);
  }
  if (typeof raw !== 'object' || raw === null || Array.isArray(raw)) throw new ModelFormatError(file, 'header is not a JSON object');
  const dataStart = 8 + headerJson.byteLength;
  const out = new Map<string, TensorInfo>();
  for (const [name, value] of Object.entries(raw)) {
    if (name === '__metadata__') continue;
    const parsed = EntrySchema.safeParse(value);
    if (!parsed.success) {
      const issue = parsed.error.issues[0]!;
      throw new ModelFormatError(file, `header entry field "${issue.path.join('.')}": ${issue.message}`, name);
    }
    const { dtype, shape, data_offsets: [begin, end] } = parsed.data;
    const size = DTYPE_SIZES[dtype];
    if (size === undefined) throw new ModelFormatError(file, `unknown dtype "${dtype}"`, name);
    if (end < begin) throw new ModelFormatError(file, `data_offsets [${begin}, ${end}] run backwards`, name);
    const elements = shape.reduce((a, b) => a * b, 1);
    if (elements * size !== end - begin) {
      throw new ModelFormatError(file, `shape [${shape}] of ${dtype} needs ${elements * size} bytes but data_offsets span ${end - begin}`, name);
    }
    if (fileSize !== null && dataStart + end > fileSize) {
      throw new ModelFormatError(file, `data_offsets end ${end} lies past the end of the file (${fileSize - dataStart} data bytes)`, name);
    }
    out.set(name, { name, file, dtype, shape, offset: dataStart + begin, byteLength: end - begin });
  }
  return out;
}

/** Parse a whole safetensors file already in memory. */
export function parseSafetensorsFile(bytes: Uint8Array, file: string): Map<string, TensorInfo> {
  const headerLength = readHeaderLength(bytes, file, bytes.byteLength);
  if (8 + headerLength > bytes.byteLength) throw new ModelFormatError(file, `truncated: header of ${headerLength} bytes, file of ${bytes.byteLength}`);
  return parseSafetensorsHeader(bytes.subarray(8, 8 + headerLength), file, bytes.byteLength);
}

export function readHeaderLength(prefix: Uint8Array, file: string, fileSize: number | null): number {
  if (prefix.byteLength < 8) throw new ModelFormatError(file, `truncated: ${prefix.byteLength} bytes, no 8-byte header length`);
  const n = new DataView(prefix.buffer, prefix.byteOffset, 8).getBigUint64(0, true);
  if (n < 2n || n > BigInt(MAX_HEADER_BYTES)) throw new ModelFormatError(file, `header length ${n} is absurd (limit ${MAX_HEADER_BYTES})`);
  const len = Number(n);
  if (fileSize !== null && 8 + len > fileSize) throw new ModelFormatError(file, `truncated: header claims ${len} bytes, file has ${fileSize}`);
  return len;
}

export function asSupportedDtype(info: Pick<TensorInfo, 'dtype' | 'file' | 'name'>): SafetensorsDtype {
  if (!SUPPORTED.includes(info.dtype)) throw new ModelFormatError(info.file, `dtype ${info.dtype} is not supported (BF16, F16, F32 are)`, info.name);
  return info.dtype as SafetensorsDtype;
}

const CODEC: Record<SafetensorsDtype, Dtype> = { BF16: 'bf16', F16: 'f16', F32: 'f32' };

/** Raw stored bytes → float32 (the cached-bytes path uses this too). */
export function decodeTensorBytes(raw: Pick<RawTensor, 'dtype' | 'shape' | 'bytes'>): LoadedTensor {
  return { dtype: raw.dtype, shape: raw.shape, data: decodeTensor(raw.bytes, CODEC[raw.dtype]) };
}
