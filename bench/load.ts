/**
 * Load benchmark: many users at once through the tracker's OpenAI API, on
 * 3-node meshes of real processes (relay, tracker, `meshnet node` ×3) on the
 * `small` fixture, measured at the client (streamed chats, temperature 0).
 *
 * Two meshes, the same three nodes' worth of processes:
 *   replicas  the Node host's default budget (1024 MiB): each node holds the
 *             whole model, so a chat is one node; KV room for hundreds of chats
 *   split     60 MiB per node (the demo's layout): layers 0-4, 4-8, 8-12, every
 *             chat crosses all three; KV room for a few dozen short chats, and
 *             the tracker's queue set small (16 chats, 20 s) so that 64 at
 *             once go past it
 *
 * On each mesh:
 *   - every prompt alone, then 16 at once: each must give its alone text;
 *   - 1, 4, 16 and 64 chats at once: aggregate tokens/s, p50/p95 time to first
 *     token, and what every chat got: 200, or 429 + Retry-After (at once when
 *     the queue is full, within 1 s of the wait limit otherwise), never a 5xx;
 *   - (split) a soak: 8 clients sending chats back to back for 60 s, 0 errors,
 *     relay, tracker and node RSS after within 10 % of before;
 *   - the nodes' logs: no 409 replay.
 *
 * Batching at a hop (docs/architecture.md, "Batching at a hop") should raise the aggregate figures: rerun with
 * `--label <name>` on each branch and `--compare <a copy of an earlier
 * bench/results/load.json>` to print
 * the ratio per row (runs on different days differ; the lead reruns on a
 * quiet machine). Table on stdout, JSON in bench/results/load.json.
 * `--max-batch N` starts the nodes with it (1: batching off).
 *
 * `--batching` runs the batching comparison instead (bench/lib/batching.ts):
 * the split mesh twice in one run, batching off (--max-batch 1) then on, 1,
 * 2, 4, 8 and 16 chats at once: aggregate tokens/s, its ratio to one chat
 * (target ≥ 4× at 8 chats), p50/p95 time between tokens, the nodes' batch
 * sizes; JSON in bench/results/load-batching.json.
 *
 *   npx tsx bench/load.ts [--quick] [--mesh split|replicas|both] [--label NAME] [--compare FILE] [--soak-s N] [--max-batch N] [--batching]
 */
import { readFileSync } from 'node:fs';
import { loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import { SPLIT_QUEUE, TOPICS, chat, round, startMesh, type Mesh, type Round } from './lib/load-mesh.ts';
import { fmt, loadAverage1m, printTable, writeResult } from './lib/stats.ts';

const argv = process.argv.slice(2);
if (argv.includes('--help') && /bench[\\/]load\.ts$/.test(process.argv[1] ?? '')) {
  process.stdout.write(`npx tsx bench/load.ts [options]
  many chats at once through the tracker, real relay and node processes

  --quick          16 tokens a chat, a 20 s soak
  --mesh M         split, replicas or both (default both)
  --label NAME     the run's name in the JSON (default current)
  --compare FILE   print each row's ratio to an earlier bench/results/load.json
  --soak-s N       soak length in seconds (default 60)
  --max-batch N    start the nodes with it (1: batching off)
  --batching       batching off vs on, 1/2/4/8/16 chats (bench/results/load-batching.json)
  --help           this text
`);
  process.exit(0);
}
const flag = (name: string) => argv.includes(`--${name}`);
const opt = (name: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
};
const quick = flag('quick');
const meshes = (opt('mesh') ?? 'both') === 'both' ? (['split', 'replicas'] as const) : ([opt('mesh')] as Array<'split' | 'replicas'>);
const label = opt('label') ?? 'current';
const compareFile = opt('compare');
const SOAK_S = Number(opt('soak-s') ?? (quick ? 20 : 60));
const MAX_TOKENS = quick ? 16 : 32;
const MAX_BATCH = opt('max-batch');
const CONCURRENCY = [1, 4, 16, 64];
const here = fileURLToPath(new URL('.', import.meta.url));

function rssKiB(pid: number | undefined): number {
  if (pid === undefined) return NaN;
  const m = /VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
  return m ? Number(m[1]) : NaN;
}

function rssOf(m: Mesh): Record<string, number> {
  const out: Record<string, number> = { relay: rssKiB(m.relay.child.pid), tracker: rssKiB(m.tracker.child.pid) };
  m.nodes.forEach((n, i) => (out[`node${i + 1}`] = rssKiB(n.child.pid)));
  return out;
}

interface Soak {
  seconds: number;
  clients: number;
  chats: number;
  errors: number;
  error_samples: string[];
  rss_before_kib: Record<string, number>;
  rss_after_kib: Record<string, number>;
  /** after / before per process. */
  rss_ratio: Record<string, number>;
  within_10_percent: boolean;
}

async function soak(m: Mesh, seconds: number, clients: number): Promise<Soak> {
  const before = rssOf(m);
  const end = performance.now() + seconds * 1000;
  let chats = 0;
  const errors: string[] = [];
  await Promise.all(
    Array.from({ length: clients }, async (_, c) => {
      for (let k = 0; performance.now() < end; k++) {
        const o = await chat(m.tracker.url, c * 7 + k, m.maxTokens);
        chats++;
        if (o.status !== 200 || o.streamError) errors.push(`${o.status} ${o.streamError ?? o.error ?? ''}`.slice(0, 200));
      }
    }),
  );
  // Let timers and sockets of the last chats settle before reading RSS again.
  await new Promise((r) => setTimeout(r, 2000));
  const after = rssOf(m);
  const ratio: Record<string, number> = {};
  for (const k of Object.keys(before)) ratio[k] = +(after[k]! / before[k]!).toFixed(3);
  return {
    seconds,
    clients,
    chats,
    errors: errors.length,
    error_samples: errors.slice(0, 5),
    rss_before_kib: before,
    rss_after_kib: after,
    rss_ratio: ratio,
    within_10_percent: Object.values(ratio).every((r) => r <= 1.1 && r >= 0.9),
  };
}

interface MeshResult {
  mesh: 'split' | 'replicas';
  spans: Array<[number, number]>;
  kv_budget_mib: number[];
  queue: { length: number; wait_ms: number };
  alone_then_16: { ok: number; text_mismatches: number; failures: number };
  rounds: Round[];
  soak: Soak | null;
  replays_in_logs: number;
  busy_answers: number;
}

async function runMesh(kind: 'split' | 'replicas', modelUrl: string): Promise<MeshResult> {
  process.stderr.write(`\n[${kind}] starting relay, tracker and 3 nodes...\n`);
  const m = await startMesh(kind, modelUrl, { ...(MAX_BATCH !== undefined ? { maxBatch: MAX_BATCH } : {}), maxTokens: MAX_TOKENS });
  try {
    const dash = (await (await fetch(`${m.tracker.url}/api/dashboard`)).json()) as { nodes: Array<{ serving: { start_layer: number; end_layer: number }; kv?: { budget_bytes: number } | null }> };
    const queue = kind === 'split' ? { length: SPLIT_QUEUE.length, wait_ms: SPLIT_QUEUE.waitMs } : { length: 128, wait_ms: 30_000 };
    // Warm every node (graph first runs, sockets), then each prompt alone: the texts every later chat must match.
    process.stderr.write(`[${kind}] warm-up and ${TOPICS.length} chats alone...\n`);
    await chat(m.tracker.url, 0, m.maxTokens);
    const alone = new Map<number, string>();
    for (let i = 0; i < TOPICS.length; i++) {
      const o = await chat(m.tracker.url, i, m.maxTokens);
      if (o.status !== 200 || o.streamError) throw new Error(`[${kind}] chat ${i} alone failed: ${o.status} ${o.error ?? o.streamError}`);
      alone.set(i, o.text);
    }
    process.stderr.write(`[${kind}] 16 at once...\n`);
    const sixteen = await round(m, 16, 1, alone, queue.wait_ms);
    const rounds: Round[] = [];
    for (const c of CONCURRENCY) {
      process.stderr.write(`[${kind}] ${c} at once...\n`);
      rounds.push(await round(m, c, c === 1 ? 3 : c === 4 ? 2 : 1, alone, queue.wait_ms));
    }
    let s: Soak | null = null;
    if (kind === 'split') {
      process.stderr.write(`[${kind}] soak: 8 clients for ${SOAK_S} s...\n`);
      s = await soak(m, SOAK_S, 8);
    }
    const metrics = await (await fetch(`${m.tracker.url}/metrics`)).text();
    const busy = Number(/^meshnet_tracker_busy_answers_total (\d+)/m.exec(metrics)?.[1] ?? 0);
    const replays = m.nodes.reduce((n, x) => n + (x.stderr().match(/answered 409/g)?.length ?? 0), 0);
    return {
      mesh: kind,
      spans: dash.nodes.map((n) => [n.serving.start_layer, n.serving.end_layer]),
      kv_budget_mib: dash.nodes.map((n) => (n.kv ? +(n.kv.budget_bytes / 2 ** 20).toFixed(1) : NaN)),
      queue,
      alone_then_16: { ok: sixteen.ok, text_mismatches: sixteen.text_mismatches, failures: sixteen.chats - sixteen.ok },
      rounds,
      soak: s,
      replays_in_logs: replays,
      busy_answers: busy,
    };
  } finally {
    await m.stop();
  }
}

async function main(): Promise<void> {
  if (flag('batching')) {
    const { runBatching } = await import('./lib/batching.ts');
    await runBatching({ quick, label, maxBatch: MAX_BATCH === undefined ? 16 : Number(MAX_BATCH), maxTokens: MAX_TOKENS, queueWaitMs: SPLIT_QUEUE.waitMs, out: `${here}results/load-batching.json` });
    return;
  }
  const loadBefore = loadavg()[0]!;
  const st: StaticServer = await startStaticServer({ root: await ensureModel('small') });
  const results: MeshResult[] = [];
  try {
    for (const kind of meshes) results.push(await runMesh(kind, `${st.url}/`));
  } finally {
    await st.close();
  }
  const previous = compareFile ? (JSON.parse(readFileSync(compareFile, 'utf8')) as { label?: string; meshes: MeshResult[] }) : undefined;
  const prevRound = (mesh: string, c: number) => previous?.meshes.find((x) => x.mesh === mesh)?.rounds.find((r) => r.concurrency === c);

  console.log(`\nload bench (${label}): small, ${MAX_TOKENS} max tokens per chat, temperature 0, streamed; 1-minute load average ${loadBefore.toFixed(2)} before, ${loadavg()[0]!.toFixed(2)} after`);
  for (const r of results) {
    const header = ['chats at once', 'chats', 'ok', '429', '5xx', 'text ≠ alone', 'bad 429', 'agg tok/s', 'TTFT p50 ms', 'TTFT p95 ms', ...(previous ? [`agg × ${previous.label ?? 'before'}`] : [])];
    printTable(
      `[${r.mesh}] spans ${r.spans.map(([a, b]) => `${a}-${b}`).join(', ')}; KV budget ${r.kv_budget_mib.join(' / ')} MiB; queue ${r.queue.length} chats, ${r.queue.wait_ms / 1000} s`,
      header,
      r.rounds.map((x) => {
        const p = prevRound(r.mesh, x.concurrency);
        const ints = [x.concurrency, x.chats, x.ok, x.status_429, x.status_5xx, x.text_mismatches, x.bad_429s].map(String);
        return [...ints, x.aggregate_tokens_per_s, x.ttft_p50_ms, x.ttft_p95_ms, ...(previous ? [p ? fmt(x.aggregate_tokens_per_s / p.aggregate_tokens_per_s) : '-'] : [])];
      }),
    );
    console.log(`  16 at once after each alone: ${r.alone_then_16.ok}/16 succeeded, ${r.alone_then_16.text_mismatches} with another text (target 16/16, 0)`);
    console.log(`  409 replays in node logs: ${r.replays_in_logs} (target 0); MESH_ERR_BUSY answers the tracker routed around: ${r.busy_answers}`);
    if (r.soak) {
      const s = r.soak;
      console.log(`  soak: ${s.clients} clients × ${s.seconds} s: ${s.chats} chats, ${s.errors} errors (target 0)${s.error_samples.length ? `: ${s.error_samples.join(' | ')}` : ''}`);
      console.log(`  RSS after / before: ${Object.entries(s.rss_ratio).map(([k, v]) => `${k} ${v}`).join(', ')} (target within 10 %: ${s.within_10_percent ? 'met' : 'NOT met'})`);
    }
  }
  writeResult(`${here}results/load.json`, { bench: 'load', label, quick, max_tokens: MAX_TOKENS, load_average_1m: loadAverage1m(loadBefore), meshes: results });
}

main().catch((e: unknown) => {
  console.error(e);
  process.exitCode = 1;
});
