/**
 * Speculative decoding over a WAN: the `small` fixture (12 layers, hidden
 * 512) on 3 real `meshnet node` processes (head [0,4), middle [4,8), tail
 * [8,12)), chained, every node behind one user-space delaying proxy in front
 * of the relay (20 ms one-way a leg, bench/lib/wan.ts), side by side in one
 * run against speculation off:
 *
 *   - oracle: a prediction that is the reference continuation
 *     (prediction_token_ids: OpenAI's Predicted Outputs used as an oracle,
 *     α = 1 at no draft cost, the upper bound) at k = 4;
 *   - the target itself as the draft model (`--draft` = the same
 *     checkpoint: α = 1, each draft costs a whole-model step on the head) at
 *     k = 4 and adaptive;
 *   - prompt lookup (adaptive; over this random-weight model's own text,
 *     which rarely repeats within the run);
 *   - a prediction with every 4th token wrong at k = 4 (a middling α, to
 *     hold tokens per trip against theory);
 *   - a useless drafter (a prediction of wrong tokens: α ≈ 0) at adaptive k,
 *     and at k = 4 to show what the adaptation saves;
 *   - a draft model that disagrees with the target (the same preset made
 *     with another seed, on a second head [0,4): α ≈ 0, every draft costs
 *     a whole-model step) at adaptive k and at k = 4, and its very first
 *     generation on that head (nothing carried from earlier generations:
 *     one sample, from the warm-up).
 *
 * For each: α (maximum likelihood: accepted / (accepted + rejecting
 * trips)), the mean k drafted, tokens per decode trip against the theory
 * (1 − α^(k+1)) / (1 − α) averaged over the trips' k, tokens/s and its ratio
 * to off (decode: from the first token to the last), and whether the tokens
 * equal speculation off. Table on stdout, JSON in
 * bench/results/speculative.json.
 *
 *   npx tsx bench/speculative.ts [--quick] [--delay-ms 20]
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import { Identity } from '../src/net/identity.ts';
import type { GenerateEvent, GenerateRequest, RouteHop } from '../src/protocol/tracker.ts';
import { expectedTokens } from '../src/node/head/speculation/adaptive-k.ts';
import { generateDirect, signedRouteHeaders, startNode, startTrackerProc, type NodeProc } from '../test/helpers/mesh.ts';
import { median, startDelayedRelay, type DelayedRelay } from './lib/wan.ts';
import { printTable, writeResult } from './lib/stats.ts';

if (process.argv.includes('--help') || process.argv.includes('-h')) {
  process.stdout.write(`npx tsx bench/speculative.ts [options]
  speculative decoding on a 3-node chain over a delayed relay, against speculation off

  --quick          2 runs of 32 tokens (default: 3 runs of 48)
  --delay-ms N     one-way delay of a leg (default 20)
  --help           this text

  Table on stdout; JSON in bench/results/speculative.json.
`);
  process.exit(0);
}
const quick = process.argv.includes('--quick');
const RUNS = quick ? 2 : 3;
const NEW_TOKENS = quick ? 32 : 48;
const delayArg = process.argv.indexOf('--delay-ms');
const ONE_WAY = delayArg > 0 ? Number(process.argv[delayArg + 1]) : 20;
const MODEL = 'small';
const PROMPT = [{ role: 'user', content: 'Write a short story about a lighthouse keeper and a storm at sea.' }];

interface Run {
  ids: number[];
  tokS: number;
  /** Per decode trip: drafted, accepted (trips without drafts: 0, 0), tokens emitted. */
  trips: Array<{ drafted: number; accepted: number; tokens: number }>;
}

async function main(): Promise<void> {
  const loadBefore = loadavg()[0]!;
  const st = await startStaticServer({ root: await ensureModel(MODEL) });
  // Another seed of the same preset: the same tokenizer, other weights (a draft model that is nearly always wrong).
  const st2 = await startStaticServer({ root: await ensureModel(MODEL, undefined, 1) });
  const work = mkdtempSync(join(tmpdir(), 'meshnet-bench-spec-'));
  const nodes: NodeProc[] = [];
  let delayed: DelayedRelay | undefined;
  let tracker: Awaited<ReturnType<typeof startTrackerProc>> | undefined;
  try {
    const trackerId = await Identity.generate();
    const keyFile = join(work, 'tracker-key.json');
    writeFileSync(keyFile, JSON.stringify(await trackerId.export()));
    delayed = await startDelayedRelay(ONE_WAY);
    tracker = await startTrackerProc(['--model', `${MODEL}=${st.url}`, '--relay', delayed.relay.url, '--key-file', keyFile, '--heartbeat-interval-ms', '1000']);
    process.stderr.write('starting nodes...\n');
    const base = ['--model', MODEL, '--model-url', st.url, '--budget-mb', '2048', '--threads', '1', '--max-context', '512', '--no-links', '--relay', delayed.url, '--tracker', tracker.url];
    const [head, mid, tail, head2] = await Promise.all([startNode([...base, '--layers', '0-4', '--draft', st.url]), startNode([...base, '--layers', '4-8']), startNode([...base, '--layers', '8-12']), startNode([...base, '--layers', '0-4', '--draft', st2.url])]);
    nodes.push(head!, mid!, tail!, head2!);
    await Promise.all(nodes.map((n) => n.waitFor((e) => e.event === 'registered')));
    const hops: RouteHop[] = [mid!, tail!].map((n, i) => ({ peer_id: n.peerId, start_layer: 4 + 4 * i, end_layer: 8 + 4 * i, relay_addr: n.relayAddr! }));
    if (!mid!.relayAddr?.startsWith(delayed.url)) throw new Error(`the relay gave ${mid!.relayAddr}, not the proxy's address`);

    let runId = 0;
    const viaMesh = async (extra: Partial<GenerateRequest>, via: NodeProc = head!): Promise<Run> => {
      const headers = await signedRouteHeaders(trackerId, via, hops);
      let tFirst = 0;
      let tLast = 0;
      const ids: number[] = [];
      const trips: Run['trips'] = [];
      for await (const ev of generateDirect(via.endpoint, headers, { messages: PROMPT, max_tokens: NEW_TOKENS, temperature: 0, session_id: `spec-${++runId}`, ...extra }) as AsyncIterable<GenerateEvent>) {
        if (ev.type === 'token') {
          tLast = performance.now();
          if (ids.length === 0) tFirst = tLast;
          ids.push(ev.token_id);
          // A trip's first token carries its counts; tokens without them continue the trip (or are plain trips).
          if (ev.drafted !== undefined) trips.push({ drafted: ev.drafted, accepted: ev.accepted ?? 0, tokens: 1 });
          else if (trips.length > 0 && trips.at(-1)!.tokens < trips.at(-1)!.accepted + 1) trips.at(-1)!.tokens++;
          else trips.push({ drafted: 0, accepted: 0, tokens: 1 });
        } else if (ev.type === 'error') throw new Error(`${ev.code}: ${ev.message}`);
      }
      // The prompt's step is no decode trip.
      trips.shift();
      return { ids, tokS: (1000 * (ids.length - 1)) / (tLast - tFirst), trips };
    };

    const offRun = await viaMesh({ speculative: false });
    const reference = offRun.ids;
    const wrong = reference.map((t) => (t + 1) % 2048);
    const partly = reference.map((t, i) => (i % 4 === 3 ? (t + 1) % 2048 : t));
    const configs: Array<{ name: string; k: string; req: () => Partial<GenerateRequest>; otherDraft?: boolean }> = [
      { name: 'off', k: '-', req: () => ({ speculative: false }) },
      { name: 'oracle (prediction = reference)', k: '4', req: () => ({ draft_model: 'prompt-lookup', prediction_token_ids: reference, speculative_k: 4 }) },
      { name: 'draft model = the target', k: '4', req: () => ({ speculative_k: 4 }) },
      { name: 'draft model = the target', k: 'adaptive', req: () => ({}) },
      { name: 'prompt lookup (text so far)', k: 'adaptive', req: () => ({ draft_model: 'prompt-lookup' }) },
      // A middling α, for tokens per trip against theory: the output leaves the prediction at every 4th token and is found again in it.
      { name: 'prediction, every 4th token wrong', k: '4', req: () => ({ draft_model: 'prompt-lookup', prediction_token_ids: partly, speculative_k: 4 }) },
      { name: 'useless drafter (α ≈ 0)', k: 'adaptive', req: () => ({ draft_model: 'prompt-lookup', prediction_token_ids: wrong }) },
      { name: 'useless drafter (α ≈ 0)', k: '4', req: () => ({ draft_model: 'prompt-lookup', prediction_token_ids: wrong, speculative_k: 4 }) },
      { name: 'draft model = another seed (α ≈ 0)', k: 'adaptive', req: () => ({}), otherDraft: true },
      { name: 'draft model = another seed (α ≈ 0)', k: '4', req: () => ({ speculative_k: 4 }), otherDraft: true },
    ];
    const runOf = (c: (typeof configs)[number]) => viaMesh(c.req(), c.otherDraft ? head2! : head!);
    // Warm-up: graphs, sockets. A head carries what its draft model's generations learnt (α, costs, probe
    // back-off) to the next: the disagreeing draft model's first generation on head2 is the only one that
    // starts with nothing carried, so it is kept as a row of its own (one sample).
    let cold: Run | undefined;
    for (const c of configs) {
      const r = await runOf(c);
      if (c.otherDraft && c.k === 'adaptive' && !cold) cold = r;
    }
    const results = new Map<(typeof configs)[number], Run[]>();
    for (let r = 0; r < RUNS; r++) {
      for (const c of configs) {
        process.stderr.write(`run ${r + 1}/${RUNS}: ${c.name}, k ${c.k}\n`);
        results.set(c, [...(results.get(c) ?? []), await runOf(c)]);
      }
    }
    const offTokS = median(results.get(configs[0]!)!.map((x) => x.tokS));
    const coldConfig = { name: 'draft model = another seed, 1st generation (nothing carried; 1 sample)', k: 'adaptive', req: () => ({}), otherDraft: true };
    results.set(coldConfig, [cold!]);
    const rows = [...configs, coldConfig].map((c) => {
      const rs = results.get(c)!;
      const trips = rs.flatMap((x) => x.trips);
      const drafting = trips.filter((t) => t.drafted > 0);
      const accepted = drafting.reduce((n, t) => n + t.accepted, 0);
      const rejecting = drafting.filter((t) => t.accepted < t.drafted).length;
      const alpha = drafting.length === 0 ? null : accepted / Math.max(1, accepted + rejecting);
      const tokensPerTrip = trips.reduce((n, t) => n + t.tokens, 0) / Math.max(1, trips.length);
      const theory = alpha === null ? 1 : trips.reduce((n, t) => n + expectedTokens(alpha, t.drafted), 0) / Math.max(1, trips.length);
      const tokS = median(rs.map((x) => x.tokS));
      return {
        drafter: c.name,
        k: c.k,
        mean_k: +(trips.reduce((n, t) => n + t.drafted, 0) / Math.max(1, trips.length)).toFixed(2),
        alpha: alpha === null ? null : +alpha.toFixed(3),
        tokens_per_trip: +tokensPerTrip.toFixed(3),
        trips_per_token: +(1 / tokensPerTrip).toFixed(3),
        theory_tokens_per_trip: +theory.toFixed(3),
        x_theory: +(tokensPerTrip / theory).toFixed(3),
        tokens_per_s: +tokS.toFixed(2),
        x_off: +(tokS / offTokS).toFixed(3),
        same_tokens_as_off: rs.every((x) => x.ids.join() === reference.join()),
      };
    });
    printTable(
      `speculative decoding: ${MODEL} (12 layers, hidden 512), 3 nodes [0,4) [4,8) [8,12) chained, ${ONE_WAY} ms one-way a leg, 1 ONNX thread each, ${NEW_TOKENS} new tokens greedy, medians of ${RUNS}; load ${loadBefore.toFixed(1)} → ${loadavg()[0]!.toFixed(1)} on ${cpus().length} cores (shared machine)`,
      ['drafter', 'k', 'mean k', 'α', 'tokens/trip', 'trips/token', 'theory', '× theory', 'tok/s', '× off', 'tokens = off'],
      rows.map((r) => [r.drafter, r.k, r.mean_k, r.alpha ?? '-', r.tokens_per_trip, r.trips_per_token, r.theory_tokens_per_trip, r.x_theory, r.tokens_per_s, r.x_off, String(r.same_tokens_as_off)]),
    );
    const row = (name: string, k: string) => rows.find((r) => r.drafter.startsWith(name) && r.k === k)!;
    const oracle = row('oracle', '4').x_off;
    const useless = row('useless', 'adaptive').x_off;
    const otherAdaptive = row('draft model = another seed (', 'adaptive').x_off;
    console.log(`oracle at k = 4: ${oracle}× tok/s of off (target ≥ 3: ${oracle >= 3 ? 'met' : 'NOT met'})`);
    console.log(`useless drafter, adaptive k: ${useless}× of off (target ≥ 0.97: ${useless >= 0.97 ? 'met' : 'NOT met'})`);
    console.log(`a disagreeing draft model, adaptive k: ${otherAdaptive}× of off (target ≥ 0.97: ${otherAdaptive >= 0.97 ? 'met' : 'NOT met'}); its first generation, nothing carried: ${row('draft model = another seed, 1st', 'adaptive').x_off}×; at k = 4: ${row('draft model = another seed (', '4').x_off}×`);
    console.log(`tokens per trip against theory: ${rows.filter((r) => r.alpha !== null).map((r) => `${r.drafter} k ${r.k}: ${r.x_theory}×`).join('; ')} (target ≥ 0.9)`);
    writeResult(fileURLToPath(new URL('./results/speculative.json', import.meta.url)), {
      bench: 'speculative',
      date: new Date().toISOString(),
      model: MODEL,
      cpus: cpus().length,
      load_average_1m: { before: +loadBefore.toFixed(2), after: +loadavg()[0]!.toFixed(2) },
      one_way_ms: ONE_WAY,
      new_tokens: NEW_TOKENS,
      runs: RUNS,
      rows,
    });
  } finally {
    await Promise.all(nodes.map((n) => n.stop()));
    await tracker?.stop();
    await delayed?.stop();
    await st.close();
    await st2.close();
    rmSync(work, { recursive: true, force: true });
  }
}

await main();
