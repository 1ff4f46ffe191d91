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
 *     one sample, from the warm-up);
 *   - self-speculation on a third head [0,4) (`--draft self:4`: the
 *     target's first 4 layers, its final norm and LM head) at adaptive k
 *     and at k = 4.
 *
 * `--first-generation`: only a draft model's first generations on a head
 * (nothing carried: the policy's start), each on a head of its own. Per
 * draft model (another seed: α ≈ 0, three heads; the target itself: α = 1,
 * two heads) each head gives speculation off, the first generation and the
 * second (carried),
 * interleaved; with `--baseline DIR` as many heads run DIR's checkout
 * (DIR/bin/meshnet.js; the hops are this checkout's) side by side. JSON in
 * bench/results/speculative-first.json.
 *
 * For each: α (maximum likelihood: accepted / (accepted + rejecting
 * trips)), the mean k drafted, tokens per decode trip against the theory
 * (1 − α^(k+1)) / (1 − α) averaged over the trips' k, tokens/s and its ratio
 * to off (decode: from the first token to the last), and whether the tokens
 * equal speculation off. Table on stdout, JSON in
 * bench/results/speculative.json.
 *
 *   npx tsx bench/speculative.ts [--quick] [--delay-ms 20] [--first-generation [--baseline DIR]]
 */
import { cpus, loadavg } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { GenerateRequest } from '../src/protocol/tracker.ts';
import { median } from './lib/wan.ts';
import { specRow, startSpecMesh, type SpecRun } from './lib/spec-mesh.ts';
import { loadAverage1m, printTable, writeResult } from './lib/stats.ts';

if (process.argv.includes('--help') || process.argv.includes('-h')) {
  process.stdout.write(`npx tsx bench/speculative.ts [options]
  speculative decoding on a 3-node chain over a delayed relay, against speculation off

  --quick          2 runs of 32 tokens (default: 3 runs of 48)
  --delay-ms N     one-way delay of a leg (default 20)
  --first-generation  only draft models' first generations on fresh heads (the policy's start), 3 heads each
  --baseline DIR   with --first-generation: as many heads run from DIR's checkout (DIR/bin/meshnet.js), side by side
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
const baselineArg = process.argv.indexOf('--baseline');
const BASELINE = baselineArg > 0 ? process.argv[baselineArg + 1] : undefined;
const MODEL = 'small';
const PROMPT = [{ role: 'user', content: 'Write a short story about a lighthouse keeper and a storm at sea.' }];

async function main(): Promise<void> {
  const loadBefore = loadavg()[0]!;
  // Head 0 holds the target itself as its draft model; head 1 the same preset made with another seed
  // (the same tokenizer, other weights: a draft model that is nearly always wrong).
  // Head 2 drafts with its own first 4 layers and the target's final norm and LM head (`--draft self:4`).
  const mesh = await startSpecMesh({ model: MODEL, cuts: [4, 8, 12], oneWayMs: ONE_WAY, heads: [0, 1, 'self:4'] });
  try {
    const viaMesh = (extra: Partial<GenerateRequest>, via = 0): Promise<SpecRun> => mesh.generate({ messages: PROMPT, max_tokens: NEW_TOKENS, ...extra }, via);
    const offRun = await viaMesh({ speculative: false });
    const reference = offRun.ids;
    const wrong = reference.map((t) => (t + 1) % 2048);
    const partly = reference.map((t, i) => (i % 4 === 3 ? (t + 1) % 2048 : t));
    // `via`: the head (0: target as draft; 1: another seed as draft; 2: self:4). Each head is its own process, so
    // each config's × off is against speculation off through the same head.
    const configs: Array<{ name: string; k: string; req: () => Partial<GenerateRequest>; via: number }> = [
      { name: 'off', k: '-', req: () => ({ speculative: false }), via: 0 },
      { name: 'oracle (prediction = reference)', k: '4', req: () => ({ draft_model: 'prompt-lookup', prediction_token_ids: reference, speculative_k: 4 }), via: 0 },
      { name: 'draft model = the target', k: '4', req: () => ({ speculative_k: 4 }), via: 0 },
      { name: 'draft model = the target', k: 'adaptive', req: () => ({}), via: 0 },
      { name: 'prompt lookup (text so far)', k: 'adaptive', req: () => ({ draft_model: 'prompt-lookup' }), via: 0 },
      // A middling α, for tokens per trip against theory: the output leaves the prediction at every 4th token and is found again in it.
      { name: 'prediction, every 4th token wrong', k: '4', req: () => ({ draft_model: 'prompt-lookup', prediction_token_ids: partly, speculative_k: 4 }), via: 0 },
      { name: 'useless drafter (α ≈ 0)', k: 'adaptive', req: () => ({ draft_model: 'prompt-lookup', prediction_token_ids: wrong }), via: 0 },
      { name: 'useless drafter (α ≈ 0)', k: '4', req: () => ({ draft_model: 'prompt-lookup', prediction_token_ids: wrong, speculative_k: 4 }), via: 0 },
      { name: 'off (head 1)', k: '-', req: () => ({ speculative: false }), via: 1 },
      { name: 'draft model = another seed (α ≈ 0)', k: 'adaptive', req: () => ({}), via: 1 },
      { name: 'draft model = another seed (α ≈ 0)', k: '4', req: () => ({ speculative_k: 4 }), via: 1 },
      { name: 'off (head 2)', k: '-', req: () => ({ speculative: false }), via: 2 },
      { name: 'self-speculation (first 4 layers + head)', k: 'adaptive', req: () => ({}), via: 2 },
      { name: 'self-speculation (first 4 layers + head)', k: '4', req: () => ({ speculative_k: 4 }), via: 2 },
    ];
    const runOf = (c: (typeof configs)[number]) => viaMesh(c.req(), c.via);
    // A head carries what its draft model's generations learnt (α, costs, probe back-off) to the next: the
    // disagreeing draft model's first generation on head 1 is the only one that starts with nothing carried,
    // and is kept as a row of its own (one sample). Head 1 is warmed first without touching that memory: the
    // oracle (its own span's verification shapes) and a sampled generation (its draft model's graphs: sampled
    // drafts are remembered apart from greedy ones).
    await viaMesh({ draft_model: 'prompt-lookup', prediction_token_ids: reference, speculative_k: 4 }, 1);
    await viaMesh({ temperature: 0.8, seed: 7, speculative_k: 2 }, 1);
    let cold: SpecRun | undefined;
    for (const c of configs) {
      const r = await runOf(c); // warm-up: graphs, sockets
      if (c.via === 1 && c.k === 'adaptive' && !cold) cold = r;
    }
    const results = new Map<(typeof configs)[number], SpecRun[]>();
    for (let r = 0; r < RUNS; r++) {
      for (const c of configs) {
        process.stderr.write(`run ${r + 1}/${RUNS}: ${c.name}, k ${c.k}\n`);
        results.set(c, [...(results.get(c) ?? []), await runOf(c)]);
      }
    }
    const offOf = (via: number) => median(results.get(configs.find((c) => c.k === '-' && c.via === via)!)!.map((x) => x.tokS));
    const coldConfig = { name: 'draft model = another seed, 1st generation (nothing carried; 1 sample)', k: 'adaptive', req: () => ({}), via: 1 };
    results.set(coldConfig, [cold!]);
    const rows = [...configs, coldConfig].map((c) => {
      const rs = results.get(c)!;
      return { drafter: c.name, k: c.k, head: c.via, ...specRow(rs, offOf(c.via)), same_tokens_as_off: rs.every((x) => x.ids.join() === reference.join()) };
    });
    printTable(
      `speculative decoding: ${MODEL} (12 layers, hidden 512), 3 nodes [0,4) [4,8) [8,12) chained, ${ONE_WAY} ms one-way a leg, 1 ONNX thread each, ${NEW_TOKENS} new tokens greedy, medians of ${RUNS}; × off against off through the same head; load ${loadBefore.toFixed(1)} → ${loadavg()[0]!.toFixed(1)} on ${cpus().length} cores (shared machine)`,
      ['drafter', 'head', 'k', 'mean k', 'α', 'tokens/trip', 'trips/token', 'theory', '× theory', 'tok/s', '× off', 'tokens = off'],
      rows.map((r) => [r.drafter, r.head, r.k, r.mean_k, r.alpha ?? '-', r.tokens_per_trip, r.trips_per_token, r.theory_tokens_per_trip, r.x_theory, r.tokens_per_s, r.x_off, String(r.same_tokens_as_off)]),
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
      model: MODEL,
      load_average_1m: loadAverage1m(loadBefore),
      one_way_ms: ONE_WAY,
      new_tokens: NEW_TOKENS,
      runs: RUNS,
      rows,
    });
  } finally {
    await mesh.stop();
  }
}

/**
 * A draft model's first generation on a head (nothing carried) against off
 * and its second generation, three fresh heads per draft model and variant.
 */
async function firstGeneration(): Promise<void> {
  const loadBefore = loadavg()[0]!;
  // Three fresh heads for the draft model that disagrees (its ratio to off is near 1: the noisier case), two for the target.
  const variants = [{ name: 'this checkout', bin: undefined as string | undefined }, ...(BASELINE ? [{ name: `baseline ${BASELINE}`, bin: join(BASELINE, 'bin', 'meshnet.js') }] : [])];
  const drafts = [
    { name: 'draft model = another seed (α ≈ 0)', seed: 1, heads: quick ? 1 : 3 },
    { name: 'draft model = the target (α = 1)', seed: 0, heads: quick ? 1 : 2 },
  ];
  // heads[v][d][i]: variant v, draft model d, the i-th fresh head.
  const layout = variants.flatMap((v, vi) => drafts.flatMap((d, di) => Array.from({ length: d.heads }, (_, i) => ({ vi, di, i, seed: d.seed, bin: v.bin }))));
  const mesh = await startSpecMesh({ model: MODEL, cuts: [4, 8, 12], oneWayMs: ONE_WAY, heads: layout.map((h) => h.seed), headBins: layout.map((h) => h.bin) });
  try {
    const viaMesh = (extra: Partial<GenerateRequest>, via: number): Promise<SpecRun> => mesh.generate({ messages: PROMPT, max_tokens: NEW_TOKENS, ...extra }, via);
    const reference = (await viaMesh({ speculative: false }, 0)).ids;
    // Warm every head without touching its greedy draft model's memory: a sampled generation at k = 4 runs its
    // span's verification shapes and its draft model's graphs (sampled drafts are remembered apart).
    for (let h = 0; h < layout.length; h++) {
      process.stderr.write(`warming head ${h + 1}/${layout.length}\n`);
      await viaMesh({ temperature: 0.8, seed: 7, speculative_k: 4 }, h);
    }
    const kinds = ['off', '1st generation (nothing carried)', '2nd generation (carried)'] as const;
    const results = new Map<string, SpecRun[]>();
    const key = (vi: number, di: number, kind: string) => `${vi}|${di}|${kind}`;
    for (let i = 0; i < Math.max(...drafts.map((d) => d.heads)); i++) {
      for (let vi = 0; vi < variants.length; vi++) {
        for (let di = 0; di < drafts.length; di++) {
          const h = layout.findIndex((x) => x.vi === vi && x.di === di && x.i === i);
          if (h < 0) continue;
          for (const kind of kinds) {
            process.stderr.write(`head ${h + 1}: ${variants[vi]!.name}, ${drafts[di]!.name}, ${kind}\n`);
            const r = await viaMesh(kind === 'off' ? { speculative: false } : {}, h);
            if (r.headLog.length > 0) process.stderr.write(`  head logged: ${r.headLog.join(' | ')}\n`);
            results.set(key(vi, di, kind), [...(results.get(key(vi, di, kind)) ?? []), r]);
          }
        }
      }
    }
    const rows = variants.flatMap((v, vi) =>
      drafts.flatMap((d, di) => {
        const off = results.get(key(vi, di, 'off'))!;
        const offTokS = median(off.map((x) => x.tokS));
        return kinds.map((kind) => {
          const rs = results.get(key(vi, di, kind))!;
          return {
            variant: v.name,
            drafter: d.name,
            generation: kind,
            ...specRow(rs, offTokS),
            // Each head's run against off through that same head.
            x_off_each: rs.map((x, i) => +(x.tokS / off[i]!.tokS).toFixed(3)),
            first_token_ms: Math.round(median(rs.map((x) => x.firstTokenMs))),
            // Tokens per second from the request (the first token's wait included).
            end_to_end_tokens_per_s: +median(rs.map((x) => (1000 * x.ids.length) / (x.firstTokenMs + (1000 * (x.ids.length - 1)) / x.tokS))).toFixed(2),
            max_gap_ms: Math.round(Math.max(...rs.map((x) => x.maxGapMs))),
            same_tokens_as_off: rs.every((x) => x.ids.join() === reference.join()),
          };
        });
      }),
    );
    printTable(
      `a draft model's first generation on a head: ${MODEL}, 3 nodes [0,4) [4,8) [8,12) chained, ${ONE_WAY} ms one-way a leg, 1 ONNX thread each, ${NEW_TOKENS} new tokens greedy, medians over fresh heads (${drafts.map((d) => `${d.heads} for ${d.name.replace('draft model = ', '')}`).join(', ')}); load ${loadBefore.toFixed(1)} → ${loadavg()[0]!.toFixed(1)} on ${cpus().length} cores (shared machine)`,
      ['variant', 'drafter', 'generation', 'mean k', 'α', 'tokens/trip', 'tok/s', '× off', '× off per head', '1st token ms', 'tok/s from request', 'max gap ms', 'tokens = off'],
      rows.map((r) => [r.variant, r.drafter, r.generation, r.mean_k, r.alpha ?? '-', r.tokens_per_trip, r.tokens_per_s, r.x_off, r.x_off_each.join(' '), r.first_token_ms, r.end_to_end_tokens_per_s, r.max_gap_ms, String(r.same_tokens_as_off)]),
    );
    for (const v of variants) {
      const first = rows.find((r) => r.variant === v.name && r.drafter.startsWith('draft model = another seed') && r.generation.startsWith('1st'))!.x_off;
      console.log(`${v.name}: a disagreeing draft model's first generation ${first}× of off (target ≥ 0.97: ${first >= 0.97 ? 'met' : 'NOT met'})`);
    }
    writeResult(fileURLToPath(new URL('./results/speculative-first.json', import.meta.url)), {
      bench: 'speculative --first-generation',
      model: MODEL,
      load_average_1m: loadAverage1m(loadBefore),
      one_way_ms: ONE_WAY,
      new_tokens: NEW_TOKENS,
      heads_each: Object.fromEntries(drafts.map((d) => [d.name, d.heads])),
      baseline: BASELINE ?? null,
      rows,
    });
  } finally {
    await mesh.stop();
  }
}

if (process.argv.includes('--first-generation')) await firstGeneration();
else await main();
