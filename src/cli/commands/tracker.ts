/** `meshnet tracker`: options from src/tracker/options.ts; the tracker is loaded when the command runs. */
import { InvalidArgumentError, type Command } from 'commander';
import { TRACKER_DEFAULTS, type TrackerModelSource } from '../../tracker/options.ts';
import { DTYPES, isDtype, type Dtype } from '../../protocol/tensor.ts';
import { CliError } from '../failure.ts';
import { int, nonNegative, onShutdown } from '../util.ts';
import { isHubRef, parseHubRef } from '../../model/hub.ts';
import { checkClusterName } from '../../cluster/subjects.ts';

/** `--nats a,b`: the URLs (checked when the command runs: the NATS client loads only for a cluster). */
function natsArg(value: string, previous: string[] = []): string[] {
  return [...previous, ...value.split(',').map((v) => v.trim()).filter(Boolean)];
}

function modelArg(value: string, previous: TrackerModelSource[] = []): TrackerModelSource[] {
  const i = value.indexOf('=');
  if (i <= 0 || i === value.length - 1) throw new InvalidArgumentError(`expected NAME=URL (the base URL of an HF-layout checkpoint) or NAME=hf:ORG/REPO[@REVISION], got "${value}"`);
  const url = value.slice(i + 1);
  if (isHubRef(url)) {
    try {
      parseHubRef(url);
    } catch (e) {
      throw new InvalidArgumentError((e as Error).message);
    }
    return [...previous, { name: value.slice(0, i), url }];
  }
  try {
    new URL(url);
  } catch {
    throw new InvalidArgumentError(`"${url}" is not a URL (nor a hub id hf:ORG/REPO[@REVISION])`);
  }
  return [...previous, { name: value.slice(0, i), url }];
}

/** `--wire-dtype bf16` (every model) or `--wire-dtype NAME=f32` (one model); repeatable. */
function wireDtypeArg(value: string, previous: Array<{ model?: string; dtype: Dtype }> = []): Array<{ model?: string; dtype: Dtype }> {
  const i = value.lastIndexOf('=');
  const dtype = (i < 0 ? value : value.slice(i + 1)).trim().toLowerCase();
  if (!isDtype(dtype)) throw new InvalidArgumentError(`expected [NAME=]DTYPE with DTYPE one of ${DTYPES.join(', ')}, got "${value}"`);
  return [...previous, i < 0 ? { dtype } : { model: value.slice(0, i), dtype }];
}

/** Apply --wire-dtype entries: a named one to its model (which must be served), an unnamed one as the default. */
export function applyWireDtypes(models: TrackerModelSource[], entries: ReadonlyArray<{ model?: string; dtype: Dtype }>): { models: TrackerModelSource[]; wireDtype?: Dtype } {
  let wireDtype: Dtype | undefined;
  const out = models.map((m) => ({ ...m }));
  for (const e of entries) {
    if (e.model === undefined) {
      wireDtype = e.dtype;
      continue;
    }
    const m = out.find((x) => x.name === e.model);
    if (!m) throw new CliError(`--wire-dtype names model "${e.model}", which no --model serves`);
    m.wireDtype = e.dtype;
  }
  return { models: out, ...(wireDtype ? { wireDtype } : {}) };
}

/** `--startup-wait-ms` of `meshnet tracker` (the library's default is 0: tests and embedders answer at once). */
const CLI_STARTUP_WAIT_MS = 5_000;

export function configure(cmd: Command): void {
  const d = TRACKER_DEFAULTS;
  cmd
    .requiredOption('--model <NAME=URL>', 'a model to serve: its name and the base URL of its HF-layout checkpoint, or hf:ORG/REPO[@REVISION] for a hub repo (pinned to its commit; HF_TOKEN for gated repos, HF_ENDPOINT for a mirror) (repeatable; one whose checkpoint cannot be read is retried with backoff while the others serve)', modelArg)
    .option('--port <n>', 'TCP port (0 picks a free one)', int, d.port)
    .option('--host <addr>', 'interface to bind', d.host)
    .option('--relay <url>', 'relay to register with (reaches NAT\'d heads over its fast path)')
    .option('--key-file <path>', 'file holding the tracker\'s Ed25519 key (created when missing); without it the key changes every run')
    .option('--wire-dtype <[NAME=]DTYPE>', `activations between hops: bf16 (half the bytes), f16, or f32 (a split gives the un-split tokens exactly); NAME= sets one model's (repeatable). Default: ${d.wireDtype}`, wireDtypeArg, [])
    .option('--max-tokens-limit <n>', 'largest max_tokens a client may ask for', int, d.maxTokensLimit)
    .option('--default-max-tokens <n>', 'max_tokens when a request gives none', int, d.defaultMaxTokens)
    .option('--heartbeat-interval-ms <n>', `heartbeat period given to nodes; a node missing --dead-after-missed-heartbeats (${d.deadAfterMissedHeartbeats}) is removed`, int, d.heartbeatIntervalMs)
    .option('--dead-after-missed-heartbeats <n>', 'heartbeat periods of silence after which a node is removed (bench/swarm.ts raises it to hold donors whose beats it pauses)', int, d.deadAfterMissedHeartbeats)
    .option('--rejoin-grace-ms <n>', 'a node removed for silence may come back with its span: for this long no serving node is moved onto its layers (new and idle nodes still take them)', int, d.rejoinGraceMs)
    .option('--kv-context <n>', 'tokens of KV cache reserved per node when sizing spans', int, d.kvReserveContextTokens)
    .option('--hop-latency-ms <n>', 'estimated network cost of one hop, for routing', int, d.hopLatencyMs)
    .option('--route-slack <x>', 'routes costing up to (1 + x) × the cheapest share the traffic, each in proportion to its throughput (0: always the cheapest)', nonNegative, d.routeSlack)
    .option('--route-ttl-ms <n>', 'validity of a signed route', int, d.routeTtlMs)
    .option('--generate-timeout-ms <n>', 'longest silence from a head before failing over', int, d.generateIdleTimeoutMs)
    .option('--queue-max-length <n>', 'chats that may wait for KV room when no route has any; one more gets 429 + Retry-After (0: no queue)', int, d.queueMaxLength)
    .option('--queue-max-wait-ms <n>', 'longest a chat waits for KV room before it gets 429 + Retry-After', int, d.queueMaxWaitMs)
    .option('--startup-wait-ms <n>', 'for this long after start, a chat with no route waits for nodes to register (a restarted tracker\'s nodes come back within about a second) instead of getting 503', int, CLI_STARTUP_WAIT_MS)
    .option('--no-checks', 'turn spot-checks off: no hop is re-executed to catch a node that lies (docs/verification.md)')
    .option('--check-min-rate <p>', 'smallest share of a proven node\'s sessions still checked (BOINC\'s adaptive replication: a new node\'s every session until 10 checks pass in a row, then max(p, 1/passes in a row))', Number, d.checkMinRate)
    .option('--quarantine-ms <n>', 'first quarantine of a node found lying, doubled for each further offence', int, d.quarantineMs)
    .option('--audit-walk-ms <n>', 'after two disjoint routes contradict a head\'s generation, how long the walk of its hops may take to name one before the head is quarantined', int, d.auditWalkMs)
    .option('--nats <urls>', 'join a cluster of trackers: NATS server URL(s), comma-separated (nats://host:4222); the registry lives in JetStream KV and any tracker answers any node or chat. Without it the tracker runs alone, its registry in memory', natsArg)
    .option('--cluster <name>', 'the cluster\'s name (its NATS subjects and registry bucket), with --nats', d.cluster)
    .option('--operator-key-file <path>', 'with --nats: the cluster operator\'s Ed25519 key file (created when missing); the tracker certifies its own key with it, and nodes that know the operator key accept routes from any tracker so certified')
    .option('--log-level <level>', 'pino log level (silent, error, warn, info, debug)', d.logLevel)
    .action(async (o: Record<string, unknown>) => {
      const nats = o.nats ? await import('../../cluster/nats.ts') : undefined;
      try {
        checkClusterName(o.cluster as string);
        if (nats) o.nats = nats.parseNatsServers(o.nats as string[]);
      } catch (e) {
        throw new CliError(`${(e as Error).message} (--nats nats://host:4222[,nats://host2:4222], --cluster NAME)`);
      }
      if (o.relay) await (await import('../preflight.ts')).reachRelay(o.relay as string);
      const { startTracker } = await import('../../tracker/server.ts');
      const wire = applyWireDtypes(o.model as TrackerModelSource[], o.wireDtype as Array<{ model?: string; dtype: Dtype }>);
      const tracker = await startTracker({
        ...(wire.wireDtype ? { wireDtype: wire.wireDtype } : {}),
        port: o.port as number,
        host: o.host as string,
        relayUrl: o.relay as string | undefined,
        keyFile: o.keyFile as string | undefined,
        models: wire.models,
        maxTokensLimit: o.maxTokensLimit as number,
        defaultMaxTokens: o.defaultMaxTokens as number,
        heartbeatIntervalMs: o.heartbeatIntervalMs as number,
        deadAfterMissedHeartbeats: o.deadAfterMissedHeartbeats as number,
        rejoinGraceMs: o.rejoinGraceMs as number,
        kvReserveContextTokens: o.kvContext as number,
        hopLatencyMs: o.hopLatencyMs as number,
        routeSlack: o.routeSlack as number,
        routeTtlMs: o.routeTtlMs as number,
        generateIdleTimeoutMs: o.generateTimeoutMs as number,
        queueMaxLength: o.queueMaxLength as number,
        queueMaxWaitMs: o.queueMaxWaitMs as number,
        startupWaitMs: o.startupWaitMs as number,
        checks: o.checks !== false,
        checkMinRate: o.checkMinRate as number,
        quarantineMs: o.quarantineMs as number,
        auditWalkMs: o.auditWalkMs as number,
        logLevel: o.logLevel as string,
        nats: o.nats as string[] | undefined,
        cluster: o.cluster as string,
        operatorKeyFile: o.operatorKeyFile as string | undefined,
      }).catch((e: unknown) => {
        // NATS unreachable at start: its one line, naming the URL(s).
        if (nats && e instanceof nats.NatsUnreachableError) throw new CliError(e.message);
        throw e;
      });
      // One machine-readable line first: scripts and tests wait for it.
      process.stdout.write(`${JSON.stringify({ event: 'listening', role: 'tracker', url: tracker.url, port: tracker.port, peer_id: tracker.identity.peerId, public_key: tracker.publicKey })}\n`);
      onShutdown(() => tracker.close());
    });
}
