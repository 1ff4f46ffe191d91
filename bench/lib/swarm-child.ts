/**
 * One donor process of the simulated swarm (forked by bench/lib/swarm-pool.ts):
 * runs its slice of donors (bench/lib/swarm-donors.ts) and answers the
 * bench's requests over IPC. It exits when the bench goes (IPC closed).
 */
import { Agent } from 'undici';
import type { ChildChurn, ChildCounters, ChildInit, ChildRequest, ChildRestartStatus, ChildStarted, ChildStatus, ChildWindow } from './swarm-pool.ts';
import { Donor, SwarmStats, type CallKind } from './swarm-donors.ts';
import { SWARM_BUDGETS } from './swarm-shape.ts';

interface Entry {
  donor: Donor;
  relay: number;
}

const stats = new SwarmStats();
stats.loop.start();
const entries: Entry[] = [];
const starting: Array<Promise<void>> = [];
const failures: string[] = [];
let init: ChildInit | undefined;
let sharedAgent: Agent | undefined;
let window: { stall0: number; cpu0: NodeJS.CpuUsage; t0: number } | undefined;
let restart: { at: number; mine: Donor[] } | undefined;
/** Beats paused (op 'pause'): each donor's beat is answered in the process with the tracker's last answer. */
let beatsPaused = false;

async function makeDonor(i: number): Promise<Entry> {
  const c = init!;
  const [mb, format] = SWARM_BUDGETS[i % SWARM_BUDGETS.length]!;
  const relay = i % c.relayUrls.length;
  const donor = await Donor.create({ relayUrl: c.relayUrls[relay]!, trackerUrl: c.trackerUrls[i % c.trackerUrls.length]!, model: 'swarm', memoryBudgetMb: mb, weightFormat: format, loadMs: 500 + (i % 10) * 150, stats, paused: () => beatsPaused, ...(sharedAgent ? { agent: sharedAgent } : {}) });
  const e = { donor, relay };
  entries.push(e);
  return e;
}

async function startDonors(indices: number[]): Promise<void> {
  for (const i of indices) {
    const { donor } = await makeDonor(i);
    starting.push(donor.start().catch((e: unknown) => void (failures.length < 5 && failures.push((e as Error).message))));
  }
}

const alive = () => entries.filter((e) => !e.donor.closed);

async function handle(req: ChildRequest): Promise<unknown> {
  switch (req.op) {
    case 'init':
      init = req.init;
      if (init.sharedHttp) sharedAgent = new Agent({ pipelining: 1 });
      return null;
    case 'start':
      await startDonors(req.indices);
      return null;
    case 'started': {
      await Promise.all(starting);
      return { registered: entries.filter((e) => e.donor.registered).length, failures } satisfies ChildStarted;
    }
    case 'status': {
      const live = alive();
      return {
        alive: live.length,
        registered: live.filter((e) => e.donor.registered).length,
        longPeriods: live.filter((e) => (e.donor.periodMs ?? 0) > init!.heartbeatMs).length,
      } satisfies ChildStatus;
    }
    case 'record':
      stats.reset();
      stats.recording = true;
      window = { stall0: stats.loop.now(), cpu0: process.cpuUsage(), t0: performance.now() };
      return null;
    case 'pause':
      beatsPaused = req.paused;
      return null;
    case 'counters':
      return { shed: stats.shed, dropped: stats.dropped, errorCodes: Object.fromEntries(stats.errorCodes) } satisfies ChildCounters;
    case 'churn': {
      let left = 0;
      // Those the tracker holds as they go: only these will be removed for missed heartbeats (one still registering is not).
      let leftRegistered = 0;
      for (let k = 0; k < req.leave; k++) {
        const live = alive();
        const e = live[Math.floor(Math.random() * live.length)];
        if (!e) break;
        if (e.donor.registered) leftRegistered++;
        e.donor.close();
        left++;
      }
      void startDonors(req.join).catch(() => {});
      return { left, leftRegistered } satisfies ChildChurn;
    }
    case 'restart-mark':
      restart = { at: req.at, mine: alive().filter((e) => e.relay === req.relay).map((e) => e.donor) };
      return restart.mine.length;
    case 'restart-status': {
      const r = restart;
      if (!r) return { mine: 0, back: 0, backIn60s: 0 } satisfies ChildRestartStatus;
      return {
        mine: r.mine.length,
        back: r.mine.filter((d) => d.closed || d.lastRelayRegisteredAt > r.at).length,
        backIn60s: r.mine.filter((d) => d.closed || (d.lastRelayRegisteredAt > r.at && d.lastRelayRegisteredAt - r.at <= 60_000)).length,
      } satisfies ChildRestartStatus;
    }
    case 'collect': {
      const w = window ?? { stall0: stats.loop.now(), cpu0: process.cpuUsage(), t0: performance.now() };
      const cpu = process.cpuUsage(w.cpu0);
      const stalledMs = stats.loop.now() - w.stall0;
      stats.recording = false;
      const kinds: CallKind[] = ['register', 'heartbeat'];
      const periods: Record<string, number> = {};
      const live = alive();
      for (const e of live) {
        const p = String(e.donor.periodMs ?? 'none');
        periods[p] = (periods[p] ?? 0) + 1;
      }
      const mem = process.memoryUsage();
      return {
        latency: { register: Float64Array.from(stats.latency.register), heartbeat: Float64Array.from(stats.latency.heartbeat) },
        latencyLessStall: { register: Float64Array.from(stats.latencyLessStall.register), heartbeat: Float64Array.from(stats.latencyLessStall.heartbeat) },
        outcomes: Object.fromEntries(kinds.map((k) => [k, Object.fromEntries(stats.outcomes[k])])) as ChildWindow['outcomes'],
        dropped: stats.dropped,
        shed: stats.shed,
        errorCodes: Object.fromEntries(stats.errorCodes),
        stalledMs,
        cpuMs: (cpu.user + cpu.system) / 1000,
        windowMs: performance.now() - w.t0,
        beatsRelay: entries.reduce((a, e) => a + (e.donor.client?.beats.relay ?? 0), 0),
        beatsHttp: entries.reduce((a, e) => a + (e.donor.client?.beats.http ?? 0), 0),
        beatsBatched: entries.reduce((a, e) => a + (e.donor.client?.beats.batched ?? 0), 0),
        alive: live.length,
        periods,
        heapUsedMiB: mem.heapUsed / 2 ** 20,
        rssMiB: mem.rss / 2 ** 20,
      } satisfies ChildWindow;
    }
    case 'close':
      for (const e of entries) e.donor.close();
      await sharedAgent?.close().catch(() => {});
      // Answered first, then gone.
      setTimeout(() => process.exit(0), 50);
      return null;
  }
}

process.on('message', (m: ChildRequest & { id: number }) => {
  handle(m).then(
    (value) => process.send?.({ id: m.id, ok: true, value }),
    (e: unknown) => process.send?.({ id: m.id, ok: false, error: (e as Error)?.stack ?? String(e) }),
  );
});
// The bench is gone (or closed the channel): so are its donors.
process.on('disconnect', () => process.exit(0));
