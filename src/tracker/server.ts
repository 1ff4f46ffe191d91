/**
 * The tracker process: the app on Node's http server, a relay registration
 * (the tracker is a peer too: it reaches heads over the relay's fast path and
 * answers tracker API calls that arrive over the relay), the sweep timer, and
 * the model registry loaded from each model's checkpoint URL.
 */
import pino, { type Logger } from 'pino';
import { type MeshRequest, type MeshResponse } from '../protocol/envelopes.ts';
import { BEAT_BATCH_FEATURE } from '../protocol/beat-batch.ts';
import { Identity, MemoryKeyStore } from '../net/identity.ts';
import type { MeshHandler } from '../net/contract.ts';
import { RelayClient } from '../net/relay-client.ts';
import { createTracker, type Tracker } from './app.ts';
import type { NatsHandle } from '../cluster/nats.ts';
import type { ClusterStore, ClusterStoreOptions } from './cluster/store.ts';
import { encodeBase64Url } from '../protocol/base64.ts';
import { createHeadTransport } from './head-proxy.ts';
import { bodySource, serveApp } from './http.ts';
import { FileKeyStore } from '../host/node/key-file.ts';
import { NodeWebSocketConstructor } from '../host/node/socket.ts';
import { createTrackerMetrics } from './metrics.ts';
import { hubAwareLoader } from './hub-models.ts';
import { ModelCatalog, type ModelRetryOptions, type ModelSpec } from './model-registry.ts';
import { resolveTrackerOptions, type TrackerOptions } from './options.ts';
import { Ticker } from './ticker.ts';

export interface RunningTracker extends Tracker {
  url: string;
  port: number;
  logger: Logger;
  relay: RelayClient | undefined;
  close(): Promise<void>;
}

export interface StartTrackerExtras {
  /** Already sized models (skips fetching config.json). */
  modelSpecs?: ModelSpec[];
  fetch?: typeof fetch;
  identity?: Identity;
  logger?: Logger;
  /** Backoff of model loads that fail (tests shorten it). */
  modelRetry?: ModelRetryOptions;
  /** Cluster timings (tests shorten the lease and the silences). */
  cluster?: Partial<ClusterStoreOptions>;
}

/**
 * The app as a relay bridge handler: tracker API calls may arrive over the
 * relay too. Heartbeats over the relay (`POST /api/nodes/beat`) skip the
 * web Request/Response: at thousands of donors they are most of what a
 * tracker does.
 */
export function relayHandlerFor(fetchFn: (req: Request) => Promise<Response>, beat?: Tracker['relayBeat']): MeshHandler {
  return async (req: MeshRequest): Promise<MeshResponse> => {
    if (beat && req.method === 'POST' && req.path === '/api/nodes/beat') return beat(req.from, req.body);
    const body = req.method === 'GET' || req.method === 'HEAD' ? undefined : (req.body as Uint8Array<ArrayBuffer>);
    const res = await fetchFn(new Request(new URL(req.path, 'http://tracker.relay'), { method: req.method, headers: req.headers, body, signal: req.signal }));
    const headers: Record<string, string> = {};
    res.headers.forEach((v, k) => (headers[k] = v));
    // Streamed as it comes (SSE answers stay streams over the relay too).
    return { status: res.status, headers, body: bodySource(res) ?? (res.body ? streamChunks(res.body) : new Uint8Array(0)) };
  };
}

async function* streamChunks(body: ReadableStream<Uint8Array>): AsyncGenerator<Uint8Array> {
  const reader = body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    yield value;
  }
}

async function loadClusterCode() {
  const [{ connectNats }, { ClusterStore, relayBase }, { certifyTracker }] = await Promise.all([import('../cluster/nats.ts'), import('./cluster/store.ts'), import('./cluster/trust.ts')]);
  return { connectNats, ClusterStore, relayBase, certifyTracker };
}

export async function startTracker(partial: Partial<TrackerOptions>, extras: StartTrackerExtras = {}): Promise<RunningTracker> {
  const o = resolveTrackerOptions(partial);
  // Synchronous: a start failure's one line (src/cli/failure.ts) must come after the lines logged before it,
  // not race an async write flushed at exit. The tracker logs per node and per failure, not per token.
  const logger = extras.logger ?? pino({ name: 'tracker', level: o.logLevel }, pino.destination({ dest: 2, sync: true }));
  const fetchFn = extras.fetch ?? globalThis.fetch;
  const identity = extras.identity ?? (await Identity.loadOrCreate(o.keyFile ? new FileKeyStore(o.keyFile) : new MemoryKeyStore()));
  if (!extras.modelSpecs && o.models.length === 0) throw new TypeError('the tracker needs at least one model (--model NAME=URL)');
  // A cluster replica: NATS first, so that an unreachable server fails the start with one line naming it.
  let nats: NatsHandle | undefined;
  // The NATS client loads only for a cluster: a tracker alone (npm start) needs nothing of it.
  const clusterCode = o.nats ? await loadClusterCode() : undefined;
  if (o.nats && clusterCode) nats = await clusterCode.connectNats({ servers: o.nats, name: `tracker-${identity.peerId}`, logger });
  const logModel = (m: ModelSpec) => logger.info({ model: m.name, url: m.url, layers: m.numLayers, layer_mb: +(m.layerBytes[0]! / 2 ** 20).toFixed(2), kv_mb_per_layer: +(m.kvBytesPerLayer / 2 ** 20).toFixed(2), sized_from: m.sizedFrom }, 'model registered');
  // A model whose checkpoint cannot be read is retried with backoff; the others serve meanwhile.
  // Models that load later join the registry the tracker is built with below.
  const late: { registry?: Tracker['registry'] } = {};
  const catalog = new ModelCatalog(hubAwareLoader(fetchFn, o, process.env), {
    onError: (name, url, err, attempts, retryInMs) => logger.warn({ model: name, url, attempt: attempts, retry_in_ms: retryInMs, err: err.message }, `model ${name}: cannot load its checkpoint from ${url}; retrying in ${(retryInMs / 1000).toFixed(1)} s`),
    onLoaded: (spec, attempts) => {
      late.registry?.addModel(spec);
      logModel(spec);
      logger.info({ model: spec.name, attempts }, `model ${spec.name} loaded after ${attempts} attempts`);
    },
  }, extras.modelRetry);
  const models = extras.modelSpecs ?? (await catalog.start(o.models));
  for (const m of models) logModel(m);

  let relay: RelayClient | undefined;
  if (o.relayUrl) {
    // The Node.js host's socket: zero mask (no copy of each frame sent) and one write per tick (a tick's heartbeat
    // answers leave in one writev, not one write(2) each).
    // `features`: relays with beat-batch send this tracker its nodes' heartbeats in batches (docs/protocol.md §9.1).
    relay = new RelayClient({ relayUrl: o.relayUrl, WebSocket: NodeWebSocketConstructor, identity, outageBudgetMs: o.relayOutageBudgetMs, info: { role: 'tracker', models: models.map((m) => m.name), features: [BEAT_BATCH_FEATURE] } });
  }
  const metrics = createTrackerMetrics();
  const tracker = createTracker({ options: o, models, identity, transport: createHeadTransport({ relay }), logger, metrics, pendingModels: catalog.pending });
  late.registry = tracker.registry;
  if (relay) {
    relay.setHandler(relayHandlerFor(tracker.app.fetch, tracker.relayBeat));
    relay.setBeatsHandler((msg) => tracker.relayBeats(msg));
    // One line per event: the connection lost, and back (not every attempt in between).
    relay.on('state', (e) => {
      if (e.state === 'disconnected' && e.lost) logger.warn({ reason: e.reason, wait_ms: relay!.options.outageBudgetMs }, 'relay connection lost; reconnecting (chats over it wait)');
      else if (e.state === 'registered') logger.info({ ...(e.outageMs !== undefined ? { outage_ms: e.outageMs } : {}) }, e.outageMs !== undefined ? 'relay connection back' : 'relay connection up');
    });
    relay.start();
    try {
      await relay.ready(10_000);
    } catch (e) {
      // The tracker still serves direct-HTTP heads; the client keeps reconnecting.
      logger.warn({ err: (e as Error).message }, 'relay not reachable yet; retrying in the background');
    }
  }
  // One clock for the periodic jobs (load tick, cluster store, sweep): the process wakes once a beat for all (ticker.ts).
  const ticker = new Ticker();
  let cluster: ClusterStore | undefined;
  if (nats && clusterCode) {
    const { ClusterStore, certifyTracker } = clusterCode;
    try {
      const publicKey = encodeBase64Url(identity.publicKey);
      const cert = o.operatorKeyFile ? await certifyTracker(o.operatorKeyFile, publicKey) : undefined;
      // The registry's snapshot is loaded before the tracker listens: it never answers from an empty copy.
      cluster = await ClusterStore.start({
        nats,
        cluster: o.cluster,
        registry: tracker.registry,
        self: { peerId: identity.peerId, publicKey, url: '', ...(cert ? { cert } : {}) },
        options: { ...extras.cluster, heartbeatIntervalMs: o.heartbeatIntervalMs, now: o.now },
        logger,
        metrics,
        load: tracker.load,
        ticker,
      });
      tracker.attachCluster(cluster);
      logger.info({ cluster: o.cluster, nats: o.nats, nodes: tracker.registry.nodes.size, leader: cluster.leader() }, 'joined the cluster');
    } catch (e) {
      await nats.close();
      throw e;
    }
  }
  const served = await serveApp(tracker.app.fetch, o.port, o.host, o.maxBodyBytes, { 'GET /api/nodes/watch': (req, res) => tracker.watch.serve(req, res) });
  await cluster?.setUrl(served.url);
  if (cluster && relay && clusterCode) {
    const c = cluster;
    const { relayBase } = clusterCode;
    const announce = () => void c.setRelay(relayBase(relay.relayAddr)).catch(() => undefined);
    relay.on('state', (e) => e.state === 'registered' && announce());
    announce();
  }
  tracker.load.start(ticker);
  const stopSweeps = ticker.every(o.heartbeatIntervalMs, () => {
    try {
      tracker.sweep();
    } catch (e) {
      logger.error({ err: e }, 'sweep failed');
    }
  });
  logger.info({ url: served.url, peer_id: identity.peerId, relay: o.relayUrl ?? null }, 'tracker listening');
  return {
    ...tracker,
    url: served.url,
    port: served.port,
    logger,
    relay,
    async close() {
      catalog.close();
      stopSweeps();
      tracker.load.stop();
      await cluster?.close();
      await nats?.close();
      tracker.admission.close();
      relay?.close();
      tracker.watch.close();
      await served.close();
    },
  };
}
