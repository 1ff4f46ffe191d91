/**
 * bench/swarm.ts's results: one run's figures as they go into the JSON
 * (RunResult), and the report printed after every run: the table, the loop
 * probes, the answers not 200, the relay restarts, and the tracker's fixed
 * cost against its cost per beat. Apart from the driver so the shape of
 * what a run yields reads in one place.
 */
import { loadavg } from 'node:os';
import type { LoopSummary } from './proc-readings.ts';
import { printTable } from './stats.ts';
import type { BeatMode, SwarmOptions } from './swarm-options.ts';

export interface RunResult {
  bin: string;
  /** `--donors-per-bin`: the swarm-child.ts the donors of this run ran. */
  donors_from?: string;
  /** 'paused': the donors did not beat in the window (--beat-modes). */
  beat_mode: BeatMode;
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
  /** The tracker process's CPU time during its route picks (bucket bounds): the pick's work, without its waits for a core. */
  route_pick_tracker_cpu_p50_ms: number;
  route_pick_tracker_cpu_p99_ms: number;
  /** The window's route picks by bucket, summed over the trackers: [upper bound in ms (null: +Inf), picks at or under it] (cumulative). */
  route_pick_tracker_hist_ms: Array<[number | null, number]>;
  route_pick_tracker_cpu_hist_ms: Array<[number | null, number]>;
  /** The donor processes' nice value (--sim-nice), and the 3-node mesh's (--mesh-nice). */
  sim_nice: number;
  mesh_nice: number;
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

/**
 * Prints the report of every run, and sets each beating run's fixed_ms_per_s and per_beat_us_over_paused from the
 * paused run of the same build and donors (so the JSON written after carries them).
 */
export function reportRuns(results: RunResult[], o: SwarmOptions, loadBefore: number): void {
  const binName = (b: string) => (o.bins.length > 1 ? b.replace(/\/bin\/meshnet\.js(?=$|::)/, '').split('/').pop()! : o.label);
  const runName = (r: RunResult) => `${binName(r.bin)}${o.beatModes.length > 1 || r.beat_mode === 'paused' ? ` (${r.beat_mode})` : ''}`;
  printTable(
    `simulated swarm: ${o.minutes} min window, heartbeats every ${o.heartbeatMs / 1000} s${o.churn ? `, churn ${o.churn * 100}%/min` : ''}${o.mesh ? ', 3-node mesh chatting' : ''} (shared 2-core machine)`,
    ['run', 'donors', 'procs', 'tracker CPU %', 'µs/call', 'hb p50 ms', 'hb p99 ms', 'hb p99 less sim stall', 'sim stalled s', 'hb failed', 'dropped (404)', 'removed live', 'shed', 'tracker KiB/donor', 'at window end', 'window median', 'window max', 'relay KiB/donor', 'NATS KiB/donor', 'route p99 ms (probe)', 'pick p99 ms (tracker)', 'pick CPU p99 ms', 'chats ok/failed', 'chat tok/s', 'sim CPU %'],
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
      r.route_pick_tracker_cpu_p99_ms,
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
}
