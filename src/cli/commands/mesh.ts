/** `meshnet mesh`: Playwright and the mesh code load when the command runs. */
import { existsSync } from 'node:fs';
import { InvalidArgumentError, type Command } from 'commander';
import { CliError } from '../failure.ts';
import { onShutdown } from '../util.ts';

function count(value: string): number {
  const n = Number(value);
  if (!Number.isInteger(n) || n < 1 || n > 64) throw new InvalidArgumentError(`expected 1..64 nodes, got "${value}"`);
  return n;
}

function mib(value: string): number {
  const n = Number(value);
  if (!Number.isFinite(n) || n < 0.25) throw new InvalidArgumentError(`expected a budget in MiB (≥ 0.25), got "${value}"`);
  return n;
}

export function configure(cmd: Command): void {
  cmd
    .requiredOption('--nodes <n>', 'browser nodes to open', count)
    .requiredOption('--tracker <url>', 'tracker base URL (http[s]://)')
    .requiredOption('--relay <url>', 'relay URL the pages connect to (ws[s]://)')
    .option('--app <url>', 'the served donor page (meshnet serve-app); default: serve dist/ here, building it when missing')
    .option('--model <name>', 'model id at the tracker (default: its first model)')
    .option('--backend <kind>', 'wasm, webgpu or auto', 'wasm')
    .option('--budget <MiB>', 'memory each page gives the mesh (weights + KV), MiB', mib)
    .option('--threads <n>', 'WASM threads per page (default: cores - 1)', (v) => Number(v))
    .option('--chromium <path>', 'Chromium executable', process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium')
    .action(async (o: { nodes: number; tracker: string; relay: string; app?: string; model?: string; backend: string; budget?: number; threads?: number; chromium: string }) => {
      if (!['wasm', 'webgpu', 'auto'].includes(o.backend)) cmd.error(`--backend must be wasm, webgpu or auto, got "${o.backend}"`);
      const { reachRelay, reachTracker } = await import('../preflight.ts');
      const tracker = await reachTracker(o.tracker);
      if (o.model && !tracker.models.includes(o.model)) throw new CliError(`the tracker at ${o.tracker} serves no model "${o.model}" (it serves: ${tracker.models.join(', ')}); fix --model`);
      await reachRelay(o.relay);
      if (!existsSync(o.chromium)) throw new CliError(`no Chromium at ${o.chromium}: install it (apt-get install chromium, or npm run setup), or give --chromium PATH`);
      const { startBrowserMesh, terminalView } = await import('../browser-mesh.ts');
      const view = terminalView(process.stdout);
      const mesh = await startBrowserMesh({
        nodes: o.nodes,
        trackerUrl: o.tracker,
        relayUrl: o.relay,
        ...(o.app ? { appUrl: o.app } : {}),
        ...(o.model ? { model: o.model } : {}),
        backend: o.backend as 'wasm' | 'webgpu' | 'auto',
        ...(o.budget !== undefined ? { budgetMb: o.budget } : {}),
        ...(o.threads !== undefined ? { threads: o.threads } : {}),
        chromium: o.chromium,
        onUpdate: (rows) => view.update(rows),
        log: (m) => {
          view.clear();
          process.stderr.write(`${m}\n`);
        },
      });
      process.stderr.write(`mesh: ${o.nodes} browser node(s) from ${mesh.appUrl}; Ctrl-C stops them\n`);
      onShutdown(() => mesh.close());
    });
}
