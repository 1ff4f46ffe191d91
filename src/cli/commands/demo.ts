import { InvalidArgumentError, type Command } from 'commander';
import { DEMO_DEFAULTS, runDemo } from '../demo.ts';
import { onShutdown } from '../util.ts';

export function register(program: Command): void {
  program
    .command('demo')
    .description('The whole mesh on this machine (npm start): model, relay, tracker, headless browser nodes, one streamed chat; then the donor page and dashboard stay up until Ctrl-C')
    .option('--nodes <n>', 'browser nodes', (v) => Number(v), DEMO_DEFAULTS.nodes)
    .option('--budget <MiB>', 'memory each browser node gives', (v) => Number(v), DEMO_DEFAULTS.budgetMb)
    .option('--preset <name>', 'generated model: small or tiny', DEMO_DEFAULTS.preset)
    .option('--prompt <text>', 'the chat message', DEMO_DEFAULTS.prompt)
    .option('--max-tokens <n>', 'tokens to generate', (v) => Number(v), DEMO_DEFAULTS.maxTokens)
    .option('--exit', 'stop after the chat instead of waiting for Ctrl-C', false)
    .option('--chromium <path>', 'Chromium executable (default: /usr/bin/chromium, installed when missing)')
    .action(async (o: { nodes: number; budget: number; preset: string; prompt: string; maxTokens: number; exit: boolean; chromium?: string }) => {
      if (o.preset !== 'small' && o.preset !== 'tiny') throw new InvalidArgumentError(`--preset must be small or tiny, got "${o.preset}"`);
      if (!Number.isInteger(o.nodes) || o.nodes < 1) throw new InvalidArgumentError('--nodes must be a positive integer');
      const demo = await runDemo({ nodes: o.nodes, budgetMb: o.budget, preset: o.preset, prompt: o.prompt, maxTokens: o.maxTokens, exitAfterChat: o.exit, out: process.stdout, ...(o.chromium ? { chromium: o.chromium } : {}) });
      if (o.exit) {
        await demo.close();
        process.exit(0);
      }
      onShutdown(() => demo.close());
    });
}
