import { InvalidArgumentError, type Command } from 'commander';
import { startBrowserMesh, terminalView } from '../browser-mesh.ts';
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

export function register(program: Command): void {
  program
    .command('mesh')
    .description('Run N browser nodes as headless Chromium pages (one browser context each) that join the tracker; shows each node\'s state, layers, download and tokens served')
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
      if (!['wasm', 'webgpu', 'auto'].includes(o.backend)) throw new InvalidArgumentError(`--backend must be wasm, webgpu or auto, got "${o.backend}"`);
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
