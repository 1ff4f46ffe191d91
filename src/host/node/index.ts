/**
 * `meshnet node`: the node runtime (src/node/runtime) on Node.js.
 *
 *   startNodeHost()
 *     ├─ nodeAdapter (adapter.ts)   key file, Range weights, onnxruntime-node, node:http and link dialling for hops
 *     ├─ NodeRuntime                relay, tracker session, span adoption, the handler, stats, state
 *     └─ openSurface (surface.ts)   the HTTP server and GET /link, into the runtime's handler
 *
 * Events go to stdout as JSON lines (`listening`, `registered`, `serving`,
 * `generate-*`, `link-open`): tests and scripts wait for them.
 */
import { MeshError } from '../../protocol/errors.ts';
import { decodeBase64 } from '../../protocol/base64.ts';
import type { LogLevel, SpanHooks } from '../../node/runtime/host.ts';
import { NodeRuntime, type RuntimeEvent } from '../../node/runtime/runtime.ts';
import type { Dtype } from '../../protocol/tensor.ts';
import { nodeAdapter } from './adapter.ts';
import type { NodeBackendChoice, NodeTestHooks } from './backends.ts';
import { defaultCacheDir } from './hub-cache.ts';
import { hubEndpoint, isHubRef, resolveHubModel } from '../../model/hub.ts';
import { openSurface } from './surface.ts';

export interface NodeHostOptions {
  /** Relay base URL (ws[s]:// or http[s]://); absent: direct HTTP only. */
  relayUrl?: string;
  /** Tracker base URL; absent: a static span (layers + modelUrl) and a configured tracker key. */
  trackerUrl?: string;
  /** Direct HTTP port; 0 picks a free one. */
  port: number;
  /** Interface to bind. */
  host: string;
  /** Host name put in the advertised endpoint (default: the bound host). */
  publicHost?: string;
  /** Memory the donor gives, MiB: the span's weights, and the KV caches get the rest. */
  budgetMb: number;
  /** Where the Ed25519 identity lives; absent: a fresh id each run. */
  keyFile?: string;
  /** Static span [start, end) instead of the tracker's assignment. */
  layers?: [number, number];
  /** Base URL of the checkpoint for `layers`, or a hub id hf:ORG/REPO[@REVISION] (pinned to its commit at start). */
  modelUrl?: string;
  /** Hub files kept here (default: defaultCacheDir()). */
  cacheDir?: string;
  /** HF_ENDPOINT and HF_TOKEN (default: process.env). */
  env?: Record<string, string | undefined>;
  /** A static span's wire dtype (absent: sends bf16, accepts all three). */
  wireDtype?: Dtype;
  /** Model id as the tracker's registry knows it. */
  model: string;
  /** ONNX intra-op threads; absent: ORT decides. */
  threads?: number;
  /** What runs the span: onnxruntime-node's CPU (default) or WebGPU through Dawn (backends.ts). */
  backend?: NodeBackendChoice;
  /** Failures a software GPU never has (backends.ts, from MESHNET_TEST_* variables). */
  testHooks?: NodeTestHooks;
  /**
   * Wrappers around the span's weights and executor: test code makes a lying node with them
   * (docs/verification.md §8). Programmatic only: no command-line option or variable sets them.
   */
  spanHooks?: SpanHooks;
  /** `--graph-capture` (with `--backend webgpu`). */
  graphCapture?: boolean;
  /** Test hook: every /forward waits this long first (a slow donor). */
  injectDelayMs: number;
  /** The donor's cap on the device's busy time, 0.05..1 (runtime/duty-cycle.ts). @defaultValue 1 */
  dutyCycle?: number;
  /** base64url raw Ed25519 key that signs routes, for a head without a tracker (tests). */
  trackerKey?: string;
  /** base64url operator key of the tracker cluster: routes only from trackers it certified. */
  operatorKey?: string;
  /** Largest request body, bytes (413 above). */
  maxBodyBytes: number;
  /** Positions one session may reach (its KV cache grows to at most this). */
  maxContext: number;
  /** A KV session idle this long may be dropped when room is needed, ms. @defaultValue 120000 */
  kvIdleTtlMs?: number;
  /** Most sessions' one-token steps run as one batch; 1 turns batching off. @defaultValue 16 */
  maxBatch?: number;
  /** Which path first when a hop has a relay address and an endpoint (see HopTransportInit.order). */
  hopOrder: 'relay' | 'direct' | 'adaptive';
  /** How this node drives a pipeline as a head (PipelineOptions.hopMode). @defaultValue 'chain' */
  hopMode?: 'chain' | 'star';
  /** As a head: the draft model's checkpoint (speculative decoding; NodeRuntimeConfig.draftModelUrl). */
  draftModelUrl?: string;
  /** As a head: false never drafts. @defaultValue true */
  speculation?: boolean;
  /** Accept direct links on GET /link and dial them to hops with an endpoint (src/net/direct-link.ts). @defaultValue true */
  links?: boolean;
  /** Tell the tracker (and so other nodes) the HTTP endpoint; false: a node behind NAT, reached over the relay only. @defaultValue true */
  advertiseEndpoint?: boolean;
  /** Machine-readable events (stdout). */
  emit: (event: Record<string, unknown>) => void;
  /** Log lines (stderr). */
  log: (level: 'info' | 'warn' | 'error', message: string) => void;
}

// Apart from the host so that `meshnet node --help` prints them without loading onnxruntime.
export { NODE_HOST_DEFAULTS } from './options.ts';

export interface NodeHost {
  peerId: string;
  endpoint: string;
  relayAddr: string | undefined;
  /** The span served now, if any. */
  serving(): { start_layer: number; end_layer: number } | null;
  close(): Promise<void>;
}

export async function startNodeHost(o: NodeHostOptions): Promise<NodeHost> {
  if (o.layers && !o.modelUrl) throw new MeshError('MESH_ERR_BAD_REQUEST', '--layers needs --model-url');
  const links = o.links !== false;
  const log = (level: LogLevel, message: string): void => o.log(level === 'debug' ? 'info' : level, message);
  const env = o.env ?? process.env;
  const hub = { endpoint: hubEndpoint(env), ...(env.HF_TOKEN ? { token: env.HF_TOKEN } : {}), cacheDir: o.cacheDir ?? defaultCacheDir(env) };
  let modelUrl = o.modelUrl;
  if (modelUrl !== undefined && isHubRef(modelUrl)) {
    const r = await resolveHubModel(globalThis.fetch, modelUrl, hub);
    log('info', `${modelUrl} is commit ${r.sha}: loading from ${r.url}`);
    modelUrl = r.url;
  }
  const adapter = nodeAdapter({ keyFile: o.keyFile, threads: o.threads, links, hub, log, ...(o.backend ? { backend: o.backend } : {}), ...(o.testHooks ? { testHooks: o.testHooks } : {}), ...(o.graphCapture ? { graphCapture: true } : {}), ...(o.spanHooks ? { spanHooks: o.spanHooks } : {}) });
  const runtime = await NodeRuntime.create(adapter, {
    ...(o.relayUrl ? { relayUrl: o.relayUrl } : {}),
    ...(o.trackerUrl ? { trackerUrl: o.trackerUrl } : {}),
    model: o.model,
    ...(o.layers ? { span: { model: o.model, modelUrl: modelUrl!, startLayer: o.layers[0], endLayer: o.layers[1], ...(o.wireDtype ? { wireDtype: o.wireDtype } : {}) } } : {}),
    ...(o.trackerKey ? { trackerKey: decodeBase64(o.trackerKey) } : {}),
    ...(o.operatorKey ? { operatorKey: o.operatorKey } : {}),
    memoryBudgetBytes: o.budgetMb * 2 ** 20,
    maxContext: o.maxContext,
    ...(o.kvIdleTtlMs !== undefined ? { kvIdleTtlMs: o.kvIdleTtlMs } : {}),
    ...(o.maxBatch !== undefined ? { maxBatch: o.maxBatch } : {}),
    hopOrder: o.hopOrder,
    ...(o.hopMode ? { hopMode: o.hopMode } : {}),
    ...(o.draftModelUrl ? { draftModelUrl: o.draftModelUrl } : {}),
    ...(o.speculation === false ? { speculation: false } : {}),
    backendKind: o.backend === 'webgpu' ? 'webgpu' : 'onnxruntime-node',
    // A daemon keeps serving what it has and asks again at the next heartbeat.
    retryFailedLoads: true,
    injectDelayMs: o.injectDelayMs,
    ...(o.dutyCycle !== undefined ? { dutyCycle: o.dutyCycle } : {}),
  });
  const peerId = runtime.peerId;
  runtime.on((e: RuntimeEvent) => {
    if (e.type === 'registered') o.emit({ event: 'registered', peer_id: peerId, tracker: o.trackerUrl, assignment: e.assignment });
    else if (e.type === 'serving') {
      const rebuilt = e.rebuilt ? { rebuilt: { losses: e.rebuilt.loss.losses, reason: e.rebuilt.loss.reason, layer_ms: e.rebuilt.layerMs } } : {};
      o.emit({ event: 'serving', peer_id: peerId, model: e.span.model, start_layer: e.span.startLayer, end_layer: e.span.endLayer, load_ms: e.loadMs, backend: e.backend, ...rebuilt });
    }
    else if (e.type === 'generate' && (e.event.type === 'recovered' || e.event.type === 'done' || e.event.type === 'error')) o.emit({ event: `generate-${e.event.type}`, session_id: e.sessionId, ...e.event });
  });

  const surface = await openSurface({
    port: o.port,
    host: o.host,
    ...(o.publicHost ? { publicHost: o.publicHost } : {}),
    maxBodyBytes: o.maxBodyBytes,
    links,
    identity: runtime.identity,
    http: runtime.handlerFor('http'),
    link: runtime.handlerFor('link'),
    onLinkOpen: (caller) => o.emit({ event: 'link-open', caller_peer_id: caller }),
    log,
  });
  if (o.advertiseEndpoint !== false) runtime.endpoint = surface.endpoint;
  const close = async (): Promise<void> => {
    await runtime.close();
    adapter.close();
    await surface.close();
  };
  try {
    await runtime.connect();
    o.emit({ event: 'listening', role: 'node', peer_id: peerId, endpoint: surface.endpoint, relay_addr: runtime.relayAddr ?? null, port: surface.port });
    // A static span is loaded before this resolves (a failure ends the process); a tracker's arrives with its answers.
    await runtime.start({ waitForSpan: o.layers !== undefined });
  } catch (e) {
    await close();
    throw e;
  }

  return {
    peerId,
    endpoint: surface.endpoint,
    get relayAddr() {
      return runtime.relayAddr;
    },
    serving: () => {
      const s = runtime.span;
      return s ? { start_layer: s.spec.startLayer, end_layer: s.spec.endLayer } : null;
    },
    close,
  };
}
