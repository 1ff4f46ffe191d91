/**
 * A whole cluster of real processes on loopback, for cluster tests and
 * benches: nats-server (JetStream, temp store), M relays joined through it,
 * N trackers (each registered at a relay, round robin), haproxy in front of
 * the trackers, and `meshnet node` processes split across the relays.
 *
 *   const c = await startCluster({ relays: 2, trackers: 3, model: { name: 'tiny', url } });
 *   await c.addNode({ relay: 1, args: ['--layers', '1-3'] });
 *   c.baseUrl            // haproxy (or the only tracker): what an OpenAI client uses
 *   await c.killRelay(1) // SIGKILL; its nodes move to the relays they were also given
 *   await c.stop()
 *
 * Trackers join the cluster's NATS (`--nats`, `--cluster`) only when
 * `trackerNats` is set: a tracker that does not know the flag would refuse
 * to start.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer, type ChatMessage } from '../../src/model/tokenizer.ts';
import { Identity } from '../../src/net/identity.ts';
import { startRelayProcess, type RelayProcess } from './relay-process.ts';
import { startNode, startTrackerProc, type NodeProc, type TrackerProc } from './mesh.ts';
import { startHaproxy, startNats, type Haproxy, type NatsServer } from './cluster.ts';
import { fixture } from './shard.ts';

export interface ClusterInit {
  /** @defaultValue 2 */
  relays?: number;
  /** @defaultValue 1 */
  trackers?: number;
  /** The model every tracker serves (`--model NAME=URL`). */
  model: { name: string; url: string };
  /** Cluster name (NATS subjects). @defaultValue a fresh one, so tests never share subjects */
  cluster?: string;
  relayArgs?: string[];
  trackerArgs?: string[];
  /** Pass `--nats` and `--cluster` to trackers too. @defaultValue false */
  trackerNats?: boolean;
  /** haproxy in front of the trackers. @defaultValue trackers > 1 */
  haproxy?: boolean;
  /** Every tracker signs with this key (a test that holds it can sign routes). @defaultValue a fresh key */
  trackerKey?: Identity;
}

export interface NodeSpec {
  /** Index of the relay it registers at first; the others of `alsoRelays` follow in its `--relay` list. */
  relay: number;
  /** More relays (indexes) it may fail over to. */
  alsoRelays?: number[];
  /** Which tracker it talks to: an index, or 'front' (haproxy). @defaultValue 0 */
  tracker?: number | 'front';
  args?: string[];
}

export interface Cluster {
  readonly nats: NatsServer;
  readonly relays: RelayProcess[];
  readonly trackers: TrackerProc[];
  readonly haproxy: Haproxy | undefined;
  readonly nodes: NodeProc[];
  readonly cluster: string;
  readonly trackerKey: Identity;
  /** The one base URL clients use: haproxy when there is one, else the first tracker. */
  readonly baseUrl: string;
  addNode(spec: NodeSpec): Promise<NodeProc>;
  killTracker(i: number, signal?: NodeJS.Signals): Promise<void>;
  killRelay(i: number, signal?: NodeJS.Signals): Promise<void>;
  stop(): Promise<void>;
}

let clusterSeq = 0;

export async function startCluster(init: ClusterInit): Promise<Cluster> {
  const work = mkdtempSync(join(tmpdir(), 'meshnet-cluster-'));
  const cluster = init.cluster ?? `t${process.pid}x${++clusterSeq}`;
  const nats = await startNats();
  const relays: RelayProcess[] = [];
  const trackers: TrackerProc[] = [];
  const nodes: NodeProc[] = [];
  let haproxy: Haproxy | undefined;
  const stop = async () => {
    await Promise.all(nodes.map((n) => n.stop()));
    await haproxy?.stop();
    await Promise.all(trackers.map((t) => t.stop()));
    await Promise.all(relays.map((r) => r.stop()));
    await nats.stop();
    rmSync(work, { recursive: true, force: true });
  };
  try {
    const relayCount = init.relays ?? 2;
    relays.push(...(await Promise.all(Array.from({ length: relayCount }, () => startRelayProcess(['--nats', nats.url, '--cluster', cluster, ...(init.relayArgs ?? [])])))));
    const trackerKey = init.trackerKey ?? (await Identity.generate());
    const keyFile = join(work, 'tracker.key');
    writeFileSync(keyFile, JSON.stringify(await trackerKey.export()));
    const trackerCount = init.trackers ?? 1;
    for (let i = 0; i < trackerCount; i++) {
      const args = ['--model', `${init.model.name}=${init.model.url}`, '--relay', relays[i % relays.length]!.url, '--key-file', keyFile, ...(init.trackerNats ? ['--nats', nats.url, '--cluster', cluster] : []), ...(init.trackerArgs ?? [])];
      trackers.push(await startTrackerProc(args));
    }
    if (init.haproxy ?? trackerCount > 1) haproxy = await startHaproxy({ backends: trackers.map((t) => t.url) });
    const baseUrl = haproxy?.url ?? trackers[0]!.url;
    const c: Cluster = {
      nats,
      relays,
      trackers,
      get haproxy() {
        return haproxy;
      },
      nodes,
      cluster,
      trackerKey,
      baseUrl,
      async addNode(spec) {
        const relayList = [spec.relay, ...(spec.alsoRelays ?? [])].map((i) => relays[i]!.url).join(',');
        const tracker = spec.tracker === 'front' ? baseUrl : trackers[spec.tracker ?? 0]!.url;
        const n = await startNode(['--relay', relayList, '--tracker', tracker, '--model', init.model.name, '--model-url', init.model.url, ...(spec.args ?? [])]);
        nodes.push(n);
        return n;
      },
      async killTracker(i, signal = 'SIGKILL') {
        await trackers[i]!.stop(signal);
      },
      async killRelay(i, signal = 'SIGKILL') {
        await relays[i]!.stop(signal);
      },
      stop,
    };
    return c;
  } catch (e) {
    await stop().catch(() => undefined);
    throw e;
  }
}

/** The float64 reference's greedy tokens for a chat on the `tiny` fixture (what a cluster serving `tiny` must answer), cut at EOS. */
export function tinyChatReference(messages: readonly ChatMessage[], maxTokens: number): number[] {
  const f = fixture('tiny');
  const utf8d = new TextDecoder();
  const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(f.files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
  const all = new ReferenceModel(f.cfg, f.weights).greedy(tok.encodeChat(messages), maxTokens);
  const eos = all.findIndex((t) => tok.isEos(t));
  return eos >= 0 ? all.slice(0, eos) : all;
}
