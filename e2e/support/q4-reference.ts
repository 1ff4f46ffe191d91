/**
 * The independent check for 4-bit nodes: the float64 reference run on the
 * weights the kernel multiplies by — every quantized matrix (quantize.ts)
 * dequantized — so a q4 node must match it within f32 tolerance.
 */
import { FUSED_Q4_SCHEME } from '../../src/model/fused-graph.ts';
import { fixtureConfig, makeModel, type FixturePreset } from '../../src/model/fixture.ts';
import type { WeightSource, WeightTensor } from '../../src/model/graph.ts';
import { dequantizeQ4, quantizeQ4 } from '../../src/model/quantize.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { isQuantizedTensor } from '../../src/model/weight-format.ts';
import { weightsFromFiles } from '../../test/helpers/weights.ts';

export function dequantized(src: WeightSource): WeightSource {
  const cache = new Map<string, WeightTensor>();
  return (name) => {
    const w = src(name);
    if (!isQuantizedTensor(name, w.shape)) return w;
    let d = cache.get(name);
    if (!d) {
      d = { shape: w.shape, data: dequantizeQ4(quantizeQ4(w.data, w.shape[0]!, w.shape[1]!, FUSED_Q4_SCHEME)) };
      cache.set(name, d);
    }
    return d;
  };
}

const refs = new Map<string, ReferenceModel>();
/** The reference over `preset`'s 4-bit weights, dequantized. */
export function q4Reference(preset: FixturePreset): ReferenceModel {
  let r = refs.get(preset);
  if (!r) {
    r = new ReferenceModel(fixtureConfig(preset), dequantized(weightsFromFiles(makeModel(preset))));
    refs.set(preset, r);
  }
  return r;
}
