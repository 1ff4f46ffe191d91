/**
 * Test-side weight access: parses the fixture's in-memory safetensors files
 * (bf16) into float32 tensors by name.
 */
import { decodeTensor } from '../../src/protocol/tensor.ts';
import type { WeightSource, WeightTensor } from '../../src/model/graph.ts';

export function weightsFromFiles(files: Map<string, Uint8Array>): WeightSource {
  const tensors = new Map<string, WeightTensor>();
  for (const [file, bytes] of files) {
    if (!file.endsWith('.safetensors')) continue;
    const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const headerLen = Number(dv.getBigUint64(0, true));
    const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + headerLen))) as Record<string, { dtype: string; shape: number[]; data_offsets: [number, number] }>;
    const base = 8 + headerLen;
    for (const [name, t] of Object.entries(header)) {
      if (name === '__metadata__') continue;
      const raw = bytes.subarray(base + t.data_offsets[0], base + t.data_offsets[1]);
      const dtype = t.dtype === 'BF16' ? 'bf16' : t.dtype === 'F16' ? 'f16' : 'f32';
      tensors.set(name, { shape: t.shape, data: decodeTensor(raw, dtype) });
    }
  }
  return (name) => {
    const t = tensors.get(name);
    if (!t) throw new Error(`no tensor ${name}`);
    return t;
  };
}
