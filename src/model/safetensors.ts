/**
 * safetensors: an 8-byte little-endian header length, a JSON header, then the
 * raw tensor bytes. This module writes the format (for fixtures) and reads it
 * over HTTP Range requests, fetching only the byte ranges a node needs.
 */
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

export { ModelFormatError };
