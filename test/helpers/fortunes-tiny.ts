/**
 * The shipped `fortunes-tiny` checkpoint (models/fortunes-tiny) for tests:
 * its config, tokenizer and the float64 reference's greedy answer to a chat,
 * read from the files the demo serves.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { SHIPPED_MODELS } from '../../src/cli/demo-model.ts';
import { parseModelConfig, type ModelConfig } from '../../src/model/config.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { weightsFromFiles } from './weights.ts';

export const FORTUNES_DIR = SHIPPED_MODELS['fortunes-tiny'].dir;

export interface Fortunes {
  cfg: ModelConfig;
  tok: ModelTokenizer;
  /** Greedy ids of the float64 reference for a one-message chat, cut before eos, and their streamed text. */
  greedy(prompt: string, maxTokens: number): { ids: number[]; text: string };
}

let cached: Fortunes | undefined;

export function fortunesTiny(): Fortunes {
  if (cached) return cached;
  const read = (f: string) => readFileSync(join(FORTUNES_DIR, f));
  const cfg = parseModelConfig(JSON.parse(read('config.json').toString('utf8')));
  const tok = ModelTokenizer.fromJson(JSON.parse(read('tokenizer.json').toString('utf8')), JSON.parse(read('tokenizer_config.json').toString('utf8')), { extraEosTokenIds: cfg.eosTokenIds });
  const ref = new ReferenceModel(cfg, weightsFromFiles(new Map([['model.safetensors', new Uint8Array(read('model.safetensors'))]])));
  cached = {
    cfg,
    tok,
    greedy(prompt, maxTokens) {
      const all = ref.greedy(tok.encodeChat([{ role: 'user', content: prompt }]), maxTokens);
      const eos = all.findIndex((t) => tok.isEos(t));
      const ids = eos >= 0 ? all.slice(0, eos) : all;
      const dec = tok.streamDecoder({ skipSpecialTokens: true });
      return { ids, text: ids.map((t) => dec.push(t)).join('') };
    },
  };
  return cached;
}
