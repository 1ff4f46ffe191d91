/** `meshnet demo`: options from src/cli/demo-options.ts; the demo (Playwright, relay, tracker) loads when it runs. */
import { InvalidArgumentError, type Command } from 'commander';
import { DEMO_DEFAULTS, DEMO_MODELS, isDemoModel } from '../demo-options.ts';
import { onShutdown } from '../util.ts';

function positiveInt(value: string): number {
  const n = Number(value);
  if (!Number.isInteger(n) || n < 1) throw new InvalidArgumentError(`expected a positive integer, got "${value}"`);
  return n;
}

function mib(value: string): number {
  const n = Number(value);
  if (!Number.isFinite(n) || n <= 0) throw new InvalidArgumentError(`expected a budget in MiB, got "${value}"`);
  return n;
}

export function configure(cmd: Command): void {
  cmd
    .option('--nodes <n>', 'browser nodes', positiveInt, DEMO_DEFAULTS.nodes)
    .option('--budget <MiB>', 'memory each browser node gives (default: the least that lets --nodes pages hold the whole model between them, so a chat crosses every page)', mib)
    .option('--preset <name>', `the model: fortunes-tiny (shipped in models/, learned weights: English quotes), or a generated fixture with random weights: ${DEMO_MODELS.slice(1).join(', ')}`, DEMO_DEFAULTS.preset)
    .option('--prompt <text>', 'the chat message', DEMO_DEFAULTS.prompt)
    .option('--max-tokens <n>', 'tokens to generate', positiveInt, DEMO_DEFAULTS.maxTokens)
    .option('--exit', 'stop after the chat instead of waiting for Ctrl-C', false)
    .option('--chromium <path>', 'Chromium executable (default: /usr/bin/chromium, installed when missing)')
    .action(async (o: { nodes: number; budget?: number; preset: string; prompt: string; maxTokens: number; exit: boolean; chromium?: string }) => {
      if (!isDemoModel(o.preset)) cmd.error(`--preset must be one of ${DEMO_MODELS.join(', ')}, got "${o.preset}"`);
      const { runDemo } = await import('../demo.ts');
      const demo = await runDemo({ nodes: o.nodes, ...(o.budget !== undefined ? { budgetMb: o.budget } : {}), preset: o.preset, prompt: o.prompt, maxTokens: o.maxTokens, exitAfterChat: o.exit, out: process.stdout, ...(o.chromium ? { chromium: o.chromium } : {}) });
      if (o.exit) {
        await demo.close();
        process.exit(0);
      }
      onShutdown(() => demo.close());
    });
}
