/**
 * How a command fails: one line on stderr that says what went wrong and what
 * to do, exit code 1. The stack trace only with `--verbose`.
 *
 * A `CliError` carries a message already written for the user; anything else
 * is described from what it is (a busy port, an unreachable URL…) and ends
 * with a pointer to `--verbose`.
 */
export class CliError extends Error {
  override readonly name = 'CliError';
}

interface SystemError extends Error {
  code?: string;
  port?: number;
  address?: string;
  syscall?: string;
  path?: string;
}

/** The user-facing line for `e`, without the command prefix. */
export function describeFailure(e: unknown): string {
  if (e instanceof CliError) return e.message;
  if (!(e instanceof Error)) return `${String(e)} (run with --verbose for details)`;
  const s = e as SystemError;
  const where = s.address !== undefined && s.port !== undefined ? `${s.address}:${s.port}` : s.port !== undefined ? `port ${s.port}` : undefined;
  switch (s.code) {
    case 'EADDRINUSE':
      return `${where ?? 'the port'} is already in use: stop what holds it, or pick another with --port (0 picks a free one)`;
    case 'EACCES':
      if (s.syscall === 'listen' || s.syscall === 'bind') return `no permission to listen on ${where ?? 'that port'}: use a port above 1023 (--port)`;
      return `permission denied${s.path ? ` on ${s.path}` : ''}: choose a path you can write (${e.message})`;
    case 'EADDRNOTAVAIL':
      return `${where ?? 'the address'} is not an address of this machine: fix --host`;
    case 'ENOENT':
      return `${s.path ?? 'a file'} does not exist: check the path you gave`;
  }
  // Some libraries (Playwright) put a whole log in the message: its first line is the summary.
  const summary = e.message.split('\n')[0]!.trim();
  const cause = (e as { cause?: unknown }).cause;
  const detail = cause instanceof Error && cause.message && !summary.includes(cause.message) ? ` (${cause.message.split('\n')[0]})` : '';
  return `${summary}${detail} (run with --verbose for details)`;
}

/** Write the failure (one line, or the stack with `verbose`) and exit 1. */
export function fail(command: string | undefined, e: unknown, verbose: boolean): never {
  const prefix = command ? `meshnet ${command}` : 'meshnet';
  const line = `${prefix}: ${describeFailure(e).replace(/\s*\n\s*/g, ' ')}\n`;
  process.stderr.write(verbose && e instanceof Error && e.stack ? `${line}${e.stack}\n` : line);
  process.exit(1);
}
