import type { Command } from 'commander';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { REPO_ROOT } from '../models.ts';
import { startStaticServer } from '../static-server.ts';
import { int, onShutdown } from '../util.ts';

export function register(program: Command): void {
  program
    .command('serve-app')
    .description('Serve the donor page (dist/, built with `vite build` when missing) with the COOP/COEP headers WASM threads need')
    .option('--port <n>', 'TCP port (0 picks a free one)', int, 8080)
    .option('--host <addr>', 'interface to bind', '127.0.0.1')
    .option('--dir <path>', 'the built app', join(REPO_ROOT, 'dist'))
    .option('--rebuild', 'run vite build first even when the directory exists', false)
    .action(async (o: { port: number; host: string; dir: string; rebuild: boolean }) => {
      if (o.rebuild || !existsSync(join(o.dir, 'index.html'))) {
        // vite is a dev dependency: imported only when a build is needed.
        const { build } = await import('vite');
        await build({ root: REPO_ROOT, logLevel: 'warn', build: { outDir: o.dir } });
      }
      const server = await startStaticServer({ root: o.dir, port: o.port, host: o.host });
      // One machine-readable line first: scripts and tests wait for it.
      process.stdout.write(`${JSON.stringify({ event: 'listening', role: 'app', url: server.url, port: server.port })}\n`);
      onShutdown(() => server.close());
    });
}
