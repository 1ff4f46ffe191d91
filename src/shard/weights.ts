/**
 * WeightLoader over the safetensors Range reader: each graph fetches and
 * decodes only its own tensors, and they become garbage once the session
 * holds them.
 */
import type { SafetensorsReader } from '../model/safetensors.ts';
import type { WeightSource } from '../model/graph.ts';
import type { WeightLoader } from './contract.ts';

export function readerWeightLoader(reader: SafetensorsReader): WeightLoader {
  return async (names) => {
    const loaded = await reader.loadTensors(names);
    const source: WeightSource = (name) => {
      const t = loaded.get(name);
      if (!t) throw new Error(`tensor ${name} was not requested for this graph`);
      return t;
    };
    return source;
  };
}
