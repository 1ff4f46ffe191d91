/**
 * WAN-shaped benchmark: chained hops against the star, on the `small`
 * fixture (12 layers, hidden 512) split over 3 real `meshnet node`
 * processes (head [0,4), middle [4,8), tail [8,12)), side by side in one run:
 *
 *   - 20 ms one-way between nodes: every node reaches relay B through one
 *     user-space delaying TCP proxy (bench/lib/delay-proxy.ts) that holds
 *     each chunk 10 ms each way, so node → relay → node is 20 ms one-way
 *     (relay B tells peers the proxy's address, so every leg, the chain's
 *     last hop → head included, goes through it). Direct links are off;
 *   - no delay: the same shape on relay A, against the un-split model in
 *     this process (same ShardExecutor, no transport);
 *   - star (every hop answers the head: 2(N−1) = 4 legs a token) and chain
 *     (head → middle → tail → head: N = 3 legs), each with its own head
 *     process (--hop-mode), the same middle and tail;
 *   - the floor: legs × one-way delay + compute (the one-process ms/token);
 *   - recovery: the middle of the 20 ms chain killed mid-generation, the
 *     tracker's spare replayed into; tokens compared, time to the next token.
 *
 * Table on stdout, JSON in bench/results/wan.json. The same shape with
 * browser pages (`?hop=star|chain`): bench/wan-browser.ts.
 *
 *   npx tsx bench/wan.ts [--quick] [--delay-ms 20] [--model small|tiny]
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ensureModel } from '../src/cli/models.ts';
import { createNodeBackend } from '../src/host/node/onnx.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import { parseModelConfig } from '../src/model/config.ts';
import { openSafetensors } from '../src/model/safetensors.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { Identity } from '../src/net/identity.ts';
import { encodeBase64Url } from '../src/protocol/base64.ts';
import type { GenerateEvent, RouteHop } from '../src/protocol/tracker.ts';
import { ShardExecutor } from '../src/shard/executor.ts';
import { readerWeightLoader } from '../src/shard/weights.ts';
import { startRelayProcess, type RelayProcess } from '../test/helpers/relay-process.ts';
import { generateDirect, signedRouteHeaders, startNode, startTrackerProc, until, type NodeProc } from '../test/helpers/mesh.ts';
import { median, startDelayedRelay, type DelayedRelay } from './lib/wan.ts';
import { loadAverage1m, printTable, writeResult } from './lib/stats.ts';

if (process.argv.includes('--help') || process.argv.includes('-h')) {
  process.stdout.write(`npx tsx bench/wan.ts [options]
  chained hops against the star, and against one process, over real relay and node processes

  --quick          2 runs of 24 tokens (default: 3 runs of 48)
  --delay-ms N     one-way delay between nodes for the WAN set (default 20)
  --model M        small (default) or tiny
  --inject-ms N    middles and tails wait N ms per /forward (compute without CPU)
  --help           this text

  Table on stdout; JSON in bench/results/wan.json.
`);
  process.exit(0);
}
const quick = process.argv.includes('--quick');
const RUNS = quick ? 2 : 3;
const NEW_TOKENS = quick ? 24 : 48;
const delayArg = process.argv.indexOf('--delay-ms');
const ONE_WAY = delayArg > 0 ? Number(process.argv[delayArg + 1]) : 20;
const modelArg = process.argv.indexOf('--model');
const MODEL = modelArg > 0 ? process.argv[modelArg + 1]! : 'small';
const PROMPT = [{ role: 'user', content: 'Write a short story about a lighthouse keeper and a storm at sea.' }];

interface Run {
  msPerToken: number;
  tokS: number;
  ids: number[];
  recoveryMs?: number;
  nextTokenAfterKillMs?: number;
}

async function main(): Promise<void> {
  const loadBefore = loadavg()[0]!;
  const dir = await ensureModel(MODEL as Parameters<typeof ensureModel>[0]);
  const st = await startStaticServer({ root: dir });
  const cfg = parseModelConfig(await (await fetch(`${st.url}/config.json`)).json());
  // Three spans of (about) a third of the layers each.
  const L = cfg.numLayers;
  const [A, B] = [Math.round(L / 3), Math.round((2 * L) / 3)];
  const work = mkdtempSync(join(tmpdir(), 'meshnet-bench-wan-'));
  const nodes: NodeProc[] = [];
  const relays: RelayProcess[] = [];
  let delayed: DelayedRelay | undefined;
  let tracker: Awaited<ReturnType<typeof startTrackerProc>> | undefined;
  try {
    const trackerId = await Identity.generate();
    const keyFile = join(work, 'tracker-key.json');
    writeFileSync(keyFile, JSON.stringify(await trackerId.export()));
    // Route and reply address signed as the tracker would (the reply address lets chain-mode heads chain).
    const sign = (head: NodeProc, hops: RouteHop[]): Promise<Record<string, string>> => signedRouteHeaders(trackerId, head, hops);

    // Relay A: no delay. Relay B: behind the proxy, and says so in relay_addr.
    const relayA = await startRelayProcess();
    relays.push(relayA);
    delayed = await startDelayedRelay(ONE_WAY);
    const proxyUrl = delayed.url;
    const relayB = delayed.relay;
    tracker = await startTrackerProc(['--model', `${MODEL}=${st.url}`, '--relay', relayB.url, '--key-file', keyFile, '--heartbeat-interval-ms', '1000']);

    process.stderr.write('starting nodes...\n');
    const base = ['--model', MODEL, '--model-url', st.url, '--budget-mb', '2048', '--threads', '1', '--max-context', '512', '--no-links'];
    const onA = [...base, '--relay', relayA.url, '--tracker-key', encodeBase64Url(trackerId.publicKey)];
    const onB = [...base, '--relay', proxyUrl, '--tracker', tracker.url];
    // --inject-ms N: middles and tails wait N ms per /forward (compute without CPU: tells the legs from CPU contention).
    const injectArg = process.argv.indexOf('--inject-ms');
    const inject = injectArg > 0 ? ['--inject-delay-ms', process.argv[injectArg + 1]!] : [];
    const specs: string[][] = [
      [...onA, '--layers', `0-${A}`, '--hop-mode', 'chain'],
      [...onA, '--layers', `0-${A}`, '--hop-mode', 'star'],
      [...onA, '--layers', `${A}-${B}`, ...inject],
      [...onA, '--layers', `${B}-${L}`, ...inject],
      [...onB, '--layers', `0-${A}`, '--hop-mode', 'chain'],
      [...onB, '--layers', `0-${A}`, '--hop-mode', 'star'],
      [...onB, '--layers', `${A}-${B}`, ...inject],
      [...onB, '--layers', `${B}-${L}`, ...inject],
      [...onB, '--layers', `${A}-${B}`, ...inject],
    ];
    for (let i = 0; i < specs.length; i += 2) nodes.push(...(await Promise.all(specs.slice(i, i + 2).map((s) => startNode(s)))));
    const [chainA, starA, midA, tailA, chainB, starB, midB, tailB, spareB] = nodes as [NodeProc, NodeProc, NodeProc, NodeProc, NodeProc, NodeProc, NodeProc, NodeProc, NodeProc];
    await Promise.all([chainB, starB, midB, tailB, spareB].map((n) => n.waitFor((e) => e.event === 'registered')));
    const hopVia = (n: NodeProc, a: number, b: number): RouteHop => ({ peer_id: n.peerId, start_layer: a, end_layer: b, relay_addr: n.relayAddr! });
    if (!midB.relayAddr?.startsWith(proxyUrl)) throw new Error(`relay B gave ${midB.relayAddr}, not the proxy's address`);

    // ---- one process: the un-split model, no transport
    const tok = await ModelTokenizer.load(fetch, `${st.url}/`, { extraEosTokenIds: cfg.eosTokenIds });
    const whole = await ShardExecutor.create({ config: cfg, backend: createNodeBackend({ intraOpNumThreads: 1 }), weights: readerWeightLoader(await openSafetensors(fetch, `${st.url}/`)), startLayer: 0, endLayer: cfg.numLayers, maxContext: 512 });
    const promptIds = tok.encodeChat(PROMPT);
    const oneProcess = async (): Promise<Run> => {
      let r = await whole.forward({ session: 'bench', position: 0, tokenIds: promptIds, sampling: { temperature: 0 } });
      const t1 = performance.now();
      const ids: number[] = [];
      let pos = promptIds.length;
      for (let i = 0; i < NEW_TOKENS; i++) {
        if (r.kind !== 'token') throw new Error('expected a token');
        ids.push(r.tokenId);
        if (i === NEW_TOKENS - 1) break;
        r = await whole.forward({ session: 'bench', position: pos++, tokenIds: [r.tokenId], sampling: { temperature: 0 } });
      }
      const ms = (performance.now() - t1) / (ids.length - 1);
      whole.dropSession('bench');
      return { msPerToken: ms, tokS: 1000 / ms, ids };
    };

    let runId = 0;
    const viaMesh = async (head: NodeProc, hops: RouteHop[], kill?: { node: NodeProc; afterTokens: number }): Promise<Run> => {
      const headers = await sign(head, hops);
      let tFirst = 0;
      let tLast = 0;
      let tKill = 0;
      let nextAfterKill: number | undefined;
      const ids: number[] = [];
      let recoveryMs: number | undefined;
      for await (const ev of generateDirect(head.endpoint, headers, { messages: PROMPT, max_tokens: NEW_TOKENS, temperature: 0, session_id: `wan-${++runId}` }) as AsyncIterable<GenerateEvent>) {
        if (ev.type === 'token') {
          tLast = performance.now();
          if (ids.length === 0) tFirst = tLast;
          if (tKill > 0 && nextAfterKill === undefined) nextAfterKill = tLast - tKill;
          ids.push(ev.token_id);
          if (kill && ids.length === kill.afterTokens) {
            kill.node.child.kill('SIGKILL');
            tKill = performance.now();
          }
        } else if (ev.type === 'recovered') recoveryMs = ev.recovery_ms;
        else if (ev.type === 'error') throw new Error(`${ev.code}: ${ev.message}`);
      }
      const ms = (tLast - tFirst) / (ids.length - 1);
      return { msPerToken: ms, tokS: 1000 / ms, ids, ...(recoveryMs !== undefined ? { recoveryMs } : {}), ...(nextAfterKill !== undefined ? { nextTokenAfterKillMs: nextAfterKill } : {}) };
    };

    const configs = [
      { name: 'one process', delay: 0, legs: 0, run: oneProcess },
      { name: '3 nodes, star', delay: 0, legs: 4, run: () => viaMesh(starA, [hopVia(midA, A, B), hopVia(tailA, B, L)]) },
      { name: '3 nodes, chain', delay: 0, legs: 3, run: () => viaMesh(chainA, [hopVia(midA, A, B), hopVia(tailA, B, L)]) },
      { name: '3 nodes, star', delay: ONE_WAY, legs: 4, run: () => viaMesh(starB, [hopVia(midB, A, B), hopVia(tailB, B, L)]) },
      { name: '3 nodes, chain', delay: ONE_WAY, legs: 3, run: () => viaMesh(chainB, [hopVia(midB, A, B), hopVia(tailB, B, L)]) },
    ];
    for (const c of configs) await c.run(); // warm-up: graphs, sockets
    const results = new Map<(typeof configs)[number], Run[]>();
    for (let r = 0; r < RUNS; r++) {
      for (const c of configs) {
        process.stderr.write(`run ${r + 1}/${RUNS}: ${c.name}, ${c.delay} ms\n`);
        results.set(c, [...(results.get(c) ?? []), await c.run()]);
      }
    }
    const compute = median(results.get(configs[0]!)!.map((x) => x.msPerToken));
    const reference = results.get(configs[0]!)![0]!.ids.join();
    const rows = configs.map((c) => {
      const rs = results.get(c)!;
      const ms = median(rs.map((x) => x.msPerToken));
      const floor = c.legs * c.delay + compute;
      return {
        config: c.name,
        one_way_ms: c.delay,
        legs_per_token: c.legs,
        ms_per_token: +ms.toFixed(2),
        tokens_per_s: +(1000 / ms).toFixed(2),
        floor_ms_per_token: +floor.toFixed(2),
        x_floor: +(ms / floor).toFixed(3),
        x_one_process_tok_s: +(compute / ms).toFixed(3),
        same_tokens_as_one_process: rs.every((x) => x.ids.join() === reference),
        // bf16 at hop boundaries may flip a near-tie against one process; chain and star must agree with each other.
        same_tokens_as_star: rs.every((x) => x.ids.join() === results.get(configs.find((o) => o.delay === c.delay && o.legs === 4)!)![0]!.ids.join()),
      };
    });
    const c0 = (r: (typeof rows)[number]) => (r.legs_per_token === 0 ? '-' : String(r.same_tokens_as_star));
    const row = (name: string, delay: number) => rows.find((r) => r.config === name && r.one_way_ms === delay)!;

    process.stderr.write('recovery: killing the middle of the 20 ms chain mid-generation...\n');
    await until(async () => (await fetch(`${tracker!.url}/api/route?model=${MODEL}`)).ok, 20_000, 'tracker route');
    const undisturbed = results.get(configs[4]!)![0]!.ids.join();
    const rec = await viaMesh(chainB, [hopVia(midB, A, B), hopVia(tailB, B, L)], { node: midB, afterTokens: 8 });
    void spareB;

    printTable(
      `WAN bench: ${MODEL} (${cfg.numLayers} layers, hidden ${cfg.hiddenSize}), 3 nodes [0,${A}) [${A},${B}) [${B},${L}), 1 ONNX thread each, ${NEW_TOKENS} new tokens, bf16 wire, medians of ${RUNS}; load ${loadBefore.toFixed(1)} → ${loadavg()[0]!.toFixed(1)} on ${cpus().length} cores`,
      ['config', 'one-way ms', 'legs', 'ms/token', 'tok/s', 'floor ms', '× floor', '× one process', 'tokens = one process', 'tokens = star'],
      rows.map((r) => [r.config, r.one_way_ms, r.legs_per_token, r.ms_per_token, r.tokens_per_s, r.floor_ms_per_token, r.x_floor, r.x_one_process_tok_s, String(r.same_tokens_as_one_process), c0(r)]),
    );
    const chainVsStar = row('3 nodes, chain', ONE_WAY).tokens_per_s / row('3 nodes, star', ONE_WAY).tokens_per_s;
    const chainFloor = row('3 nodes, chain', ONE_WAY).x_floor;
    const noDelay = row('3 nodes, chain', 0).x_one_process_tok_s;
    console.log(`chain vs star tok/s at ${ONE_WAY} ms one-way: ${chainVsStar.toFixed(3)}× (target ≥ 1.25: ${chainVsStar >= 1.25 ? 'met' : 'NOT met'})`);
    console.log(`chain ms/token vs its floor at ${ONE_WAY} ms: ${chainFloor}× (target ≤ 1.15: ${chainFloor <= 1.15 ? 'met' : 'NOT met'})`);
    console.log(`no delay, 3 nodes chain vs one process: ${noDelay}× (target ≥ 0.85: ${noDelay >= 0.85 ? 'met' : 'NOT met'})`);
    console.log(`recovery (middle killed after token 8, chain, ${ONE_WAY} ms): recovery_ms ${rec.recoveryMs ?? 'none'}, next token ${rec.nextTokenAfterKillMs?.toFixed(0)} ms after the kill; tokens unchanged: ${rec.ids.join() === undisturbed}`);
    writeResult(fileURLToPath(new URL(MODEL === 'small' && inject.length === 0 ? './results/wan.json' : `./results/wan-${MODEL}.json`, import.meta.url)), {
      bench: 'wan',
      model: MODEL,
      load_average_1m: loadAverage1m(loadBefore),
      one_way_ms: ONE_WAY,
      new_tokens: NEW_TOKENS,
      runs: RUNS,
      compute_ms_per_token: +compute.toFixed(2),
      rows,
      chain_vs_star_tok_s: +chainVsStar.toFixed(3),
      recovery: { killed_after_tokens: 8, recovery_ms: rec.recoveryMs ?? null, next_token_after_kill_ms: rec.nextTokenAfterKillMs ?? null, tokens_unchanged: rec.ids.join() === undisturbed },
    });
    await whole.release();
  } finally {
    await Promise.all(nodes.map((n) => n.stop()));
    await tracker?.stop();
    for (const r of relays) await r.stop();
    await delayed?.stop();
    await st.close();
    rmSync(work, { recursive: true, force: true });
  }
}

await main();
