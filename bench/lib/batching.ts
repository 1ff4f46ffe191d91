/**
 * The batching comparison of bench/load.ts (`--batching`, issue 11): the
 * split mesh (3 nodes, layers 0-4 / 4-8 / 8-12 of `small`, every chat
 * crosses all three) started twice in one run — batching off
 * (`--max-batch 1`), then on — and 1, 2, 4, 8, 16 chats at once on each.
 * Per row: aggregate tokens/s, its ratio to one chat on the same mesh (the
 * target: ≥ 4× at 8 chats with batching on), p50/p95 time between tokens,
 * chats whose text differs from the same prompt alone (target 0), and the
 * batch sizes the nodes ran (GET /info).
 */
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer } from '../../src/cli/static-server.ts';
import { aloneTexts, round, startMesh, type Mesh, type Round } from '../load.ts';
import { fmt, printTable, writeResult } from './stats.ts';

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

interface Side {
  max_batch: number;
  rounds: Round[];
  /** Per node: runs by batch size (index = sessions in the run), over the whole side. */
  node_batch_sizes: number[][];
}

async function nodeBatchSizes(m: Mesh): Promise<number[][]> {
  return Promise.all(m.nodes.map(async (n) => ((await (await fetch(`${n.endpoint}/info`)).json()) as { batch?: { sizes: number[] } }).batch?.sizes ?? []));
}

async function side(modelUrl: string, maxBatch: number, o: BatchingOptions): Promise<Side> {
  process.stderr.write(`\n[batching] --max-batch ${maxBatch}: starting relay, tracker and 3 nodes...\n`);
  const m = await startMesh('split', modelUrl, String(maxBatch));
  try {
    process.stderr.write('[batching] warm-up and every prompt alone...\n');
    const alone = await aloneTexts(m);
    const rounds: Round[] = [];
    for (const c of CHATS) {
      process.stderr.write(`[batching] --max-batch ${maxBatch}: ${c} at once...\n`);
      rounds.push(await round(m, c, o.quick ? (c <= 2 ? 2 : 1) : c <= 4 ? 3 : 2, alone, o.queueWaitMs));
    }
    return { max_batch: maxBatch, rounds, node_batch_sizes: await nodeBatchSizes(m) };
  } finally {
    await m.stop();
  }
}

export async function runBatching(o: BatchingOptions): Promise<void> {
  const st = await startStaticServer({ root: await ensureModel('small') });
  let off: Side;
  let on: Side;
  try {
    off = await side(`${st.url}/`, 1, o);
    on = await side(`${st.url}/`, o.maxBatch, o);
  } finally {
    await st.close();
  }
  const one = (s: Side) => s.rounds[0]!.aggregate_tokens_per_s;
  console.log(`\nbatching at each hop (${o.label}): split mesh of 3 nodes on small, ${o.maxTokens} max tokens per chat, temperature 0, streamed`);
  printTable(
    `batching off (--max-batch 1) vs on (--max-batch ${o.maxBatch}), same run`,
    ['chats', 'off tok/s', 'on tok/s', 'on/off', 'off × 1 chat', 'on × 1 chat', 'off TBT p50', 'off TBT p95', 'on TBT p50', 'on TBT p95', 'text ≠ alone', 'failed'],
    CHATS.map((c, i) => {
      const a = off.rounds[i]!;
      const b = on.rounds[i]!;
      return [
        String(c),
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
        `${a.chats - a.ok}/${b.chats - b.ok}`,
      ];
    }),
  );
  const eight = on.rounds[CHATS.indexOf(8)]!.aggregate_tokens_per_s / one(on);
  console.log(`  8 chats with batching: ${fmt(eight)}× one chat (target ≥ 4: ${eight >= 4 ? 'met' : 'NOT met'})`);
  on.node_batch_sizes.forEach((sizes, i) => {
    const runs = sizes.map((n, size) => (size > 0 && n > 0 ? `${size}:${n}` : '')).filter(Boolean);
    console.log(`  node ${i + 1} runs by batch size (sessions:runs): ${runs.join(' ')}`);
  });
  writeResult(o.out, { bench: 'load-batching', label: o.label, quick: o.quick, max_tokens: o.maxTokens, chats: CHATS, off, on, eight_chats_over_one: +eight.toFixed(2) });
}
