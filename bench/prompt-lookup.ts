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
 * bench/results/prompt-lookup.json.
 *
 *   npx tsx bench/prompt-lookup.ts [--quick] [--delay-ms 20]
 */
import { cpus, loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import { fixtureConfig, makeModel } from '../src/model/fixture.ts';
import { ReferenceModel } from '../src/model/reference.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { weightsFromFiles } from '../test/helpers/weights.ts';
import { median } from './lib/wan.ts';
import { specRow, startSpecMesh, type SpecRun } from './lib/spec-mesh.ts';
import { printTable, writeResult } from './lib/stats.ts';

if (process.argv.includes('--help') || process.argv.includes('-h')) {
  process.stdout.write(`npx tsx bench/prompt-lookup.ts [options]
  prompt lookup on input-grounded prompts (tiny-copy, a model that copies its input) on a 3-node chain over a delayed relay

  --quick          2 runs of 32 tokens (default: 3 runs of 48)
  --delay-ms N     one-way delay of a leg (default 20)
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

  const mesh = await startSpecMesh({ model: MODEL, cuts: [2, 4, 6], oneWayMs: ONE_WAY, heads: [null] });
  try {
    const configs = [
      { name: 'off', k: '-', req: { speculative: false } },
      { name: 'prompt lookup', k: 'adaptive', req: {} },
      { name: 'prompt lookup', k: '4', req: { speculative_k: 4 } },
    ];
    const runOf = (p: (typeof prompts)[number], c: (typeof configs)[number]) => mesh.generate({ prompt_token_ids: p.ids, max_tokens: NEW_TOKENS, ...c.req });
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
      const off = results.get(`${p.name}|off|-`)!;
      const offTokS = median(off.map((x) => x.tokS));
      const offIds = off[0]!.ids;
      return configs.map((c) => {
        const rs = results.get(`${p.name}|${c.name}|${c.k}`)!;
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
    const worst = Math.min(...lookup.map((r) => r.x_off));
    console.log(`prompt lookup (default, adaptive k) on input-grounded prompts: ${lookup.map((r) => `${r.prompt} ${r.x_off}×`).join(', ')} of off (target ≥ 1.5: ${worst >= 1.5 ? 'met' : 'NOT met'} by the worst)`);
    writeResult(fileURLToPath(new URL('./results/prompt-lookup.json', import.meta.url)), {
      bench: 'prompt-lookup',
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
    await mesh.stop();
  }
}

await main();
