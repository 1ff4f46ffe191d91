/**
 * The real processes of a bench/swarm.ts run: nats-server (with --nats),
 * the relays, the trackers and the 3-node mesh, started in that order and
 * stopped in the reverse one. What started is kept as it starts, so a run
 * that fails half-way still stops every process it had.
 */
import { startRelayProcess, type RelayProcess } from '../../test/helpers/relay-process.ts';
import { spawnMeshnet, until, type NodeProc, type Proc } from '../../test/helpers/mesh.ts';
import { startNats, type NatsServer } from '../../test/helpers/cluster.ts';
import { PAUSE_DEAD_AFTER, type SwarmOptions } from './swarm-options.ts';

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

export type ClusterOptions = Pick<SwarmOptions, 'nats' | 'relayNats' | 'relays' | 'trackers' | 'mesh' | 'heartbeatMs' | 'beatModes' | 'profRelays' | 'relayArgs'>;

export class SwarmCluster {
  readonly relays: RelayProcess[] = [];
  /** Each relay's first port: a restarted relay comes back on it, where its donors reconnect. */
  readonly relayPorts: number[] = [];
  readonly trackers: Array<Proc & { url: string }> = [];
  readonly nodes: NodeProc[] = [];
  nats: NatsServer | undefined;
  /** performance.now() at the first tracker's spawn: its CPU profile's clock starts there. */
  trackerSpawnedAt = 0;
  private natsWatch: ReturnType<typeof setInterval> | undefined;
  private clusterArgs: string[] = [];

  constructor(
    private readonly o: ClusterOptions,
    private readonly bin: string,
  ) {}

  /** Starts every process; `trackerNodeArgs` are the trackers' node flags. Returns once the mesh serves a chat through each tracker. */
  async start(swarmUrl: string, smallUrl: string, trackerNodeArgs: string[]): Promise<void> {
    const { o, bin } = this;
    if (o.nats) this.nats = await startNats();
    const nats = this.nats;
    // nats-server must outlive the run: if it goes, say so with the end of its log (a Go panic, a signal) at once.
    this.natsWatch = nats
      ? setInterval(() => {
          try {
            process.kill(nats.pid, 0);
          } catch {
            clearInterval(this.natsWatch);
            this.natsWatch = undefined;
            console.log(`  nats-server (pid ${nats.pid}) is GONE; its log ends:\n${nats.log().slice(-4000)}`);
          }
        }, 500)
      : undefined;
    this.natsWatch?.unref();
    this.clusterArgs = nats ? ['--nats', nats.url, '--cluster', 'swarm'] : [];
    for (let i = 0; i < o.relays; i++) {
      const r = await startRelayProcess(this.relayArgs(), bin, this.relayNodeArgs());
      this.relays.push(r);
      this.relayPorts.push(r.port);
    }
    this.trackerSpawnedAt = performance.now();
    for (let i = 0; i < o.trackers; i++) {
      const tp = spawnMeshnet(['tracker', '--port', '0', '--log-level', 'warn', '--model', `swarm=${swarmUrl}`, ...(o.mesh ? ['--model', `small=${smallUrl}`] : []), '--relay', this.relays[i % o.relays]!.url, '--heartbeat-interval-ms', String(o.heartbeatMs), ...(o.beatModes.includes('paused') ? ['--dead-after-missed-heartbeats', String(PAUSE_DEAD_AFTER)] : []), ...this.clusterArgs], {}, bin, trackerNodeArgs);
      const l = await tp.waitFor((e) => e.event === 'listening');
      this.trackers.push(Object.assign(tp, { url: l.url as string }));
    }

    if (o.mesh) {
      for (let i = 0; i < 3; i++) {
        const p = spawnMeshnet(['node', '--port', '0', '--threads', '1', '--relay', this.relays[0]!.url, '--tracker', this.trackerFor(i), '--model', 'small', '--budget-mb', '60'], {}, bin);
        const nl = await p.waitFor((e) => e.event === 'listening');
        const n = Object.assign(p, { peerId: nl.peer_id as string, endpoint: nl.endpoint as string, relayAddr: (nl.relay_addr as string | null) ?? null });
        this.nodes.push(n);
        await n.waitFor((e) => e.event === 'serving', 120_000);
      }
      for (const t of this.trackers) {
        await until(async () => {
          const r = await fetch(`${t.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 }) });
          return r.status === 200;
        }, 60_000, 'the 3-node mesh serving a chat');
      }
    }
  }

  private relayArgs(): string[] {
    return [...(this.o.relayNats ? this.clusterArgs : []), ...this.o.relayArgs];
  }

  /** A relay's node flags: its CPU profile at 10 ms sampling (the default 1 ms makes a 10-minute profile huge). */
  private relayNodeArgs(): string[] {
    return this.o.profRelays ? ['--cpu-prof', `--cpu-prof-dir=${this.o.profRelays}`, '--cpu-prof-interval=10000'] : [];
  }

  /** The tracker the i-th donor, node or probe talks to: round robin. */
  trackerFor(i: number): string {
    return this.trackers[i % this.o.trackers]!.url;
  }

  /** Starts relay `i` again on its port after it was stopped; a port its old sockets still hold is tried again, 40 times 250 ms apart. */
  async startRelayAgain(i: number): Promise<void> {
    const nats = this.nats;
    for (let tries = 0; ; tries++) {
      try {
        this.relays[i] = await startRelayProcess(['--port', String(this.relayPorts[i]), ...this.relayArgs()], this.bin, this.relayNodeArgs());
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
  }

  async stop(): Promise<void> {
    await Promise.all(this.nodes.map((n) => n.stop()));
    await Promise.all(this.trackers.map((t) => t.stop()));
    await Promise.all(this.relays.map((r) => r.stop()));
    clearInterval(this.natsWatch);
    await this.nats?.stop();
  }
}
