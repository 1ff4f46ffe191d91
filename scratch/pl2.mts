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
  const out: number[] = []; const ctx = [...ids];
  for (let i = 0; i < n; i++) { const r = await ex.forward({ tokenIds: ctx, sampling: {} }); if (r.kind !== 'token') throw 0; if (tok.isEos(r.tokenId)) break; out.push(r.tokenId); ctx.push(r.tokenId); }
  return out;
}
function simulate(prompt: number[], gen: number[], k: number) {
  const d = new PromptLookupDrafter(); const acc = [...prompt]; let trips = 0, i = 0, drafted = 0, accepted = 0;
  while (i < gen.length) { const p = d.propose(acc, k).ids; let a = 0; while (a < p.length && i + a < gen.length && p[a] === gen[i + a]) a++; const e = Math.min(a + 1, gen.length - i); acc.push(...gen.slice(i, i + e)); i += e; trips++; drafted += p.length; accepted += a; }
  return `${gen.length} tokens in ${trips} trips (${(gen.length / trips).toFixed(2)}/trip), accepted ${accepted}/${drafted}`;
}
for (const topic of ['computers', 'love', 'life', 'money', 'work', 'the future', 'cats', 'wisdom']) {
  const g = await greedy(tok.encodeChat([{ role: 'user', content: `Tell me a fortune about ${topic}` }]), 120);
  const F = tok.decode(g, { skipSpecialTokens: true });
  const words = F.split(' ');
  const prompt = tok.encodeChat([{ role: 'user', content: `Repeat this: ${F}` }]);
  const raw = tok.encode(`${F}\n\n${words.slice(0, 3).join(' ')}`);
  const g2 = await greedy(prompt, 120); const g3 = await greedy(raw, 120);
  console.log(JSON.stringify(F).slice(0, 100), g.length);
  console.log('   chat-repeat:', JSON.stringify(tok.decode(g2)).slice(0, 80), simulate(prompt, g2, 4));
  console.log('   raw-continue:', JSON.stringify(tok.decode(g3)).slice(0, 80), simulate(raw, g3, 4));
}
