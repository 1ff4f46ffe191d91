/**
 * The meshes and chats bench/load.ts and its batching comparison
 * (bench/lib/batching.ts) share: a 3-node mesh of real processes on the
 * `small` fixture, one streamed chat timed at the client, and rounds of
 * chats at once checked against every prompt alone.
 */
import { startRelayProcess, type RelayProcess } from '../../test/helpers/relay-process.ts';
import { startNode, startTrackerProc, until, type NodeProc, type TrackerProc } from '../../test/helpers/mesh.ts';
import { quantile } from './stats.ts';

/** Split mesh: the tracker's queue, small on purpose so that 64 chats at once go past it. */
export const SPLIT_QUEUE = { length: 16, waitMs: 20_000 };
export const TOPICS = [
  'a lighthouse keeper and a storm', 'a fox who shares her GPU', 'the last train of the night', 'a robot learning to paint',
  'a city under the sea', 'two rival bakers', 'a map with a missing island', 'the moon asking for a holiday',
  'a cat who runs a library', 'a violin found in an attic', 'snow in the desert', 'a detective who is afraid of the dark',
  'an orchard on Mars', 'a letter delivered fifty years late', 'a clock that runs backwards', 'the quietest dragon',
];
const prompt = (i: number) => `Write a short story about ${TOPICS[i % TOPICS.length]}.`;

export interface Outcome {
  status: number;
  ms: number;
  ttftMs: number | null;
  tokens: number;
  text: string;
  /** 429: `error.reason` (queue_full, queue_timeout, busy). */
  reason?: string;
  retryAfter?: string | null;
  /** Time between successive streamed tokens, ms. */
  gaps?: number[];
  /** A 200 stream that ended with an error event instead of [DONE]. */
  streamError?: string;
  error?: string;
}

/** One streamed chat, timed at the client. */
export async function chat(trackerUrl: string, i: number, maxTokens: number): Promise<Outcome> {
  const t0 = performance.now();
  let res: Response;
  try {
    res = await fetch(`${trackerUrl}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: prompt(i) }], max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true } }),
    });
  } catch (e) {
    return { status: 0, ms: performance.now() - t0, ttftMs: null, tokens: 0, text: '', error: (e as Error).message };
  }
  if (res.status !== 200 || !res.body) {
    const body = (await res.json().catch(() => ({}))) as { error?: { message?: string; reason?: string } };
    return { status: res.status, ms: performance.now() - t0, ttftMs: null, tokens: 0, text: '', retryAfter: res.headers.get('retry-after'), ...(body.error?.reason ? { reason: body.error.reason } : {}), error: body.error?.message ?? `HTTP ${res.status}` };
  }
  let text = '';
  let tokens = 0;
  let ttftMs: number | null = null;
  const gaps: number[] = [];
  let lastAt = 0;
  let streamError: string | undefined;
  let buf = '';
  const dec = new TextDecoder();
  for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
    buf += dec.decode(chunk, { stream: true });
    let k: number;
    while ((k = buf.indexOf('\n\n')) >= 0) {
      const line = buf.slice(0, k).trim();
      buf = buf.slice(k + 2);
      if (!line.startsWith('data:')) continue;
      const data = line.slice(5).trim();
      if (data === '[DONE]') continue;
      const msg = JSON.parse(data) as { error?: { message: string }; usage?: { completion_tokens: number }; choices?: Array<{ delta?: { content?: string } }> };
      if (msg.error) streamError = msg.error.message;
      if (msg.usage) tokens = msg.usage.completion_tokens;
      const d = msg.choices?.[0]?.delta?.content;
      if (d) {
        const now = performance.now();
        ttftMs ??= now - t0;
        if (lastAt > 0) gaps.push(now - lastAt);
        lastAt = now;
        text += d;
      }
    }
  }
  return { status: 200, ms: performance.now() - t0, ttftMs, tokens, text, gaps, ...(streamError ? { streamError } : {}) };
}

export interface Mesh {
  kind: 'split' | 'replicas';
  /** Each chat's max_tokens. */
  maxTokens: number;
  relay: RelayProcess;
  tracker: TrackerProc;
  nodes: NodeProc[];
  stop(): Promise<void>;
}

export async function startMesh(kind: 'split' | 'replicas', modelUrl: string, o: { maxBatch?: string | number; maxTokens: number }): Promise<Mesh> {
  const maxBatch = o.maxBatch;
  const relay = await startRelayProcess();
  let tracker: TrackerProc | undefined;
  const nodes: NodeProc[] = [];
  const stop = async () => {
    await Promise.all(nodes.map((n) => n.stop()));
    await tracker?.stop();
    await relay.stop();
  };
  try {
    const queue = kind === 'split' ? ['--queue-max-length', String(SPLIT_QUEUE.length), '--queue-max-wait-ms', String(SPLIT_QUEUE.waitMs)] : [];
    const t = await startTrackerProc(['--model', `small=${modelUrl}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000', ...queue]);
    tracker = t;
    const budget = [...(kind === 'split' ? ['--budget-mb', '60'] : []), ...(maxBatch !== undefined ? ['--max-batch', String(maxBatch)] : [])];
    // One at a time: each sees the previous ones' spans (split: 0-4, 4-8, 8-12). One ONNX thread each: three processes share the cores.
    for (let i = 0; i < 3; i++) {
      const n = await startNode(['--relay', relay.url, '--tracker', t.url, '--model', 'small', '--threads', '1', ...budget]);
      nodes.push(n);
      await n.waitFor((e) => e.event === 'serving', 120_000);
    }
    await until(async () => {
      const d = (await (await fetch(`${t.url}/api/dashboard`)).json()) as { nodes: Array<{ status: string; kv: unknown }> };
      return d.nodes.length === 3 && d.nodes.every((n) => n.status === 'serving' && n.kv !== null);
    }, 30_000, 'three serving nodes reporting KV');
    return { kind, maxTokens: o.maxTokens, relay, tracker: t, nodes, stop };
  } catch (e) {
    // Leave no process behind when the mesh does not come up.
    await stop();
    throw e;
  }
}

export interface Round {
  concurrency: number;
  chats: number;
  ok: number;
  status_429: number;
  status_5xx: number;
  other_failures: number;
  /** Successful chats whose text differs from the same prompt alone. */
  text_mismatches: number;
  /** 429s that broke the timing rule (queue_full after > 1 s, queue_timeout outside [limit, limit + 1 s]) or came without Retry-After. */
  bad_429s: number;
  /** Tokens streamed, over the time from the start to the last successful chat's end. */
  tokens: number;
  /** reason and client-side time of each 429: queue_full at once, queue_timeout at the wait limit. */
  answers_429: Array<{ reason: string; ms: number; retry_after: string | null }>;
  aggregate_tokens_per_s: number;
  ttft_p50_ms: number;
  ttft_p95_ms: number;
  wall_s: number;
  /** Time between tokens within a chat, over every successful chat's gaps. */
  tbt_p50_ms: number;
  tbt_p95_ms: number;
}

/** `c` chats at once, `rounds` times; prompts cycle through the topics (so every text has its alone twin). */
/** What rounds run one at a time add up to (bench/lib/batching.ts interleaves two meshes' rounds). */
export interface RoundSink {
  gaps: number[];
  busyMs: number;
  tokens: number;
}

export async function round(m: Mesh, c: number, rounds: number, alone: Map<number, string>, waitLimitMs: number, sink?: RoundSink): Promise<Round> {
  const all: Array<{ i: number; o: Outcome }> = [];
  let wall = 0;
  let busyWall = 0;
  let tokens = 0;
  for (let r = 0; r < rounds; r++) {
    const t0 = performance.now();
    const outs = await Promise.all(Array.from({ length: c }, (_, k) => chat(m.tracker.url, r * c + k, m.maxTokens).then((o) => ({ i: (r * c + k) % TOPICS.length, o }))));
    wall += performance.now() - t0;
    // Tokens per second while chats ran: up to the last success (a 429 at the wait limit generates nothing).
    busyWall += Math.max(0, ...outs.filter((x) => x.o.status === 200).map((x) => x.o.ms));
    tokens += outs.reduce((n, x) => n + x.o.tokens, 0);
    all.push(...outs);
  }
  const ok = all.filter((x) => x.o.status === 200 && !x.o.streamError);
  const t429 = all.filter((x) => x.o.status === 429);
  const badTiming = (o: Outcome) => {
    if (!o.retryAfter || !/^[1-9]\d*$/.test(o.retryAfter)) return true;
    if (o.reason === 'queue_timeout') return o.ms < waitLimitMs - 50 || o.ms > waitLimitMs + 1000;
    return o.reason === 'queue_full' ? o.ms > 1000 : false;
  };
  const ttfts = ok.map((x) => x.o.ttftMs ?? NaN).filter(Number.isFinite).sort((a, b) => a - b);
  const gaps = ok.flatMap((x) => x.o.gaps ?? []).sort((a, b) => a - b);
  if (sink) {
    sink.gaps.push(...gaps);
    sink.busyMs += busyWall;
    sink.tokens += tokens;
  }
  return {
    concurrency: c,
    chats: all.length,
    ok: ok.length,
    tokens,
    status_429: t429.length,
    status_5xx: all.filter((x) => x.o.status >= 500 || (x.o.status === 200 && x.o.streamError)).length,
    other_failures: all.filter((x) => x.o.status !== 200 && x.o.status !== 429 && x.o.status < 500).length,
    text_mismatches: ok.filter((x) => alone.has(x.i) && x.o.text !== alone.get(x.i)).length,
    bad_429s: t429.filter((x) => badTiming(x.o)).length,
    answers_429: t429.map((x) => ({ reason: x.o.reason ?? '?', ms: Math.round(x.o.ms), retry_after: x.o.retryAfter ?? null })),
    aggregate_tokens_per_s: +(tokens / (busyWall / 1000)).toFixed(2),
    ttft_p50_ms: +quantile(ttfts, 0.5).toFixed(1),
    ttft_p95_ms: +quantile(ttfts, 0.95).toFixed(1),
    wall_s: +(wall / 1000).toFixed(2),
    tbt_p50_ms: +quantile(gaps, 0.5).toFixed(1),
    tbt_p95_ms: +quantile(gaps, 0.95).toFixed(1),
  };
}

export async function aloneTexts(m: Mesh): Promise<Map<number, string>> {
  await chat(m.tracker.url, 0, m.maxTokens);
  const alone = new Map<number, string>();
  for (let i = 0; i < TOPICS.length; i++) {
    const o = await chat(m.tracker.url, i, m.maxTokens);
    if (o.status !== 200 || o.streamError) throw new Error(`[${m.kind}] chat ${i} alone failed: ${o.status} ${o.error ?? o.streamError}`);
    alone.set(i, o.text);
  }
  return alone;
}

