/**
 * The Node.js host as the runtime sees it (src/node/runtime/host.ts):
 * global fetch, the `ws` package (zero-mask sends, one write per tick), a
 * key file, weights read by Range straight from the model host into the
 * graphs, onnxruntime-node, node:http for direct hops, and direct links.
 */
import { ModelFetchError, ModelFormatError } from '../../model/errors.ts';
import { hubFetch } from '../../model/hub.ts';
import { cachingHubFetch } from './hub-cache.ts';
import { openSafetensors } from '../../model/safetensors.ts';
import { ModelTokenizer } from '../../model/tokenizer.ts';
import { LinkPool } from '../../net/direct-link.ts';
import { MemoryKeyStore, type KeyStore } from '../../net/identity.ts';
import { watchWsHandshake } from '../../net/relay-hop.ts';
import type { LogLevel, RuntimeHost, SpanHooks, WeightStore } from '../../node/runtime/host.ts';
import { readerWeightLoader } from '../../shard/weights.ts';
import { FileKeyStore } from './key-file.ts';
import { createHttpDirect, type HttpDirect } from './http-direct.ts';
import { NodeWebSocketConstructor } from './socket.ts';
import { nodeBackends, type NodeBackendChoice, type NodeTestHooks } from './backends.ts';

export interface NodeAdapterOptions {
  /** Where the Ed25519 identity lives; absent: a fresh id each run. */
  keyFile?: string;
  /** ONNX intra-op threads; absent: ORT decides. */
  threads?: number;
  /** onnxruntime-node's CPU (default), or WebGPU through Dawn (backends.ts). */
  backend?: NodeBackendChoice;
  /** Failures a software GPU never has, for tests (backends.ts). */
  testHooks?: NodeTestHooks;
  /** See NodeBackendOptions.graphCapture. */
  graphCapture?: boolean;
  /** Dial direct links to hops with an endpoint. */
  links: boolean;
  /** Hub files: endpoint (HF_ENDPOINT), HF_TOKEN for the hub origin, and the disk cache of pinned files. */
  hub: { endpoint: string; token?: string; cacheDir: string };
  /** Test code's wrappers around the span (RuntimeHost.spanHooks); the CLI never sets them. */
  spanHooks?: SpanHooks;
  log(level: LogLevel, message: string): void;
}

export interface NodeAdapter extends RuntimeHost {
  /** Close what the host opened beside the runtime (the direct HTTP agent). */
  close(): void;
}

/** Weights by HTTP Range from the model host, each graph fetching its own tensors (hub files pinned to a commit come from the disk cache). */
function rangeWeights(fetchFn: typeof fetch): WeightStore {
  return {
    async config(modelUrl) {
      let res: Response;
      try {
        res = await fetchFn(`${modelUrl}config.json`);
      } catch (e) {
        throw new ModelFetchError('config.json', `cannot reach ${modelUrl}: ${(e as Error).message}`);
      }
      if (!res.ok) throw new ModelFetchError('config.json', `HTTP ${res.status} from ${modelUrl}`, res.status);
      try {
        return (await res.json()) as unknown;
      } catch (e) {
        throw new ModelFormatError('config.json', `not valid JSON (${(e as Error).message})`);
      }
    },
    async open(spec) {
      const reader = await openSafetensors(fetchFn, spec.modelUrl);
      return { loader: readerWeightLoader(reader), fetchedBytes: 0, storedBytes: 0 };
    },
    tokenizer: (modelUrl, config) => ModelTokenizer.load(fetchFn, modelUrl, { extraEosTokenIds: config.eosTokenIds }),
  };
}

export function nodeAdapter(o: NodeAdapterOptions): NodeAdapter {
  const keys: KeyStore = o.keyFile ? new FileKeyStore(o.keyFile) : new MemoryKeyStore();
  const httpDirect: HttpDirect = createHttpDirect();
  const backends = nodeBackends({ choice: o.backend ?? 'cpu', ...(o.threads !== undefined ? { threads: o.threads } : {}), ...(o.testHooks ? { hooks: o.testHooks } : {}), ...(o.graphCapture ? { graphCapture: true } : {}), log: o.log });
  return {
    name: 'node',
    fetch: globalThis.fetch,
    WebSocket: NodeWebSocketConstructor,
    keys,
    // Checkpoint files: hub redirects and token (model/hub.ts), pinned hub files kept on disk (hub-cache.ts); other URLs untouched.
    weights: rangeWeights(cachingHubFetch(hubFetch(globalThis.fetch, { endpoint: o.hub.endpoint, ...(o.hub.token ? { token: o.hub.token } : {}) }), { endpoint: o.hub.endpoint, dir: o.hub.cacheDir })),
    backends,
    log: o.log,
    direct: httpDirect.send,
    watchHandshake: watchWsHandshake,
    // Frames straight to hops that accept links (Node.js nodes): no relay in between, cheaper than HTTP.
    ...(o.links ? { links: (identity) => new LinkPool({ identity, WebSocket: NodeWebSocketConstructor, onLog: (m) => o.log('warn', m) }) } : {}),
    ...(o.spanHooks ? { spanHooks: o.spanHooks } : {}),
    close: () => {
      httpDirect.close();
      backends.close();
    },
  };
}
