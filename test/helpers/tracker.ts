/** Test helpers: a tracker app without sockets, and signed fake nodes. */
import pino from 'pino';
import { Identity } from '../../src/net/identity.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import type { GenerateEvent, NodeInfo, NodeMessage, NodeStats, RegisterAnswer } from '../../src/protocol/tracker.ts';
import { parseModelConfig } from '../../src/model/config.ts';
import { createTracker, type Tracker } from '../../src/tracker/app.ts';
import type { HeadTransport } from '../../src/tracker/head-proxy.ts';
import { createTrackerMetrics } from '../../src/tracker/metrics.ts';
import { sizeModel, type ModelSpec } from '../../src/tracker/model-registry.ts';
import { resolveTrackerOptions, type TrackerOptions } from '../../src/tracker/options.ts';
import { signBody } from '../../src/tracker/signing.ts';

/** The `small` fixture's shape: 12 layers, hidden 512, f32 layer ≈ 11.5 MiB + 2 MiB KV reserve. */
export const SMALL_CONFIG = {
  architectures: ['LlamaForCausalLM'],
  vocab_size: 2048,
  hidden_size: 512,
  intermediate_size: 1536,
  num_hidden_layers: 12,
  num_attention_heads: 8,
  num_key_value_heads: 2,
  head_dim: 64,
  max_position_embeddings: 2048,
  rms_norm_eps: 1e-5,
  rope_theta: 10000,
  tie_word_embeddings: false,
  bos_token_id: 1,
  eos_token_id: 2,
};

export function smallSpec(name = 'small', o: Partial<TrackerOptions> = {}): ModelSpec {
  const r = resolveTrackerOptions(o);
  return sizeModel(name, `http://models.test/${name}`, parseModelConfig(SMALL_CONFIG), r);
}

export const MIB = 1024 * 1024;

/** Layer cost of the small spec, in MiB (weights + KV reserve). */
export function layerMib(spec: ModelSpec): number {
  return (spec.layerBytes[0]! + spec.kvBytesPerLayer) / MIB;
}

export interface TestTracker extends Tracker {
  clock: { now: number };
}

export async function makeTracker(o: Partial<TrackerOptions> = {}, transport?: HeadTransport, specs?: ModelSpec[]): Promise<TestTracker> {
  const clock = { now: 1_800_000_000_000 };
  const options = resolveTrackerOptions({ logLevel: 'silent', now: () => clock.now, ...o });
  const identity = await Identity.generate();
  const t = createTracker({
    options,
    models: specs ?? [smallSpec('small', options)],
    identity,
    transport: transport ?? { open: () => Promise.reject(new Error('no transport in this test')) },
    logger: pino({ level: 'silent' }),
    metrics: createTrackerMetrics(),
  });
  return Object.assign(t, { clock });
}

export const DEFAULT_INFO: NodeInfo = { model: 'small', backend: 'onnxruntime-node', memory_budget_mb: 64, host: 'node' };

export class FakeNode {
  serving: { start_layer: number; end_layer: number } | null = null;
  assignment: RegisterAnswer['assignment'] = null;
  stats: NodeStats | undefined;
  endpoint: string | undefined;
  relayAddr: string | undefined;

  private constructor(
    readonly identity: Identity,
    public info: NodeInfo,
  ) {}

  static async create(info: Partial<NodeInfo> = {}): Promise<FakeNode> {
    return new FakeNode(await Identity.generate(), { ...DEFAULT_INFO, ...info });
  }

  get peerId(): string {
    return this.identity.peerId;
  }

  message(now: number, over: Partial<NodeMessage> = {}): NodeMessage {
    return {
      peer_id: this.peerId,
      public_key: encodeBase64Url(this.identity.publicKey),
      info: this.info,
      timestamp: now,
      ...(this.stats ? { stats: this.stats } : {}),
      ...(this.endpoint ? { endpoint: this.endpoint } : {}),
      ...(this.relayAddr ? { relay_addr: this.relayAddr } : {}),
      serving: this.serving,
      ...over,
    };
  }

  async post(t: { app: Tracker['app'] }, path: string, now: number, over: Partial<NodeMessage> = {}): Promise<Response> {
    const signed = await signBody(this.identity, this.message(now, over));
    return t.app.request(path, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(signed) });
  }

  /** Register (or heartbeat); records the assignment. With `load`, it then "loads" it: serving = assignment. */
  async register(t: TestTracker, opts: { load?: boolean } = {}): Promise<RegisterAnswer> {
    return this.call(t, '/api/nodes/register', opts);
  }

  async heartbeat(t: TestTracker, opts: { load?: boolean } = {}): Promise<RegisterAnswer> {
    return this.call(t, '/api/nodes/heartbeat', opts);
  }

  private async call(t: TestTracker, path: string, opts: { load?: boolean }): Promise<RegisterAnswer> {
    const res = await this.post(t, path, t.clock.now);
    const body = (await res.json()) as RegisterAnswer;
    if (res.status !== 200) throw Object.assign(new Error(`${path} → ${res.status}: ${JSON.stringify(body)}`), { status: res.status, body });
    this.assignment = body.assignment;
    if (opts.load) this.serving = body.assignment && { start_layer: body.assignment.start_layer, end_layer: body.assignment.end_layer };
    return body;
  }

  /** Register, load the assignment, heartbeat so the tracker sees it serving. */
  async join(t: TestTracker): Promise<RegisterAnswer> {
    await this.register(t, { load: true });
    return this.heartbeat(t, { load: true });
  }

  /** Report serving a span directly (e.g. a Node.js node started with --layers). */
  withStats(layerMs: number, queueDepth = 0): this {
    this.stats = { rpm: 0, layer_ms: layerMs, queue_depth: queueDepth, kv_free_bytes: 1e9, tokens_served: 0 };
    return this;
  }

  /** KV figures as a node's heartbeat reports them (bytes; room in blocks of `block` positions). */
  withKv(kv: { budget: number; used?: number; perToken: number; block?: number; maxTokens?: number }): this {
    const used = kv.used ?? 0;
    this.stats = {
      ...(this.stats ?? { rpm: 0, layer_ms: 1, queue_depth: 0, tokens_served: 0 }),
      kv_free_bytes: Math.max(0, kv.budget - used),
      kv_budget_bytes: kv.budget,
      kv_used_bytes: used,
      kv_sessions: used > 0 ? 1 : 0,
      kv_bytes_per_token: kv.perToken,
      kv_block_tokens: kv.block ?? 64,
      kv_max_tokens: kv.maxTokens ?? 2048,
    };
    return this;
  }
}

/** A HeadTransport that answers from a script per head: each call takes the next script for that head. */
export function scriptedTransport(scripts: Record<string, Array<(req: { headers: Record<string, string>; body: unknown }) => AsyncIterable<GenerateEvent | 'break'> | Iterable<GenerateEvent | 'break'>>>) {
  const calls: Array<{ head: string; headers: Record<string, string>; body: Record<string, unknown> }> = [];
  const transport: HeadTransport = {
    async open(head, headers, body) {
      const parsed = JSON.parse(new TextDecoder().decode(body)) as Record<string, unknown>;
      calls.push({ head: head.peerId, headers, body: parsed });
      const list = scripts[head.peerId];
      const script = list?.shift();
      if (!script) throw Object.assign(new Error('no script'), {});
      const events = script({ headers, body: parsed });
      return (async function* () {
        for await (const ev of events as AsyncIterable<GenerateEvent | 'break'>) {
          if (ev === 'break') throw new Error('connection reset');
          yield new TextEncoder().encode(JSON.stringify(ev) + '\n');
        }
      })();
    },
  };
  return { transport, calls };
}

export function tokenEvents(texts: string[], from = 0): GenerateEvent[] {
  return texts.map((text, i) => ({ type: 'token', index: from + i, token_id: 100 + from + i, text, logprob: -0.1 }));
}
