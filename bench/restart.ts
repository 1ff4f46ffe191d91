/**
 * Relay and tracker restarts under load, on real processes: a relay or a
 * tracker is killed (SIGKILL) mid-chat and a new process started on the same
 * port a second later, over several trials, on a mesh of three headless
 * Chromium pages and on a mesh of three `meshnet node` processes, both
 * serving the shipped `fortunes-tiny` behind a tracker (the demo's budget for
 * three nodes, so every chat crosses all three).
 *
 * Per trial it records:
 *   - the chat in flight at the kill: did it finish with the float64
 *     reference's greedy text (survived), or how it failed;
 *   - the first new chat after the process's return: how long after the
 *     return it finished (new chats are sent back to back from the return on);
 *   - stalls: the longest silence of any chat of the trial (before its HTTP
 *     headers, or between two events), and how many were over 10 s;
 *   - for a relay restart, how long after its return each node was
 *     registered with it again (relay /peers);
 *   - weight bytes served by the model server during the trial (a page or a
 *     node that downloads its span again shows here).
 *
 * `--kill silent` (Node.js mesh, a fourth node so a span has two holders):
 * a hop of the chat's route that has another holder is stopped (SIGSTOP: its
 * sockets stay open, nothing answers, as a frozen page) mid-chat and let go
 * (SIGCONT) after the chat. Recorded: whether the chat still gave the
 * reference text, and its longest silence (the time to give up on the hop
 * plus the replacement).
 *
 * Table on stdout, JSON in bench/results/restart.json.
 *
 *   npx tsx bench/restart.ts [--mesh pages|nodes|both] [--kill relay|tracker|silent|both|all]
 *                            [--trials N] [--max-tokens N] [--down-ms N] [--node-endpoints] [--logs]
 */
import { createServer } from 'node:net';
import { mkdtempSync, rmSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { startBrowserMesh, serveBuiltApp, type BrowserMesh } from '../src/cli/browser-mesh.ts';
import { pageBudget } from '../src/cli/demo.ts';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import { loadModelSpec } from '../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../src/tracker/options.ts';
import { FORTUNES_DIR, fortunesTiny } from '../test/helpers/fortunes-tiny.ts';
import { startRelayProcess, type RelayProcess } from '../test/helpers/relay-process.ts';
import { startNode, startTrackerProc, until, type NodeProc, type TrackerProc } from '../test/helpers/mesh.ts';
import { median, printTable, writeResult } from './lib/stats.ts';

function arg(name: string, fallback: string): string {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? process.argv[i + 1]! : fallback;
}

type Kill = 'relay' | 'tracker' | 'silent';
const MESHES = arg('mesh', 'both') === 'both' ? (['pages', 'nodes'] as const) : ([arg('mesh', 'both')] as Array<'pages' | 'nodes'>);
const KILLS: readonly Kill[] = arg('kill', 'both') === 'both' ? ['relay', 'tracker'] : arg('kill', 'both') === 'all' ? ['relay', 'tracker', 'silent'] : [arg('kill', 'both') as Kill];
const TRIALS = Number(arg('trials', process.argv.includes('--quick') ? '2' : '5'));
const MAX_TOKENS = Number(arg('max-tokens', '40'));
const DOWN_MS = Number(arg('down-ms', '1000'));
/** Tokens the chat in flight has streamed when the process is killed. */
const KILL_AFTER_TOKENS = 3;
/** A silence this long in any chat is a stall. */
const STALL_MS = 10_000;
const PROMPTS = ['Tell me a fortune about science.', 'Tell me a short story about a fox who shares her GPU.', 'Tell me a fortune about computers.', 'Tell me a fortune about the sea.'];
const MODEL = 'fortunes-tiny';

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const a = s.address();
      const port = typeof a === 'object' && a ? a.port : 0;
      s.close(() => resolve(port));
    });
  });
}

// ---------------------------------------------------------------- a chat, timed

interface ChatResult {
  ok: boolean;
  ids: number[];
  text: string;
  finish: string | null;
  error: string | undefined;
  /** ms from the request to the HTTP headers (NaN: none came). */
  headersMs: number;
  /** ms from the request to the end (finished or failed). */
  ms: number;
  /** Longest silence: before the headers, or between two events, ms. */
  maxGapMs: number;
}

/** One streamed chat through the OpenAI API, every event timed; `onToken` sees the count so far. */
async function chat(trackerUrl: string, prompt: string, maxTokens: number, opts: { onToken?: (n: number) => void; timeoutMs?: number } = {}): Promise<ChatResult> {
  const t0 = performance.now();
  let last = t0;
  let maxGap = 0;
  const tick = (): void => {
    const now = performance.now();
    maxGap = Math.max(maxGap, now - last);
    last = now;
  };
  const r: ChatResult = { ok: false, ids: [], text: '', finish: null, error: undefined, headersMs: NaN, ms: 0, maxGapMs: 0 };
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), opts.timeoutMs ?? 90_000);
  try {
    const res = await fetch(`${trackerUrl}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: prompt }], max_tokens: maxTokens, temperature: 0, stream: true }),
      signal: ctl.signal,
    });
    tick();
    r.headersMs = performance.now() - t0;
    if (!res.ok || !res.body) {
      r.error = `HTTP ${res.status}: ${(await res.text()).slice(0, 200)}`;
      return r;
    }
    let buf = '';
    let done = false;
    const dec = new TextDecoder();
    for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
      tick();
      buf += dec.decode(chunk, { stream: true });
      let i: number;
      while ((i = buf.indexOf('\n\n')) >= 0) {
        const event = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of event.split('\n')) {
          if (!line.startsWith('data:')) continue;
          const data = line.slice(5).trim();
          if (data === '[DONE]') {
            done = true;
            continue;
          }
          const msg = JSON.parse(data) as { error?: { message: string; code?: string }; choices?: Array<{ delta?: { content?: string }; finish_reason?: string | null; token_ids?: number[] }> };
          if (msg.error) {
            r.error = `in-stream ${msg.error.code ?? ''}: ${msg.error.message}`.slice(0, 300);
            continue;
          }
          const c = msg.choices?.[0];
          if (c?.token_ids?.length) {
            r.ids.push(...c.token_ids);
            opts.onToken?.(r.ids.length);
          }
          r.text += c?.delta?.content ?? '';
          if (c?.finish_reason) r.finish = c.finish_reason;
        }
      }
    }
    if (!done && !r.error) r.error = 'the stream ended without [DONE]';
    r.ok = done && !r.error && r.finish !== null;
  } catch (e) {
    r.error = `${(e as Error).name}: ${(e as Error).message}${(e as { cause?: { code?: string } }).cause?.code ? ` (${(e as { cause: { code: string } }).cause.code})` : ''}`;
  } finally {
    clearTimeout(timer);
    tick();
    r.ms = performance.now() - t0;
    r.maxGapMs = maxGap;
  }
  return r;
}

/** New chats back to back from now until one finishes well (or `limitMs` passes); the ms from now to that finish, and every chat's result. */
async function firstGoodChat(trackerUrl: string, limitMs: number): Promise<{ ms: number; attempts: ChatResult[] }> {
  const t0 = performance.now();
  const attempts: ChatResult[] = [];
  while (performance.now() - t0 < limitMs) {
    const r = await chat(trackerUrl, PROMPTS[0]!, 8, { timeoutMs: limitMs });
    attempts.push(r);
    if (r.ok) return { ms: performance.now() - t0, attempts };
    await sleep(20);
  }
  return { ms: NaN, attempts };
}

// ---------------------------------------------------------------- the mesh

interface Mesh {
  kind: 'pages' | 'nodes';
  /** The Node.js mesh's node processes, with their peer ids. */
  nodeProcs: NodeProc[];
  relay: RelayProcess;
  relayPort: number;
  tracker: TrackerProc;
  trackerPort: number;
  keyFile: string;
  /** Peer ids of the mesh's nodes (tracker's view once all serve). */
  peers: string[];
  close(): Promise<void>;
}

async function startMesh(kind: 'pages' | 'nodes', model: StaticServer, work: string): Promise<Mesh> {
  const relayPort = await freePort();
  const trackerPort = await freePort();
  const keyFile = join(work, `tracker-${kind}.key`);
  const relay = await startRelayProcess(['--port', String(relayPort)]);
  const tracker = await startTrackerProc(['--port', String(trackerPort), '--model', `${MODEL}=${model.url}`, '--relay', relay.url, '--key-file', keyFile]);
  const budgetMb = pageBudget(await loadModelSpec(MODEL, `${model.url}/`, fetch, resolveTrackerOptions({})), 3, undefined);
  let browser: BrowserMesh | undefined;
  let app: StaticServer | undefined;
  const nodes: NodeProc[] = [];
  if (kind === 'pages') {
    app = await serveBuiltApp();
    browser = await startBrowserMesh({ nodes: 3, trackerUrl: tracker.url, relayUrl: relay.url, appUrl: `${app.url}/`, model: MODEL, backend: 'wasm', budgetMb, threads: 1, pollMs: 500 });
    await browser.waitServing(180_000);
  } else {
    // One after another: each assignment depends on the spans already given. A fourth (for --kill silent) holds a span twice.
    for (let i = 0; i < (KILLS.includes('silent') ? 4 : 3); i++) {
      const n = await startNode(['--relay', relay.url, '--tracker', tracker.url, '--budget-mb', String(budgetMb), '--max-context', '256', '--key-file', join(work, `node-${i}.key`), ...nodeArgs()]);
      await n.waitFor((e) => e.event === 'serving', 90_000);
      nodes.push(n);
    }
  }
  const m: Mesh = {
    kind,
    nodeProcs: nodes,
    relay,
    relayPort,
    tracker,
    trackerPort,
    keyFile,
    peers: [],
    async close() {
      await browser?.close();
      await Promise.all(nodes.map((n) => n.stop()));
      await m.tracker.stop();
      await m.relay.stop();
      await app?.close();
    },
  };
  await healthy(m);
  m.peers = await meshPeers(m);
  return m;
}

/**
 * `meshnet node` flags: relay-only nodes (no endpoint advertised, as behind
 * NAT), so the relay carries the tracker's /generate and every hop as it does
 * for pages — with endpoints a Node.js mesh never needs the relay
 * (`--node-endpoints`). MESHNET_BENCH_NODE_ARGS adds more (space-separated).
 */
function nodeArgs(): string[] {
  const extra = process.env.MESHNET_BENCH_NODE_ARGS?.split(' ').filter(Boolean) ?? [];
  return process.argv.includes('--node-endpoints') ? extra : ['--no-endpoint', ...extra];
}

async function meshPeers(m: Mesh): Promise<string[]> {
  const d = (await (await fetch(`${m.tracker.url}/api/dashboard`)).json()) as { nodes: Array<{ peer_id: string }> };
  return d.nodes.map((n) => n.peer_id);
}

/** Every layer served and one chat through: the mesh is back to normal. */
async function healthy(m: Mesh, ms = 120_000): Promise<void> {
  await until(async () => (await fetch(`${m.tracker.url}/api/route?model=${MODEL}`)).ok, ms, 'a complete route');
  await until(async () => (await chat(m.tracker.url, PROMPTS[0]!, 4, { timeoutMs: 20_000 })).ok, ms, 'a chat through the mesh');
}

/** Watch the relay's /peers from now: when each of `peers` is registered there (ms from `t0`, NaN: not within `ms`). */
async function peersBack(relayHttp: string, peers: readonly string[], t0: number, ms = 15_000): Promise<number[]> {
  const back = new Map<string, number>();
  const deadline = performance.now() + ms;
  while (back.size < peers.length && performance.now() < deadline) {
    try {
      const r = (await (await fetch(`${relayHttp}/peers`)).json()) as { peers: Array<{ peer_id: string }> };
      const now = performance.now() - t0;
      for (const p of r.peers) if (peers.includes(p.peer_id) && !back.has(p.peer_id)) back.set(p.peer_id, now);
    } catch {
      // not up yet
    }
    await sleep(25);
  }
  return peers.map((p) => back.get(p) ?? NaN);
}

/**
 * Bytes of tensor data asked for: Range reads of a safetensors file past its
 * header (a tracker that starts reads the header and config.json; a node that
 * loads a span reads its tensors).
 */
function tensorBytes(ranges: ReadonlyArray<{ path: string; range: string | null; status: number }>): number {
  let n = 0;
  for (const r of ranges) {
    if (!r.path.endsWith('.safetensors') || r.status >= 300) continue;
    const m = /^bytes=(\d+)-(\d+)$/.exec(r.range ?? '');
    if (!m) continue;
    const [a, b] = [Number(m[1]), Number(m[2])];
    // The 8-byte length and the JSON header are what every reader of the file takes first.
    if (a <= 8) continue;
    n += b - a + 1;
  }
  return n;
}

// ---------------------------------------------------------------- one trial

interface Trial {
  mesh: 'pages' | 'nodes';
  kill: Kill;
  trial: number;
  /** Tracker trials alternate: the same key file, or a new key. */
  key?: 'same' | 'new';
  inflight: { survived: boolean; tokens: number; error: string | undefined; maxGapMs: number; headersMs: number; ms: number };
  /** ms from the return to the end of the first new chat that finished well (NaN: none within the limit). */
  firstNewChatMs: number;
  newChatAttempts: number;
  newChatErrors: string[];
  /** Longest silence of any chat in the trial, ms. */
  maxGapMs: number;
  stalls: number;
  /** Relay trials: ms from the relay's return until each node was registered with it again. */
  peersBackMs: number[];
  /** Model bytes served during the trial (re-downloads). */
  weightBytes: number;
  /** ms from the kill to the new process listening. */
  downMs: number;
}

/** A hop of the last chat's route (not the head) whose layers another node also serves, and its process. */
async function silentCandidate(m: Mesh): Promise<NodeProc | undefined> {
  const d = (await (await fetch(`${m.tracker.url}/api/dashboard`)).json()) as { nodes: Array<{ peer_id: string; serving: { start_layer: number; end_layer: number } | null }>; recent_routes: Array<{ kind: string; hops: Array<{ peer_id: string; start_layer: number; end_layer: number }> }> };
  const route = d.recent_routes[0];
  if (!route) return undefined;
  for (const h of route.hops.slice(1)) {
    const spare = d.nodes.some((n) => n.peer_id !== h.peer_id && n.serving && n.serving.start_layer <= h.start_layer && n.serving.end_layer >= h.end_layer && !route.hops.slice(0, 1).some((x) => x.peer_id === n.peer_id));
    const proc = m.nodeProcs.find((p) => p.peerId === h.peer_id);
    if (spare && proc) return proc;
  }
  return undefined;
}

async function trial(m: Mesh, model: StaticServer, kill: Kill, k: number, work: string): Promise<Trial> {
  const prompt = PROMPTS[k % PROMPTS.length]!;
  const want = fortunesTiny().greedy(prompt, MAX_TOKENS);
  const ranges0 = model.stats.ranges.length;
  let killed!: () => void;
  const killNow = new Promise<void>((r) => (killed = r));
  const inflight = chat(m.tracker.url, prompt, MAX_TOKENS, { onToken: (n) => n >= KILL_AFTER_TOKENS && killed(), timeoutMs: 120_000 });
  await Promise.race([killNow, inflight.then(() => undefined)]);
  const tKill = performance.now();
  let key: 'same' | 'new' | undefined;
  let stopped: NodeProc | undefined;
  if (kill === 'silent') {
    stopped = await silentCandidate(m);
    stopped?.child.kill('SIGSTOP');
  } else if (kill === 'relay') {
    await m.relay.stop('SIGKILL');
    await sleep(DOWN_MS);
    m.relay = await startRelayProcess(['--port', String(m.relayPort)]);
  } else {
    await m.tracker.stop('SIGKILL');
    await sleep(DOWN_MS);
    key = k % 2 === 0 ? 'same' : 'new';
    if (key === 'new') rmSync(m.keyFile, { force: true });
    m.tracker = await startTrackerProc(['--port', String(m.trackerPort), '--model', `${MODEL}=${model.url}`, '--relay', m.relay.url, '--key-file', m.keyFile]);
  }
  const tBack = performance.now();
  const [back, first, done] = await Promise.all([
    kill === 'relay' ? peersBack(m.relay.httpUrl, m.peers, tBack) : Promise.resolve([]),
    kill === 'silent' ? Promise.resolve({ ms: NaN, attempts: [] }) : firstGoodChat(m.tracker.url, 30_000),
    inflight,
  ]);
  stopped?.child.kill('SIGCONT');
  if (kill === 'silent' && !stopped) console.log(`trial ${k}: no hop of the route has a second holder; nothing stopped`);
  const survived = done.ok && done.ids.length === want.ids.length && done.ids.every((id, i) => id === want.ids[i]) && done.text === want.text;
  const gaps = [done.maxGapMs, ...first.attempts.map((a) => a.maxGapMs)];
  const t: Trial = {
    mesh: m.kind,
    kill,
    trial: k,
    ...(key ? { key } : {}),
    inflight: { survived, tokens: done.ids.length, error: done.error ?? (done.ok && !survived ? `text differs from the reference at token ${done.ids.findIndex((id, i) => id !== want.ids[i])}` : undefined), maxGapMs: done.maxGapMs, headersMs: done.headersMs, ms: done.ms },
    firstNewChatMs: first.ms,
    newChatAttempts: first.attempts.length,
    newChatErrors: [...new Set(first.attempts.filter((a) => !a.ok).map((a) => a.error ?? '?'))].slice(0, 3),
    maxGapMs: Math.max(...gaps),
    stalls: gaps.filter((g) => g > STALL_MS).length,
    peersBackMs: back,
    weightBytes: tensorBytes(model.stats.ranges.slice(ranges0)),
    downMs: tBack - tKill,
  };
  console.log(JSON.stringify(t));
  if (!survived && kill !== 'tracker' && process.argv.includes('--logs')) {
    for (const n of m.nodeProcs) console.log(`--- node ${n.peerId.slice(0, 8)} stderr (tail)\n${n.stderr().split('\n').slice(-15).join('\n')}`);
    console.log(`--- tracker stderr (tail)\n${m.tracker.stderr().split('\n').slice(-15).join('\n')}`);
  }
  // The next trial starts on a mesh that is whole again.
  await healthy(m).catch((e: Error) => console.log(`mesh not healthy after trial ${k}: ${e.message}`));
  m.peers = await meshPeers(m).catch(() => m.peers);
  void work;
  return t;
}

// ---------------------------------------------------------------- main

async function main(): Promise<void> {
  const load0 = loadavg()[0]!;
  const model = await startStaticServer({ root: FORTUNES_DIR, port: 0, host: '127.0.0.1' });
  const work = mkdtempSync(join(tmpdir(), 'meshnet-bench-restart-'));
  // The reference once, before any mesh (seconds of synchronous float64 work).
  for (const p of PROMPTS) fortunesTiny().greedy(p, MAX_TOKENS);
  const trials: Trial[] = [];
  try {
    for (const kind of MESHES) {
      const m = await startMesh(kind, model, work);
      try {
        for (const kill of KILLS) for (let k = 0; k < TRIALS; k++) trials.push(await trial(m, model, kill, k, work));
      } finally {
        await m.close();
      }
    }
  } finally {
    await model.close();
    rmSync(work, { recursive: true, force: true });
  }

  const rows: Array<Array<string | number>> = [];
  for (const kind of MESHES) {
    for (const kill of KILLS) {
      const ts = trials.filter((t) => t.mesh === kind && t.kill === kill);
      if (ts.length === 0) continue;
      const firsts = ts.map((t) => t.firstNewChatMs).filter(Number.isFinite);
      const back = ts.flatMap((t) => t.peersBackMs);
      rows.push([
        kind,
        kill,
        `${ts.filter((t) => t.inflight.survived).length}/${ts.length}`,
        firsts.length ? median(firsts) : NaN,
        firsts.length ? Math.max(...firsts) : NaN,
        `${ts.filter((t) => !Number.isFinite(t.firstNewChatMs)).length}`,
        ts.reduce((n, t) => n + t.stalls, 0),
        median(ts.map((t) => t.maxGapMs)),
        Math.max(...ts.map((t) => t.maxGapMs)),
        kill === 'relay' && back.length ? median(back) : NaN,
        kill === 'relay' && back.length ? Math.max(...back) : NaN,
        ts.reduce((n, t) => n + t.weightBytes, 0),
      ]);
    }
  }
  printTable(
    `Restarts (SIGKILL, same port ${DOWN_MS} ms later), ${TRIALS} trials each, ${MAX_TOKENS}-token chats, fortunes-tiny on 3 nodes; load ${load0.toFixed(2)} (shared machine)`,
    ['mesh', 'killed', 'chat survived', 'new chat p50 ms', 'new chat max ms', 'no new chat', 'stalls>10s', 'max gap p50 ms', 'max gap ms', 'nodes back p50 ms', 'nodes back max ms', 'weight bytes'],
    rows,
  );
  for (const t of trials.filter((x) => !x.inflight.survived)) console.log(`  ${t.mesh}/${t.kill} #${t.trial}: in-flight chat: ${t.inflight.error} (${t.inflight.tokens} tokens)`);
  for (const t of trials.filter((x) => x.newChatErrors.length)) console.log(`  ${t.mesh}/${t.kill} #${t.trial}: new chats failed first: ${t.newChatErrors.join(' | ')}`);
  writeResult(join(import.meta.dirname, 'results', 'restart.json'), { trials: TRIALS, maxTokens: MAX_TOKENS, downMs: DOWN_MS, loadavg: load0, rows, trialsDetail: trials });
}

main().then(
  () => process.exit(0),
  (e: unknown) => {
    console.error(e);
    process.exit(1);
  },
);
