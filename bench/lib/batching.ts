/**
 * The batching comparison of bench/load.ts (`--batching`; docs/architecture.md, "Batching at a hop"): two
 * split meshes (3 nodes each, layers 0-4 / 4-8 / 8-12 of `small`, every chat
 * crosses all three) up at once — batching off (`--max-batch 1`) and on —
 * and 1, 2, 4, 8, 16 chats at once, the two meshes' rounds interleaved
 * (off, on, off, on, …) so that a busy machine slows both alike. Per row:
 * aggregate tokens/s, its ratio to one chat on the same mesh (the target:
 * ≥ 4× at 8 chats with batching on), p50/p95 time between tokens within a
 * chat, chats whose text differs from the same prompt alone (target 0), and
 * the batch sizes the nodes ran (GET /info), and CPU ms per token of every
 * process (relay, tracker, each node: where a token's time goes).
 */
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer } from '../../src/cli/static-server.ts';
import { aloneTexts, round, startMesh, type Mesh, type RoundSink } from './load-mesh.ts';
import { fmt, printTable, quantile, writeResult } from './stats.ts';
import { cpuSpent, meshPids, sampleMesh } from './proc-cpu.ts';

export interface BatchingOptions {
  quick: boolean;
  label: string;
  /** The "on" side's --max-batch. */
  maxBatch: number;
  maxTokens: number;
  queueWaitMs: number;
  out: string;
}

const CHATS = [1, 2, 4, 8, 16];

interface Row {
  chats: number;
  rounds: number;
  ok: number;
  failed: number;
  text_mismatches: number;
  tokens: number;
  aggregate_tokens_per_s: number;
  tbt_p50_ms: number;
  tbt_p95_ms: number;
  /** CPU ms per generated token of each process (relay, tracker, node1..3) and all together, over this row's rounds. */
  cpu_ms_per_token: Record<string, number>;
}

interface Side {
  max_batch: number;
  rows: Row[];
  /** Per node: runs by batch size (index = sessions in the run), over the whole run. */
  node_batch_sizes: number[][];
}

async function nodeBatchSizes(m: Mesh): Promise<number[][]> {
  return Promise.all(m.nodes.map(async (n) => ((await (await fetch(`${n.endpoint}/info`)).json()) as { batch?: { sizes: number[] } }).batch?.sizes ?? []));
}

export async function runBatching(o: BatchingOptions): Promise<void> {
  const st = await startStaticServer({ root: await ensureModel('small') });
  const meshes: Mesh[] = [];
  const sides: Side[] = [];
  try {
    const batches = [1, o.maxBatch];
    for (const mb of batches) {
      process.stderr.write(`\n[batching] --max-batch ${mb}: starting relay, tracker and 3 nodes...\n`);
      meshes.push(await startMesh('split', `${st.url}/`, { maxBatch: String(mb), maxTokens: o.maxTokens }));
    }
    process.stderr.write('[batching] warm-up and every prompt alone, on each mesh...\n');
    const alone = [await aloneTexts(meshes[0]!), await aloneTexts(meshes[1]!)];
    const rows: Row[][] = [[], []];
    for (const c of CHATS) {
      const reps = o.quick ? (c <= 4 ? 3 : 2) : c <= 4 ? 6 : 3;
      const sinks: RoundSink[] = [0, 1].map(() => ({ gaps: [], busyMs: 0, tokens: 0 }));
      const acc = [0, 1].map(() => ({ ok: 0, failed: 0, mismatches: 0 }));
      const cpu: Array<Record<string, number>> = [{}, {}];
      process.stderr.write(`[batching] ${c} at once, ${reps} rounds per mesh, interleaved...\n`);
      for (let r = 0; r < reps; r++) {
        for (const s of [0, 1]) {
          const pids = meshPids(meshes[s]!);
          const before = sampleMesh(pids);
          const x = await round(meshes[s]!, c, 1, alone[s]!, o.queueWaitMs, sinks[s]);
          for (const [k, ms] of Object.entries(cpuSpent(before, sampleMesh(pids)))) cpu[s]![k] = (cpu[s]![k] ?? 0) + ms;
          acc[s]!.ok += x.ok;
          acc[s]!.failed += x.chats - x.ok;
          acc[s]!.mismatches += x.text_mismatches;
        }
      }
      for (const s of [0, 1]) {
        const k = sinks[s]!;
        k.gaps.sort((a, b) => a - b);
        rows[s]!.push({
          chats: c,
          rounds: reps,
          ok: acc[s]!.ok,
          failed: acc[s]!.failed,
          text_mismatches: acc[s]!.mismatches,
          tokens: k.tokens,
          aggregate_tokens_per_s: +(k.tokens / (k.busyMs / 1000)).toFixed(2),
          tbt_p50_ms: +quantile(k.gaps, 0.5).toFixed(1),
          tbt_p95_ms: +quantile(k.gaps, 0.95).toFixed(1),
          cpu_ms_per_token: Object.fromEntries(Object.entries(cpu[s]!).map(([name, ms]) => [name, +(ms / Math.max(1, k.tokens)).toFixed(2)])),
        });
      }
    }
    for (const s of [0, 1]) sides.push({ max_batch: batches[s]!, rows: rows[s]!, node_batch_sizes: await nodeBatchSizes(meshes[s]!) });
  } finally {
    for (const m of meshes) await m.stop();
    await st.close();
  }
  const [off, on] = sides as [Side, Side];
  const one = (s: Side) => s.rows[0]!.aggregate_tokens_per_s;
  console.log(`\nbatching at each hop (${o.label}): split mesh of 3 nodes on small, ${o.maxTokens} max tokens per chat, temperature 0, streamed; rounds of the two meshes interleaved`);
  printTable(
    `batching off (--max-batch 1) vs on (--max-batch ${o.maxBatch}), same run`,
    ['chats', 'rounds', 'off tok/s', 'on tok/s', 'on/off', 'off × 1 chat', 'on × 1 chat', 'off TBT p50', 'off TBT p95', 'on TBT p50', 'on TBT p95', 'text ≠ alone', 'failed'],
    CHATS.map((c, i) => {
      const a = off.rows[i]!;
      const b = on.rows[i]!;
      return [
        String(c),
        String(a.rounds),
        a.aggregate_tokens_per_s,
        b.aggregate_tokens_per_s,
        fmt(b.aggregate_tokens_per_s / a.aggregate_tokens_per_s),
        fmt(a.aggregate_tokens_per_s / one(off)),
        fmt(b.aggregate_tokens_per_s / one(on)),
        a.tbt_p50_ms,
        a.tbt_p95_ms,
        b.tbt_p50_ms,
        b.tbt_p95_ms,
        `${a.text_mismatches}/${b.text_mismatches}`,
        `${a.failed}/${b.failed}`,
      ];
    }),
  );
  const procs = Object.keys(on.rows[0]!.cpu_ms_per_token);
  printTable(
    'CPU ms per generated token, by process (/proc user + kernel over the rounds; batching off / on)',
    ['chats', ...procs],
    CHATS.map((c, i) => [String(c), ...procs.map((k) => `${fmt(off.rows[i]!.cpu_ms_per_token[k] ?? NaN)} / ${fmt(on.rows[i]!.cpu_ms_per_token[k] ?? NaN)}`)]),
  );
  const eight = on.rows[CHATS.indexOf(8)]!.aggregate_tokens_per_s / one(on);
  console.log(`  8 chats with batching: ${fmt(eight)}× one chat (target ≥ 4: ${eight >= 4 ? 'met' : 'NOT met'})`);
  on.node_batch_sizes.forEach((sizes, i) => {
    const runs = sizes.map((n, size) => (size > 0 && n > 0 ? `${size}:${n}` : '')).filter(Boolean);
    console.log(`  node ${i + 1} runs by batch size (sessions:runs): ${runs.join(' ')}`);
  });
  writeResult(o.out, { bench: 'load-batching', label: o.label, quick: o.quick, max_tokens: o.maxTokens, chats: CHATS, off, on, eight_chats_over_one: +eight.toFixed(2) });
}
