/**
 * bench/swarm — the control plane under a simulated swarm.
 *
 * Thousands of donors (bench/lib/swarm-donors.ts), each with its own key, a
 * real /ws registration at a relay process and the node core's own tracker
 * session (signed registration, heartbeats at the interval the tracker hands
 * out), none doing model work, spread over --donor-procs child processes
 * (bench/lib/swarm-pool.ts: by default one per 2,500 donors, so no one
 * process meets the file limit or stalls its donors' beats); beside them a real
 * 3-node mesh (`meshnet node` processes on the `small` fixture, layers split
 * 0-4/4-8/8-12) serving chats through the same tracker.
 *
 * The donors serve a model of their own, `swarm` (a Llama-3-8B-shaped
 * config.json, no weights: the tracker sizes spans from the config), so no
 * chat is ever routed through a donor that computes nothing; route picks for
 * it are probed through GET /api/route?model=swarm.
 *
 * After a ramp (donors join at a steady rate) and a settle, one measured
 * window of --minutes. With --settle-min-s S the settle lasts at least S
 * seconds, then until every donor was told the configured heartbeat period
 * again (a tracker behind during the ramp hands out up to 60 s, and a donor
 * hears the shorter one only at its next beat), at most --settle-s. The
 * window:
 *   - tracker CPU (from /proc) in % of a core and per tracker call;
 *   - heartbeat latency p50/p99 at the donor, failures by kind (timeout,
 *     401, 404, 503, network);
 *   - donors dropped: a live donor's heartbeat answered 404 (it was removed),
 *     and the tracker's removals for missed heartbeats of donors that never left;
 *   - memory per donor at the tracker and the relay (RSS growth over the ramp / donors);
 *   - route pick latency (probe, at the client);
 *   - chats through the mesh: tokens/s, first token, errors;
 *   - with --churn F: F of the donors leave (silently, as a closed tab) and as
 *     many new ones join each minute, spread over the minute;
 *   - with --relay-restart: the first relay is stopped and started again on
 *     its port mid-window: how long until all its donors are registered again,
 *     and whether any heartbeat was refused meanwhile.
 * The simulator's own CPU is measured apart (process.cpuUsage of each donor
 * process and of the bench), and so is each donor process's own stall (a beat's
 * latency less the stall of its process while it was in flight).
 *
 * With --trackers K (K > 1 implies --nats): a nats-server, K trackers as
 * replicas of one cluster, relays in the cluster too; donors spread over the
 * trackers and relays, chats through each tracker in turn; memory per donor
 * at NATS too, and route picks timed inside the trackers.
 *
 *   npx tsx bench/swarm.ts [--donors 1000,2000,5000] [--minutes 1] [--ramp-s 30] [--settle-s 15] [--settle-min-s S]
 *                          [--relays 1] [--trackers 1] [--nats] [--churn 0.05] [--relay-restart] [--no-mesh] [--shared-http]
 *                          [--donor-procs N[,M...]] [--beat-modes beating,paused] [--no-probe]
 *                          [--bin PATH ...] [--label NAME] [--out FILE]
 *                          [--loop-probe DIR] [--prof DIR] [--heap-snapshot DIR]
 *
 * `--loop-probe`: event-loop delay, stalls and GC pauses of every process over
 * the window (bench/lib/loop-probe.mjs), printed and kept in the JSON; `--prof`:
 * a CPU profile of each tracker; `--heap-snapshot`: tracker heap snapshots
 * before the ramp and after the window, for bench/heap-diff.ts (the snapshot
 * before the ramp adds to the RSS read as the baseline: take memory per donor
 * from a run without it).
 *
 * `--beat-modes beating,paused`: each run twice, the donors beating and then
 * with their beats paused over the window (answered in their own process,
 * the tracker hears nothing; its --dead-after-missed-heartbeats is raised so
 * it keeps them): the tracker's fixed cost, and per beat what beating adds to
 * it. `--no-probe`: no route-pick probes in the window.
 *
 * `--shared-http`: one HTTP pool for every donor instead of one each (fewer
 * sockets and objects in the simulator; registrations then reuse warm
 * connections, which a real swarm's tracker does not get).
 *
 * `--bin` (repeatable) runs every donor count with each given bin/meshnet.js
 * in turn (a baseline checkout's and this one's), so before/after figures
 * come from one run on the same machine. `--bin PATH::FLAGS` gives that
 * run's tracker FLAGS as node flags (e.g. `::--max-semi-space-size=4`).
 */
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import { startRelayProcess, type RelayProcess } from '../test/helpers/relay-process.ts';
import { spawnMeshnet, until, type NodeProc, type Proc } from '../test/helpers/mesh.ts';
import { cpuMs } from './lib/proc-cpu.ts';
import { loadAverage1m, printTable, quantile, writeResult } from './lib/stats.ts';
import { SWARM_CONFIG } from './lib/swarm-shape.ts';
import { DonorPool, defaultDonorProcs } from './lib/swarm-pool.ts';
import { startNats, type NatsServer } from '../test/helpers/cluster.ts';
import { startLoopProbe } from './lib/loop-probe.mjs';

const argv = process.argv.slice(2);
if (argv.includes('--help')) {
  process.stdout.write(readFileSync(fileURLToPath(import.meta.url), 'utf8').split('*/')[0]!.replace(/^\/\*\*?|^ \* ?/gm, ''));
  process.exit(0);
}
const opt = (name: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
};
const opts = (name: string) => argv.flatMap((a, i) => (a === `--${name}` && argv[i + 1] ? [argv[i + 1]!] : []));
const flag = (name: string) => argv.includes(`--${name}`);
const quick = flag('quick');
const DONORS = (opt('donors') ?? (quick ? '300' : '1000')).split(',').map(Number);
const MINUTES = Number(opt('minutes') ?? (quick ? 0.5 : 1));
const RAMP_S = Number(opt('ramp-s') ?? (quick ? 10 : 30));
const SETTLE_S = Number(opt('settle-s') ?? (quick ? 5 : 15));
/** The settle lasts at least this long, then until every donor beats at the configured period again (at most --settle-s). */
const SETTLE_MIN_S = Number(opt('settle-min-s') ?? SETTLE_S);
const RELAYS = Number(opt('relays') ?? 1);
const TRACKERS = Number(opt('trackers') ?? 1);
const NATS = flag('nats') || TRACKERS > 1;
/** Relays join the cluster too (their federation: a donor on one relay reaches a tracker on another over the fast path). */
const RELAY_NATS = NATS && !flag('no-relay-nats');
const CHURN = Number(opt('churn') ?? 0);
const RELAY_RESTART = flag('relay-restart');
const MESH = !flag('no-mesh');
/** One HTTP pool for all donors of a donor process (bench/lib/swarm-donors.ts DonorConfig.agent): fewer sockets and objects in the simulator. */
const SHARED_HTTP = flag('shared-http');
/** Donor processes (bench/lib/swarm-pool.ts); by default one per 2,500 donors. A list (`1,2`) runs each in turn, side by side. */
const DONOR_PROCS: Array<number | undefined> = opt('donor-procs') === undefined ? [undefined] : opt('donor-procs')!.split(',').map((x) => Math.max(1, Number(x)));
const HEARTBEAT_MS = Number(opt('heartbeat-ms') ?? 5000);
/**
 * `beating` (the default) and/or `paused`, each run in turn with the same build: in a paused run the donors
 * stop beating for the window (each beat answered in its own process with the tracker's last answer), so the
 * tracker's CPU there is its fixed cost with that many donors registered and attached. With `paused` in the
 * list every run's tracker gets --dead-after-missed-heartbeats PAUSE_DEAD_AFTER, so the sweep keeps the
 * silent donors (the trackers of all runs alike: a build without the flag cannot be used with it).
 */
const BEAT_MODES = (opt('beat-modes') ?? 'beating').split(',') as Array<'beating' | 'paused'>;
if (BEAT_MODES.some((m) => m !== 'beating' && m !== 'paused')) throw new Error(`--beat-modes: beating and/or paused, not ${opt('beat-modes')}`);
const PAUSE_DEAD_AFTER = 1000;
/** No route-pick probes (GET /api/route every 500 ms) in the window: the tracker's CPU is then only the swarm's. */
const PROBES = !flag('no-probe');
const LABEL = opt('label') ?? 'current';
/** Write a CPU profile of each tracker process into this directory (node --cpu-prof). */
const PROF = opt('prof');
/**
 * Event-loop probes (bench/lib/loop-probe.mjs) in the tracker, relay and
 * mesh processes and in this simulator: delay percentiles, stalls and GC
 * pauses over the window, so a heartbeat tail can be pinned on a process.
 */
const LOOP_DIR = opt('loop-probe');
/** Heap snapshots of the tracker into this directory: before the ramp and after the window (bench/heap-diff.ts compares them). */
const HEAP_DIR = opt('heap-snapshot');
const here = fileURLToPath(new URL('.', import.meta.url));
const OUT = opt('out') ?? join(here, 'results', 'swarm.json');
const LOOP_IMPORT = `--import ${new URL('./lib/loop-probe.mjs', import.meta.url).href}`;
if (LOOP_DIR) {
  mkdirSync(LOOP_DIR, { recursive: true });
  // Children inherit it (the relay helper passes this process's environment on).
  process.env.MESHNET_LOOP_PROBE_DIR = LOOP_DIR;
  process.env.NODE_OPTIONS = `${process.env.NODE_OPTIONS ?? ''} ${LOOP_IMPORT}`.trim();
}
// This process runs the chats and probes; the donors' processes ('sim1'…) get their probe from NODE_OPTIONS.
const simProbe = LOOP_DIR ? startLoopProbe('bench', LOOP_DIR) : undefined;
const BINS = opts('bin').length ? opts('bin') : [fileURLToPath(new URL('../bin/meshnet.js', import.meta.url))];

/** The tracker's node flags: a CPU profile, a heap snapshot on SIGTTIN. */
function trackerNodeArgs(): string[] {
  return [...(PROF ? ['--cpu-prof', `--cpu-prof-dir=${PROF}`] : []), ...(HEAP_DIR ? ['--heapsnapshot-signal=SIGTTIN', `--diagnostic-dir=${HEAP_DIR}`] : [])];
}

/** Signal each tracker for a heap snapshot and wait until every file is written (its size stops changing). */
async function heapSnapshots(pids: Array<number | undefined>): Promise<void> {
  if (!HEAP_DIR) return;
  mkdirSync(HEAP_DIR, { recursive: true });
  const before = new Set(readdirSync(HEAP_DIR));
  for (const pid of pids) if (pid !== undefined) process.kill(pid, 'SIGTTIN');
  const size = (f: string) => statSync(join(HEAP_DIR, f)).size;
  let last = '';
  for (const t0 = Date.now(); Date.now() - t0 < 120_000; ) {
    await sleep(1000);
    const fresh = readdirSync(HEAP_DIR).filter((f) => !before.has(f));
    const now = fresh.map((f) => `${f}:${size(f)}`).join(',');
    if (fresh.length >= pids.length && now === last) return;
    last = now;
  }
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** CPU ms of a process so far; NaN once it is gone (a process that died mid-run must not end the bench). */
function cpuOf(pid: number | undefined): number {
  try {
    return cpuMs(pid).all;
  } catch {
    return NaN;
  }
}

function rssKiB(pid: number | undefined): number {
  if (pid === undefined) return NaN;
  try {
    const m = /VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
    return m ? Number(m[1]) : NaN;
  } catch {
    return NaN;
  }
}

interface ProcRef {
  name: string;
  pid: () => number | undefined;
}

interface Chats {
  ok: number;
  failed: number;
  tokensPerS: number[];
  ttftMs: number[];
  errors: string[];
  stop(): Promise<void>;
}

/** Streamed chats one after another, through each tracker in turn, until stopped. */
function chatLoop(trackerUrls: string[]): Chats {
  const c: Chats = { ok: 0, failed: 0, tokensPerS: [], ttftMs: [], errors: [], stop: async () => {} };
  let running = true;
  const done = (async () => {
    for (let i = 0; running; i++) {
      const t0 = performance.now();
      const trackerUrl = trackerUrls[i % trackerUrls.length]!;
      try {
        const res = await fetch(`${trackerUrl}/v1/chat/completions`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: `Tell me about swarm number ${i}.` }], max_tokens: 16, temperature: 0, stream: true, stream_options: { include_usage: true } }),
        });
        if (res.status !== 200 || !res.body) throw new Error(`HTTP ${res.status}: ${(await res.text()).slice(0, 200)}`);
        let first = 0;
        let tokens = 0;
        let buf = '';
        const dec = new TextDecoder();
        for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
          if (!first) first = performance.now();
          buf += dec.decode(chunk, { stream: true });
          let k: number;
          while ((k = buf.indexOf('\n\n')) >= 0) {
            const line = buf.slice(0, k).trim();
            buf = buf.slice(k + 2);
            if (!line.startsWith('data:') || line.includes('[DONE]')) continue;
            const msg = JSON.parse(line.slice(5)) as { error?: { message: string }; usage?: { completion_tokens: number } };
            if (msg.error) throw new Error(msg.error.message);
            if (msg.usage) tokens = msg.usage.completion_tokens;
          }
        }
        const end = performance.now();
        c.ok++;
        c.ttftMs.push(first - t0);
        if (tokens > 1) c.tokensPerS.push(((tokens - 1) * 1000) / (end - first));
      } catch (e) {
        c.failed++;
        if (c.errors.length < 5) c.errors.push((e as Error).message);
        await sleep(500);
      }
    }
  })();
  c.stop = async () => {
    running = false;
    await done;
  };
  return c;
}

interface RunResult {
  bin: string;
  /** 'paused': the donors did not beat in the window (--beat-modes). */
  beat_mode: 'beating' | 'paused';
  route_probes: boolean;
  /** Tracker CPU over the window, ms per second (all trackers). */
  tracker_cpu_ms_per_s: number;
  /** A beating run beside a paused one (same build, donors): the paused run's CPU (ms/s), and the µs each beat adds to it. */
  fixed_ms_per_s?: number;
  per_beat_us_over_paused?: number;
  settle_s: number;
  tracker_kib_per_donor_window_median: number;
  tracker_kib_per_donor_window_max: number;
  long_period_donors: number;
  donors: number;
  window_s: number;
  window_from_tracker_start_s: number;
  tracker_cpu_pct: number;
  tracker_us_per_call: number;
  tracker_calls: number;
  heartbeats: number;
  heartbeat_p50_ms: number;
  heartbeat_p99_ms: number;
  heartbeat_p50_less_sim_stall_ms: number;
  heartbeat_p99_less_sim_stall_ms: number;
  /** The worst donor process's own stall over the window (each one's in sim_stalled_ms_each). */
  sim_stalled_ms: number;
  sim_stalled_ms_each: number[];
  /** Donor processes, and each one's CPU over the window in % of a core (sim_cpu_pct is their sum plus the bench's own). */
  donor_procs: number;
  sim_cpu_pct_each: number[];
  bench_cpu_pct: number;
  sim_rss_mib_each: number[];
  /** Heartbeat periods the live donors were last told at the window's end: ms → donors. */
  heartbeat_periods: Record<string, number>;
  heartbeat_failures: Record<string, number>;
  /** Answers that were not 200 by kind, outcome and error code: who refused (the relay or the tracker), and why. */
  error_codes: Record<string, number>;
  register_failures: Record<string, number>;
  dropped_404: number;
  tracker_removals_missed: number;
  shed_answers: number;
  tracker_kib_per_donor: number;
  tracker_kib_per_donor_end: number;
  nats_kib_per_donor: number;
  tracker_cpu_pct_each: number[];
  route_pick_tracker_p50_ms: number;
  route_pick_tracker_p99_ms: number;
  route_picks: number;
  relay_kib_per_donor: number;
  tracker_rss_mib: number;
  relay_cpu_pct: number;
  sim_cpu_pct: number;
  route_pick_p50_ms: number;
  route_pick_p99_ms: number;
  route_pick_failures: number;
  chats_ok: number;
  chats_failed: number;
  chat_tokens_per_s: number;
  chat_ttft_ms: number;
  chat_errors: string[];
  /** Heartbeats sent over the relay socket / as signed HTTP (all donors, whole run). */
  beats_relay: number;
  beats_http: number;
  /** Of beats_relay, those the relay batched to the tracker (beat-batch). */
  beats_batched: number;
  churn_left: number;
  /** Of churn_left, those registered at the tracker as they left; of those, still registered when removals were read. */
  churn_left_registered: number;
  churn_left_unremoved: number;
  /** How long after the window the bench waited for the leavers' removals before reading the count. */
  churn_removal_wait_s: number;
  churn_joined: number;
  /** Per process (with --loop-probe): event-loop delay, stalls and GC pauses over the window. */
  loop?: Record<string, LoopSummary>;
  relay_restart?: { donors: number; all_back_s: number | null; back_in_60s: number; shed_during: number; dropped_during: number; relay_back_s: number; error_codes_during: Record<string, number> };
}

interface LoopSummary {
  delay_ms: { p50: number; p99: number; max: number };
  elu: number;
  stalls: number;
  stall_ms: number;
  worst_stalls: Array<{ at: number; ms: number }>;
  gc_pauses: number;
  gc_ms: number;
  gc_max_ms: number;
  heap_used_mib: number;
}

/** Each probed process's window, read from its probe file (written every 2 s). */
async function loopSummary(procs: Array<{ name: string; pid: number | undefined }>): Promise<Record<string, LoopSummary>> {
  simProbe?.write();
  await sleep(2200);
  const files = readdirSync(LOOP_DIR!);
  const out: Record<string, LoopSummary> = {};
  for (const p of procs) {
    const f = files.find((x) => x.endsWith(`-${p.pid}.json`));
    if (!f) continue;
    const d = JSON.parse(readFileSync(join(LOOP_DIR!, f), 'utf8')) as { delay_ms: { p50: number; p99: number; max: number }; elu: number; stalls: Array<{ at: number; ms: number }>; gcs: Array<{ ms: number }>; heap_used_mib: number };
    out[p.name] = {
      delay_ms: { p50: d.delay_ms.p50, p99: d.delay_ms.p99, max: d.delay_ms.max },
      elu: d.elu,
      stalls: d.stalls.length,
      stall_ms: d.stalls.reduce((a, s) => a + s.ms, 0),
      worst_stalls: [...d.stalls].sort((a, b) => b.ms - a.ms).slice(0, 10),
      gc_pauses: d.gcs.length,
      gc_ms: d.gcs.reduce((a, g) => a + g.ms, 0),
      gc_max_ms: Math.max(0, ...d.gcs.map((g) => g.ms)),
      heap_used_mib: d.heap_used_mib,
    };
  }
  return out;
}

async function metricValue(url: string, name: string, labels: Record<string, string> = {}): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text();
  let sum = 0;
  for (const line of text.split('\n')) {
    if (!line.startsWith(name)) continue;
    const m = /^([a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$/.exec(line);
    if (!m || m[1] !== name) continue;
    const l = m[2] ?? '';
    if (Object.entries(labels).every(([k, v]) => l.includes(`${k}="${v}"`))) sum += Number(m[3]);
  }
  return sum;
}

interface Hist {
  /** Upper bounds (s) and cumulative counts. */
  buckets: Array<[number, number]>;
  count: number;
}

async function histogram(url: string, name: string): Promise<Hist> {
  const text = await (await fetch(`${url}/metrics`)).text().catch(() => '');
  const buckets: Array<[number, number]> = [];
  let count = 0;
  for (const line of text.split('\n')) {
    const b = new RegExp(`^${name}_bucket\\{le="([^"]+)"\\} ([0-9.e+-]+)$`).exec(line);
    if (b) buckets.push([b[1] === '+Inf' ? Infinity : Number(b[1]), Number(b[2])]);
    const c = new RegExp(`^${name}_count ([0-9.e+-]+)$`).exec(line);
    if (c) count = Number(c[1]);
  }
  return { buckets, count };
}

/** The window's histogram: each tracker's after minus before, summed. */
function mergeHist(after: Hist[], before: Hist[]): Hist {
  const out: Hist = { buckets: (after[0]?.buckets ?? []).map(([le]) => [le, 0]), count: 0 };
  after.forEach((h, i) => {
    const b = before[i]!;
    out.count += h.count - b.count;
    h.buckets.forEach(([, v], k) => (out.buckets[k]![1] += v - (b.buckets[k]?.[1] ?? 0)));
  });
  return out;
}

/** The bucket bound under which fraction q of the observations lie (an upper bound on the quantile). */
function quantileOfHist(h: Hist, q: number): number {
  if (h.count === 0) return NaN;
  for (const [le, v] of h.buckets) if (v >= q * h.count) return le;
  return Infinity;
}

/**
 * After a churned window: wait (at most 4 heartbeat periods plus 30 s) until no tracker holds more nodes than
 * the mesh and the live registered donors, i.e. every leaver was removed. Returns how many still were not (the
 * smallest registry over the trackers: in a cluster the leader removes first, the others follow it through KV).
 */
async function leaversStillRegistered(urls: string[], pool: DonorPool, meshNodes: number): Promise<{ still: number; waitedS: number }> {
  const t0 = performance.now();
  let still: number;
  for (;;) {
    const sizes = await Promise.all(urls.map(async (u) => ((await (await fetch(`${u}/healthz`)).json()) as { nodes: number }).nodes));
    const live = (await pool.status()).registered;
    still = Math.max(0, Math.min(...sizes) - meshNodes - live);
    if (still === 0 || performance.now() - t0 > 4 * HEARTBEAT_MS + 30_000) break;
    await sleep(1000);
  }
  return { still, waitedS: Math.round((performance.now() - t0) / 100) / 10 };
}

async function runOnce(binSpec: string, donorCount: number, donorProcs: number | undefined, beatMode: 'beating' | 'paused', swarmUrl: string, smallUrl: string): Promise<RunResult> {
  // `PATH::FLAGS`: the tracker of this run gets FLAGS (space-separated) as node flags, e.g. a smaller young generation.
  const [bin, flags] = binSpec.split('::') as [string, string | undefined];
  const extraNodeArgs = flags ? flags.split(' ').filter(Boolean) : [];
  const relays: RelayProcess[] = [];
  const relayPorts: number[] = [];
  const trackers: Array<Proc & { url: string }> = [];
  const nodes: NodeProc[] = [];
  let pool: DonorPool | undefined;
  let chats: Chats | undefined;
  let nats: NatsServer | undefined;
  let natsWatch: ReturnType<typeof setInterval> | undefined;
  try {
    if (NATS) nats = await startNats();
    // nats-server must outlive the run: if it goes, say so with the end of its log (a Go panic, a signal) at once.
    natsWatch = nats
      ? setInterval(() => {
          try {
            process.kill(nats!.pid, 0);
          } catch {
            clearInterval(natsWatch);
            natsWatch = undefined;
            console.log(`  nats-server (pid ${nats!.pid}) is GONE; its log ends:\n${nats!.log().slice(-4000)}`);
          }
        }, 500)
      : undefined;
    natsWatch?.unref();
    const cluster = nats ? ['--nats', nats.url, '--cluster', 'swarm'] : [];
    for (let i = 0; i < RELAYS; i++) {
      const r = await startRelayProcess(RELAY_NATS ? cluster : [], bin);
      relays.push(r);
      relayPorts.push(r.port);
    }
    const trackerSpawnedAt = performance.now();
    for (let i = 0; i < TRACKERS; i++) {
      const tp = spawnMeshnet(['tracker', '--port', '0', '--log-level', 'warn', '--model', `swarm=${swarmUrl}`, ...(MESH ? ['--model', `small=${smallUrl}`] : []), '--relay', relays[i % RELAYS]!.url, '--heartbeat-interval-ms', String(HEARTBEAT_MS), ...(BEAT_MODES.includes('paused') ? ['--dead-after-missed-heartbeats', String(PAUSE_DEAD_AFTER)] : []), ...cluster], {}, bin, [...trackerNodeArgs(), ...extraNodeArgs]);
      const l = await tp.waitFor((e) => e.event === 'listening');
      trackers.push(Object.assign(tp, { url: l.url as string }));
    }
    const trackerFor = (i: number) => trackers[i % TRACKERS]!.url;

    if (MESH) {
      for (let i = 0; i < 3; i++) {
        const p = spawnMeshnet(['node', '--port', '0', '--threads', '1', '--relay', relays[0]!.url, '--tracker', trackerFor(i), '--model', 'small', '--budget-mb', '60'], {}, bin);
        const nl = await p.waitFor((e) => e.event === 'listening');
        const n = Object.assign(p, { peerId: nl.peer_id as string, endpoint: nl.endpoint as string, relayAddr: (nl.relay_addr as string | null) ?? null });
        nodes.push(n);
        await n.waitFor((e) => e.event === 'serving', 120_000);
      }
      for (const t of trackers) {
        await until(async () => {
          const r = await fetch(`${t.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 }) });
          return r.status === 200;
        }, 60_000, 'the 3-node mesh serving a chat');
      }
    }

    const procs: ProcRef[] = [
      ...trackers.map((t, i) => ({ name: `tracker${i + 1}`, pid: () => t.child.pid })),
      ...relays.map((_, i) => ({ name: `relay${i + 1}`, pid: () => relays[i]!.child.pid })),
      ...(nats ? [{ name: 'nats', pid: () => nats!.pid }] : []),
    ];
    await sleep(1000);
    await heapSnapshots(trackers.map((t) => t.child.pid));
    const rssBefore = Object.fromEntries(procs.map((p) => [p.name, rssKiB(p.pid())]));

    // The donors' processes, then the ramp: donors join at a steady rate, spread over the relays and trackers.
    const procsN = donorProcs ?? defaultDonorProcs(donorCount);
    pool = await DonorPool.start(procsN, { relayUrls: relays.map((r) => r.url), trackerUrls: trackers.map((t) => t.url), heartbeatMs: HEARTBEAT_MS, sharedHttp: SHARED_HTTP });
    const donorPool = pool;
    let made = 0;
    const t0 = performance.now();
    const perTick = Math.max(1, Math.ceil((donorCount * 100) / (RAMP_S * 1000)));
    while (made < donorCount) {
      const batch: number[] = [];
      for (let k = 0; k < perTick && made < donorCount; k++) batch.push(made++);
      donorPool.start(batch);
      const due = t0 + (made / donorCount) * RAMP_S * 1000;
      const wait = due - performance.now();
      if (wait > 0) await sleep(wait);
    }
    const started = await donorPool.started();
    const rampS = (performance.now() - t0) / 1000;
    console.log(`  ${donorCount} donors in ${procsN} processes started in ${rampS.toFixed(1)} s; ${started.registered} registered${started.failures.length ? `; start failures e.g. ${started.failures.join(' | ')}` : ''}`);
    // Settle: at least SETTLE_MIN_S, then until every donor was told the configured period again (a tracker behind
    // during the ramp hands out up to 60 s, and a donor hears the shorter one only at its next beat), at most SETTLE_S.
    const s0 = performance.now();
    await sleep(Math.min(SETTLE_S, SETTLE_MIN_S) * 1000);
    while (performance.now() - s0 < SETTLE_S * 1000 && (await donorPool.status()).longPeriods > 0) await sleep(1000);
    const longPeriods = (await donorPool.status()).longPeriods;
    const settleS = Math.round((performance.now() - s0) / 1000);
    console.log(`  settled in ${settleS} s; ${longPeriods} donors still on a period over ${HEARTBEAT_MS} ms`);
    const rssAfter = Object.fromEntries(procs.map((p) => [p.name, rssKiB(p.pid())]));

    // The measured window.
    if (MESH) chats = chatLoop(trackers.map((t) => t.url));
    const removals = async () => (await Promise.all(trackers.map((t) => metricValue(t.url, 'meshnet_tracker_node_removals_total', { reason: 'missed heartbeats' }).catch(() => NaN)))).reduce((a, b) => a + b, 0);
    const removalsBefore = await removals();
    const picksBefore = await Promise.all(trackers.map((t) => histogram(t.url, 'meshnet_tracker_route_pick_seconds')));
    if (LOOP_DIR) {
      // SIGUSR2 resets the probes of our node processes; nats-server takes SIGUSR2 as "enter lame duck mode"
      // and shuts down ten seconds later: never send it there.
      for (const p of procs) if (p.name !== 'nats' && p.pid() !== undefined) process.kill(p.pid()!, 'SIGUSR2');
      for (const pid of donorPool.pids) if (pid !== undefined) process.kill(pid, 'SIGUSR2');
      simProbe?.reset();
    }
    await donorPool.record();
    if (beatMode === 'paused') {
      await donorPool.pause(true);
      // The beats already sent are answered before the window counts.
      await sleep(1000);
    }
    const cpuBefore = Object.fromEntries(procs.map((p) => [p.name, cpuOf(p.pid())]));
    const simBefore = process.cpuUsage();
    const w0 = performance.now();
    const windowMs = MINUTES * 60_000;
    // The tracker's RSS every 5 s of the window: one reading at its end catches the heap wherever its GC cycle is.
    const rssSamples: number[] = [];
    const rssTimer = setInterval(() => rssSamples.push(rssKiB(trackers[0]!.child.pid)), 5_000);

    // Route picks, probed at the client.
    const picks: number[] = [];
    let pickFailures = 0;
    let probing = true;
    let probes = 0;
    const probe = (async () => {
      while (probing && PROBES) {
        const p0 = performance.now();
        const r = await fetch(`${trackerFor(probes++)}/api/route?model=swarm`).catch(() => undefined);
        if (r?.status === 200) picks.push(performance.now() - p0);
        else pickFailures++;
        await r?.arrayBuffer().catch(() => {});
        await sleep(500);
      }
    })();

    // Churn: each second, CHURN/60 of the donors leave and as many join (in the same donor process, picked at random).
    let left = 0;
    let leftRegistered = 0;
    let joined = 0;
    const churnCalls: Array<Promise<void>> = [];
    const churnTimer = CHURN > 0 ? setInterval(() => {
      const n = (donorCount * CHURN) / 60;
      const whole = Math.floor(n) + (Math.random() < n - Math.floor(n) ? 1 : 0);
      const by = new Map<number, number[]>();
      for (let k = 0; k < whole; k++) {
        const c = Math.floor(Math.random() * donorPool.size);
        by.set(c, [...(by.get(c) ?? []), made++]);
      }
      for (const [c, join] of by) {
        joined += join.length;
        churnCalls.push(donorPool.churn(c, join.length, join).then((l) => {
          left += l.left;
          leftRegistered += l.leftRegistered;
        }, () => {}));
      }
    }, 1000) : undefined;

    // Relay restart: mid-window, the first relay goes down and comes back on its port.
    let restart: RunResult['relay_restart'];
    const restartJob = RELAY_RESTART ? (async () => {
      await sleep(windowMs / 2 - 30_000 > 0 ? windowMs / 2 - 30_000 : windowMs / 4);
      const r0 = relays[0]!;
      const before = await donorPool.counters();
      const at = Date.now();
      const mine = await donorPool.restartMark(0, at);
      await r0.stop('SIGKILL');
      // Back on its port (its donors reconnect there); a port its old sockets still hold is tried again.
      for (let tries = 0; ; tries++) {
        try {
          relays[0] = await startRelayProcess(['--port', String(relayPorts[0]), ...(RELAY_NATS ? cluster : [])], bin);
          break;
        } catch (e) {
          if (tries >= 40) throw e;
          if (tries === 0) {
            let natsAlive = false;
            try {
              if (nats) natsAlive = process.kill(nats.pid, 0);
            } catch {
              // gone
            }
            console.log(`  relay restart: ${(e as Error).message.trim()}; trying again every 250 ms${nats ? ` (nats-server ${natsAlive ? 'alive' : 'GONE'}; its log ends: ${nats.log().slice(-1500)})` : ''}`);
          }
          await sleep(250);
        }
      }
      const relayBackS = (Date.now() - at) / 1000;
      console.log(`  relay restarted ${relayBackS.toFixed(2)} s after the kill`);
      let allBack: number | null = null;
      let st = await donorPool.restartStatus();
      for (;;) {
        if (st.back === st.mine) {
          allBack = (Date.now() - at) / 1000;
          break;
        }
        if (Date.now() - at > 120_000) break;
        await sleep(250);
        st = await donorPool.restartStatus();
      }
      const after = await donorPool.counters();
      restart = {
        donors: mine,
        all_back_s: allBack,
        back_in_60s: st.backIn60s,
        shed_during: after.shed - before.shed,
        dropped_during: after.dropped - before.dropped,
        relay_back_s: relayBackS,
        // From the kill until all were back (or 120 s): answers not 200 by who refused and why.
        error_codes_during: Object.fromEntries(Object.entries(after.errorCodes).map(([k, n]) => [k, n - (before.errorCodes[k] ?? 0)]).filter(([, n]) => (n as number) > 0)),
      };
    })() : Promise.resolve();

    let restartError: unknown;
    const restartDone = restartJob.catch((e: unknown) => void (restartError = e));
    await sleep(windowMs);
    await restartDone;
    if (restartError) throw restartError;
    if (churnTimer) clearInterval(churnTimer);
    probing = false;
    await probe;
    clearInterval(rssTimer);
    const windowS = (performance.now() - w0) / 1000;
    const cpuAfter = Object.fromEntries(procs.map((p) => [p.name, cpuOf(p.pid())]));
    const rssEnd = Object.fromEntries(procs.map((p) => [p.name, rssKiB(p.pid())]));
    const sim = process.cpuUsage(simBefore);
    const w = await donorPool.collect();
    await chats?.stop();
    await Promise.all(churnCalls);
    // The donors that left late in the window are removed only after their deadline (3 periods, plus any lateness
    // the tracker excuses): wait until every tracker has dropped them, so each leaver is one removal in the count.
    const leftover = CHURN > 0 ? await leaversStillRegistered(trackers.map((t) => t.url), donorPool, MESH ? 3 : 0) : { still: 0, waitedS: 0 };
    const removalsAfter = await removals();
    const loop = LOOP_DIR ? await loopSummary([...procs.map((p) => ({ name: p.name, pid: p.pid() })), ...donorPool.pids.map((pid, i) => ({ name: `sim${i + 1}`, pid })), { name: 'bench', pid: process.pid }]) : undefined;
    const heapDonors = w.alive;
    await heapSnapshots(trackers.map((t) => t.child.pid));
    if (HEAP_DIR) console.log(`  heap snapshots in ${HEAP_DIR}: the last pair is before the ramp and after the window, ${heapDonors} donors`);
    const picksAfter = await Promise.all(trackers.map((t) => histogram(t.url, 'meshnet_tracker_route_pick_seconds')));
    const pickHist = mergeHist(picksAfter, picksBefore);

    const trackerCpus = trackers.map((_, i) => cpuAfter[`tracker${i + 1}`]! - cpuBefore[`tracker${i + 1}`]!);
    const trackerCpuMs = trackerCpus.reduce((a, b) => a + b, 0);
    const relayCpuMs = relays.reduce((s, _, i) => s + (cpuAfter[`relay${i + 1}`]! - cpuBefore[`relay${i + 1}`]!), 0);
    const count = (k: 'heartbeat' | 'register') => [...w.outcomes[k].values()].reduce((a, b) => a + b, 0);
    const calls = count('heartbeat') + count('register');
    const hb = w.latency.heartbeat.sort((a, b) => a - b);
    const hbLess = w.latencyLessStall.heartbeat.sort((a, b) => a - b);
    const outcomes = (k: 'heartbeat' | 'register') => Object.fromEntries([...w.outcomes[k]].filter(([o]) => o !== 'ok'));
    const benchCpuMs = (sim.user + sim.system) / 1000;
    const relayRssGrowth = relays.reduce((s, _, i) => s + (rssAfter[`relay${i + 1}`]! - rssBefore[`relay${i + 1}`]!), 0);
    const pk = [...picks].sort((a, b) => a - b);
    const tps = chats ? [...chats.tokensPerS].sort((a, b) => a - b) : [];
    const ttft = chats ? [...chats.ttftMs].sort((a, b) => a - b) : [];
    return {
      bin: binSpec,
      beat_mode: beatMode,
      route_probes: PROBES,
      donors: donorCount,
      settle_s: settleS,
      long_period_donors: longPeriods,
      window_s: windowS,
      // Seconds from the first tracker's spawn: the window's span in its CPU profile (bench/cpuprofile-top.ts --from-s/--to-s).
      window_from_tracker_start_s: (w0 - trackerSpawnedAt) / 1000,
      tracker_cpu_pct: (trackerCpuMs / (windowS * 1000)) * 100,
      tracker_cpu_ms_per_s: trackerCpuMs / windowS,
      tracker_us_per_call: calls ? (trackerCpuMs * 1000) / calls : NaN,
      tracker_calls: calls,
      heartbeats: count('heartbeat'),
      heartbeat_p50_ms: quantile(hb, 0.5),
      heartbeat_p99_ms: quantile(hb, 0.99),
      // Less its donor process's own stall while each beat was in flight (bench/lib/swarm-donors.ts LoopClock).
      heartbeat_p50_less_sim_stall_ms: quantile(hbLess, 0.5),
      heartbeat_p99_less_sim_stall_ms: quantile(hbLess, 0.99),
      sim_stalled_ms: Math.max(...w.stalledMsEach),
      sim_stalled_ms_each: w.stalledMsEach,
      donor_procs: donorPool.size,
      sim_cpu_pct_each: w.cpuMsEach.map((ms) => (ms / (windowS * 1000)) * 100),
      bench_cpu_pct: (benchCpuMs / (windowS * 1000)) * 100,
      sim_rss_mib_each: w.rssMiBEach.map((m) => Math.round(m)),
      heartbeat_periods: w.periods,
      heartbeat_failures: outcomes('heartbeat'),
      error_codes: w.errorCodes,
      register_failures: outcomes('register'),
      dropped_404: w.dropped,
      // Removals of donors that never left (those that did are expected to go): counted after the leavers' deadlines
      // passed, less each leaver the tracker held as it left (one still registering is never removed) and has dropped.
      // In a cluster only the leader removes, so the sum over trackers counts each removal once.
      tracker_removals_missed: removalsAfter - removalsBefore - (leftRegistered - leftover.still),
      churn_left_registered: leftRegistered,
      churn_left_unremoved: leftover.still,
      churn_removal_wait_s: leftover.waitedS,
      shed_answers: w.shed,
      // Every tracker holds the whole registry: the largest growth of one.
      tracker_kib_per_donor: Math.max(...trackers.map((_, i) => rssAfter[`tracker${i + 1}`]! - rssBefore[`tracker${i + 1}`]!)) / donorCount,
      // The same at the window's end: steady state, the ramp's registration connections closed (65 s keep-alive) or closing.
      tracker_kib_per_donor_end: Math.max(...trackers.map((_, i) => rssEnd[`tracker${i + 1}`]! - rssBefore[`tracker${i + 1}`]!)) / donorCount,
      // The first tracker's RSS growth over the window, from a reading every 5 s: median and largest.
      tracker_kib_per_donor_window_median: (quantile([...rssSamples].sort((a, b) => a - b), 0.5) - rssBefore.tracker1!) / donorCount,
      tracker_kib_per_donor_window_max: (Math.max(...rssSamples) - rssBefore.tracker1!) / donorCount,
      nats_kib_per_donor: nats ? (rssAfter.nats! - rssBefore.nats!) / donorCount : NaN,
      tracker_cpu_pct_each: trackerCpus.map((ms) => (ms / (windowS * 1000)) * 100),
      route_pick_tracker_p50_ms: quantileOfHist(pickHist, 0.5) * 1000,
      route_pick_tracker_p99_ms: quantileOfHist(pickHist, 0.99) * 1000,
      route_picks: pickHist.count,
      relay_kib_per_donor: relayRssGrowth / donorCount,
      tracker_rss_mib: rssAfter.tracker1! / 1024,
      relay_cpu_pct: (relayCpuMs / (windowS * 1000)) * 100,
      sim_cpu_pct: ((w.cpuMsEach.reduce((a, b) => a + b, 0) + benchCpuMs) / (windowS * 1000)) * 100,
      route_pick_p50_ms: quantile(pk, 0.5),
      route_pick_p99_ms: quantile(pk, 0.99),
      route_pick_failures: pickFailures,
      chats_ok: chats?.ok ?? 0,
      chats_failed: chats?.failed ?? 0,
      chat_tokens_per_s: quantile(tps, 0.5),
      chat_ttft_ms: quantile(ttft, 0.5),
      chat_errors: chats?.errors ?? [],
      beats_relay: w.beatsRelay,
      beats_http: w.beatsHttp,
      beats_batched: w.beatsBatched,
      churn_left: left,
      churn_joined: joined,
      ...(restart ? { relay_restart: restart } : {}),
      ...(loop ? { loop } : {}),
    };
  } finally {
    await chats?.stop().catch(() => {});
    await pool?.close();
    await Promise.all(nodes.map((n) => n.stop()));
    await Promise.all(trackers.map((t) => t.stop()));
    await Promise.all(relays.map((r) => r.stop()));
    clearInterval(natsWatch);
    await nats?.stop();
  }
}

const dir = mkdtempSync(join(tmpdir(), 'meshnet-swarm-'));
writeFileSync(join(dir, 'config.json'), JSON.stringify(SWARM_CONFIG));
const swarmServer: StaticServer = await startStaticServer({ root: dir });
const smallServer: StaticServer | undefined = MESH ? await startStaticServer({ root: await ensureModel('small') }) : undefined;
const loadBefore = loadavg()[0]!;
const results: RunResult[] = [];
try {
  for (const n of DONORS) {
    for (const bin of BINS) {
      for (const procs of DONOR_PROCS) {
        for (const mode of BEAT_MODES) {
          console.log(`\n--- ${n} donors, ${bin}${procs ? `, ${procs} donor processes` : ''}, beats ${mode}`);
          const r = await runOnce(bin, n, procs, mode, swarmServer.url, smallServer?.url ?? '');
          results.push(r);
          console.log(JSON.stringify(r));
        }
      }
    }
  }
} finally {
  await swarmServer.close();
  await smallServer?.close();
}

const binName = (b: string) => (BINS.length > 1 ? b.replace(/\/bin\/meshnet\.js(?=$|::)/, '').split('/').pop()! : LABEL);
const runName = (r: RunResult) => `${binName(r.bin)}${BEAT_MODES.length > 1 || r.beat_mode === 'paused' ? ` (${r.beat_mode})` : ''}`;
printTable(
  `simulated swarm: ${MINUTES} min window, heartbeats every ${HEARTBEAT_MS / 1000} s${CHURN ? `, churn ${CHURN * 100}%/min` : ''}${MESH ? ', 3-node mesh chatting' : ''} (shared 2-core machine)`,
  ['run', 'donors', 'procs', 'tracker CPU %', 'µs/call', 'hb p50 ms', 'hb p99 ms', 'hb p99 less sim stall', 'sim stalled s', 'hb failed', 'dropped (404)', 'removed live', 'shed', 'tracker KiB/donor', 'at window end', 'window median', 'window max', 'relay KiB/donor', 'NATS KiB/donor', 'route p99 ms (probe)', 'pick p99 ms (tracker)', 'chats ok/failed', 'chat tok/s', 'sim CPU %'],
  results.map((r) => [
    runName(r),
    r.donors,
    r.donor_procs,
    r.tracker_cpu_pct,
    r.tracker_us_per_call,
    r.heartbeat_p50_ms,
    r.heartbeat_p99_ms,
    r.heartbeat_p99_less_sim_stall_ms,
    r.sim_stalled_ms / 1000,
    Object.values(r.heartbeat_failures).reduce((a, b) => a + b, 0),
    r.dropped_404,
    r.tracker_removals_missed,
    r.shed_answers,
    r.tracker_kib_per_donor,
    r.tracker_kib_per_donor_end,
    r.tracker_kib_per_donor_window_median,
    r.tracker_kib_per_donor_window_max,
    r.relay_kib_per_donor,
    r.nats_kib_per_donor,
    r.route_pick_p99_ms,
    r.route_pick_tracker_p99_ms,
    `${r.chats_ok}/${r.chats_failed}`,
    r.chat_tokens_per_s,
    r.sim_cpu_pct,
  ]),
);
for (const r of results) {
  for (const [name, l] of Object.entries(r.loop ?? {})) console.log(`loop ${runName(r)} ${r.donors} ${name}: delay p50 ${l.delay_ms.p50} p99 ${l.delay_ms.p99} max ${l.delay_ms.max} ms, elu ${l.elu.toFixed(2)}, ${l.stalls} stalls (${l.stall_ms} ms), ${l.gc_pauses} GC pauses >= 5 ms (${l.gc_ms.toFixed(0)} ms, max ${l.gc_max_ms}), heap ${l.heap_used_mib.toFixed(0)} MiB`);
}
for (const r of results) if (Object.keys(r.error_codes).length) console.log(`answers not 200 (${binName(r.bin)}, ${r.donors}): ${JSON.stringify(r.error_codes)}`);
for (const r of results) if (r.relay_restart) console.log(`relay restart (${binName(r.bin)}, ${r.donors}): ${JSON.stringify(r.relay_restart)}`);
console.log(`load average (1 min) at start ${loadBefore.toFixed(2)}, at end ${loadavg()[0]!.toFixed(2)}`);
// Beating against paused with the same build and donors: the tracker's fixed cost (ms of CPU a second with the
// donors registered and attached, no beat) and what each beat adds on top of it.
for (const p of results.filter((r) => r.beat_mode === 'paused')) {
  const b = results.find((r) => r.beat_mode === 'beating' && r.bin === p.bin && r.donors === p.donors && r.donor_procs === p.donor_procs);
  if (!b) continue;
  const perBeatUs = ((b.tracker_cpu_ms_per_s - p.tracker_cpu_ms_per_s) * 1000) / (b.heartbeats / b.window_s);
  console.log(`fixed vs per beat (${binName(p.bin)}, ${p.donors} donors): fixed ${p.tracker_cpu_ms_per_s.toFixed(1)} ms/s (${((p.tracker_cpu_ms_per_s * 1000) / (b.heartbeats / b.window_s)).toFixed(1)} µs per beat at the beating run's rate), beating ${b.tracker_cpu_ms_per_s.toFixed(1)} ms/s, ${(b.heartbeats / b.window_s).toFixed(0)} beats/s: ${perBeatUs.toFixed(1)} µs per beat on top of the fixed cost`);
  b.per_beat_us_over_paused = perBeatUs;
  b.fixed_ms_per_s = p.tracker_cpu_ms_per_s;
}
writeResult(OUT, { bench: 'swarm', label: LABEL, beat_modes: BEAT_MODES, route_probes: PROBES, load_average_1m: loadAverage1m(loadBefore), minutes: MINUTES, heartbeat_ms: HEARTBEAT_MS, churn: CHURN, relays: RELAYS, trackers: TRACKERS, nats: NATS, mesh: MESH, runs: results });
process.exit(0);
