/**
 * A node that lies, as a real process (docs/verification.md): the Node.js
 * host with a fault from faults.ts wrapped around its span. Test code only:
 * nothing the CLI loads reaches this file, and no option or variable of
 * `meshnet node` can make a node lie (test/cli/fault-hooks.test.ts).
 *
 *   tsx test/helpers/lying-node.ts '<json>'
 *
 * The JSON: { mode, relay?, tracker, model, numLayers, budgetMb?, layers?,
 * modelUrl?, wireDtype?, honestSessions?, hopMode?, maxContext? }. Events on stdout as `meshnet node`
 * writes them (`listening`, `serving`, …), plus `{event: "lying", mode}`.
 *
 * Without the argument it takes commands on stdin, one JSON a line, and
 * hosts one lying node after another: `{"start": <json>}` closes the node
 * it hosts (if any) and starts a new one (a new identity: a new node to the
 * tracker), `{"close": true}` closes it (`{event: "closed"}`). Every event
 * then carries `run`, the number of the start it belongs to (1, 2, …).
 * Starting a process per node costs seconds of module loading; a test that
 * goes through many nodes pays it once.
 */
import { createInterface } from 'node:readline';
import { startNodeHost, type NodeHost } from '../../src/host/node/index.ts';
import { NODE_HOST_DEFAULTS } from '../../src/host/node/options.ts';
import type { WeightLoader } from '../../src/shard/contract.ts';
import { lyingForward, lyingWeights, type LyingMode } from './faults.ts';

interface LyingNodeConfig {
  mode: LyingMode;
  relay?: string;
  tracker: string;
  model: string;
  budgetMb?: number;
  layers?: [number, number];
  modelUrl?: string;
  honestSessions?: number;
  hopMode?: 'chain' | 'star';
  maxContext?: number;
  numLayers: number;
  wireDtype?: 'bf16' | 'f16' | 'f32';
}

const emitLine = (event: Record<string, unknown>) => process.stdout.write(`${JSON.stringify(event)}\n`);

async function startLiar(cfg: LyingNodeConfig, emit: (event: Record<string, unknown>) => void): Promise<NodeHost> {
  const fault = { mode: cfg.mode, numLayers: cfg.numLayers, ...(cfg.honestSessions !== undefined ? { honestSessions: cfg.honestSessions } : {}), onFirstLie: () => emit({ event: 'first-lie', mode: cfg.mode, at: Date.now() }) };

  /** Layer names a wrong-layers node asks its loader for instead: the next layer's. */
  const shift = (name: string) => name.replace(/^model\.layers\.(\d+)\./, (_, l: string) => `model.layers.${Math.min(cfg.numLayers - 1, Number(l) + 1)}.`);

  const host = await startNodeHost({
    ...(cfg.relay ? { relayUrl: cfg.relay } : {}),
    trackerUrl: cfg.tracker,
    port: 0,
    host: '127.0.0.1',
    budgetMb: cfg.budgetMb ?? NODE_HOST_DEFAULTS.budgetMb,
    ...(cfg.layers ? { layers: cfg.layers, modelUrl: cfg.modelUrl! } : {}),
    ...(cfg.wireDtype ? { wireDtype: cfg.wireDtype } : {}),
    model: cfg.model,
    injectDelayMs: 0,
    maxBodyBytes: NODE_HOST_DEFAULTS.maxBodyBytes,
    maxContext: cfg.maxContext ?? NODE_HOST_DEFAULTS.maxContext,
    hopOrder: 'relay',
    hopMode: cfg.hopMode ?? 'chain',
    spanHooks: {
      weights: (loader: WeightLoader): WeightLoader => {
        if (cfg.mode === 'wrong-layers') {
          return async (names) => {
            const src = await loader(names.map(shift));
            return (name) => src(shift(name));
          };
        }
        if (cfg.mode === 'tampered' || cfg.mode === 'q4-as-f32') return async (names) => lyingWeights(await loader(names), fault);
        return loader;
      },
      executor: (ex) => {
        const forward = lyingForward(ex, fault);
        // The same executor with its forward lying; everything else (KV, stats, release) is the real one's.
        return new Proxy(ex, { get: (t, k, r) => (k === 'forward' ? forward : Reflect.get(t, k, r) as unknown) });
      },
    },
    emit,
    log: (level, message) => process.stderr.write(`${JSON.stringify({ level, time: Date.now(), msg: message })}\n`),
  });
  emit({ event: 'lying', mode: cfg.mode, peer_id: host.peerId });
  return host;
}

let host: NodeHost | undefined;
const arg = process.argv[2];
if (arg !== undefined) host = await startLiar(JSON.parse(arg) as LyingNodeConfig, emitLine);
else {
  let run = 0;
  // One command at a time, in order: a start waits for the close before it.
  let queue = Promise.resolve();
  const close = async (tag: Record<string, unknown>) => {
    const h = host;
    host = undefined;
    if (h) await h.close();
    emitLine({ event: 'closed', ...tag });
  };
  createInterface({ input: process.stdin }).on('line', (line) => {
    const cmd = JSON.parse(line) as { start?: LyingNodeConfig; close?: boolean };
    queue = queue.then(async () => {
      if (cmd.close) return close({ run });
      if (!cmd.start) return;
      if (host) await close({ run });
      const tag = { run: ++run };
      host = await startLiar(cmd.start, (event) => emitLine({ ...event, ...tag }));
    });
    queue = queue.catch((e: unknown) => {
      process.stderr.write(`${(e as Error).stack ?? String(e)}\n`);
      process.exit(1);
    });
  });
}
const stop = () => void (host ? host.close() : Promise.resolve()).then(() => process.exit(0));
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
