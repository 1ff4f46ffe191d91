import { readFileSync } from 'node:fs';
import { parseModelConfig } from '../src/model/config.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { ShardExecutor } from '../src/shard/executor.ts';
import { nodeBackend } from '../test/helpers/shard.ts';
import { weightsFromFiles } from '../test/helpers/weights.ts';
import { PromptLookupDrafter } from '../src/node/head/speculation/prompt-lookup.ts';

const dir = 'models/fortunes-tiny/';
const read = (f: string) => readFileSync(dir + f);
const cfg = parseModelConfig(JSON.parse(read('config.json').toString()));
const tok = ModelTokenizer.fromJson(JSON.parse(read('tokenizer.json').toString()), JSON.parse(read('tokenizer_config.json').toString()), { extraEosTokenIds: cfg.eosTokenIds });
const w = weightsFromFiles(new Map([['model.safetensors', new Uint8Array(read('model.safetensors'))]]));
const ex = await ShardExecutor.create({ config: cfg, backend: nodeBackend, weights: () => w, startLayer: 0, endLayer: cfg.numLayers, maxContext: 1024 });
async function greedy(ids: number[], n: number): Promise<number[]> {
  const out: number[] = [];
  const ctx = [...ids];
  for (let i = 0; i < n; i++) {
    const r = await ex.forward({ tokenIds: ctx, sampling: {} });
    if (r.kind !== 'token') throw new Error();
    if (tok.isEos(r.tokenId)) break;
    out.push(r.tokenId); ctx.push(r.tokenId);
  }
  return out;
}
function simulate(prompt: number[], gen: number[], k: number) {
  const d = new PromptLookupDrafter();
  const acc = [...prompt];
  let trips = 0, drafted = 0, accepted = 0, i = 0;
  while (i < gen.length) {
    const p = d.propose(acc, k).ids;
    let a = 0;
    while (a < p.length && i + a < gen.length && p[a] === gen[i + a]) a++;
    const emit = Math.min(a + 1, gen.length - i);
    acc.push(...gen.slice(i, i + emit)); i += emit; trips++; drafted += p.length; accepted += a;
  }
  return { trips, tokens: gen.length, drafted, accepted, perTrip: (gen.length / trips).toFixed(2) };
}
const prompts: Array<[string, number[]]> = [
  ['chat fortune', tok.encodeChat([{ role: 'user', content: 'Tell me a fortune about computers' }])],
  ['chat quote', tok.encodeChat([{ role: 'user', content: 'Repeat after me: The Universe is populated by stable things. -- Richard Dawkins' }])],
  ['raw repeat', tok.encode('Q: What is the meaning of life?\nA: To be or not to be, that is the question.\nQ: What is the meaning of life?\nA:')],
];
for (const [name, p] of prompts) {
  const gen = await greedy(p, 96);
  console.log(name, JSON.stringify(tok.decode(gen)).slice(0, 200));
  for (const k of [2, 4, 8]) console.log('  k', k, simulate(p, gen, k));
}
