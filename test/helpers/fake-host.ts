/**
 * An in-memory host for the node runtime: the `tiny` fixture's files as the
 * weight store (gated, so a test can hold a load mid-way), onnxruntime-node
 * as the backend (real graphs, cheap), a memory key store, and a scripted
 * tracker behind `fetch`. No socket anywhere: no relay, no links.
 */
import { MemoryKeyStore } from '../../src/net/identity.ts';
import { Identity } from '../../src/net/identity.ts';
import type { LogLevel, RuntimeHost, SpanSpec } from '../../src/node/runtime/host.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import type { Assignment, NodeMessage } from '../../src/protocol/tracker.ts';
import { fixture, nodeBackend } from './shard.ts';

export const MODEL_URL = 'http://models.test/tiny/';
const utf8d = new TextDecoder();

export interface FakeHost extends RuntimeHost {
  /** Spans whose weights were opened, in order. */
  opened: SpanSpec[];
  /** Held loads: open() of a span in here waits until release(span) is called. */
  hold(startLayer: number, endLayer: number): void;
  release(startLayer: number, endLayer: number): void;
  /** open() of this span throws. */
  failing: Set<string>;
  logs: Array<{ level: LogLevel; message: string }>;
}

export function fakeHost(fetchFn?: typeof fetch): FakeHost {
  const f = fixture('tiny');
  const file = (name: string): unknown => JSON.parse(utf8d.decode(f.files.get(name)!));
  const held = new Map<string, { wait: Promise<void>; go: () => void }>();
  const key = (a: number, b: number) => `${a}-${b}`;
  const host: FakeHost = {
    name: 'node',
    fetch: fetchFn ?? (() => Promise.reject(new Error('no network in this host'))),
    WebSocket: class {
      constructor() {
        throw new Error('no sockets in this host');
      }
    } as unknown as RuntimeHost['WebSocket'],
    keys: new MemoryKeyStore(),
    opened: [],
    failing: new Set(),
    logs: [],
    weights: {
      config: async () => file('config.json'),
      async open(spec) {
        host.opened.push(spec);
        await held.get(key(spec.startLayer, spec.endLayer))?.wait;
        if (host.failing.has(key(spec.startLayer, spec.endLayer))) throw Object.assign(new Error(`the model host is down (layers ${spec.startLayer}-${spec.endLayer})`), { code: 'MESH_ERR_MODEL_FETCH' });
        return { loader: () => f.weights, fetchedBytes: 0, storedBytes: 0 };
      },
      tokenizer: async (_url, cfg) => ModelTokenizer.fromJson(file('tokenizer.json'), file('tokenizer_config.json'), { extraEosTokenIds: cfg.eosTokenIds }),
    },
    backends: { choose: async () => ({ backend: nodeBackend, info: { name: nodeBackend.name, kind: 'onnxruntime-node', dtype: 'f32' } }) },
    log: (level, message) => host.logs.push({ level, message }),
    hold(a, b) {
      let go!: () => void;
      const wait = new Promise<void>((r) => (go = r));
      held.set(key(a, b), { wait, go });
    },
    release(a, b) {
      held.get(key(a, b))?.go();
      held.delete(key(a, b));
    },
  };
  return host;
}

/** A tracker that answers registrations and heartbeats from a script of assignments (the last one repeats). */
export interface ScriptedTracker {
  fetch: typeof fetch;
  /** The next answers' assignment. */
  assign(a: Assignment | null): void;
  /** Every node message received, in order. */
  messages: Array<{ path: string; body: NodeMessage }>;
  publicKey: Uint8Array;
}

export async function scriptedTracker(intervalMs = 30): Promise<ScriptedTracker> {
  const id = await Identity.generate();
  let current: Assignment | null = null;
  const messages: ScriptedTracker['messages'] = [];
  const t: ScriptedTracker = {
    publicKey: id.publicKey,
    messages,
    assign(a) {
      current = a;
    },
    fetch: (async (input: RequestInfo | URL, init?: RequestInit) => {
      const url = new URL(String(input));
      if (url.pathname === '/api/tracker') return Response.json({ models: ['tiny'] });
      const signed = JSON.parse(String(init?.body)) as { body: NodeMessage };
      messages.push({ path: url.pathname, body: signed.body });
      return Response.json({ assignment: current, heartbeat_interval_ms: intervalMs, tracker_public_key: encodeBase64Url(id.publicKey) });
    }) as typeof fetch,
  };
  return t;
}

export function assignment(start: number, end: number): Assignment {
  return { model: 'tiny', start_layer: start, end_layer: end, model_url: MODEL_URL };
}
