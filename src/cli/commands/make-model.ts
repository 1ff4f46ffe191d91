/** `meshnet make-model`: write a generated fixture checkpoint in Hugging Face layout. */
import type { Command } from 'commander';
import { FIXTURE_PRESETS, isFixturePreset } from '../../model/fixture.ts';

export function configure(cmd: Command): void {
  cmd
    .requiredOption('--preset <name>', `fixture preset: ${FIXTURE_PRESETS.join(', ')}`)
    .requiredOption('--out <dir>', 'directory to write the checkpoint into')
    .option('--seed <n>', 'weight seed (same seed, same bytes)', '0')
    .action(async (opts: { preset: string; out: string; seed: string }) => {
      if (!isFixturePreset(opts.preset)) cmd.error(`unknown preset "${opts.preset}" (have: ${FIXTURE_PRESETS.join(', ')})`);
      if (!/^\d+$/.test(opts.seed) || Number(opts.seed) > 0xffffffff) cmd.error(`--seed must be an integer 0..4294967295, got "${opts.seed}"`);
      const { writeModel } = await import('../models.ts');
      const t0 = performance.now();
      const r = await writeModel(opts.preset, opts.out, Number(opts.seed));
      if (r.skipped) console.log(`${r.dir} already holds ${opts.preset} (seed ${opts.seed}); nothing to do`);
      else console.log(`wrote ${opts.preset} (seed ${opts.seed}) to ${r.dir}: ${r.files.join(', ')} in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
    });
}
