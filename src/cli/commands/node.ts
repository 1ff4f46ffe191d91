/** `meshnet node`: options from src/host/node/options.ts; onnxruntime and the node host load when the command runs. */
import type { Command } from 'commander';
import { InvalidArgumentError } from 'commander';
import { DTYPES, isDtype, type Dtype } from '../../protocol/tensor.ts';
import { KV_DEFAULTS } from '../../shard/kv-ledger.ts';
import { DEFAULT_MAX_BATCH } from '../../shard/batch-queue.ts';
import { CliError } from '../failure.ts';
import { NODE_HOST_DEFAULTS } from '../../host/node/options.ts';
import { int, onShutdown } from '../util.ts';

function layerRange(value: string): [number, number] {
  const m = /^(\d+)-(\d+)$/.exec(value);
  if (!m || Number(m[1]) >= Number(m[2])) throw new InvalidArgumentError(`expected "a-b" with a < b (end exclusive), got "${value}"`);
  return [Number(m[1]), Number(m[2])];
}

function hopOrder(value: string): 'relay' | 'direct' | 'adaptive' {
  if (value !== 'relay' && value !== 'direct' && value !== 'adaptive') throw new InvalidArgumentError(`expected relay, direct or adaptive, got "${value}"`);
  return value;
}

function hopMode(value: string): 'chain' | 'star' {
  if (value !== 'chain' && value !== 'star') throw new InvalidArgumentError(`expected chain or star, got "${value}"`);
  return value;
}

function wireDtype(value: string): Dtype {
  const v = value.trim().toLowerCase();
  if (!isDtype(v)) throw new InvalidArgumentError(`expected one of ${DTYPES.join(', ')}, got "${value}"`);
  return v;
}

function backendChoice(value: string): 'cpu' | 'webgpu' {
  if (value !== 'cpu' && value !== 'webgpu') throw new InvalidArgumentError(`expected cpu or webgpu, got "${value}"`);
  return value;
}

function dutyCycle(value: string): number {
  const n = Number(value);
  if (!Number.isFinite(n) || n < 0.05 || n > 1) throw new InvalidArgumentError(`expected a share of the device's time in [0.05, 1], got "${value}"`);
  return n;
}

function positive(value: string): number {
  const n = Number(value);
  if (!Number.isFinite(n) || n <= 0) throw new InvalidArgumentError(`expected a positive number, got "${value}"`);
  return n;
}

export function configure(cmd: Command): void {
  cmd
    .option('--relay <urls>', 'relay base URL (ws[s]:// or http[s]://); several, comma-separated, to fail over between relays (a relay of a cluster also names its others)')
    .option('--tracker <url>', 'tracker base URL (assignment, heartbeats, replacement spans)')
    .option('--port <n>', 'direct HTTP port (0 picks a free one)', int, NODE_HOST_DEFAULTS.port)
    .option('--host <addr>', 'interface the direct HTTP surface binds', NODE_HOST_DEFAULTS.host)
    .option('--public-host <name>', 'host name advertised in the endpoint (default: the bound interface)')
    .option('--budget-mb <n>', 'memory given to the mesh, MiB: the weights of the span held, and KV caches get the rest (fractions allowed)', positive, NODE_HOST_DEFAULTS.budgetMb)
    .option('--key-file <path>', 'Ed25519 identity file (created on first run; keeps the peer id across restarts)')
    .option('--layers <a-b>', 'static span [a, b) instead of the tracker\'s assignment (needs --model-url)', layerRange)
    .option('--model-url <url>', 'base URL of the HF-layout checkpoint for --layers, or hf:ORG/REPO[@REVISION] (pinned to its commit; HF_TOKEN for gated repos, HF_ENDPOINT for a mirror)')
    .option('--cache-dir <path>', 'where hub files pinned to a commit are kept (default: $MESHNET_CACHE_DIR, else ~/.cache/meshnet)')
    .option('--wire-dtype <dtype>', 'with --layers: activations between hops, bf16, f16 or f32 (a head sends it, a hop accepts only it; default: sends bf16, accepts all). A tracker\'s nodes get the tracker\'s (--wire-dtype there)', wireDtype)
    .option('--model <name>', `model id as the tracker knows it (default: the tracker's only model; with --layers: "${NODE_HOST_DEFAULTS.staticModel}")`)
    .option('--threads <n>', 'ONNX intra-op threads (default: onnxruntime decides)', int)
    .option('--backend <kind>', 'what runs the span: cpu (onnxruntime-node) or webgpu (onnxruntime-web\'s WebGPU EP on Dawn, fused graphs; a lost GPU device is rebuilt, then the CPU takes over)', backendChoice, 'cpu')
    .option('--graph-capture', 'with --backend webgpu: decode steps replay a captured GPU graph (onnxruntime graph capture; prefill runs uncaptured). Off by default until measured on real GPUs')
    .option('--duty-cycle <fraction>', 'share of the device\'s time given, 0.05..1: the node rests between its steps, and the tracker counts on that much less throughput from it', dutyCycle, NODE_HOST_DEFAULTS.dutyCycle)
    .option('--inject-delay-ms <n>', 'test hook: delay every /forward by this many ms (a slow donor)', int, NODE_HOST_DEFAULTS.injectDelayMs)
    .option('--tracker-key <base64url>', 'route-signing public key for a head without a tracker (tests, static meshes)')
    .option('--operator-key <base64url>', 'the tracker cluster\'s operator key: take routes only from trackers it certified (default: pinned from the first tracker answer that carries a certificate)')
    .option('--max-body-bytes <n>', 'largest request body, bytes (413 above)', int, NODE_HOST_DEFAULTS.maxBodyBytes)
    .option('--max-context <n>', 'positions one session may reach (its KV cache is sized by what the head declares, up to this)', int, NODE_HOST_DEFAULTS.maxContext)
    .option('--kv-idle-ttl-ms <n>', 'a KV session idle this long may be dropped when a new one needs its room (live sessions never are)', int, KV_DEFAULTS.idleTtlMs)
    .option('--hop-mode <mode>', 'as a head: chain (each hop pushes its output to the next, the last answers the head: N legs a token) or star (every hop answers the head; ADR-era peers)', hopMode, NODE_HOST_DEFAULTS.hopMode)
    .option('--max-batch <n>', 'most sessions\' one-token steps run together as one batch at this node (1: batching off)', int, DEFAULT_MAX_BATCH)
    .option('--hop-order <order>', 'path first for a hop with both a relay address and an endpoint: relay (ADR-0014), direct, or adaptive (the faster measured one)', hopOrder, NODE_HOST_DEFAULTS.hopOrder)
    .option('--no-links', 'neither accept nor dial direct links (GET /link: the fast path\'s frames without a relay); direct hops then use HTTP')
    .option('--draft <model-url>', 'as a head: draft with this model (a smaller checkpoint with the target\'s tokenizer, run whole on this node\'s backend; refused when its vocabulary differs), or self:N (self-speculation: the target\'s own first N layers with its final norm and LM head). Without it: prompt lookup')
    .option('--no-speculation', 'as a head: never draft (speculative decoding off; requests may also turn it off with "speculative": false)')
    .option('--no-endpoint', 'advertise no HTTP endpoint (a node behind NAT): the tracker and other nodes reach it over the relay only (needs --relay); its HTTP port still answers locally')
    .action(async (o: Record<string, unknown>) => {
      if (!o.tracker && !o.layers) cmd.error('give --tracker, or --layers with --model-url: a tracker (--tracker URL) assigns this node its layers; --layers a-b serves a fixed span');
      if (!((o.maxBatch as number) >= 1)) cmd.error('--max-batch must be at least 1 (1 turns batching off)');
      if (o.layers && !o.modelUrl) cmd.error('--layers needs --model-url (the checkpoint to load the layers from)');
      if (typeof o.modelUrl === 'string' && o.modelUrl.startsWith('hf:')) {
        const { parseHubRef } = await import('../../model/hub.ts');
        try {
          parseHubRef(o.modelUrl);
        } catch (e) {
          cmd.error(`--model-url: ${(e as Error).message}`);
        }
      }
      if (o.endpoint === false && !o.relay) cmd.error('--no-endpoint needs --relay: without an endpoint the relay is the only way to reach this node');
      if (o.graphCapture && o.backend !== 'webgpu') cmd.error('--graph-capture needs --backend webgpu: graph capture replays GPU work');
      if (o.wireDtype && !o.layers) cmd.error('--wire-dtype is for a static span (--layers): a tracker gives its nodes the model\'s wire dtype');
      const log = (level: 'info' | 'warn' | 'error', message: string) => process.stderr.write(`${JSON.stringify({ level, time: Date.now(), msg: message })}\n`);
      const model = o.tracker ? await trackerModel(o.tracker as string, o.model as string | undefined, log) : ((o.model as string | undefined) ?? NODE_HOST_DEFAULTS.staticModel);
      if (o.relay) await (await import('../preflight.ts')).reachRelay(o.relay as string);
      (await import('../trace-file.ts')).installTraceFromEnv('node');
      const { startNodeHost } = await import('../../host/node/index.ts');
      const { testHooksFromEnv } = await import('../../host/node/backends.ts');
      const host = await startNodeHost({
        relayUrl: o.relay as string | undefined,
        trackerUrl: o.tracker as string | undefined,
        port: o.port as number,
        host: o.host as string,
        publicHost: o.publicHost as string | undefined,
        budgetMb: o.budgetMb as number,
        keyFile: o.keyFile as string | undefined,
        layers: o.layers as [number, number] | undefined,
        modelUrl: o.modelUrl as string | undefined,
        cacheDir: o.cacheDir as string | undefined,
        ...(o.wireDtype ? { wireDtype: o.wireDtype as Dtype } : {}),
        model,
        threads: o.threads as number | undefined,
        backend: o.backend as 'cpu' | 'webgpu',
        ...(o.graphCapture ? { graphCapture: true } : {}),
        testHooks: testHooksFromEnv(process.env),
        injectDelayMs: o.injectDelayMs as number,
        dutyCycle: o.dutyCycle as number,
        trackerKey: o.trackerKey as string | undefined,
        operatorKey: o.operatorKey as string | undefined,
        maxBodyBytes: o.maxBodyBytes as number,
        maxContext: o.maxContext as number,
        kvIdleTtlMs: o.kvIdleTtlMs as number,
        maxBatch: o.maxBatch as number,
        hopOrder: o.hopOrder as 'relay' | 'direct' | 'adaptive',
        hopMode: o.hopMode as 'chain' | 'star',
        links: o.links !== false,
        ...(o.draft ? { draftModelUrl: o.draft as string } : {}),
        ...(o.speculation === false ? { speculation: false } : {}),
        advertiseEndpoint: o.endpoint !== false,
        // One JSON object per stdout line: tests and scripts wait for `listening` and `serving`.
        emit: (event) => process.stdout.write(`${JSON.stringify(event)}\n`),
        log,
      });
      onShutdown(() => host.close());
    });
}

/** The model to join: --model if the tracker serves it, else the tracker's only model (loaded or still loading). */
async function trackerModel(trackerUrl: string, asked: string | undefined, log: (level: 'info', message: string) => void): Promise<string> {
  const { reachTracker } = await import('../preflight.ts');
  const info = await reachTracker(trackerUrl);
  const models = [...info.models, ...info.models_pending];
  if (asked !== undefined) {
    if (!models.includes(asked)) throw new CliError(`the tracker at ${trackerUrl} serves no model "${asked}" (it serves: ${models.join(', ')}): fix --model`);
    return asked;
  }
  if (models.length === 1) {
    log('info', `joining model "${models[0]}", the only one the tracker at ${trackerUrl} serves`);
    return models[0]!;
  }
  throw new CliError(`the tracker at ${trackerUrl} serves ${models.length} models (${models.join(', ')}): choose one with --model`);
}
