/**
 * `meshnet` — one CLI for every role. Each subcommand lives in
 * `src/cli/commands/<name>.ts` and exports `register(program)`; help text
 * comes from each role's options module so defaults are written once.
 */
import { Command } from 'commander';
import { commands } from './commands/index.ts';

const program = new Command('meshnet')
  .description('Pipeline-parallel LLM inference over volunteer browser and Node.js nodes')
  .version('0.1.0');

for (const register of commands) register(program);

await program.parseAsync(process.argv);
