/**
 * bench/tracker-cluster — chats through a cluster of three trackers on NATS
 * against one tracker alone, and what a tracker's death costs.
 *
 * Two meshes up side by side on one relay, each three `meshnet node`
 * processes on the `small` fixture (layers split 0-4/4-8/8-12):
 *   alone    one tracker, its registry in memory (what `npm start` runs);
 *   cluster  three trackers with --nats (one nats-server, JetStream KV), an
 *            haproxy in front checking /healthz; the nodes know only haproxy's URL.
 * Chats alternate between the two (so the shared machine's noise falls on
 * both alike): streamed, greedy, the same prompts; tokens/s after the first
 * token and time to first token at the client, medians; the texts must match.
 * Targets: cluster tokens/s ≥ 0.97× alone, first token ≤ +5 ms.
 * A third column goes to the same cluster through a second haproxy
 * configured as before `option http-no-delay` (which held each streamed
 * SSE chunk ~200 ms for a fuller packet), so the fix shows side by side.
 *
 * Then a tracker killed (SIGKILL) while chats stream through each of the
 * three: chats on the other two must all finish (0 lost); a client going
 * through haproxy retries at once and must get a new chat within 2 s.
 *
 *   npx tsx bench/tracker-cluster.ts [--chats 30] [--quick]
 */
import { fileURLToPath } from 'node:url';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import { startHaproxy, startNats } from '../test/helpers/cluster.ts';
import { spawnMeshnet, until, type NodeProc, type Proc } from '../test/helpers/mesh.ts';
import { startRelayProcess } from '../test/helpers/relay-process.ts';
import { loadavg } from 'node:os';
import { loadAverage1m, median, printTable, quantile, writeResult } from './lib/stats.ts';

const argv = process.argv.slice(2);
const opt = (name: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
};
const quick = argv.includes('--quick');
const CHATS = Number(opt('chats') ?? (quick ? 8 : 30));
const MAX_TOKENS = quick ? 16 : 32;
const here = fileURLToPath(new URL('.', import.meta.url));
const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

interface Chat {
  status: number;
  ttftMs: number;
  tokensPerS: number;
  tokens: number;
  text: string;
  error?: string;
}

/** One streamed greedy chat; the text, time to first token and tokens/s after it. */
async function chat(base: string, prompt: string, maxTokens = MAX_TOKENS, signal?: AbortSignal): Promise<Chat> {
  const t0 = performance.now();
  let res: Response;
  try {
    res = await fetch(`${base}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: prompt }], max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true } }),
      ...(signal ? { signal } : {}),
    });
  } catch (e) {
    return { status: 0, ttftMs: NaN, tokensPerS: NaN, tokens: 0, text: '', error: (e as Error).message };
  }
  if (res.status !== 200 || !res.body) return { status: res.status, ttftMs: NaN, tokensPerS: NaN, tokens: 0, text: '', error: (await res.text().catch(() => '')).slice(0, 200) };
  let first = 0;
  let tokens = 0;
  let text = '';
  let buf = '';
  let error: string | undefined;
  let done = false;
  const dec = new TextDecoder();
  try {
    for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
      buf += dec.decode(chunk, { stream: true });
      let k: number;
      while ((k = buf.indexOf('\n\n')) >= 0) {
        const line = buf.slice(0, k).trim();
        buf = buf.slice(k + 2);
        if (!line.startsWith('data:')) continue;
        const data = line.slice(5).trim();
        if (data === '[DONE]') {
          done = true;
          continue;
        }
        const m = JSON.parse(data) as { error?: { message: string }; usage?: { completion_tokens: number }; choices?: Array<{ delta?: { content?: string } }> };
        if (m.error) error = m.error.message;
        const piece = m.choices?.[0]?.delta?.content;
        if (piece) {
          if (!first) first = performance.now();
          text += piece;
        }
        if (m.usage) tokens = m.usage.completion_tokens;
      }
    }
  } catch (e) {
    error = `stream broken: ${(e as Error).message}`;
  }
  const end = performance.now();
  if (!done && !error) error = 'stream ended without [DONE]';
  return { status: error ? 599 : 200, ttftMs: first ? first - t0 : NaN, tokensPerS: tokens > 1 && first ? ((tokens - 1) * 1000) / (end - first) : NaN, tokens, text, ...(error ? { error } : {}) };
}

const TOPICS = ['a lighthouse in a storm', 'a fox who shares her GPU', 'the last train', 'a robot painter', 'a city under the sea', 'two rival bakers', 'a missing island', 'the moon on holiday'];
const prompt = (i: number) => `Write a short story about ${TOPICS[i % TOPICS.length]}.`;

const loadBefore = loadavg()[0]!;
const procs: Proc[] = [];
const st = await startStaticServer({ root: await ensureModel('small') });
const nats = await startNats();
const relay = await startRelayProcess();
let haproxyStop: (() => Promise<void>) | undefined;
async function tracker(args: string[]): Promise<Proc & { url: string }> {
  const p = spawnMeshnet(['tracker', '--port', '0', '--log-level', 'warn', '--model', `small=${st.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000', ...args]);
  procs.push(p);
  const l = await p.waitFor((e) => e.event === 'listening');
  return Object.assign(p, { url: l.url as string });
}
async function mesh(trackerUrl: string): Promise<NodeProc[]> {
  const out: NodeProc[] = [];
  for (let i = 0; i < 3; i++) {
    const p = spawnMeshnet(['node', '--port', '0', '--threads', '1', '--relay', relay.url, '--tracker', trackerUrl, '--model', 'small', '--budget-mb', '60']);
    procs.push(p);
    const l = await p.waitFor((e) => e.event === 'listening');
    const n = Object.assign(p, { peerId: l.peer_id as string, endpoint: l.endpoint as string, relayAddr: (l.relay_addr as string | null) ?? null });
    await n.waitFor((e) => e.event === 'serving', 120_000);
    out.push(n);
  }
  return out;
}

try {
  const alone = await tracker([]);
  const cluster = [await tracker(['--nats', nats.url, '--cluster', 'bench']), await tracker(['--nats', nats.url, '--cluster', 'bench']), await tracker(['--nats', nats.url, '--cluster', 'bench'])];
  const haproxy = await startHaproxy({ backends: cluster.map((t) => t.url), checkIntervalMs: 250, fall: 2, rise: 1 });
  // The same cluster behind haproxy as configured before `option http-no-delay`.
  const delaying = await startHaproxy({ backends: cluster.map((t) => t.url), checkIntervalMs: 250, fall: 2, rise: 1, noDelay: false });
  haproxyStop = async () => {
    await haproxy.stop();
    await delaying.stop();
  };
  await mesh(alone.url);
  await mesh(haproxy.url);
  const ready = async (url: string) => until(async () => (await chat(url, 'hi', 2)).status === 200, 60_000, `a chat through ${url}`);
  await ready(alone.url);
  for (const t of cluster) await ready(t.url);
  // Warm both paths alike.
  for (let i = 0; i < 3; i++) {
    await chat(alone.url, prompt(i));
    await chat(haproxy.url, prompt(i));
  }

  const a: Chat[] = [];
  const b: Chat[] = [];
  const d: Chat[] = [];
  let mismatches = 0;
  const order: Array<[string, Chat[]]> = [
    [alone.url, a],
    [haproxy.url, b],
    [delaying.url, d],
  ];
  for (let i = 0; i < CHATS; i++) {
    // Rotate which goes first, so none always runs right after another's work.
    const texts: string[] = [];
    for (let k = 0; k < order.length; k++) {
      const [url, into] = order[(i + k) % order.length]!;
      const c = await chat(url, prompt(i));
      into.push(c);
      if (c.status === 200) texts.push(c.text);
    }
    if (new Set(texts).size > 1) mismatches++;
  }
  const ok = (cs: Chat[]) => cs.filter((c) => c.status === 200);
  const tpsA = median(ok(a).map((c) => c.tokensPerS));
  const tpsB = median(ok(b).map((c) => c.tokensPerS));
  const tpsD = median(ok(d).map((c) => c.tokensPerS));
  const ttA = median(ok(a).map((c) => c.ttftMs));
  const ttB = median(ok(b).map((c) => c.ttftMs));
  const ttD = median(ok(d).map((c) => c.ttftMs));
  const p90 = (cs: Chat[]) => quantile(ok(cs).map((c) => c.ttftMs).sort((p, q) => p - q), 0.9);
  printTable(
    `chats through one tracker vs a 3-tracker cluster (NATS, haproxy), ${CHATS} each, rotating, ${MAX_TOKENS} tokens, greedy (shared 2-core machine)`,
    ['setup', 'ok', 'tokens/s p50', 'first token p50 ms', 'first token p90 ms'],
    [
      ['alone', ok(a).length, tpsA, ttA, p90(a)],
      ['cluster', ok(b).length, tpsB, ttB, p90(b)],
      ['cluster, haproxy without http-no-delay', ok(d).length, tpsD, ttD, p90(d)],
      ['cluster / alone', '', tpsB / tpsA, ttB - ttA, ''],
      ['without http-no-delay / alone', '', tpsD / tpsA, ttD - ttA, ''],
    ],
  );
  console.log(`prompts whose texts differed between the setups: ${mismatches}; load average (1 min) at start ${loadBefore.toFixed(2)}, now ${loadavg()[0]!.toFixed(2)}`);

  // A tracker killed while chats stream through each of the three.
  const long = Math.max(48, MAX_TOKENS * 2);
  const running = cluster.flatMap((t, i) => [0, 1].map((k) => ({ tracker: i, chat: chat(t.url, prompt(10 + 2 * i + k), long) })));
  await sleep(quick ? 800 : 1500);
  const killedAt = performance.now();
  cluster[0]!.child.kill('SIGKILL');
  // A client through haproxy: retry at once until a chat goes through.
  let firstOkMs = NaN;
  let retries = 0;
  for (let t = 0; t < 60; t++) {
    const c = await chat(haproxy.url, prompt(t), 4);
    if (c.status === 200) {
      firstOkMs = performance.now() - killedAt;
      break;
    }
    retries++;
  }
  const results = await Promise.all(running.map(async (r) => ({ tracker: r.tracker, c: await r.chat })));
  const survivors = results.filter((r) => r.tracker !== 0);
  const lost = survivors.filter((r) => r.c.status !== 200);
  const onKilled = results.filter((r) => r.tracker === 0);
  printTable('a tracker SIGKILLed mid-chat (2 chats streaming through each of 3 trackers)', ['chats on the survivors', 'lost', 'chats on the killed one', 'cut', 'new chat through haproxy after the kill ms', 'failed tries'], [
    [survivors.length, lost.length, onKilled.length, onKilled.filter((r) => r.c.status !== 200).length, firstOkMs, retries],
  ]);
  if (lost.length) console.log('lost:', lost.map((r) => r.c.error).join(' | '));
  writeResult(`${here}results/tracker-cluster.json`, {
    bench: 'tracker-cluster',
    chats: CHATS,
    load_average_1m: loadAverage1m(loadBefore),
    max_tokens: MAX_TOKENS,
    alone: { ok: ok(a).length, tokens_per_s_p50: tpsA, ttft_p50_ms: ttA },
    cluster: { ok: ok(b).length, tokens_per_s_p50: tpsB, ttft_p50_ms: ttB },
    cluster_without_no_delay: { ok: ok(d).length, tokens_per_s_p50: tpsD, ttft_p50_ms: ttD },
    ratio_tokens_per_s: tpsB / tpsA,
    ttft_delta_ms: ttB - ttA,
    ratio_tokens_per_s_without_no_delay: tpsD / tpsA,
    ttft_delta_ms_without_no_delay: ttD - ttA,
    text_mismatches: mismatches,
    kill: { survivors: survivors.length, lost: lost.length, on_killed: onKilled.length, cut: onKilled.filter((r) => r.c.status !== 200).length, first_new_chat_ms: firstOkMs, failed_tries: retries },
  });
} finally {
  await Promise.all(procs.map((p) => p.stop()));
  await haproxyStop?.();
  await relay.stop();
  await nats.stop();
  await st.close();
}
process.exit(0);
