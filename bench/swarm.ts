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
 *                          [--bin PATH ...] [--donors-per-bin] [--label NAME] [--out FILE]
 *                          [--loop-probe DIR] [--prof DIR] [--prof-relays DIR] [--heap-snapshot DIR]
 *                          [--relay-args "FLAGS"] [--sim-nice N] [--mesh-nice N]
 *
 * `--loop-probe`: event-loop delay, stalls and GC pauses of every process over
 * the window (bench/lib/loop-probe.mjs), printed and kept in the JSON; `--prof`:
 * a CPU profile of each tracker (`--prof-relays`: of each relay, at 10 ms
 * sampling); `--relay-args`: flags for every relay (e.g. "--beat-batch-ms 50");
 * `--sim-nice N`: the donor processes run at nice N (a real swarm's donors
 * are on their own machines, not on the trackers' two cores); `--mesh-nice N`:
 * the 3-node mesh's processes too (its nodes compute a chat's tokens at
 * nice 0 beside the trackers otherwise); the pick's
 * CPU time (`pick CPU p99`) beside its clock time tells its own work from
 * its waits for a core either way.
 * `--heap-snapshot`: tracker heap snapshots
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
 * `--donors-per-bin`: each run's donors are that bin's checkout's too (its
 * bench/lib/swarm-child.ts, so its src/node), for a change on the nodes' side;
 * without it every run's donors are this checkout's.
 */
import { mkdirSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { loadavg, setPriority, tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import { loadAverage1m, quantile, writeResult } from './lib/stats.ts';
import { SWARM_CONFIG } from './lib/swarm-shape.ts';
import { DonorPool, defaultDonorProcs } from './lib/swarm-pool.ts';
import { startLoopProbe } from './lib/loop-probe.mjs';
import { parseSwarmOptions, type BeatMode } from './lib/swarm-options.ts';
import { SwarmCluster } from './lib/swarm-cluster.ts';
import { chatLoop, type Chats } from './lib/swarm-chats.ts';
import { cpuOf, heapSnapshots, loopSummary, profilingNodeArgs, rssKiB } from './lib/proc-readings.ts';
import { histMs, histogram, mergeHist, metricValue, quantileOfHist } from './lib/metrics-scrape.ts';
import { reportRuns, type RunResult } from './lib/swarm-report.ts';

const argv = process.argv.slice(2);
if (argv.includes('--help')) {
  process.stdout.write(readFileSync(fileURLToPath(import.meta.url), 'utf8').split('*/')[0]!.replace(/^\/\*\*?|^ \* ?/gm, ''));
  process.exit(0);
}
const o = parseSwarmOptions(argv);
const LOOP_IMPORT = `--import ${new URL('./lib/loop-probe.mjs', import.meta.url).href}`;
if (o.loopDir) {
  mkdirSync(o.loopDir, { recursive: true });
  // Children inherit it (the relay helper passes this process's environment on).
  process.env.MESHNET_LOOP_PROBE_DIR = o.loopDir;
  process.env.NODE_OPTIONS = `${process.env.NODE_OPTIONS ?? ''} ${LOOP_IMPORT}`.trim();
}
// This process runs the chats and probes; the donors' processes ('sim1'…) get their probe from NODE_OPTIONS.
const simProbe = o.loopDir ? startLoopProbe('bench', o.loopDir) : undefined;

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

interface ProcRef {
  name: string;
  pid: () => number | undefined;
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
    if (still === 0 || performance.now() - t0 > 4 * o.heartbeatMs + 30_000) break;
    await sleep(1000);
  }
  return { still, waitedS: Math.round((performance.now() - t0) / 100) / 10 };
}

async function runOnce(binSpec: string, donorCount: number, donorProcs: number | undefined, beatMode: BeatMode, swarmUrl: string, smallUrl: string): Promise<RunResult> {
  // `PATH::FLAGS`: the tracker of this run gets FLAGS (space-separated) as node flags, e.g. a smaller young generation.
  const [bin, flags] = binSpec.split('::') as [string, string | undefined];
  const extraNodeArgs = flags ? flags.split(' ').filter(Boolean) : [];
  const cluster = new SwarmCluster(o, bin);
  const { relays, trackers } = cluster;
  let pool: DonorPool | undefined;
  let chats: Chats | undefined;
  try {
    await cluster.start(swarmUrl, smallUrl, [...profilingNodeArgs(o.prof, o.heapDir), ...extraNodeArgs]);
    const { nats, trackerSpawnedAt } = cluster;
    // --mesh-nice: the mesh's nodes yield the cores to the control plane, as nodes on their own machines would.
    if (o.meshNice) for (const n of cluster.nodes) if (n.child.pid !== undefined) setPriority(n.child.pid, o.meshNice);

    const procs: ProcRef[] = [
      ...trackers.map((t, i) => ({ name: `tracker${i + 1}`, pid: () => t.child.pid })),
      ...relays.map((_, i) => ({ name: `relay${i + 1}`, pid: () => relays[i]!.child.pid })),
      ...(nats ? [{ name: 'nats', pid: () => nats!.pid }] : []),
    ];
    await sleep(1000);
    await heapSnapshots(o.heapDir, trackers.map((t) => t.child.pid));
    const rssBefore = Object.fromEntries(procs.map((p) => [p.name, rssKiB(p.pid())]));

    // The donors' processes, then the ramp: donors join at a steady rate, spread over the relays and trackers.
    const procsN = donorProcs ?? defaultDonorProcs(donorCount);
    const donorEntry = o.donorsPerBin ? join(dirname(bin), '..', 'bench', 'lib', 'swarm-child.ts') : undefined;
    pool = await DonorPool.start(procsN, { relayUrls: relays.map((r) => r.url), trackerUrls: trackers.map((t) => t.url), heartbeatMs: o.heartbeatMs, sharedHttp: o.sharedHttp }, donorEntry);
    const donorPool = pool;
    // --sim-nice: the donors yield the cores to the trackers, as donors on their own machines would.
    if (o.simNice) for (const pid of donorPool.pids) if (pid !== undefined) setPriority(pid, o.simNice);
    let made = 0;
    const t0 = performance.now();
    const perTick = Math.max(1, Math.ceil((donorCount * 100) / (o.rampS * 1000)));
    while (made < donorCount) {
      const batch: number[] = [];
      for (let k = 0; k < perTick && made < donorCount; k++) batch.push(made++);
      donorPool.start(batch);
      const due = t0 + (made / donorCount) * o.rampS * 1000;
      const wait = due - performance.now();
      if (wait > 0) await sleep(wait);
    }
    const started = await donorPool.started();
    const rampS = (performance.now() - t0) / 1000;
    console.log(`  ${donorCount} donors in ${procsN} processes started in ${rampS.toFixed(1)} s; ${started.registered} registered${started.failures.length ? `; start failures e.g. ${started.failures.join(' | ')}` : ''}`);
    // Settle: at least --settle-min-s, then until every donor was told the configured period again (a tracker behind
    // during the ramp hands out up to 60 s, and a donor hears the shorter one only at its next beat), at most --settle-s.
    const s0 = performance.now();
    await sleep(Math.min(o.settleS, o.settleMinS) * 1000);
    while (performance.now() - s0 < o.settleS * 1000 && (await donorPool.status()).longPeriods > 0) await sleep(1000);
    const longPeriods = (await donorPool.status()).longPeriods;
    const settleS = Math.round((performance.now() - s0) / 1000);
    console.log(`  settled in ${settleS} s; ${longPeriods} donors still on a period over ${o.heartbeatMs} ms`);
    const rssAfter = Object.fromEntries(procs.map((p) => [p.name, rssKiB(p.pid())]));

    // The measured window.
    if (o.mesh) chats = chatLoop(trackers.map((t) => t.url));
    const removals = async () => (await Promise.all(trackers.map((t) => metricValue(t.url, 'meshnet_tracker_node_removals_total', { reason: 'missed heartbeats' }).catch(() => NaN)))).reduce((a, b) => a + b, 0);
    const removalsBefore = await removals();
    const picksBefore = await Promise.all(trackers.map((t) => histogram(t.url, 'meshnet_tracker_route_pick_seconds')));
    const pickCpuBefore = await Promise.all(trackers.map((t) => histogram(t.url, 'meshnet_tracker_route_pick_cpu_seconds')));
    if (o.loopDir) {
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
    const windowMs = o.minutes * 60_000;
    // The tracker's RSS every 5 s of the window: one reading at its end catches the heap wherever its GC cycle is.
    const rssSamples: number[] = [];
    const rssTimer = setInterval(() => rssSamples.push(rssKiB(trackers[0]!.child.pid)), 5_000);

    // Route picks, probed at the client.
    const picks: number[] = [];
    let pickFailures = 0;
    let probing = true;
    let probes = 0;
    const probe = (async () => {
      while (probing && o.probes) {
        const p0 = performance.now();
        const r = await fetch(`${cluster.trackerFor(probes++)}/api/route?model=swarm`).catch(() => undefined);
        if (r?.status === 200) picks.push(performance.now() - p0);
        else pickFailures++;
        await r?.arrayBuffer().catch(() => {});
        await sleep(500);
      }
    })();

    // Churn: each second, --churn/60 of the donors leave and as many join (in the same donor process, picked at random).
    let left = 0;
    let leftRegistered = 0;
    let joined = 0;
    const churnCalls: Array<Promise<void>> = [];
    const churnTimer = o.churn > 0 ? setInterval(() => {
      const n = (donorCount * o.churn) / 60;
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
    const restartJob = o.relayRestart ? (async () => {
      await sleep(windowMs / 2 - 30_000 > 0 ? windowMs / 2 - 30_000 : windowMs / 4);
      const r0 = relays[0]!;
      const before = await donorPool.counters();
      const at = Date.now();
      const mine = await donorPool.restartMark(0, at);
      await r0.stop('SIGKILL');
      await cluster.startRelayAgain(0);
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
    const leftover = o.churn > 0 ? await leaversStillRegistered(trackers.map((t) => t.url), donorPool, o.mesh ? 3 : 0) : { still: 0, waitedS: 0 };
    const removalsAfter = await removals();
    const loop = o.loopDir ? await loopSummary(o.loopDir, simProbe, [...procs.map((p) => ({ name: p.name, pid: p.pid() })), ...donorPool.pids.map((pid, i) => ({ name: `sim${i + 1}`, pid })), { name: 'bench', pid: process.pid }]) : undefined;
    const heapDonors = w.alive;
    await heapSnapshots(o.heapDir, trackers.map((t) => t.child.pid));
    if (o.heapDir) console.log(`  heap snapshots in ${o.heapDir}: the last pair is before the ramp and after the window, ${heapDonors} donors`);
    const picksAfter = await Promise.all(trackers.map((t) => histogram(t.url, 'meshnet_tracker_route_pick_seconds')));
    const pickHist = mergeHist(picksAfter, picksBefore);
    const pickCpuHist = mergeHist(await Promise.all(trackers.map((t) => histogram(t.url, 'meshnet_tracker_route_pick_cpu_seconds'))), pickCpuBefore);

    const trackerCpus = trackers.map((_, i) => cpuAfter[`tracker${i + 1}`]! - cpuBefore[`tracker${i + 1}`]!);
    const trackerCpuMs = trackerCpus.reduce((a, b) => a + b, 0);
    const relayCpuMs = relays.reduce((s, _, i) => s + (cpuAfter[`relay${i + 1}`]! - cpuBefore[`relay${i + 1}`]!), 0);
    const count = (k: 'heartbeat' | 'register') => [...w.outcomes[k].values()].reduce((a, b) => a + b, 0);
    const calls = count('heartbeat') + count('register');
    const hb = w.latency.heartbeat.sort((a, b) => a - b);
    const hbLess = w.latencyLessStall.heartbeat.sort((a, b) => a - b);
    const outcomes = (k: 'heartbeat' | 'register') => Object.fromEntries([...w.outcomes[k]].filter(([outcome]) => outcome !== 'ok'));
    const benchCpuMs = (sim.user + sim.system) / 1000;
    const relayRssGrowth = relays.reduce((s, _, i) => s + (rssAfter[`relay${i + 1}`]! - rssBefore[`relay${i + 1}`]!), 0);
    const pk = [...picks].sort((a, b) => a - b);
    const tps = chats ? [...chats.tokensPerS].sort((a, b) => a - b) : [];
    const ttft = chats ? [...chats.ttftMs].sort((a, b) => a - b) : [];
    return {
      bin: binSpec,
      ...(donorEntry ? { donors_from: donorEntry } : {}),
      beat_mode: beatMode,
      route_probes: o.probes,
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
      // The CPU the tracker used during those picks: what the clock time has above it was waiting for a core.
      route_pick_tracker_cpu_p50_ms: quantileOfHist(pickCpuHist, 0.5) * 1000,
      route_pick_tracker_cpu_p99_ms: quantileOfHist(pickCpuHist, 0.99) * 1000,
      route_pick_tracker_hist_ms: histMs(pickHist),
      route_pick_tracker_cpu_hist_ms: histMs(pickCpuHist),
      sim_nice: o.simNice,
      mesh_nice: o.meshNice,
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
    await cluster.stop();
  }
}

const dir = mkdtempSync(join(tmpdir(), 'meshnet-swarm-'));
writeFileSync(join(dir, 'config.json'), JSON.stringify(SWARM_CONFIG));
const swarmServer: StaticServer = await startStaticServer({ root: dir });
const smallServer: StaticServer | undefined = o.mesh ? await startStaticServer({ root: await ensureModel('small') }) : undefined;
const loadBefore = loadavg()[0]!;
const results: RunResult[] = [];
try {
  for (const n of o.donors) {
    for (const bin of o.bins) {
      for (const procs of o.donorProcs) {
        for (const mode of o.beatModes) {
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

reportRuns(results, o, loadBefore);
writeResult(o.out, { bench: 'swarm', label: o.label, beat_modes: o.beatModes, route_probes: o.probes, load_average_1m: loadAverage1m(loadBefore), minutes: o.minutes, heartbeat_ms: o.heartbeatMs, churn: o.churn, relays: o.relays, trackers: o.trackers, nats: o.nats, mesh: o.mesh, runs: results });
process.exit(0);
