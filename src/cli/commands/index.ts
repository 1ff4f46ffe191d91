import type { Command } from 'commander';

/**
 * Every subcommand: its name, its one-line summary (the root --help) and its
 * module, loaded only when that command runs or its --help is asked for. A
 * module's `configure` adds its options (defaults from the role's options
 * module) and an action that imports the role's code itself, so an idle
 * relay never loads onnxruntime, Playwright or the tracker.
 */
export interface CommandEntry {
  name: string;
  description: string;
  load(): Promise<{ configure(cmd: Command): void }>;
}

export const commands: CommandEntry[] = [
  { name: 'relay', description: 'Run the relay: the WebSocket hub NAT\'d nodes connect out to (/ws), the ADR-0014 /rpc path and the binary fast path', load: () => import('./relay.ts') },
  { name: 'tracker', description: 'Run the tracker: node registry and heartbeats, layer assignment from memory budgets, availability map, throughput routing, and the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models)', load: () => import('./tracker.ts') },
  { name: 'node', description: 'Run a Node.js node: serves layers over direct HTTP and the relay, registers with the tracker, heads pipelines when it holds layer 0', load: () => import('./node.ts') },
  { name: 'make-model', description: 'Generate a deterministic fixture checkpoint (config.json, bf16 safetensors, tokenizer) in Hugging Face layout', load: () => import('./make-model.ts') },
  { name: 'serve-app', description: 'Serve the donor page with the COOP/COEP headers WASM threads need (built into dist/ with vite when missing)', load: () => import('./serve-app.ts') },
  { name: 'mesh', description: 'Run N browser nodes as headless Chromium pages (one browser context each) that join the tracker; shows each node\'s state, layers, download and tokens served', load: () => import('./mesh.ts') },
  { name: 'demo', description: 'The whole mesh on this machine (npm start): model, relay, tracker, headless browser nodes, one streamed chat; then the donor page and dashboard stay up until Ctrl-C', load: () => import('./demo.ts') },
];
