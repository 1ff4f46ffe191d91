import { fixture, nodeBackend, prompts } from '../test/helpers/shard.ts';
import { ShardExecutor } from '../src/shard/executor.ts';
import { parseModelConfig } from '../src/model/config.ts';

const preset = (process.argv[2] ?? 'small') as 'small';
const f = fixture(preset);
const full = await ShardExecutor.create({ config: f.cfg, backend: nodeBackend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, maxContext: 256 });
const raw = JSON.parse(new TextDecoder().decode(f.files.get('config.json')!));
for (const n of [1, 2, 3, 4, 6, 8]) {
  if (n >= f.cfg.numLayers) continue;
  const cfg = parseModelConfig({ ...raw, num_hidden_layers: n });
  const d = await ShardExecutor.create({ config: cfg, backend: nodeBackend, weights: () => f.weights, startLayer: 0, endLayer: n, maxContext: 256 });
  let agree = 0, total = 0;
  for (const [pi, p] of prompts(f.cfg.vocabSize, 4).entries()) {
    const ctx = [...p];
    for (let t = 0; t < 30; t++) {
      const a = await full.forward({ tokenIds: ctx, sampling: {} });
      const b = await d.forward({ tokenIds: ctx, sampling: {} });
      if (a.kind !== 'token' || b.kind !== 'token') throw new Error();
      total++; if (a.tokenId === b.tokenId) agree++;
      ctx.push(a.tokenId);
    }
  }
  console.log(preset, 'layers', n, 'greedy agreement', (agree / total).toFixed(3));
}
