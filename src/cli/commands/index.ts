import type { Command } from 'commander';

/** Every subcommand registers itself here; one line each. */
export const commands: Array<(program: Command) => void> = [];
