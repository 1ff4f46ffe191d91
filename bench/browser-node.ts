/**
 * The browser node against onnxruntime-node, on the `small` fixture
 * (12 layers, hidden 512), every layer on one node:
 *   - ms per decode step (one token through all 12 layers and the LM head,
 *     session KV cache), measured inside the node (handler time, no
 *     network): Chromium WASM with 1 and 2 threads, per weight format
 *     (`?weights=f32` and `q4`: the fused graphs, f32 MatMul or 4-bit
 *     MatMulNBits), vs onnxruntime-node with the same graphs and thread
 *     count. Targets: browser <= 2.0x node; 4-bit >= 1.5x faster than f32.
 *   - the relay bridge's own cost per request (frame in -> handler -> frame
 *     out, in-memory socket), in Chromium and in Node.js. Target p50 <= 0.2 ms.
 * Medians. Table on stdout, JSON in bench/results/browser-node.json.
 *
 *   npx tsx bench/browser-node.ts [--quick]     (--quick: 1 thread only, fewer steps)
 */
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { chromium } from 'playwright-core';
import { build, preview } from 'vite';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import { createNodeBackend } from '../src/host/node/onnx.ts';
import { fixtureConfig, makeModel } from '../src/model/fixture.ts';
import { ReferenceModel } from '../src/model/reference.ts';
import { encodeTensor } from '../src/protocol/tensor.ts';
import { createForwardHandler } from '../src/node/hop/forward-handler.ts';
import { createSpanExecutor } from '../src/shard/span-executor.ts';
import type { NodeStatus, WeightFormat } from '../src/host/browser/engine.ts';
import { weightsFromFiles } from '../test/helpers/weights.ts';
import { startRelayProcess } from '../test/helpers/relay-process.ts';
import { measureBridgeCost, type BridgeCost } from './lib/bridge-cost.ts';
import { CHROMIUM_ARGS } from '../playwright.config.ts';
import { Identity, MemoryKeyStore } from '../src/net/identity.ts';
import { RelayClient } from '../src/net/relay-client.ts';
import WebSocket from 'ws';
import type { WebSocketConstructor } from '../src/net/socket.ts';

const quick = process.argv.includes('--quick');
const PROMPT = 8;
const STEPS = quick ? 12 : 32;
const cfg = fixtureConfig('small');
const H = cfg.hiddenSize;
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;

const files = makeModel('small');
const ref = new ReferenceModel(cfg, weightsFromFiles(files));
const promptIds = Array.from({ length: PROMPT }, (_, i) => 3 + ((i * 97) % 2000));
const prefill = encodeTensor(Float32Array.from(ref.embed(promptIds)), 'bf16');
const stepInput = encodeTensor(Float32Array.from(ref.embed([42])), 'bf16');

function headers(seq: number, position: number): Record<string, string> {
  return { 'x-meshnet-shape': `1,${seq},${H}`, 'x-meshnet-dtype': 'bf16', 'x-meshnet-session': 'bench', 'x-meshnet-position': String(position), 'x-meshnet-sampling': '{"temperature":0}' };
}

/** The browser node's graphs for `weights` (src/host/browser/adapter.ts graphsFor), on onnxruntime-node. */
async function nodeDecode(threads: number, weights: 'f32' | 'q4'): Promise<number> {
  const w = weightsFromFiles(files);
  const ex = await createSpanExecutor({
    config: cfg,
    backend: createNodeBackend({ intraOpNumThreads: threads }),
    weights: () => w,
    startLayer: 0,
    endLayer: cfg.numLayers,
    graphs: { kind: 'fused', projections: weights },
    maxContext: 256,
    memoryBudgetBytes: 2 ** 30,
  });
  const times: number[] = [];
  const handle = createForwardHandler(ex, { model: 'small', backend: 'onnxruntime-node/cpu', onForward: (e) => times.push(e.ms) });
  const r0 = await handle({ method: 'POST', path: '/forward', headers: headers(PROMPT, 0), body: prefill });
  if (r0.status !== 200) throw new Error(`node prefill: ${r0.status}`);
  times.length = 0;
  for (let i = 0; i < STEPS; i++) {
    const r = await handle({ method: 'POST', path: '/forward', headers: headers(1, PROMPT + i), body: stepInput });
    if (r.status !== 200) throw new Error(`node step: ${r.status}`);
  }
  await ex.release();
  return median(times);
}

async function main(): Promise<void> {
  mkdirSync('bench/results', { recursive: true });
  await build({ logLevel: 'error' });
  const dir = await ensureModel('small');
  const [relay, modelServer] = await Promise.all([startRelayProcess(), startStaticServer({ root: dir, port: 0, host: '127.0.0.1' })]);
  const app = await preview({ preview: { port: 0, host: '127.0.0.1' }, logLevel: 'error' });
  const addr = app.httpServer.address() as { port: number };
  const appUrl = `http://127.0.0.1:${addr.port}/`;
  const identity = await Identity.loadOrCreate(new MemoryKeyStore());
  const caller = new RelayClient({ relayUrl: relay.url, WebSocket: WebSocket as unknown as WebSocketConstructor, identity });
  caller.start();
  await caller.ready(10_000);
  const browser = await chromium.launch({ executablePath: process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium', args: CHROMIUM_ARGS });

  const rows: Array<{ threads: number; weights: WeightFormat; browserMs: number; roundTripMs: number; nodeMs: number; ratio: number }> = [];
  const runs: Array<{ threads: number; weights: 'f32' | 'q4' }> = [];
  for (const threads of quick ? [1] : [1, 2]) for (const weights of ['f32', 'q4'] as const) runs.push({ threads, weights });
  try {
    for (const { threads, weights } of runs) {
      const context = await browser.newContext({ serviceWorkers: 'block' });
      const page = await context.newPage();
      const q = new URLSearchParams({ relay: relay.url, model: `${modelServer.url.replace(/\/$/, '')}/`, layers: `0-${cfg.numLayers}`, backend: 'wasm', threads: String(threads), weights });
      await page.goto(`${appUrl}?${q}`);
      let s: NodeStatus;
      for (;;) {
        s = await page.evaluate(() => window.meshnet!.engine.status());
        if (s.state === 'serving') break;
        if (s.state === 'error') throw new Error(`page failed: ${s.error?.message}`);
        await page.waitForTimeout(100);
      }
      const call = (seq: number, pos: number, body: Uint8Array) => caller.request(s.peerId!, { method: 'POST', path: '/forward', headers: headers(seq, pos), body }, { timeoutMs: 60_000 });
      const r0 = await call(PROMPT, 0, prefill);
      if (r0.status !== 200) throw new Error(`browser prefill: ${r0.status} ${new TextDecoder().decode(r0.body)}`);
      const rt: number[] = [];
      for (let i = 0; i < STEPS; i++) {
        const t0 = performance.now();
        const r = await call(1, PROMPT + i, stepInput);
        rt.push(performance.now() - t0);
        if (r.status !== 200) throw new Error(`browser step: ${r.status}`);
      }
      const after = await page.evaluate(() => window.meshnet!.engine.status());
      const browserMs = median(after.recentForwardMs.slice(-STEPS));
      if (after.backend?.weights !== weights) throw new Error(`page runs ${after.backend?.weights} weights, asked ${weights}`);
      const nodeMs = await nodeDecode(threads, weights);
      rows.push({ threads, weights, browserMs, roundTripMs: median(rt), nodeMs, ratio: browserMs / nodeMs });
      await context.close();
    }

    // Bridge cost in Chromium: bundle the host-free measurement for the page.
    const out = mkdtempSync(join(tmpdir(), 'meshnet-bench-'));
    let browserBridge: BridgeCost;
    try {
      const entry = join(out, 'entry.ts');
      writeFileSync(entry, `import { measureBridgeCost } from '${process.cwd()}/bench/lib/bridge-cost.ts';\n(globalThis as any).measureBridgeCost = measureBridgeCost;\n`);
      await build({ configFile: false, logLevel: 'error', build: { outDir: out, emptyOutDir: false, lib: { entry, formats: ['iife'], name: 'bridgeBench', fileName: () => 'bridge.js' }, minify: true } });
      const page = await browser.newPage();
      await page.goto(appUrl);
      await page.addScriptTag({ content: readFileSync(join(out, 'bridge.js'), 'utf8') });
      browserBridge = await page.evaluate((n) => (globalThis as unknown as { measureBridgeCost(n: number, b: number): Promise<BridgeCost> }).measureBridgeCost(n, 1024), quick ? 500 : 3000);
    } finally {
      rmSync(out, { recursive: true, force: true });
    }
    const nodeBridge = await measureBridgeCost(quick ? 500 : 3000, 1024);

    console.log(`\nbrowser node vs onnxruntime-node, small (12 layers, hidden ${H}), decode step = 1 token through all layers + LM head, median of ${STEPS}`);
    console.log('threads | weights | browser WASM ms/step | caller round trip ms | onnxruntime-node ms/step | ratio (target <= 2.0)');
    for (const r of rows) console.log(`${String(r.threads).padStart(7)} | ${r.weights.padStart(7)} | ${r.browserMs.toFixed(2).padStart(20)} | ${r.roundTripMs.toFixed(2).padStart(19)} | ${r.nodeMs.toFixed(2).padStart(24)} | ${r.ratio.toFixed(2)}`);
    const speedups = [...new Set(rows.map((r) => r.threads))].map((threads) => {
      const f32 = rows.find((r) => r.threads === threads && r.weights === 'f32')!;
      const q4 = rows.find((r) => r.threads === threads && r.weights === 'q4')!;
      return { threads, q4OverF32Browser: f32.browserMs / q4.browserMs, q4OverF32Node: f32.nodeMs / q4.nodeMs };
    });
    console.log('\n4-bit vs f32 decode speed-up, same run (target >= 1.5x in the browser)');
    for (const s of speedups) console.log(`  ${s.threads} thread${s.threads === 1 ? '' : 's'}: browser ${s.q4OverF32Browser.toFixed(2)}x, onnxruntime-node ${s.q4OverF32Node.toFixed(2)}x`);
    console.log('\nrelay bridge own cost per request (1 KiB bf16 activation, in-memory socket, handler answers at once)');
    console.log(`  Chromium: p50 ${browserBridge.p50Ms.toFixed(3)} ms, p90 ${browserBridge.p90Ms.toFixed(3)} ms   (target p50 <= 0.2 ms)`);
    console.log(`  Node.js:  p50 ${nodeBridge.p50Ms.toFixed(3)} ms, p90 ${nodeBridge.p90Ms.toFixed(3)} ms`);
    writeFileSync(
      'bench/results/browser-node.json',
      `${JSON.stringify({ preset: 'small', promptTokens: PROMPT, decodeSteps: STEPS, decode: rows, q4Speedup: speedups, targetRatio: 2.0, targetQ4Speedup: 1.5, bridge: { chromium: browserBridge, node: nodeBridge, targetP50Ms: 0.2 }, date: new Date().toISOString() }, null, 2)}\n`,
    );
  } finally {
    await browser.close();
    caller.close();
    await Promise.all([relay.stop(), modelServer.close(), app.close()]);
  }
}

await main();
