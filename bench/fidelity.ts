/**
 * Fidelity of the fused graphs against the float64 reference on the
 * checkpoint's own weights: 256 teacher-forced tokens (the reference's
 * greedy continuation fed to both), max and mean |logit error| relative to
 * the logits' scale, and top-1 agreement. 4-bit here is the symmetric
 * block-32 quantization the GPU path uses (fused-graph.ts FUSED_Q4_SCHEME),
 * plus the asymmetric scheme for comparison. onnxruntime-node CPU kernels.
 *
 *   npx tsx bench/fidelity.ts [--quick]
 * Table on stdout, JSON in bench/results/fidelity.json.
 */
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { SHIPPED_MODELS } from '../src/cli/demo-model.ts';
import { parseModelConfig, type ModelConfig } from '../src/model/config.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { fixtureConfig, makeModel, type FixturePreset } from '../src/model/fixture.ts';
import type { WeightSource } from '../src/model/graph.ts';
import { quantizeQ4, type Q4Scheme } from '../src/model/quantize.ts';
import { ReferenceModel, newRefCache } from '../src/model/reference.ts';
import { decodeTensor } from '../src/protocol/tensor.ts';
import { FusedShardExecutor } from '../src/shard/fused-executor.ts';
import { createNodeBackend } from '../src/host/node/onnx.ts';

const quick = process.argv.includes('--quick');
const TOKENS = quick ? 32 : 256;
const backend = createNodeBackend({ intraOpNumThreads: 1 });

function weights(preset: FixturePreset): WeightSource {
  return weightsOf(makeModel(preset, 0));
}

function weightsOf(files: Map<string, Uint8Array>): WeightSource {
  const tensors = new Map<string, { shape: number[]; data: Float32Array }>();
  for (const [file, bytes] of files) {
    if (!file.endsWith('.safetensors')) continue;
    const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const len = Number(dv.getBigUint64(0, true));
    const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + len))) as Record<string, { shape: number[]; data_offsets: [number, number] }>;
    for (const [name, t] of Object.entries(header)) {
      if (name !== '__metadata__') tensors.set(name, { shape: t.shape, data: decodeTensor(bytes.subarray(8 + len + t.data_offsets[0], 8 + len + t.data_offsets[1]), 'bf16') });
    }
  }
  return (name) => tensors.get(name)!;
}

interface Row {
  preset: string;
  graph: string;
  tokens: number;
  maxRelErr: number;
  meanRelErr: number;
  top1: number;
}

/** The shipped fortunes-tiny (learned weights): its config, weights and a real chat prompt's ids. */
function fortunes(): { cfg: ModelConfig; src: WeightSource; prompt: number[] } {
  const dir = SHIPPED_MODELS['fortunes-tiny'].dir;
  const read = (f: string) => readFileSync(join(dir, f));
  const cfg = parseModelConfig(JSON.parse(read('config.json').toString('utf8')));
  const tok = ModelTokenizer.fromJson(JSON.parse(read('tokenizer.json').toString('utf8')), JSON.parse(read('tokenizer_config.json').toString('utf8')));
  return { cfg, src: weightsOf(new Map([['model.safetensors', new Uint8Array(read('model.safetensors'))]])), prompt: tok.encodeChat([{ role: 'user', content: 'Tell me a fortune about science.' }]) };
}

const rows: Row[] = [];
// Random-weight fixtures have near-flat logits (a floor for top-1 agreement); fortunes-tiny has learned ones.
for (const preset of ['tiny', 'small', 'fortunes-tiny'] as const) {
  const { cfg, src, prompt } = preset === 'fortunes-tiny' ? fortunes() : { cfg: fixtureConfig(preset), src: weights(preset), prompt: [] as number[] };
  // The reference's own greedy continuation of a fixed prompt, computed once.
  const ref = new ReferenceModel(cfg, src);
  if (prompt.length === 0) prompt.push(1, 17, 300 % cfg.vocabSize, 45, 201, 12);
  const refCache = newRefCache(cfg);
  const refLogits: Float64Array[] = [];
  let ids = prompt;
  let pos = 0;
  for (let i = 0; i < TOKENS; i++) {
    const l = ref.forward(ids, pos, refCache).slice((ids.length - 1) * cfg.vocabSize);
    refLogits.push(l);
    pos += ids.length;
    let best = 0;
    for (let j = 1; j < l.length; j++) if (l[j]! > l[best]!) best = j;
    ids = [best];
  }
  const feeds: number[][] = [prompt];
  for (let i = 0; i + 1 < TOKENS; i++) {
    const l = refLogits[i]!;
    let best = 0;
    for (let j = 1; j < l.length; j++) if (l[j]! > l[best]!) best = j;
    feeds.push([best]);
  }
  const variants: { graph: string; projections: 'f32' | 'q4'; scheme?: Q4Scheme }[] = [
    { graph: 'fused f32', projections: 'f32' },
    { graph: 'fused 4-bit symmetric (GPU path)', projections: 'q4', scheme: 'symmetric' },
    { graph: 'fused 4-bit asymmetric', projections: 'q4', scheme: 'asymmetric' },
  ];
  for (const v of variants) {
    const q4Cache = v.scheme
      ? { get: async (name: string) => { const w = src(name); return quantizeQ4(w.data, w.shape[0]!, w.shape[1]!, v.scheme); }, put: async () => undefined }
      : undefined;
    const ex = await FusedShardExecutor.create({ config: cfg, backend, weights: () => src, startLayer: 0, endLayer: cfg.numLayers, projections: v.projections, maxContext: TOKENS + prompt.length + 16, returnLogits: true, ...(q4Cache ? { q4Cache } : {}) });
    let maxRel = 0;
    let sumRel = 0;
    let top1 = 0;
    let position = 0;
    for (let i = 0; i < TOKENS; i++) {
      const r = await ex.forward({ session: 'f', position, tokenIds: feeds[i]!, sampling: { temperature: 0 } });
      if (r.kind !== 'token') throw new Error('expected a token');
      const want = refLogits[i]!;
      let scale = 0;
      let err = 0;
      let best = 0;
      for (let j = 0; j < want.length; j++) {
        scale = Math.max(scale, Math.abs(want[j]!));
        err = Math.max(err, Math.abs(r.logits[j]! - want[j]!));
        if (want[j]! > want[best]!) best = j;
      }
      const rel = err / Math.max(1, scale);
      maxRel = Math.max(maxRel, rel);
      sumRel += rel;
      if (r.tokenId === best) top1++;
      position += feeds[i]!.length;
    }
    await ex.release();
    rows.push({ preset, graph: v.graph, tokens: TOKENS, maxRelErr: maxRel, meanRelErr: sumRel / TOKENS, top1 });
  }
}

console.log('| model | graph | tokens | max |logit err| / max |logit| | mean | top-1 agreement |');
console.log('|---|---|---|---|---|---|');
for (const r of rows) console.log(`| ${r.preset} | ${r.graph} | ${r.tokens} | ${r.maxRelErr.toExponential(2)} | ${r.meanRelErr.toExponential(2)} | ${r.top1}/${r.tokens} |`);
const out = fileURLToPath(new URL('results/fidelity.json', import.meta.url));
mkdirSync(fileURLToPath(new URL('results/', import.meta.url)), { recursive: true });
writeFileSync(out, JSON.stringify({ date: new Date().toISOString(), rows }, null, 2));
console.log(`wrote ${out}`);
