/**
 * Browser mesh benchmark on the `small` fixture (12 layers, hidden 512),
 * side by side in one run:
 *
 *   - decode tokens/s of a streamed chat through the tracker's OpenAI API
 *     when the model is served by 1, 2 and 3 headless browser nodes (WASM,
 *     one thread each; the tracker splits the layers from the pages' memory
 *     budgets: 180 MiB holds all 12, 90 MiB six, 60 MiB four), against the
 *     un-split model on onnxruntime-node in this process (same ShardExecutor
 *     code, no transport) — target: 3 browser nodes ≥ 0.8 × 1 browser node
 *     (pipeline overhead ≤ 20 %);
 *   - memory per page: renderer process RSS (the page, its node worker and
 *     ORT's WASM heap live there) and the page's JS heap (CDP
 *     Performance.getMetrics).
 *
 * `compute ms/token` sums what the nodes report to the tracker (ms per
 * layer × layers held); `ms/token` minus that is the pipeline's transport
 * cost (docs/benchmarks.md has the latest figures and where a hop's ~3 ms
 * go: mostly Chromium's own WebSocket crossings).
 *
 * Each configuration gets a fresh relay, tracker and browser; the browser
 * nodes run the real code path (relay fast path between pages, tracker
 * signed routes). Medians over several chats after one warm-up chat.
 * Table on stdout, JSON in bench/results/mesh-browser.json.
 *
 *   npx tsx bench/mesh-browser.ts [--quick]
 */
import { readFileSync } from 'node:fs';
import { loadavg } from 'node:os';
import { startBrowserMesh, serveBuiltApp, type BrowserMesh } from '../src/cli/browser-mesh.ts';
import { streamChat } from '../src/cli/demo.ts';
import { ensureModel } from '../src/cli/models.ts';
import { createNodeBackend } from '../src/host/node/onnx.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import { parseModelConfig } from '../src/model/config.ts';
import { openSafetensors } from '../src/model/safetensors.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { startRelay } from '../src/relay/server.ts';
import { ShardExecutor } from '../src/shard/executor.ts';
import { readerWeightLoader } from '../src/shard/weights.ts';
import { startTracker } from '../src/tracker/server.ts';
import { printTable, writeResult } from './lib/stats.ts';

const quick = process.argv.includes('--quick');
const CHATS = quick ? 2 : 4;
const MAX_TOKENS = quick ? 32 : 64;
const PROMPT = 'Tell me a short story about a fox who shares her GPU.';
const CONFIGS = [
  { nodes: 1, budgetMb: 180 },
  { nodes: 2, budgetMb: 90 },
  { nodes: 3, budgetMb: 60 },
];
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;

interface Row {
  setup: string;
  spans: string;
  decodeTokS: number;
  firstTokenMs: number;
  /** Sum over nodes of (reported ms per layer × layers held): the compute in one token, without transport. */
  computeMsPerToken: number | null;
  rssMbPerPage: number | null;
  jsHeapMbPerPage: number | null;
}

async function pageMemory(mesh: BrowserMesh, nodes: number): Promise<{ rss: number | null; heap: number | null }> {
  const browser = mesh.browser()!;
  const cdp = await browser.newBrowserCDPSession();
  let rss: number | null;
  try {
    const info = (await cdp.send('SystemInfo.getProcessInfo')) as { processInfo: Array<{ type: string; id: number }> };
    const kb = info.processInfo
      .filter((p) => p.type === 'renderer')
      .map((p) => {
        try {
          return Number(/VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${p.id}/status`, 'utf8'))?.[1] ?? 0);
        } catch {
          return 0; // exited meanwhile
        }
      })
      .sort((a, b) => b - a)
      // One renderer per node (a browser context each); any extra (spare) renderer is the smallest.
      .slice(0, nodes);
    rss = kb.length ? kb.reduce((a, b) => a + b, 0) / kb.length / 1024 : null;
  } catch {
    rss = null; // SystemInfo unavailable in this Chromium build
  } finally {
    await cdp.detach().catch(() => undefined);
  }
  const heaps: number[] = [];
  for (let i = 0; i < nodes; i++) {
    const page = mesh.page(i);
    if (!page) continue;
    const s = await page.context().newCDPSession(page);
    await s.send('Performance.enable');
    const m = (await s.send('Performance.getMetrics')) as { metrics: Array<{ name: string; value: number }> };
    heaps.push((m.metrics.find((x) => x.name === 'JSHeapUsedSize')?.value ?? 0) / 2 ** 20);
    await s.detach();
  }
  return { rss, heap: heaps.length ? heaps.reduce((a, b) => a + b, 0) / heaps.length : null };
}

async function browserRun(modelUrl: string, appUrl: string, nodes: number, budgetMb: number): Promise<Row> {
  const relay = await startRelay({ port: 0, host: '127.0.0.1', logLevel: 'warn' });
  const tracker = await startTracker({ port: 0, host: '127.0.0.1', relayUrl: relay.url, models: [{ name: 'small', url: modelUrl }], heartbeatIntervalMs: 2000, logLevel: 'warn' });
  const mesh = await startBrowserMesh({ nodes, trackerUrl: tracker.url, relayUrl: relay.url, appUrl, model: 'small', backend: 'wasm', budgetMb, threads: 1 });
  try {
    await mesh.waitServing(180_000);
    for (;;) {
      const a = (await (await fetch(`${tracker.url}/api/availability?model=small`)).json()) as { models: Array<{ complete: boolean }> };
      if (a.models[0]?.complete) break;
      await new Promise((r) => setTimeout(r, 200));
    }
    const spans = mesh.rows().map((r) => (r.layers ? `${r.layers[0]}-${r.layers[1] - 1}` : '?')).join(' ');
    await streamChat(tracker.url, 'small', PROMPT, 8, () => {}); // warm-up: graphs, caches, routes
    const rates: number[] = [];
    const firsts: number[] = [];
    for (let i = 0; i < CHATS; i++) {
      const c = await streamChat(tracker.url, 'small', PROMPT, MAX_TOKENS, () => {});
      // Decode rate: tokens after the first over the time after the first (prefill and routing excluded).
      rates.push((c.tokens - 1) / ((c.ms - c.firstTokenMs) / 1000));
      firsts.push(c.firstTokenMs);
    }
    const mem = await pageMemory(mesh, nodes);
    // Two heartbeats later the tracker holds each node's step time from these chats.
    await new Promise((r) => setTimeout(r, 4_500));
    const d = (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { nodes: Array<{ layer_ms: number; serving: { start_layer: number; end_layer: number } | null }> };
    const computeMsPerToken = d.nodes.reduce((a, n) => a + (n.serving ? n.layer_ms * (n.serving.end_layer - n.serving.start_layer) : 0), 0);
    return { setup: `${nodes} browser node${nodes > 1 ? 's' : ''}`, spans, decodeTokS: median(rates), firstTokenMs: median(firsts), computeMsPerToken, rssMbPerPage: mem.rss, jsHeapMbPerPage: mem.heap };
  } finally {
    await mesh.close();
    await tracker.close();
    await relay.close();
  }
}

async function nodeRun(modelUrl: string): Promise<Row> {
  const cfg = parseModelConfig(await (await fetch(`${modelUrl}config.json`)).json());
  const reader = await openSafetensors(globalThis.fetch, modelUrl);
  const tok = await ModelTokenizer.load(globalThis.fetch, modelUrl, { extraEosTokenIds: cfg.eosTokenIds });
  const ex = await ShardExecutor.create({ config: cfg, backend: createNodeBackend({ intraOpNumThreads: 1 }), weights: readerWeightLoader(reader), startLayer: 0, endLayer: cfg.numLayers, maxContext: 512 });
  const prompt = tok.encodeChat([{ role: 'user', content: PROMPT }]);
  const rates: number[] = [];
  const firsts: number[] = [];
  try {
    for (let run = 0; run <= CHATS; run++) {
      const session = `bench-${run}`;
      const t0 = performance.now();
      let r = await ex.forward({ session, position: 0, tokenIds: prompt, sampling: { temperature: 0 } });
      const tFirst = performance.now();
      let position = prompt.length;
      for (let i = 1; i < MAX_TOKENS; i++) {
        if (r.kind !== 'token') throw new Error('the un-split executor did not sample');
        r = await ex.forward({ session, position, tokenIds: [r.tokenId], sampling: { temperature: 0 } });
        position++;
      }
      const tEnd = performance.now();
      ex.dropSession(session);
      if (run === 0) continue; // warm-up
      rates.push((MAX_TOKENS - 1) / ((tEnd - tFirst) / 1000));
      firsts.push(tFirst - t0);
    }
  } finally {
    await ex.release();
  }
  return { setup: 'onnxruntime-node, un-split', spans: `0-${cfg.numLayers - 1}`, decodeTokS: median(rates), firstTokenMs: median(firsts), computeMsPerToken: 1000 / median(rates), rssMbPerPage: null, jsHeapMbPerPage: null };
}

async function main(): Promise<void> {
  const dir = await ensureModel('small');
  const models = await startStaticServer({ root: dir, port: 0, host: '127.0.0.1' });
  const app = await serveBuiltApp();
  const modelUrl = `${models.url}/`;
  const rows: Row[] = [];
  try {
    console.log(`small, ${CHATS} chats × ${MAX_TOKENS} tokens per setup (after a warm-up), load average ${loadavg()[0]!.toFixed(2)}`);
    rows.push(await nodeRun(modelUrl));
    console.log(`  ${rows.at(-1)!.setup}: ${rows.at(-1)!.decodeTokS.toFixed(1)} tokens/s`);
    for (const c of CONFIGS) {
      rows.push(await browserRun(modelUrl, `${app.url}/`, c.nodes, c.budgetMb));
      console.log(`  ${rows.at(-1)!.setup}: ${rows.at(-1)!.decodeTokS.toFixed(1)} tokens/s`);
    }
  } finally {
    await app.close();
    await models.close();
  }
  const one = rows.find((r) => r.setup === '1 browser node')!;
  const three = rows.find((r) => r.setup === '3 browser nodes')!;
  const ratio = three.decodeTokS / one.decodeTokS;
  printTable(
    'decode through the tracker (OpenAI API, streamed), WASM 1 thread per page',
    ['setup', 'layers per node', 'decode tok/s', 'vs 1 browser', 'ms/token', 'compute ms/token', 'first token ms', 'renderer RSS MiB/page', 'JS heap MiB/page'],
    rows.map((r) => [r.setup, r.spans, r.decodeTokS, r.decodeTokS / one.decodeTokS, 1000 / r.decodeTokS, r.computeMsPerToken ?? '-', r.firstTokenMs, r.rssMbPerPage ?? '-', r.jsHeapMbPerPage ?? '-']),
  );
  console.log(`\n3 browser nodes / 1 browser node = ${ratio.toFixed(2)} (target ≥ 0.80): ${ratio >= 0.8 ? 'met' : 'NOT met'}`);
  writeResult('bench/results/mesh-browser.json', { preset: 'small', chats: CHATS, maxTokens: MAX_TOKENS, rows, threeOverOne: ratio, target: 0.8, loadavg: loadavg() });
}

await main();
process.exit(0);
