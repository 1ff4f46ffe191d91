/** `meshnet relay`: options from src/relay/options.ts; the server is loaded when the command runs. */
import type { Command } from 'commander';
import { CLUSTER_BEAT_BATCH_MS, RELAY_DEFAULTS } from '../../relay/options.ts';
import { InvalidArgumentError } from 'commander';
import { parseNatsServers } from '../../cluster/nats.ts';
import { checkClusterName } from '../../cluster/subjects.ts';
import { CliError } from '../failure.ts';
import { int, onShutdown } from '../util.ts';

/** `--nats nats://a:4222,nats://b:4222` (repeatable). */
function natsArg(value: string, previous: string[] = []): string[] {
  try {
    return [...previous, ...parseNatsServers(value)];
  } catch (e) {
    throw new InvalidArgumentError((e as Error).message);
  }
}

function clusterArg(value: string): string {
  try {
    return checkClusterName(value);
  } catch (e) {
    throw new InvalidArgumentError((e as Error).message);
  }
}

function clusterPathArg(value: string): 'link' | 'nats' {
  if (value !== 'link' && value !== 'nats') throw new InvalidArgumentError(`expected link or nats, got "${value}"`);
  return value;
}

export function configure(cmd: Command): void {
  cmd
    .option('--port <n>', 'TCP port (0 picks a free one)', int, RELAY_DEFAULTS.port)
    .option('--host <addr>', 'interface to bind', RELAY_DEFAULTS.host)
    .option('--public-url <url>', 'base URL given to peers as relay_addr (ws[s]://host[:port])')
    .option('--max-body-bytes <n>', 'largest request/response body in bytes', int, RELAY_DEFAULTS.maxBodyBytes)
    .option('--max-in-flight-per-peer <n>', 'requests in flight towards one peer before 503', int, RELAY_DEFAULTS.maxInFlightPerPeer)
    .option('--request-timeout-ms <n>', 'no answer for this long: 504', int, RELAY_DEFAULTS.requestTimeoutMs)
    .option('--max-peers <n>', 'registered peers at most', int, RELAY_DEFAULTS.maxPeers)
    .option('--ping-interval-ms <n>', 'liveness ping period', int, RELAY_DEFAULTS.pingIntervalMs)
    .option('--high-water-bytes <n>', 'target send-buffer level above which new requests get 503', int, RELAY_DEFAULTS.highWaterBytes)
    .option('--beat-batch-ms <n>', `heartbeats to one tracker wait at most this long to leave in one message (0: no batching; default ${RELAY_DEFAULTS.beatBatchMs}, ${CLUSTER_BEAT_BATCH_MS} with --nats)`, int)
    .option('--beat-batch-fill <n>', 'a tracker\'s heartbeats leave at once when this many wait (1-512)', int, RELAY_DEFAULTS.beatBatchFill)
    .option('--log-level <level>', 'pino log level (silent, error, warn, info, debug)', RELAY_DEFAULTS.logLevel)
    .option('--nats <urls>', 'join a cluster of relays through these NATS servers (nats://host:port, comma-separated or repeated); without it the relay runs on its own', natsArg)
    .option('--cluster <name>', 'cluster name shared by its relays and trackers', clusterArg, RELAY_DEFAULTS.cluster)
    .option('--cluster-path <path>', 'how frames cross between relays: link (direct relay-to-relay WebSocket found through NATS) or nats', clusterPathArg, RELAY_DEFAULTS.clusterPath)
    .action(async (o: Record<string, unknown>) => {
      (await import('../trace-file.ts')).installTraceFromEnv('relay');
      const { startRelay } = await import('../../relay/server.ts');
      const { NatsUnreachableError } = await import('../../cluster/nats.ts');
      const relay = await startRelay({
        ...(o.nats ? { nats: o.nats as string[] } : {}),
        cluster: o.cluster as string,
        clusterPath: o.clusterPath as 'link' | 'nats',
        port: o.port as number,
        host: o.host as string,
        publicUrl: o.publicUrl as string | undefined,
        maxBodyBytes: o.maxBodyBytes as number,
        maxInFlightPerPeer: o.maxInFlightPerPeer as number,
        requestTimeoutMs: o.requestTimeoutMs as number,
        maxPeers: o.maxPeers as number,
        pingIntervalMs: o.pingIntervalMs as number,
        highWaterBytes: o.highWaterBytes as number,
        beatBatchMs: o.beatBatchMs as number | undefined,
        beatBatchFill: o.beatBatchFill as number,
        logLevel: o.logLevel as string,
      }).catch((e: unknown) => {
        throw e instanceof NatsUnreachableError ? new CliError(e.message) : e;
      });
      // One machine-readable line first: scripts and tests wait for it.
      process.stdout.write(`${JSON.stringify({ event: 'listening', role: 'relay', url: relay.url, port: relay.port, ...(relay.cluster ? { relay_id: relay.cluster.relayId } : {}) })}\n`);
      onShutdown(() => relay.close());
    });
}
