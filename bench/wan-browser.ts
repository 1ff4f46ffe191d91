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
 *   - the floor: legs × one-way delay + the one-page compute;
 *   - each 3-page row twice: every hop through the relay (`?rtc=off`), and
 *     page to page over WebRTC data channels (docs/protocol.md §12), whose
 *     legs get the same one-way delay from the page (`?rtc_delay_ms=`: no
 *     netem here). The data-channel rows need the network namespace
 *     scripts/netns-run.sh makes (Chromium offers no loopback candidates);
 *     outside one they are left out, with a note. Their `rtc share` is the
 *     part of the hops the pages sent during the timed chats that went over
 *     a channel (the pages' own counters).
 *
 * After each 3-page run the pages after the head are asked for
 * `chain_forwards` (GET /info over the relay): > 0 proves the chain ran,
 * 0 the star. Table on stdout, JSON in bench/results/wan-browser.json.
 *
 *   scripts/netns-run.sh npx tsx bench/wan-browser.ts [--quick] [--delay-ms 20] [--model small|tiny] [--no-relay-rows | --rtc]
 *
 * `--no-relay-rows`: only the 1-page row and the data-channel rows; `--rtc`: those and
 * the no-delay relay row (3 pages / 1 page over either path, chain vs star
 * over channels, in one run); both write wan-browser-rtc.json.
 *
 * `--no-delay`: only the rows without delay.
 *
 * `--idle-pages`: one more row, 3 pages each holding the whole model, so a
 * chat runs on one page while the other two sit idle (registered, warm,
 * heartbeating): beside the 1-page row, what two more Chromium pages cost a
 * page's compute on this machine (CPU contention, not hops).
 *
 * `--trace`: after the timed chats of each no-delay row, one more chat with
 * every page stamping each stage of its steps (src/protocol/trace.ts, the
 * engine's `trace()`), lined up per step as bench/hop-trace.ts does
 * (bench/lib/step-trace.ts): where a token's time goes — onnxruntime, each
 * page's JavaScript outside it, and between pages (the legs). The timed
 * chats stay untraced.
 *
 * `--baseline-app DIR`: every selected row twice, once with the pages built
 * in DIR (an older checkout's dist/: `… (before)`) and once with this
 * checkout's, side by side in one run (the two interleaved ABBA: 1 page new,
 * before; then 3 pages before, new; …), with the ratios of each. The
 * relay, tracker and this script are this checkout's either way: for
 * changes to the page's code.
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
import { chainForwardsAfterHead, hopsSent, nodeInfos, startTrackerProc, until, type TrackerProc } from '../test/helpers/mesh.ts';
import { median, startDelayedRelay, type DelayedRelay } from './lib/wan.ts';
import { printTable, writeResult } from './lib/stats.ts';
import { analyse, type Analysis, type Stamp } from './lib/step-trace.ts';
import type { TraceStampRow } from '../src/host/browser/engine.ts';

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
const TRACE = process.argv.includes('--trace');
const BASELINE = arg('--baseline-app');

interface Config {
  name: string;
  pages: number;
  hop: 'chain' | 'star';
  /** Page-to-page hops over data channels (else every hop through the relay). */
  rtc: boolean;
  delay: number;
  /** Legs a token crosses at the delay (0 for one page). */
  legs: number;
  /** Every page holds the whole model: a chat runs on one, the others idle. */
  idle?: boolean;
  /** Served from --baseline-app (the row's name ends " (before)"). */
  before?: boolean;
}

interface Result {
  msPerToken: number;
  /** First to last token's text (the stream's end left out: the head's end of generation, usage, [DONE]). */
  msPerTokenToLast: number;
  /** From the last token's text to the stream's end, ms (median). */
  endMs: number;
  spans: string;
  routeHops: number;
  chainForwards: number[];
  texts: string[];
  /** Hops the pages sent during the timed chats, per path. */
  sent: Record<string, number>;
  /** --trace: the traced chat's steps. */
  trace?: Analysis & { clientMsPerToken: number };
}

/** One more chat with every page stamping its steps; pages named by where their span lies (head, mid, tail). */
async function tracedChat(mesh: BrowserMesh, trackerUrl: string): Promise<(Analysis & { clientMsPerToken: number }) | undefined> {
  const rows = mesh.rows().filter((r) => r.layers && mesh.page(r.index));
  const byStart = [...rows].sort((a, b) => a.layers![0] - b.layers![0]);
  const label = (i: number) => (rows.length === 1 ? 'page' : i === 0 ? 'head' : i === byStart.length - 1 ? 'tail' : 'mid');
  const names = new Map<number, string>(byStart.map((r, i) => [r.index + 1, label(i)]));
  const call = (r: (typeof rows)[number], on: boolean) => mesh.page(r.index)!.evaluate((v) => window.meshnet!.engine.trace(v), on) as Promise<TraceStampRow[]>;
  await Promise.all(rows.map((r) => call(r, true)));
  const r = await streamChat(trackerUrl, MODEL, PROMPT, MAX_TOKENS, () => {});
  const taken = await Promise.all(rows.map((r) => call(r, false)));
  const stamps: Stamp[] = taken.flatMap((list, k) => list.map(([t, stage]) => ({ t, pid: rows[k]!.index + 1, stage }))).sort((a, b) => a.t - b.t);
  const head = byStart[0]!.index + 1;
  // The traced chat's own decode as the client saw it: beside the head's step times, and the untraced chats' figure.
  return { ...analyse(stamps, names, head), clientMsPerToken: (r.lastTokenMs - r.firstTokenMs) / (r.tokens - 1) };
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
    mesh = await startBrowserMesh({ nodes: c.pages, trackerUrl: tracker.url, relayUrl: delayed?.url ?? relay.url, appUrl, model: MODEL, backend: 'wasm', budgetMb: pageBudget(spec, c.idle ? 1 : c.pages, undefined), threads: 1, hop: c.hop, rtc: c.rtc, ...(c.rtc && c.delay > 0 ? { rtcDelayMs: c.delay } : {}), pollMs: 500, log: (m) => logs.push(m) });
    await mesh.waitServing(240_000).catch((e: Error) => {
      throw new Error(`${c.name}: ${e.message}: ${JSON.stringify(mesh!.rows())} ${logs.join('; ')}`);
    });
    await until(async () => ((await (await fetch(`${tracker!.url}/api/availability?model=${MODEL}`)).json()) as { models: Array<{ complete: boolean }> }).models[0]?.complete, 60_000, 'every layer served');
    const spans = mesh.rows().map((r) => (r.layers ? `${r.layers[0]}-${r.layers[1] - 1}` : '?')).join(' ');
    await streamChat(tracker.url, MODEL, PROMPT, 8, () => {}); // warm-up: graphs, caches, routes (and the data channels dial)
    if (c.rtc && c.pages > 1) {
      await until(async () => (await nodeInfos(tracker!.url)).every((i) => (i.data_channels?.open ?? 0) > 0) || undefined, 30_000, 'a data channel open on every page').catch((e: Error) => {
        throw new Error(`${c.name}: ${e.message} (${logs.slice(-5).join('; ')})`);
      });
    }
    const sentBefore = c.pages > 1 ? hopsSent(await nodeInfos(tracker.url)) : {};
    const ms: number[] = [];
    const toLast: number[] = [];
    const ends: number[] = [];
    const texts: string[] = [];
    for (let i = 0; i < CHATS; i++) {
      const r = await streamChat(tracker.url, MODEL, PROMPT, MAX_TOKENS, () => {});
      // Decode only: the time after the first token over the tokens after it (prefill and routing excluded).
      ms.push((r.ms - r.firstTokenMs) / (r.tokens - 1));
      toLast.push((r.lastTokenMs - r.firstTokenMs) / (r.tokens - 1));
      ends.push(r.ms - r.lastTokenMs);
      texts.push(r.text);
    }
    const d = (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { recent_routes: Array<{ kind: string; hops: unknown[] }> };
    const routeHops = d.recent_routes.find((r) => r.kind === 'generate')?.hops.length ?? 0;
    const sentAfter = c.pages > 1 ? hopsSent(await nodeInfos(tracker.url)) : {};
    const sent: Record<string, number> = {};
    for (const k of Object.keys(sentAfter)) sent[k] = (sentAfter[k] ?? 0) - (sentBefore[k] ?? 0);
    const chainForwards = c.pages > 1 && !c.idle ? await chainForwardsAfterHead(tracker.url) : [];
    const trace = TRACE && c.delay === 0 && !c.idle ? await tracedChat(mesh, tracker.url) : undefined;
    return { msPerToken: median(ms), msPerTokenToLast: median(toLast), endMs: median(ends), spans, routeHops, chainForwards, texts, sent, ...(trace ? { trace } : {}) };
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
  const baseApp = BASELINE ? await startStaticServer({ root: BASELINE, port: 0, host: '127.0.0.1' }) : undefined;
  const inNetns = process.env.MESHNET_NETNS === '1';
  if (!inNetns) process.stderr.write('not inside the network namespace scripts/netns-run.sh makes: the data-channel rows are left out\n');
  const relayRows = !process.argv.includes('--no-relay-rows');
  const all: Config[] = [
    { name: '1 page', pages: 1, hop: 'chain', rtc: false, delay: 0, legs: 0 },
    ...(process.argv.includes('--idle-pages') ? [{ name: '1 page serving, 2 idle', pages: 3, hop: 'chain', rtc: false, delay: 0, legs: 0, idle: true } as Config] : []),
    { name: '3 pages, chain, relay', pages: 3, hop: 'chain', rtc: false, delay: 0, legs: 3 },
    { name: '3 pages, chain, rtc', pages: 3, hop: 'chain', rtc: true, delay: 0, legs: 3 },
    { name: '3 pages, star, relay', pages: 3, hop: 'star', rtc: false, delay: ONE_WAY, legs: 4 },
    { name: '3 pages, chain, relay', pages: 3, hop: 'chain', rtc: false, delay: ONE_WAY, legs: 3 },
    { name: '3 pages, star, rtc', pages: 3, hop: 'star', rtc: true, delay: ONE_WAY, legs: 4 },
    { name: '3 pages, chain, rtc', pages: 3, hop: 'chain', rtc: true, delay: ONE_WAY, legs: 3 },
  ];
  // --rtc: the data-channel rows with the 1-page and the no-delay relay rows beside them (the targets' ratios, one run).
  const rtcOnly = process.argv.includes('--rtc');
  // --no-delay: only the no-delay rows (3 pages / 1 page, the traces).
  const noDelay = process.argv.includes('--no-delay');
  const selected = all.filter((c) => (c.rtc ? inNetns : rtcOnly ? c.delay === 0 : relayRows || c.pages === 1 || c.idle) && (!noDelay || c.delay === 0));
  // --baseline-app: each row with the old pages and the new, ABBA (new, before; before, new; …) so drift in the machine's load falls on both.
  const configs = baseApp ? selected.flatMap((c, i) => { const b = { ...c, name: `${c.name} (before)`, before: true }; return i % 2 === 0 ? [c, b] : [b, c]; }) : selected;
  const results: Result[] = [];
  try {
    for (const c of configs) {
      process.stderr.write(`${c.name}, ${c.delay} ms one-way...\n`);
      results.push(await runMesh(c, st.url, `${(c.before ? baseApp! : app).url}/`));
      process.stderr.write(`  ${results.at(-1)!.msPerToken.toFixed(1)} ms/token\n`);
    }
  } finally {
    await app.close();
    await baseApp?.close();
    await st.close();
  }
  const loadAfter = loadavg()[0]!;
  const onePage = (before: boolean) => results[configs.findIndex((c) => c.pages === 1 && !c.idle && !!c.before === before)] ?? results[0]!;
  const compute = onePage(false).msPerToken;
  const rows = configs.map((c, i) => {
    const r = results[i]!;
    const floor = c.legs * c.delay + onePage(!!c.before).msPerToken;
    const page = (r.sent.rtc ?? 0) + (r.sent.fast ?? 0) + (r.sent.rpc ?? 0);
    return {
      config: c.name,
      hop: c.pages > 1 && !c.idle ? c.hop : '-',
      path: c.pages > 1 && !c.idle ? (c.rtc ? 'rtc' : 'relay') : '-',
      one_way_ms: c.delay,
      legs_per_token: c.legs,
      spans: r.spans,
      route_hops: r.routeHops,
      ms_per_token: +r.msPerToken.toFixed(2),
      ms_per_token_to_last: +r.msPerTokenToLast.toFixed(2),
      end_of_stream_ms: +r.endMs.toFixed(1),
      tokens_per_s: +(1000 / r.msPerToken).toFixed(2),
      floor_ms_per_token: +floor.toFixed(2),
      x_floor: +(r.msPerToken / floor).toFixed(3),
      chain_forwards_after_head: r.chainForwards,
      hops_sent: r.sent,
      rtc_share: page > 0 ? +((r.sent.rtc ?? 0) / page).toFixed(4) : null,
      same_text_as_1_page: r.texts.every((t) => t === onePage(!!c.before).texts[0]),
      ...(r.trace ? { trace: r.trace } : {}),
    };
  });
  for (const r of rows) {
    if (!r.trace) continue;
    const a = r.trace;
    printTable(`${r.config}: traced chat, step ${a.stepMs.toFixed(2)} ms (median of ${a.steps} decode steps; mean ${a.stepMeanMs.toFixed(2)}): consecutive stamps`, ['from', 'to', 'p50 ms', 'p90 ms'], a.gaps.map((g) => [g.from, g.to, g.p50.toFixed(3), g.p90.toFixed(3)]));
    printTable(`${r.config}: per step, summed (medians over steps)`, ['where', 'p50 ms'], a.grouped.map((g) => [g.group, g.p50.toFixed(3)]));
  }
  const idle = rows.find((r) => r.config === '1 page serving, 2 idle');
  printTable('decode without the stream\'s end (first to last token\'s text), and the end (last text to [DONE])', ['config', 'ms/token', 'ms/token to last', 'end of stream ms', 'traced chat: client ms/token', 'traced step p50 ms', 'traced step mean ms'], rows.map((r) => [r.config, r.ms_per_token, r.ms_per_token_to_last, r.end_of_stream_ms, r.trace ? r.trace.clientMsPerToken.toFixed(2) : '-', r.trace ? r.trace.stepMs.toFixed(2) : '-', r.trace ? r.trace.stepMeanMs.toFixed(2) : '-']));
  if (idle) console.log(`2 more pages idle beside the serving one: ${(rows[0]!.tokens_per_s / idle.tokens_per_s).toFixed(3)}× the 1-page ms/token (${idle.ms_per_token} vs ${rows[0]!.ms_per_token})`);
  printTable(
    `WAN bench, browser pages: ${MODEL}, WASM 1 thread per page, ${CHATS} chats × ${MAX_TOKENS} tokens (after a warm-up), decode medians; load ${loadBefore.toFixed(1)} → ${loadAfter.toFixed(1)} on ${cpus().length} cores`,
    ['config', 'one-way ms', 'legs', 'spans', 'ms/token', 'tok/s', 'floor ms', '× floor', 'chain_forwards after head', 'rtc share', 'text = 1 page'],
    rows.map((r) => [r.config, r.one_way_ms, String(r.legs_per_token), r.spans, r.ms_per_token, r.tokens_per_s, r.floor_ms_per_token, r.x_floor, r.chain_forwards_after_head.join(' ') || '-', r.rtc_share === null ? '-' : `${(r.rtc_share * 100).toFixed(2)} %`, String(r.same_text_as_1_page)]),
  );
  const find = (name: string, delay: number) => rows.find((r) => r.config === name && r.one_way_ms === delay);
  const ratios: Record<string, number> = {};
  for (const [path, tag] of [['relay', ''], ['rtc', ''], ...(baseApp ? [['relay', ' (before)'], ['rtc', ' (before)']] : [])] as Array<[string, string]>) {
    const star = find(`3 pages, star, ${path}${tag}`, ONE_WAY);
    const chain = find(`3 pages, chain, ${path}${tag}`, ONE_WAY);
    const three = find(`3 pages, chain, ${path}${tag}`, 0);
    const one = rows.find((r) => r.config === `1 page${tag}`) ?? rows[0]!;
    const key = (k: string) => `${k}${tag ? '_before' : ''}`;
    if (star && chain) {
      ratios[key(`chain_vs_star_tok_s_${path}`)] = +(chain.tokens_per_s / star.tokens_per_s).toFixed(3);
      console.log(`${path}${tag}: chain vs star tok/s at ${ONE_WAY} ms one-way: ${(chain.tokens_per_s / star.tokens_per_s).toFixed(3)}× (legs 3 vs 4: the floors give ${(star.floor_ms_per_token / chain.floor_ms_per_token).toFixed(3)}×); chain vs its floor ${chain.x_floor}×`);
    }
    if (three) {
      ratios[key(`three_over_one_page_no_delay_${path}`)] = +(three.tokens_per_s / one.tokens_per_s).toFixed(3);
      ratios[key(`three_over_one_page_no_delay_to_last_${path}`)] = +(one.ms_per_token_to_last / three.ms_per_token_to_last).toFixed(3);
      console.log(`${path}${tag}: no delay, 3 pages / 1 page, first to last token: ${(one.ms_per_token_to_last / three.ms_per_token_to_last).toFixed(3)}`);
      console.log(`${path}${tag}: no delay, 3 pages (chain) / 1 page tok/s: ${(three.tokens_per_s / one.tokens_per_s).toFixed(3)}${three.rtc_share !== null && path === 'rtc' ? `; hops on data channels ${(three.rtc_share * 100).toFixed(2)} %` : ''}`);
    }
  }
  // --no-relay-rows and --rtc write a file of their own: the full run's relay rows stay.
  const file = `wan-browser${MODEL === 'small' ? '' : `-${MODEL}`}${relayRows && !rtcOnly ? '' : '-rtc'}${TRACE || noDelay ? '-no-delay' : ''}${baseApp ? '-before-after' : ''}.json`;
  writeResult(fileURLToPath(new URL(`./results/${file}`, import.meta.url)), {
    bench: 'wan-browser',
    model: MODEL,
    load_average_1m: { before: +loadBefore.toFixed(2), after: +loadAfter.toFixed(2) },
    one_way_ms: ONE_WAY,
    chats: CHATS,
    max_tokens: MAX_TOKENS,
    in_network_namespace: inNetns,
    ...(BASELINE ? { baseline_app: BASELINE } : {}),
    compute_ms_per_token_1_page: +compute.toFixed(2),
    rows,
    ...ratios,
  });
}

await main();
process.exit(0);
