/** `meshnet serve-app`: the donor page over HTTP with the isolation headers. */
import type { Command } from 'commander';
import { int, onShutdown } from '../util.ts';

export function configure(cmd: Command): void {
  cmd
    .option('--port <n>', 'TCP port (0 picks a free one)', int, 8080)
    .option('--host <addr>', 'interface to bind', '127.0.0.1')
    .option('--dir <path>', 'serve this built app instead (a folder with index.html; never built into)')
    .option('--rebuild', 'rebuild the project\'s dist/ first even when it exists', false)
    .action(async (o: { port: number; host: string; dir?: string; rebuild: boolean }) => {
      const { builtApp } = await import('../app-build.ts');
      const root = await builtApp({ ...(o.dir !== undefined ? { dir: o.dir } : {}), rebuild: o.rebuild, log: (m) => process.stderr.write(`${m}\n`) });
      const { startStaticServer } = await import('../static-server.ts');
      const server = await startStaticServer({ root, port: o.port, host: o.host });
      // One machine-readable line first: scripts and tests wait for it.
      process.stdout.write(`${JSON.stringify({ event: 'listening', role: 'app', url: server.url, port: server.port, dir: root })}\n`);
      onShutdown(() => server.close());
    });
}
