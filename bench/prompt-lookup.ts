/**
 * Prompt lookup (n-gram drafting, on by default) on input-grounded prompts,
 * over a WAN: the `tiny-copy` fixture (6 layers; weights written so that it
 * copies its input like an induction head: after "a b c" it writes what
 * followed the last earlier "a b c", src/model/fixture-copy.ts) on 3 real
 * `meshnet node` processes chained ([0,2) [2,4) [4,6)), 20 ms one-way a
 * leg (bench/lib/spec-mesh.ts). Random-weight fixtures never repeat their
 * input, so this model stands in for a model asked to quote, edit or
 * extract from what it was given.
 *
 * For each prompt (a passage to quote, notes to sum up, a question
 * answered from a paragraph): speculation off, prompt lookup at the
 * adaptive k (the default), and at k = 4; medians of 3, interleaved in one
 * run. Every run's tokens are compared with speculation off, and off's with
 * the float64 reference (src/model/reference.ts). Table on stdout, JSON in
 * bench/results/prompt-lookup.json. With `--baseline DIR` a second head runs
 * DIR's checkout (DIR/bin/meshnet.js) beside this one's, off and adaptive
 * interleaved on both (the hops are this checkout's).
 *
 *   npx tsx bench/prompt-lookup.ts [--quick] [--delay-ms 20] [--baseline DIR]
 */
import { cpus, loadavg } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { fixtureConfig, makeModel } from '../src/model/fixture.ts';
import { ReferenceModel } from '../src/model/reference.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { weightsFromFiles } from '../test/helpers/weights.ts';
import { median } from './lib/wan.ts';
import { specRow, startSpecMesh, type SpecRun } from './lib/spec-mesh.ts';
import { loadAverage1m, printTable, writeResult } from './lib/stats.ts';

if (process.argv.includes('--help') || process.argv.includes('-h')) {
  process.stdout.write(`npx tsx bench/prompt-lookup.ts [options]
  prompt lookup on input-grounded prompts (tiny-copy, a model that copies its input) on a 3-node chain over a delayed relay

  --quick          2 runs of 32 tokens (default: 3 runs of 48)
  --delay-ms N     one-way delay of a leg (default 20)
  --baseline DIR   a second head from DIR's checkout (DIR/bin/meshnet.js): off and adaptive on both, side by side
  --help           this text

  Table on stdout; JSON in bench/results/prompt-lookup.json.
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
const MODEL = 'tiny-copy';

const PROMPTS: Array<{ name: string; text: string }> = [
  {
    name: 'quote a passage',
    text:
      'Copy the text below.\n\nThe keeper climbed the stairs of the lighthouse every night at dusk. He trimmed the wick, wound the clockwork ' +
      'that turned the lens, and wrote the weather in a small book. When the fog came in he rang the bell until morning.\n\nCopy: The keeper',
  },
  {
    name: 'sum up notes',
    text:
      'Notes from the meeting: the bridge will close for repairs on the first of June, and the trains will run every twenty minutes ' +
      'instead of every ten while the work goes on. The new timetable will hang on the station wall from Monday.\n\nSummary: the bridge will close',
  },
  {
    name: 'answer from a paragraph',
    text:
      'The harbour master keeps a list of the boats that leave each morning. The red boat goes to the northern islands with the mail and ' +
      'comes back before dark. The blue boat carries fish to the market in the town across the bay.\n\n' +
      'Question: where does the red boat go?\nAnswer: The red boat goes',
  },
];

async function main(): Promise<void> {
  const loadBefore = loadavg()[0]!;
  // The checkpoint the nodes load (ensureModel writes these same files), in memory for the reference.
  const files = makeModel(MODEL);
  const json = (name: string): unknown => JSON.parse(new TextDecoder().decode(files.get(name)!));
  const tok = ModelTokenizer.fromJson(json('tokenizer.json'), json('tokenizer_config.json'));
  const cfg = fixtureConfig(MODEL);
  const prompts = PROMPTS.map((p) => ({ ...p, ids: tok.encode(p.text) }));
  process.stderr.write('float64 reference...\n');
  const ref = new ReferenceModel(cfg, weightsFromFiles(files));
  const reference = prompts.map((p) => ref.greedy(p.ids, NEW_TOKENS));

  const heads = BASELINE ? [undefined, join(BASELINE, 'bin', 'meshnet.js')] : [undefined];
  const mesh = await startSpecMesh({ model: MODEL, cuts: [2, 4, 6], oneWayMs: ONE_WAY, heads: heads.map(() => null), headBins: heads });
  try {
    // With a baseline: off and the adaptive k through each head (a fixed k's policy is the same in both).
    const configs = [
      { name: 'off', k: '-', req: { speculative: false }, via: 0 },
      { name: 'prompt lookup', k: 'adaptive', req: {}, via: 0 },
      ...(BASELINE
        ? [
            { name: 'off (baseline head)', k: '-', req: { speculative: false }, via: 1 },
            { name: 'prompt lookup (baseline head)', k: 'adaptive', req: {}, via: 1 },
          ]
        : [{ name: 'prompt lookup', k: '4', req: { speculative_k: 4 }, via: 0 }]),
    ];
    const runOf = (p: (typeof prompts)[number], c: (typeof configs)[number]) => mesh.generate({ prompt_token_ids: p.ids, max_tokens: NEW_TOKENS, ...c.req }, c.via);
    for (const p of prompts) for (const c of configs) await runOf(p, c); // warm-up: graphs, sockets
    const results = new Map<string, SpecRun[]>();
    for (let r = 0; r < RUNS; r++) {
      for (const p of prompts) {
        for (const c of configs) {
          process.stderr.write(`run ${r + 1}/${RUNS}: ${p.name}, ${c.name}, k ${c.k}\n`);
          const key = `${p.name}|${c.name}|${c.k}`;
          results.set(key, [...(results.get(key) ?? []), await runOf(p, c)]);
        }
      }
    }
    const rows = prompts.flatMap((p, i) => {
      const offOf = (via: number) => results.get(`${p.name}|${configs.find((c) => c.k === '-' && c.via === via)!.name}|-`)!;
      const off = offOf(0);
      const offIds = off[0]!.ids;
      return configs.map((c) => {
        const rs = results.get(`${p.name}|${c.name}|${c.k}`)!;
        // × off against off through the same head.
        const offTokS = median(offOf(c.via).map((x) => x.tokS));
        return {
          prompt: p.name,
          prompt_tokens: p.ids.length,
          drafter: c.name,
          k: c.k,
          ...specRow(rs, offTokS),
          same_tokens_as_off: rs.every((x) => x.ids.join() === offIds.join()),
          off_equals_reference: off.every((x) => x.ids.join() === reference[i]!.join()),
          copied: JSON.stringify(tok.decode(offIds)).slice(0, 60),
        };
      });
    });
    printTable(
      `prompt lookup on input-grounded prompts: ${MODEL} (6 layers, hidden ${cfg.hiddenSize}; copies its input), 3 nodes [0,2) [2,4) [4,6) chained, ${ONE_WAY} ms one-way a leg, 1 ONNX thread each, ${NEW_TOKENS} new tokens greedy, medians of ${RUNS}; load ${loadBefore.toFixed(1)} → ${loadavg()[0]!.toFixed(1)} on ${cpus().length} cores (shared machine)`,
      ['prompt', 'drafter', 'k', 'mean k', 'α', 'tokens/trip', 'theory', '× theory', 'tok/s', '× off', 'tokens = off', 'off = float64 ref'],
      rows.map((r) => [r.prompt, r.drafter, r.k, r.mean_k, r.alpha ?? '-', r.tokens_per_trip, r.theory_tokens_per_trip, r.x_theory, r.tokens_per_s, r.x_off, String(r.same_tokens_as_off), String(r.off_equals_reference)]),
    );
    for (const p of prompts) console.log(`${p.name}: writes ${rows.find((r) => r.prompt === p.name)!.copied}`);
    const lookup = rows.filter((r) => r.drafter === 'prompt lookup' && r.k === 'adaptive');
    if (BASELINE) {
      const base = rows.filter((r) => r.drafter === 'prompt lookup (baseline head)');
      console.log(`baseline ${BASELINE}, adaptive k: ${base.map((r) => `${r.prompt} ${r.x_off}×`).join(', ')} of off through its head`);
    }
    const worst = Math.min(...lookup.map((r) => r.x_off));
    console.log(`prompt lookup (default, adaptive k) on input-grounded prompts: ${lookup.map((r) => `${r.prompt} ${r.x_off}×`).join(', ')} of off (target ≥ 1.5: ${worst >= 1.5 ? 'met' : 'NOT met'} by the worst)`);
    writeResult(fileURLToPath(new URL('./results/prompt-lookup.json', import.meta.url)), {
      bench: 'prompt-lookup',
      model: MODEL,
      load_average_1m: loadAverage1m(loadBefore),
      one_way_ms: ONE_WAY,
      new_tokens: NEW_TOKENS,
      runs: RUNS,
      baseline: BASELINE ?? null,
      rows,
    });
  } finally {
    await mesh.stop();
  }
}

await main();
