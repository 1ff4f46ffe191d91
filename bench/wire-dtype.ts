/**
 * What the wire dtype costs and buys, side by side in one run: `small`
 * (12 layers, hidden 512) on real `meshnet node` processes on loopback,
 * 64 greedy tokens,
 *
 *   - un-split: one node holding every layer (no hop);
 *   - 3 nodes, bf16 between hops (the default);
 *   - 3 nodes, f32 between hops (`--wire-dtype f32`);
 *
 * each over direct links (the head dials its hops), configurations
 * interleaved, medians of several runs, with the first token that differs
 * from the un-split run. Table on stdout, JSON in bench/results/wire-dtype.json.
 *
 *   npx tsx bench/wire-dtype.ts [--quick]
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import { cpus, loadavg } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import type { GenerateEvent, RouteHop } from '../src/protocol/tracker.ts';
import { generateDirect, hopOf, startNode, testSigner, type NodeProc } from '../test/helpers/mesh.ts';
import { firstDivergence, loadAverage1m, median } from './lib/stats.ts';

const quick = process.argv.includes('--quick');
const RUNS = quick ? 2 : 5;
const NEW_TOKENS = 64;
const PROMPT = [{ role: 'user', content: 'Write a short story about a lighthouse keeper and a storm at sea.' }];
const here = fileURLToPath(new URL('.', import.meta.url));

interface RunResult {
  ttftMs: number;
  decodeTps: number;
  ids: number[];
}

async function main(): Promise<void> {
  const loadBefore = loadavg()[0]!;
  const st = await startStaticServer({ root: await ensureModel('small') });
  const signer = await testSigner();
  const nodes: NodeProc[] = [];
  try {
    const common = ['--model-url', st.url, '--tracker-key', signer.publicKey, '--budget-mb', '512', '--max-context', '256', '--threads', '1'];
    process.stderr.write('starting nodes...\n');
    // Two at a time: loading is CPU-bound. The middle and tail take any dtype (no --wire-dtype) and answer in kind.
    const [whole, headBf16] = await Promise.all([startNode([...common, '--layers', '0-12']), startNode([...common, '--layers', '0-4'])]);
    const [headF32, middle] = await Promise.all([startNode([...common, '--layers', '0-4', '--wire-dtype', 'f32']), startNode([...common, '--layers', '4-8'])]);
    const tail = await startNode([...common, '--layers', '8-12']);
    nodes.push(whole, headBf16, headF32, middle, tail);

    let runId = 0;
    const run = async (head: NodeProc, hops: RouteHop[]): Promise<RunResult> => {
      const headers = await signer.sign(head.peerId, hops, 600_000);
      const t0 = performance.now();
      let tFirst = 0;
      let tLast = 0;
      const ids: number[] = [];
      for await (const ev of generateDirect(head.endpoint, headers, { messages: PROMPT, max_tokens: NEW_TOKENS, temperature: 0, session_id: `wire-${++runId}` }) as AsyncIterable<GenerateEvent>) {
        if (ev.type === 'token') {
          tLast = performance.now();
          if (ids.length === 0) tFirst = tLast;
          ids.push(ev.token_id);
        } else if (ev.type === 'error') throw new Error(`${ev.code}: ${ev.message}`);
      }
      return { ttftMs: tFirst - t0, decodeTps: ((ids.length - 1) * 1000) / (tLast - tFirst), ids };
    };
    const split = [hopOf(middle, 4, 8, 'direct'), hopOf(tail, 8, 12, 'direct')];
    const configs = [
      { config: 'un-split (1 node)', wire: '-', bytesPerToken: 0, run: () => run(whole, []) },
      { config: '3 nodes', wire: 'bf16', bytesPerToken: 512 * 2, run: () => run(headBf16, split) },
      { config: '3 nodes', wire: 'f32', bytesPerToken: 512 * 4, run: () => run(headF32, split) },
    ];
    // Warm every path once (graphs, direct links), then interleave so drift hits all alike.
    for (const cf of configs) await cf.run();
    const results = new Map<(typeof configs)[number], RunResult[]>();
    for (let r = 0; r < RUNS; r++) {
      for (const cf of configs) {
        process.stderr.write(`run ${r + 1}/${RUNS}: ${cf.config} (${cf.wire})\n`);
        results.set(cf, [...(results.get(cf) ?? []), await cf.run()]);
      }
    }
    const reference = results.get(configs[0]!)![0]!.ids;
    const base = median(results.get(configs[0]!)!.map((x) => x.decodeTps));
    const split3 = median(results.get(configs[1]!)!.map((x) => x.decodeTps));
    const rows = configs.map((cf) => {
      const rs = results.get(cf)!;
      const tps = median(rs.map((x) => x.decodeTps));
      return {
        config: cf.config,
        wire_dtype: cf.wire,
        activation_bytes_per_hop_per_token: cf.bytesPerToken,
        ttft_ms: +median(rs.map((x) => x.ttftMs)).toFixed(1),
        decode_tokens_per_s: +tps.toFixed(1),
        ratio_vs_unsplit: +(tps / base).toFixed(3),
        ratio_vs_bf16_split: cf.wire === '-' ? null : +(tps / split3).toFixed(3),
        tokens: rs[0]!.ids.length,
        first_divergence: firstDivergence(rs[0]!.ids, reference),
        same_tokens_every_run: rs.every((x) => x.ids.join() === rs[0]!.ids.join()),
      };
    });

    const pad = (s: string | number | null, n: number) => String(s).padEnd(n);
    console.log(`\n1-minute load average before/after: ${loadBefore.toFixed(2)} / ${loadavg()[0]!.toFixed(2)} on ${cpus().length} cores`);
    console.log(`wire dtype bench: small (12 layers, hidden 512), ${NEW_TOKENS} greedy tokens, direct links, 1 ONNX thread per process, medians of ${RUNS}`);
    console.log(`${pad('config', 20)}${pad('wire', 7)}${pad('B/hop/token', 13)}${pad('TTFT ms', 10)}${pad('decode tok/s', 14)}${pad('× un-split', 12)}${pad('× bf16 split', 14)}first token ≠ un-split`);
    for (const r of rows) {
      console.log(`${pad(r.config, 20)}${pad(r.wire_dtype, 7)}${pad(r.activation_bytes_per_hop_per_token || '-', 13)}${pad(r.ttft_ms, 10)}${pad(r.decode_tokens_per_s, 14)}${pad(r.ratio_vs_unsplit.toFixed(3), 12)}${pad(r.ratio_vs_bf16_split?.toFixed(3) ?? '-', 14)}${r.first_divergence ?? 'none'}`);
    }
    mkdirSync(join(here, 'results'), { recursive: true });
    writeFileSync(
      join(here, 'results', 'wire-dtype.json'),
      JSON.stringify({ bench: 'wire-dtype', date: new Date().toISOString(), model: 'small', cpus: cpus().length, load_average_1m: loadAverage1m(loadBefore), new_tokens: NEW_TOKENS, runs: RUNS, rows }, null, 2) + '\n',
    );
  } finally {
    await Promise.all(nodes.map((n) => n.stop()));
    await st.close();
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
