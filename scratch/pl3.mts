import { fixture, nodeBackend, prompts } from '../test/helpers/shard.ts';
import { ShardExecutor } from '../src/shard/executor.ts';
import { PromptLookupDrafter } from '../src/node/head/speculation/prompt-lookup.ts';
const f = fixture(process.argv[2] as 'small');
const ex = await ShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, maxContext: 1024 });
async function greedy(ids: number[], n: number): Promise<number[]> {
  const out: number[] = []; let r = await ex.forward({ session: 's', position: 0, tokenIds: ids, sampling: {} }); let pos = ids.length;
  for (let i = 0; i < n; i++) { if (r.kind !== 'token') throw 0; out.push(r.tokenId); if (i === n - 1) break; r = await ex.forward({ session: 's', position: pos++, tokenIds: [r.tokenId], sampling: {} }); }
  ex.dropSession('s'); return out;
}
function simulate(prompt: number[], gen: number[], k: number) {
  const d = new PromptLookupDrafter(); const acc = [...prompt]; let trips = 0, i = 0, drafted = 0, accepted = 0;
  while (i < gen.length) { const p = d.propose(acc, k).ids; let a = 0; while (a < p.length && i + a < gen.length && p[a] === gen[i + a]) a++; const e = Math.min(a + 1, gen.length - i); acc.push(...gen.slice(i, i + e)); i += e; trips++; drafted += p.length; accepted += a; }
  return `${(gen.length / trips).toFixed(2)}/trip, accepted ${accepted}/${drafted}`;
}
for (const p of prompts(f.cfg.vocabSize, 4, 3).map((x) => [...x, ...x, ...x].slice(0, 20))) {
  const c = await greedy(p, 48);
  const p2 = [...p, ...c, ...p];
  const c2 = await greedy(p2, 48);
  let same = 0; while (same < 48 && c[same] === c2[same]) same++;
  console.log('plain', simulate(p, c, 4), '| echo', simulate(p2, c2, 4), 'same prefix', same);
}
