/**
 * The Node.js host of the node core: onnxruntime-node for compute, `ws` for
 * the relay, node:http for the direct HTTP surface, a file for the identity.
 *
 *   startNodeHost()
 *     ├─ Identity (key file)          peer id stable across restarts
 *     ├─ node:http server             POST /forward, POST /generate, GET /health, GET /info, DELETE /sessions/<id>
 *     ├─ RelayClient (ws)             same handler over the relay (fast path + envelopes)
 *     ├─ TrackerClient                register → assignment; heartbeats with stats; re-register on 404
 *     └─ Span                         ShardExecutor over the assigned layers, fetched by Range from the model URL;
 *                                     swapped (load new, then switch, then release old) when the assignment moves
 *
 * Everything the node core does is in src/node; this file only wires hosts.
 */
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http';
import { once } from 'node:events';
import type { AddressInfo } from 'node:net';
import { WebSocketServer } from 'ws';
import { parseModelConfig, type ModelConfig } from '../model/config.ts';
import { openSafetensors } from '../model/safetensors.ts';
import { ModelTokenizer } from '../model/tokenizer.ts';
import type { MeshRequest, MeshResponse } from '../protocol/envelopes.ts';
import { MeshError, errorBody } from '../protocol/errors.ts';
import { normalizeHeaders } from '../protocol/headers.ts';
import { decodeBase64 } from '../protocol/base64.ts';
import type { Assignment, NodeMessage, NodeStats } from '../protocol/tracker.ts';
import { createForwardHandler, type ForwardEvent } from '../node/forward-handler.ts';
import { createHeadHandler } from '../node/head-handler.ts';
import { HopTransport } from '../node/hop-transport.ts';
import { LINK_PATH, LinkPool, acceptLink, type AcceptedLink } from '../node/direct-link.ts';
import { Identity } from '../node/identity.ts';
import { FileKeyStore } from '../tracker/key-file.ts';
import { PipelineDriver } from '../node/pipeline.ts';
import { RelayClient, type MeshHandler } from '../node/relay-client.ts';
import { RpcConnection, watchWsHandshake } from '../node/relay-hop.ts';
import { NotRegisteredError, TrackerClient } from '../node/tracker-client.ts';
import { NodeWebSocketConstructor as NodeWebSocket } from './node-socket.ts';
import { ShardExecutor } from '../shard/executor.ts';
import { readerWeightLoader } from '../shard/weights.ts';
import { createHttpDirect } from './http-direct.ts';
import { createNodeBackend } from './onnx-node.ts';

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
  /** Memory the donor gives, MiB (weights + KV). */
  budgetMb: number;
  /** Where the Ed25519 identity lives; absent: a fresh id each run. */
  keyFile?: string;
  /** Static span [start, end) instead of the tracker's assignment. */
  layers?: [number, number];
  modelUrl?: string;
  /** Model id as the tracker's registry knows it. */
  model: string;
  /** ONNX intra-op threads; absent: ORT decides. */
  threads?: number;
  /** Test hook: every /forward waits this long first (a slow donor). */
  injectDelayMs: number;
  /** base64url raw Ed25519 key that signs routes, for a head without a tracker (tests). */
  trackerKey?: string;
  /** Largest request body, bytes (413 above). */
  maxBodyBytes: number;
  /** Tokens each session's KV cache is preallocated for. */
  maxContext: number;
  /** Which path first when a hop has a relay address and an endpoint (see HopTransportInit.order). */
  hopOrder: 'relay' | 'direct' | 'adaptive';
  /** Accept direct links on GET /link and dial them to hops with an endpoint (src/node/direct-link.ts). @defaultValue true */
  links?: boolean;
  /** Machine-readable events (stdout). */
  emit: (event: Record<string, unknown>) => void;
  /** Log lines (stderr). */
  log: (level: 'info' | 'warn' | 'error', message: string) => void;
}

export { NODE_HOST_DEFAULTS } from './node-options.ts';

interface Span {
  model: string;
  modelUrl: string;
  config: ModelConfig;
  executor: ShardExecutor;
  tokenizer: ModelTokenizer | undefined;
  forward: MeshHandler;
  pipeline: PipelineDriver | undefined;
}

/** Rolling stats of the heartbeat (ADR-0013). */
class Stats {
  private readonly times: number[] = [];
  private readonly stepMs: number[] = [];
  inFlight = 0;
  tokensServed = 0;
  record(e: ForwardEvent, layers: number): void {
    const now = Date.now();
    this.times.push(now);
    while (this.times.length > 0 && this.times[0]! < now - 60_000) this.times.shift();
    if (e.status === 200) {
      this.tokensServed += e.tokens;
      if (e.tokens === 1 && layers > 0) {
        this.stepMs.push(e.ms / layers);
        if (this.stepMs.length > 101) this.stepMs.shift();
      }
    }
  }
  snapshot(kvFree: number): NodeStats {
    const now = Date.now();
    while (this.times.length > 0 && this.times[0]! < now - 60_000) this.times.shift();
    const sorted = [...this.stepMs].sort((a, b) => a - b);
    return {
      rpm: this.times.length,
      layer_ms: sorted.length ? Math.round(sorted[sorted.length >> 1]! * 1000) / 1000 : 0,
      queue_depth: this.inFlight,
      kv_free_bytes: Math.max(0, kvFree),
      tokens_served: this.tokensServed,
    };
  }
}

const utf8 = new TextEncoder();

function jsonResponse(status: number, value: unknown): MeshResponse {
  return { status, headers: { 'content-type': 'application/json' }, body: utf8.encode(JSON.stringify(value)) };
}

export interface NodeHost {
  peerId: string;
  endpoint: string;
  relayAddr: string | undefined;
  /** The span served now, if any. */
  serving(): { start_layer: number; end_layer: number } | null;
  close(): Promise<void>;
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

export async function startNodeHost(o: NodeHostOptions): Promise<NodeHost> {
  const identity = o.keyFile ? await Identity.loadOrCreate(new FileKeyStore(o.keyFile)) : await Identity.generate();
  const backend = createNodeBackend(o.threads !== undefined ? { intraOpNumThreads: o.threads } : {});
  const stats = new Stats();
  let span: Span | undefined;
  let loading: Promise<void> | undefined;
  let closed = false;
  const budgetBytes = o.budgetMb * 2 ** 20;

  const tracker = o.trackerUrl ? new TrackerClient({ trackerUrl: o.trackerUrl, fetch: globalThis.fetch, identity }) : undefined;
  const staticTrackerKey = o.trackerKey ? decodeBase64(o.trackerKey) : undefined;

  // ---- transports of the head's pipeline
  let relay: RelayClient | undefined;
  const httpDirect = createHttpDirect();
  // Frames straight to hops that accept links (Node.js nodes): no relay in between, cheaper than HTTP.
  const links = new LinkPool({ identity, WebSocket: NodeWebSocket, onLog: (m) => o.log('warn', m) });
  const transport = new HopTransport({
    link: (endpoint, peerId) => {
      if (o.links === false) return undefined;
      const c = links.get(endpoint, peerId);
      return c ? (peerId, req, opts) => c.request(peerId, req, opts) : undefined;
    },
    ...(o.relayUrl
      ? {
          fast: {
            relayUrl: o.relayUrl,
            get isRegistered() {
              return relay?.state === 'registered';
            },
            request: (peerId, req, opts) => relay!.request(peerId, req, opts),
          },
          rpc: (addr: string) => new RpcConnection(addr, { WebSocket: NodeWebSocket, watchHandshake: watchWsHandshake }),
        }
      : {}),
    direct: httpDirect.send,
    order: o.hopOrder,
    onLog: (m) => o.log('warn', m),
  });

  // ---- the handler every host path serves through
  const forwardOrUnavailable: MeshHandler = async (req) => {
    const s = span;
    const path = req.path.split('?')[0]!;
    if (!s) {
      if (path === '/health') return jsonResponse(200, { status: 'loading', sessions: 0 });
      if (path === '/info') return jsonResponse(200, { peer_id: identity.peerId, model: o.model, start_layer: null, end_layer: null, loading: loading !== undefined });
      return jsonResponse(503, errorBody('MESH_ERR_UNAVAILABLE', 'this node has no span loaded yet; route around it or retry later'));
    }
    if (path === '/forward' && req.method.toUpperCase() === 'POST') {
      stats.inFlight++;
      try {
        if (o.injectDelayMs > 0) await sleep(o.injectDelayMs);
        return await s.forward(req);
      } finally {
        stats.inFlight--;
      }
    }
    return s.forward(req);
  };
  const handler = createHeadHandler({
    forward: forwardOrUnavailable,
    peerId: identity.peerId,
    trackerKey: () => tracker?.trackerKey ?? staticTrackerKey,
    pipeline: () => span?.pipeline,
    onLog: (m) => o.log('warn', m),
    onEvent: (e, sessionId) => {
      if (e.type === 'recovered' || e.type === 'done' || e.type === 'error') o.emit({ event: `generate-${e.type}`, session_id: sessionId, ...e });
    },
  });

  // /forward requests served per surface, in /info: which paths hops really take.
  const served = { relay: 0, link: 0, http: 0 };
  const counted =
    (surface: keyof typeof served): MeshHandler =>
    (req) => {
      if (req.path === '/forward' || req.path.startsWith('/forward?')) served[surface]++;
      return handler(req);
    };

  // ---- direct HTTP surface
  const server = createServer({ noDelay: true, keepAliveTimeout: 30_000 }, (req, res) => {
    serveHttp(req, res).catch((e: unknown) => {
      o.log('error', `http ${req.method} ${req.url}: ${(e as Error).stack ?? String(e)}`);
      if (!res.headersSent) res.writeHead(500, { 'content-type': 'application/json' });
      res.end();
    });
  });
  async function serveHttp(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const declared = Number(req.headers['content-length'] ?? '0');
    if (declared > o.maxBodyBytes) {
      res.writeHead(413, { 'content-type': 'application/json', connection: 'close' });
      res.end(JSON.stringify(errorBody('MESH_ERR_TOO_LARGE', `body of ${declared} bytes is over ${o.maxBodyBytes}`)));
      req.destroy();
      return;
    }
    // Plain 'data' events: cheaper per request than async iteration, and this runs once per hop per token.
    const buf = await new Promise<Buffer | null>((resolve, reject) => {
      const chunks: Buffer[] = [];
      let n = 0;
      req.on('data', (c: Buffer) => {
        n += c.byteLength;
        if (n > o.maxBodyBytes) {
          res.writeHead(413, { 'content-type': 'application/json', connection: 'close' });
          res.end(JSON.stringify(errorBody('MESH_ERR_TOO_LARGE', `body is over ${o.maxBodyBytes} bytes`)));
          req.destroy();
          resolve(null);
          return;
        }
        chunks.push(c);
      });
      req.on('end', () => resolve(chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks, n)));
      req.on('error', reject);
    });
    if (buf === null) return;
    const ac = new AbortController();
    res.on('close', () => {
      if (!res.writableFinished) ac.abort(new Error('client went away'));
    });
    const mreq: MeshRequest = {
      method: req.method ?? 'GET',
      path: req.url ?? '/',
      headers: normalizeHeaders(req.headers as Record<string, unknown>),
      body: new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength),
      signal: ac.signal,
    };
    const r = await counted('http')(mreq);
    if (r.body instanceof Uint8Array) {
      res.writeHead(r.status, { ...r.headers, 'content-length': String(r.body.byteLength) });
      res.end(r.body);
      return;
    }
    res.writeHead(r.status, r.headers);
    for await (const chunk of r.body) {
      if (ac.signal.aborted) break;
      if (!res.write(chunk)) await Promise.race([once(res, 'drain'), once(res, 'close')]);
    }
    res.end();
  }
  // ---- direct links: the fast path's frames from callers that can reach this endpoint
  const linkServer = new WebSocketServer({ noServer: true, maxPayload: o.maxBodyBytes + 64 * 1024, perMessageDeflate: false });
  const accepted = new Set<AcceptedLink>();
  server.on('upgrade', (req, socket, head) => {
    if (o.links === false || (req.url ?? '').split('?')[0] !== LINK_PATH) {
      socket.end('HTTP/1.1 404 Not Found\r\nconnection: close\r\ncontent-length: 0\r\n\r\n');
      return;
    }
    linkServer.handleUpgrade(req, socket, head, (ws) => {
      const link = acceptLink(ws as unknown as Parameters<typeof acceptLink>[0], {
        identity,
        handler: counted('link'),
        onOpen: (caller) => o.emit({ event: 'link-open', caller_peer_id: caller }),
        options: { maxMessageBytes: o.maxBodyBytes + 64 * 1024 },
        onLog: (e) => {
          if (e.level === 'warn' || e.level === 'error') o.log(e.level, `link: ${e.event}: ${e.message}`);
        },
      });
      accepted.add(link);
      void link.closed.then(() => accepted.delete(link));
    });
  });
  server.listen(o.port, o.host);
  await once(server, 'listening');
  const port = (server.address() as AddressInfo).port;
  const endpoint = `http://${o.publicHost ?? (o.host === '0.0.0.0' || o.host === '::' ? '127.0.0.1' : o.host)}:${port}`;

  // ---- relay
  if (o.relayUrl) {
    relay = new RelayClient({
      relayUrl: o.relayUrl,
      WebSocket: NodeWebSocket,
      identity,
      handler: counted('relay'),
      info: { host: 'node', model: o.model, backend: backend.name },
      onLog: (e) => {
        if (e.level === 'warn' || e.level === 'error') o.log(e.level, `relay: ${e.event}: ${e.message}`);
      },
    });
    relay.start();
    // A relay that is down at start is not fatal: the client keeps reconnecting, and direct HTTP serves meanwhile.
    await relay.ready(20_000).catch((e: unknown) => o.log('warn', `relay: ${(e as Error).message}; serving direct HTTP while the client keeps trying`));
  }
  o.emit({ event: 'listening', role: 'node', peer_id: identity.peerId, endpoint, relay_addr: relay?.relayAddr ?? null, port });

  // ---- spans
  async function loadSpan(a: Assignment): Promise<Span> {
    const base = a.model_url.endsWith('/') ? a.model_url : `${a.model_url}/`;
    const res = await fetch(`${base}config.json`);
    if (!res.ok) throw new MeshError('MESH_ERR_UNAVAILABLE', `config.json: HTTP ${res.status} from ${base}`);
    const config = parseModelConfig(await res.json());
    const reader = await openSafetensors(globalThis.fetch, base);
    const maxContext = Math.min(o.maxContext, config.maxPositionEmbeddings);
    const executor = await ShardExecutor.create({
      config,
      backend,
      weights: readerWeightLoader(reader),
      startLayer: a.start_layer,
      endLayer: a.end_layer,
      maxContext,
      // The donor's budget covers weights and KV; half of it for KV caches is the simple split until the tracker sizes spans by measured weight bytes.
      kvBudgetBytes: budgetBytes / 2,
    });
    // The head needs the tokenizer; the last hop uses it for the token's text.
    const tokenizer = a.start_layer === 0 || a.end_layer === config.numLayers ? await ModelTokenizer.load(globalThis.fetch, base, { extraEosTokenIds: config.eosTokenIds }) : undefined;
    const layers = a.end_layer - a.start_layer;
    const forward = createForwardHandler(executor, {
      model: a.model,
      backend: backend.name,
      version: '0.1.0',
      ...(tokenizer ? { decode: (id: number) => tokenizer.decode([id]) } : {}),
      extraInfo: () => ({ peer_id: identity.peerId, endpoint, relay_addr: relay?.relayAddr ?? null, forwards_served: { ...served } }),
      onForward: (e) => stats.record(e, layers),
      onError: (e) => o.log('error', `forward: ${(e as Error).stack ?? String(e)}`),
    });
    const pipeline =
      a.start_layer === 0 && tokenizer
        ? new PipelineDriver({
            executor,
            tokenizer,
            transport,
            ...(tracker ? { replace: (hop, signal) => tracker.replace(a.model, hop, signal) } : {}),
            onLog: (m) => o.log('warn', `pipeline: ${m}`),
          })
        : undefined;
    return { model: a.model, modelUrl: a.model_url, config, executor, tokenizer, forward, pipeline };
  }

  function sameSpan(a: Assignment, s: Span | undefined): boolean {
    return s !== undefined && s.executor.startLayer === a.start_layer && s.executor.endLayer === a.end_layer && s.modelUrl === a.model_url;
  }

  async function adopt(a: Assignment): Promise<void> {
    if (sameSpan(a, span)) return;
    const t0 = Date.now();
    const next = await loadSpan(a);
    if (closed) {
      await next.executor.release();
      return;
    }
    const old = span;
    span = next;
    o.emit({ event: 'serving', peer_id: identity.peerId, model: a.model, start_layer: a.start_layer, end_layer: a.end_layer, load_ms: Date.now() - t0 });
    // release() waits for the old executor's queue, so a forward already running finishes first.
    if (old) void old.executor.release().catch(() => undefined);
  }

  /** Adoptions run one after another; a second assignment while loading waits for the first. */
  let chain: Promise<void> = Promise.resolve();
  let wanted: Assignment | undefined;
  function assign(a: Assignment | null | undefined): void {
    if (!a || o.layers) return;
    if (sameSpan(a, span) || (wanted && sameAssignment(wanted, a))) return;
    wanted = a;
    const run = chain.then(async () => {
      if (wanted !== a) return; // superseded while queued
      try {
        await adopt(a);
      } catch (e) {
        o.log('error', `loading [${a.start_layer}, ${a.end_layer}) of ${a.model_url}: ${(e as Error).message}`);
      } finally {
        if (wanted === a) wanted = undefined;
      }
    });
    loading = run;
    chain = run.then(() => {
      if (loading === run) loading = undefined;
      // Tell the tracker what we serve as soon as the span is up.
      return beat();
    });
  }

  // ---- tracker
  function nodeMessage(): NodeMessage {
    const s = span;
    const kv = s?.executor.kvStats();
    return {
      peer_id: identity.peerId,
      public_key: encodeUrl(identity.publicKey),
      ...(relay?.relayAddr ? { relay_addr: relay.relayAddr } : {}),
      endpoint,
      info: { model: o.model, backend: 'onnxruntime-node', memory_budget_mb: o.budgetMb, host: 'node', version: '0.1.0' },
      stats: stats.snapshot(kv ? kv.budgetBytes - kv.bytesUsed : budgetBytes),
      serving: s ? { start_layer: s.executor.startLayer, end_layer: s.executor.endLayer } : null,
      timestamp: Date.now(),
    };
  }

  let heartbeatMs = 5_000;
  let beatTimer: ReturnType<typeof setTimeout> | undefined;
  let registered = false;
  let beating = false;

  async function register(): Promise<void> {
    const ans = await tracker!.register(nodeMessage());
    registered = true;
    heartbeatMs = ans.heartbeat_interval_ms;
    o.emit({ event: 'registered', peer_id: identity.peerId, tracker: o.trackerUrl, assignment: ans.assignment });
    assign(ans.assignment);
  }

  async function beat(): Promise<void> {
    if (!tracker || closed || beating) return;
    beating = true;
    try {
      if (!registered) await register();
      else {
        try {
          const ans = await tracker.heartbeat(nodeMessage());
          if (ans.heartbeatIntervalMs) heartbeatMs = ans.heartbeatIntervalMs;
          assign(ans.assignment);
        } catch (e) {
          if (!(e instanceof NotRegisteredError)) throw e;
          o.log('warn', 'the tracker forgot this node (restarted?); registering again');
          registered = false;
          await register();
        }
      }
    } catch (e) {
      o.log('warn', `tracker: ${(e as Error).message}`);
    } finally {
      beating = false;
    }
  }

  function scheduleBeat(): void {
    if (closed) return;
    beatTimer = setTimeout(() => {
      void beat().finally(scheduleBeat);
    }, heartbeatMs);
  }

  if (o.layers) {
    if (!o.modelUrl) throw new MeshError('MESH_ERR_BAD_REQUEST', '--layers needs --model-url');
    await adopt({ model: o.model, model_url: o.modelUrl, start_layer: o.layers[0], end_layer: o.layers[1] });
  }
  if (tracker) {
    await beat();
    scheduleBeat();
  }

  return {
    peerId: identity.peerId,
    endpoint,
    get relayAddr() {
      return relay?.relayAddr;
    },
    serving: () => (span ? { start_layer: span.executor.startLayer, end_layer: span.executor.endLayer } : null),
    async close() {
      closed = true;
      if (beatTimer) clearTimeout(beatTimer);
      relay?.close();
      transport.close();
      links.close();
      for (const l of accepted) l.close();
      linkServer.close();
      httpDirect.close();
      server.closeAllConnections();
      await new Promise<void>((r) => server.close(() => r()));
      await span?.executor.release().catch(() => undefined);
    },
  };
}

function sameAssignment(a: Assignment, b: Assignment): boolean {
  return a.start_layer === b.start_layer && a.end_layer === b.end_layer && a.model_url === b.model_url;
}

function encodeUrl(bytes: Uint8Array): string {
  return Buffer.from(bytes).toString('base64url');
}
