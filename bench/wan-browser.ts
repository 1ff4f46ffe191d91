/**
 * WAN-shaped benchmark for browser pages: chained hops against the star when
 * the model is split over 3 headless Chromium pages (WASM, one thread each,
 * src/cli/browser-mesh.ts) behind a real tracker and relay process, the
 * pages reaching the relay through the user-space delaying proxy
 * (bench/lib/wan.ts: 20 ms one-way page → relay → page, every leg incl. the
 * chain's last hop → head). Each configuration gets a fresh relay, tracker
 * and browser; chats go through the tracker's OpenAI API (streamed):
 *
 *   - 1 page, no delay: the one-page compute (ms/token);
 *   - 3 pages, chain, no delay: the pipeline's own cost (3 pages / 1 page);
 *   - 3 pages, star (`?hop=star`: 2(N−1) = 4 legs a token) and chain
 *     (`?hop=chain`, the default: N = 3 legs) at the delay;
 *   - the floor: legs × one-way delay + the one-page compute.
 *
 * After each 3-page run the pages after the head are asked for
 * `chain_forwards` (GET /info over the relay): > 0 proves the chain ran,
 * 0 the star. Table on stdout, JSON in bench/results/wan-browser.json.
 *
 *   npx tsx bench/wan-browser.ts [--quick] [--delay-ms 20] [--model small|tiny]
 */
import { cpus, loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import { startBrowserMesh, serveBuiltApp, type BrowserMesh } from '../src/cli/browser-mesh.ts';
import { pageBudget, streamChat } from '../src/cli/demo.ts';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import { loadModelSpec } from '../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../src/tracker/options.ts';
import { startRelayProcess, type RelayProcess } from '../test/helpers/relay-process.ts';
import { chainForwardsAfterHead, startTrackerProc, until, type TrackerProc } from '../test/helpers/mesh.ts';
import { median, startDelayedRelay, type DelayedRelay } from './lib/wan.ts';
import { printTable, writeResult } from './lib/stats.ts';

const quick = process.argv.includes('--quick');
const CHATS = quick ? 2 : 3;
const MAX_TOKENS = quick ? 24 : 48;
const arg = (name: string): string | undefined => {
  const i = process.argv.indexOf(name);
  return i > 0 ? process.argv[i + 1] : undefined;
};
const ONE_WAY = Number(arg('--delay-ms') ?? 20);
const MODEL = arg('--model') ?? 'small';
const PROMPT = 'Write a short story about a lighthouse keeper and a storm at sea.';

interface Config {
  name: string;
  pages: number;
  hop: 'chain' | 'star';
  delay: number;
  /** Legs a token crosses at the delay (0 for one page). */
  legs: number;
}

interface Result {
  msPerToken: number;
  spans: string;
  routeHops: number;
  chainForwards: number[];
  texts: string[];
}

async function runMesh(c: Config, modelUrl: string, appUrl: string): Promise<Result> {
  let delayed: DelayedRelay | undefined;
  let plain: RelayProcess | undefined;
  let tracker: TrackerProc | undefined;
  let mesh: BrowserMesh | undefined;
  try {
    if (c.delay > 0) delayed = await startDelayedRelay(c.delay);
    else plain = await startRelayProcess();
    const relay = (delayed?.relay ?? plain)!;
    // The tracker talks to the relay directly: only the pages' legs are delayed.
    tracker = await startTrackerProc(['--model', `${MODEL}=${modelUrl}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000']);
    const spec = await loadModelSpec(MODEL, `${modelUrl}/`, fetch, resolveTrackerOptions({}));
    const logs: string[] = [];
    mesh = await startBrowserMesh({ nodes: c.pages, trackerUrl: tracker.url, relayUrl: delayed?.url ?? relay.url, appUrl, model: MODEL, backend: 'wasm', budgetMb: pageBudget(spec, c.pages, undefined), threads: 1, hop: c.hop, pollMs: 500, log: (m) => logs.push(m) });
    await mesh.waitServing(240_000).catch((e: Error) => {
      throw new Error(`${c.name}: ${e.message}: ${JSON.stringify(mesh!.rows())} ${logs.join('; ')}`);
    });
    await until(async () => ((await (await fetch(`${tracker!.url}/api/availability?model=${MODEL}`)).json()) as { models: Array<{ complete: boolean }> }).models[0]?.complete, 60_000, 'every layer served');
    const spans = mesh.rows().map((r) => (r.layers ? `${r.layers[0]}-${r.layers[1] - 1}` : '?')).join(' ');
    await streamChat(tracker.url, MODEL, PROMPT, 8, () => {}); // warm-up: graphs, caches, routes
    const ms: number[] = [];
    const texts: string[] = [];
    for (let i = 0; i < CHATS; i++) {
      const r = await streamChat(tracker.url, MODEL, PROMPT, MAX_TOKENS, () => {});
      // Decode only: the time after the first token over the tokens after it (prefill and routing excluded).
      ms.push((r.ms - r.firstTokenMs) / (r.tokens - 1));
      texts.push(r.text);
    }
    const d = (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { recent_routes: Array<{ kind: string; hops: unknown[] }> };
    const routeHops = d.recent_routes.find((r) => r.kind === 'generate')?.hops.length ?? 0;
    const chainForwards = c.pages > 1 ? await chainForwardsAfterHead(tracker.url) : [];
    return { msPerToken: median(ms), spans, routeHops, chainForwards, texts };
  } finally {
    await mesh?.close();
    await tracker?.stop();
    await delayed?.stop();
    await plain?.stop();
  }
}

async function main(): Promise<void> {
  const loadBefore = loadavg()[0]!;
  const st = await startStaticServer({ root: await ensureModel(MODEL as Parameters<typeof ensureModel>[0]), port: 0, host: '127.0.0.1' });
  const app = await serveBuiltApp();
  const configs: Config[] = [
    { name: '1 page', pages: 1, hop: 'chain', delay: 0, legs: 0 },
    { name: '3 pages, chain', pages: 3, hop: 'chain', delay: 0, legs: 3 },
    { name: '3 pages, star', pages: 3, hop: 'star', delay: ONE_WAY, legs: 4 },
    { name: '3 pages, chain', pages: 3, hop: 'chain', delay: ONE_WAY, legs: 3 },
  ];
  const results: Result[] = [];
  try {
    for (const c of configs) {
      process.stderr.write(`${c.name}, ${c.delay} ms one-way...\n`);
      results.push(await runMesh(c, st.url, `${app.url}/`));
      process.stderr.write(`  ${results.at(-1)!.msPerToken.toFixed(1)} ms/token\n`);
    }
  } finally {
    await app.close();
    await st.close();
  }
  const loadAfter = loadavg()[0]!;
  const compute = results[0]!.msPerToken;
  const rows = configs.map((c, i) => {
    const r = results[i]!;
    const floor = c.legs * c.delay + compute;
    return {
      config: c.name,
      hop: c.pages > 1 ? c.hop : '-',
      one_way_ms: c.delay,
      legs_per_token: c.legs,
      spans: r.spans,
      route_hops: r.routeHops,
      ms_per_token: +r.msPerToken.toFixed(2),
      tokens_per_s: +(1000 / r.msPerToken).toFixed(2),
      floor_ms_per_token: +floor.toFixed(2),
      x_floor: +(r.msPerToken / floor).toFixed(3),
      chain_forwards_after_head: r.chainForwards,
      same_text_as_1_page: r.texts.every((t) => t === results[0]!.texts[0]),
    };
  });
  printTable(
    `WAN bench, browser pages: ${MODEL}, WASM 1 thread per page, ${CHATS} chats × ${MAX_TOKENS} tokens (after a warm-up), decode medians; load ${loadBefore.toFixed(1)} → ${loadAfter.toFixed(1)} on ${cpus().length} cores`,
    ['config', 'one-way ms', 'legs', 'spans', 'ms/token', 'tok/s', 'floor ms', '× floor', 'chain_forwards after head', 'text = 1 page'],
    rows.map((r) => [r.config, r.one_way_ms, String(r.legs_per_token), r.spans, r.ms_per_token, r.tokens_per_s, r.floor_ms_per_token, r.x_floor, r.chain_forwards_after_head.join(' ') || '-', String(r.same_text_as_1_page)]),
  );
  const star = rows[2]!;
  const chain = rows[3]!;
  const chainVsStar = chain.tokens_per_s / star.tokens_per_s;
  const threeOverOne = rows[1]!.tokens_per_s / rows[0]!.tokens_per_s;
  console.log(`chain vs star tok/s at ${ONE_WAY} ms one-way: ${chainVsStar.toFixed(3)}× (legs 3 vs 4: the floors give ${(star.floor_ms_per_token / chain.floor_ms_per_token).toFixed(3)}×)`);
  console.log(`chain ms/token vs its floor at ${ONE_WAY} ms: ${chain.x_floor}×`);
  console.log(`no delay, 3 pages (chain) / 1 page tok/s: ${threeOverOne.toFixed(3)}`);
  writeResult(fileURLToPath(new URL(MODEL === 'small' ? './results/wan-browser.json' : `./results/wan-browser-${MODEL}.json`, import.meta.url)), {
    bench: 'wan-browser',
    model: MODEL,
    load_average_1m: { before: +loadBefore.toFixed(2), after: +loadAfter.toFixed(2) },
    one_way_ms: ONE_WAY,
    chats: CHATS,
    max_tokens: MAX_TOKENS,
    compute_ms_per_token_1_page: +compute.toFixed(2),
    rows,
    chain_vs_star_tok_s: +chainVsStar.toFixed(3),
    three_over_one_page_no_delay: +threeOverOne.toFixed(3),
  });
}

await main();
process.exit(0);
