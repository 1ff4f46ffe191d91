/**
 * `meshnet` — one CLI for every role. Each subcommand lives in
 * `src/cli/commands/<name>.ts`; only the one that runs is loaded (see
 * commands/index.ts), and help text comes from each role's options module so
 * defaults are written once. Failures print one line (src/cli/failure.ts).
 */
import { Command } from 'commander';
import { commands } from './commands/index.ts';
import { fail } from './failure.ts';

const args = process.argv.slice(2);
const verbose = args.includes('--verbose');
// The command is the first word that is not an option (`meshnet --verbose relay`, `meshnet help relay`).
const words = args.filter((a) => !a.startsWith('-'));
const wanted = words[0] === 'help' ? words[1] : words[0];
const running = commands.find((c) => c.name === wanted);
const prefix = running ? `meshnet ${running.name}` : 'meshnet';

process.on('uncaughtException', (e) => fail(running?.name, e, verbose));
process.on('unhandledRejection', (e) => fail(running?.name, e, verbose));

const program = new Command('meshnet')
  .description('Pipeline-parallel LLM inference over volunteer browser and Node.js nodes')
  .version('0.1.0')
  .option('--verbose', 'on failure, print the stack trace too')
  // Commander's own errors (a missing or malformed option) get the same one-line shape.
  .configureOutput({ outputError: (str, write) => write(`${prefix}: ${str.trim().replace(/^error: /, '')} (see ${prefix} --help)\n`) });

for (const c of commands) {
  const cmd = program.command(c.name).description(c.description);
  if (c === running) {
    try {
      (await c.load()).configure(cmd);
    } catch (e) {
      fail(c.name, e, verbose);
    }
  }
}

try {
  await program.parseAsync(process.argv);
} catch (e) {
  fail(running?.name, e, verbose);
}
