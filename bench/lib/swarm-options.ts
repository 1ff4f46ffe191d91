/**
 * bench/swarm.ts's command line (its --help is that file's head comment).
 * Apart from the driver so that what a run is asked for reads in one place,
 * typed, before any process starts.
 */
import { fileURLToPath } from 'node:url';

export type BeatMode = 'beating' | 'paused';

/**
 * What a paused run's trackers get as --dead-after-missed-heartbeats: the sweep keeps donors that stopped beating
 * for the window (the trackers of all runs alike: a build without the flag cannot be used with --beat-modes paused).
 */
export const PAUSE_DEAD_AFTER = 1000;

export interface SwarmOptions {
  donors: number[];
  minutes: number;
  rampS: number;
  settleS: number;
  /** The settle lasts at least this long, then until every donor beats at the configured period again (at most settleS). */
  settleMinS: number;
  relays: number;
  trackers: number;
  nats: boolean;
  /** Relays join the cluster too (their federation: a donor on one relay reaches a tracker on another over the fast path). */
  relayNats: boolean;
  churn: number;
  relayRestart: boolean;
  mesh: boolean;
  /** One HTTP pool for all donors of a donor process (bench/lib/swarm-donors.ts DonorConfig.agent): fewer sockets and objects in the simulator. */
  sharedHttp: boolean;
  /** Donor processes (bench/lib/swarm-pool.ts); undefined: one per 2,500 donors. Each entry is run in turn, side by side. */
  donorProcs: Array<number | undefined>;
  heartbeatMs: number;
  /**
   * `beating` (the default) and/or `paused`, each run in turn with the same build: in a paused run the donors
   * stop beating for the window (each beat answered in its own process with the tracker's last answer), so the
   * tracker's CPU there is its fixed cost with that many donors registered and attached. With `paused` in the
   * list every run's tracker gets --dead-after-missed-heartbeats PAUSE_DEAD_AFTER.
   */
  beatModes: BeatMode[];
  /** Route-pick probes (GET /api/route every 500 ms) in the window; without them the tracker's CPU is only the swarm's. */
  probes: boolean;
  label: string;
  /** Write a CPU profile of each tracker process into this directory (node --cpu-prof). */
  prof: string | undefined;
  /** Write a CPU profile of each relay process into this directory (a relay SIGKILLed by --relay-restart writes none; its successor does). */
  profRelays: string | undefined;
  /** Extra `meshnet relay` flags for every relay of the run (e.g. `--beat-batch-ms 50`), space-separated. */
  relayArgs: string[];
  /**
   * Event-loop probes (bench/lib/loop-probe.mjs) in the tracker, relay and
   * mesh processes and in this simulator: delay percentiles, stalls and GC
   * pauses over the window, so a heartbeat tail can be pinned on a process.
   */
  loopDir: string | undefined;
  /** Heap snapshots of the tracker into this directory: before the ramp and after the window (bench/heap-diff.ts compares them). */
  heapDir: string | undefined;
  out: string;
  /** bin/meshnet.js of each build to run, each as `PATH` or `PATH::NODE-FLAGS` for its trackers. */
  bins: string[];
  /** The donors of each --bin's run are that checkout's (its bench/lib/swarm-child.ts and src/node), not this one's. */
  donorsPerBin: boolean;
  /**
   * Nice value of the donor processes (0: as the rest). A real swarm's donors run on their own machines; here they
   * share two cores with the trackers, and a positive value lets the trackers run first when both want a core.
   */
  simNice: number;
  /** The 3-node mesh's processes' nice value (--mesh-nice). */
  meshNice: number;
}

export function parseSwarmOptions(argv: string[]): SwarmOptions {
  const opt = (name: string) => {
    const i = argv.indexOf(`--${name}`);
    return i >= 0 ? argv[i + 1] : undefined;
  };
  const opts = (name: string) => argv.flatMap((a, i) => (a === `--${name}` && argv[i + 1] ? [argv[i + 1]!] : []));
  const flag = (name: string) => argv.includes(`--${name}`);
  const quick = flag('quick');
  const settleS = Number(opt('settle-s') ?? (quick ? 5 : 15));
  const trackers = Number(opt('trackers') ?? 1);
  const nats = flag('nats') || trackers > 1;
  const beatModes = (opt('beat-modes') ?? 'beating').split(',') as BeatMode[];
  if (beatModes.some((m) => m !== 'beating' && m !== 'paused')) throw new Error(`--beat-modes: beating and/or paused, not ${opt('beat-modes')}`);
  return {
    donors: (opt('donors') ?? (quick ? '300' : '1000')).split(',').map(Number),
    minutes: Number(opt('minutes') ?? (quick ? 0.5 : 1)),
    rampS: Number(opt('ramp-s') ?? (quick ? 10 : 30)),
    settleS,
    settleMinS: Number(opt('settle-min-s') ?? settleS),
    relays: Number(opt('relays') ?? 1),
    trackers,
    nats,
    relayNats: nats && !flag('no-relay-nats'),
    churn: Number(opt('churn') ?? 0),
    relayRestart: flag('relay-restart'),
    mesh: !flag('no-mesh'),
    sharedHttp: flag('shared-http'),
    donorProcs: opt('donor-procs') === undefined ? [undefined] : opt('donor-procs')!.split(',').map((x) => Math.max(1, Number(x))),
    heartbeatMs: Number(opt('heartbeat-ms') ?? 5000),
    beatModes,
    probes: !flag('no-probe'),
    label: opt('label') ?? 'current',
    prof: opt('prof'),
    profRelays: opt('prof-relays'),
    relayArgs: (opt('relay-args') ?? '').split(' ').filter(Boolean),
    loopDir: opt('loop-probe'),
    heapDir: opt('heap-snapshot'),
    out: opt('out') ?? fileURLToPath(new URL('../results/swarm.json', import.meta.url)),
    bins: opts('bin').length ? opts('bin') : [fileURLToPath(new URL('../../bin/meshnet.js', import.meta.url))],
    donorsPerBin: flag('donors-per-bin'),
    simNice: niceValue('sim-nice', opt('sim-nice')),
    meshNice: niceValue('mesh-nice', opt('mesh-nice')),
  };
}

function niceValue(flagName: string, v: string | undefined): number {
  const n = Number(v ?? 0);
  if (!Number.isInteger(n) || n < 0 || n > 19) throw new Error(`--${flagName}: an integer from 0 to 19, not ${v}`);
  return n;
}
