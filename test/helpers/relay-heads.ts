/**
 * In-test heads over a real relay: relay peers that speak the /generate
 * NDJSON contract, check the tracker's route signature and register with the
 * tracker as nodes (reachable through the relay only).
 */
import OpenAI from 'openai';
import { expect } from 'vitest';
import { WebSocket } from 'ws';
import { Identity } from '../../src/net/identity.ts';
import type { MeshHandler } from '../../src/net/contract.ts';
import { RelayClient } from '../../src/net/relay-client.ts';
import type { WebSocketConstructor } from '../../src/net/socket.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import { generateRequestSchema, type GenerateEvent, type GenerateRequest, type NodeMessage } from '../../src/protocol/tracker.ts';
import { startRelay, type Relay } from '../../src/relay/server.ts';
import type { TrackerOptions } from '../../src/tracker/options.ts';
import { startTracker, type RunningTracker } from '../../src/tracker/server.ts';
import { signBody, verifyRoute } from '../../src/tracker/signing.ts';
import { smallSpec } from './tracker.ts';

const utf8 = new TextEncoder();

export type Cleanups = Array<() => Promise<void> | void>;

export interface HeadBehaviour {
  /** Tokens to emit after the prefix (text per token). */
  words: string[];
  /** Drop the relay connection after emitting this many tokens. */
  dieAfter?: number;
  delayMs?: number;
  /** The span it registers as serving. @defaultValue [0, 12] */
  span?: [number, number];
}

export interface TestHead {
  peerId: string;
  identity: Identity;
  client: RelayClient;
  requests: GenerateRequest[];
  routeErrors: string[];
  cancelled: number;
}

export const WORDS = ['The', ' quick', ' brown', ' fox', ' jumps', ' over', ' the', ' lazy', ' dog', '.'];

/** Register `identity` with the tracker as a node serving `span` of `small`. */
export async function registerNode(tracker: RunningTracker, identity: Identity, span: [number, number], layerMs: number, relayAddr?: string): Promise<void> {
  const msg: NodeMessage = {
    peer_id: identity.peerId,
    public_key: encodeBase64Url(identity.publicKey),
    ...(relayAddr ? { relay_addr: relayAddr } : {}),
    info: { model: 'small', backend: 'cpu', memory_budget_mb: 4096, host: 'node' },
    stats: { rpm: 0, layer_ms: layerMs, queue_depth: 0, kv_free_bytes: 1e9, tokens_served: 0 },
    serving: { start_layer: span[0], end_layer: span[1] },
    timestamp: Date.now(),
  };
  const res = await fetch(`${tracker.url}/api/nodes/register`, { method: 'POST', body: JSON.stringify(await signBody(identity, msg)) });
  expect(res.status).toBe(200);
}

export async function startHead(cleanups: Cleanups, relay: Relay, tracker: RunningTracker, behaviour: HeadBehaviour, layerMs = 1): Promise<TestHead> {
  const identity = await Identity.generate();
  const head: TestHead = { peerId: identity.peerId, identity, client: undefined as unknown as RelayClient, requests: [], routeErrors: [], cancelled: 0 };
  const handler: MeshHandler = async (req) => {
    if (req.path !== '/generate') return { status: 404, headers: { 'content-type': 'application/json' }, body: utf8.encode('{"error":{"code":"MESH_ERR_NOT_FOUND","message":"no"}}') };
    const reason = await verifyRoute(tracker.publicKey, identity.peerId, { header: req.headers['x-meshnet-route'] ?? '', expiresAt: Number(req.headers['x-meshnet-route-expires']), signature: req.headers['x-meshnet-route-signature'] ?? '' });
    if (reason) {
      head.routeErrors.push(reason);
      return { status: 403, headers: { 'content-type': 'application/json' }, body: utf8.encode(JSON.stringify({ error: { code: 'MESH_ERR_FORBIDDEN', message: reason } })) };
    }
    const body = generateRequestSchema.parse(JSON.parse(new TextDecoder().decode(req.body)));
    head.requests.push(body);
    const signal = req.signal;
    signal?.addEventListener('abort', () => head.cancelled++, { once: true });
    async function* events(): AsyncGenerator<Uint8Array> {
      const line = (e: GenerateEvent) => utf8.encode(JSON.stringify(e) + '\n');
      yield line({ type: 'start', prompt_tokens: 4, route: [] });
      let emitted = 0;
      for (let i = body.prefix_token_ids.length; i < Math.min(behaviour.words.length, body.max_tokens); i++) {
        if (signal?.aborted) return;
        await new Promise((r) => setTimeout(r, behaviour.delayMs ?? 5));
        if (behaviour.dieAfter !== undefined && emitted >= behaviour.dieAfter) {
          head.client.close(); // the head's process "dies": the relay answers the tracker 502
          await new Promise((r) => setTimeout(r, 1000));
          return;
        }
        yield line({ type: 'token', index: i, token_id: 1000 + i, text: behaviour.words[i]!, logprob: -0.5 });
        emitted++;
      }
      yield line({ type: 'done', finish_reason: body.max_tokens <= behaviour.words.length ? 'length' : 'stop', completion_tokens: emitted, prompt_tokens: 4 });
    }
    return { status: 200, headers: { 'content-type': 'application/x-ndjson' }, body: events() };
  };
  const client = new RelayClient({ relayUrl: relay.url, WebSocket: WebSocket as unknown as WebSocketConstructor, identity, handler, info: { role: 'test-head' } });
  head.client = client;
  client.start();
  const reg = await client.ready(5000);
  cleanups.push(() => client.close());
  await registerNode(tracker, identity, behaviour.span ?? [0, 12], layerMs, reg.relayAddr);
  return head;
}

/** A relay, a tracker registered with it (serving `small`), and an OpenAI client on the tracker. */
export async function startMesh(cleanups: Cleanups, o: Partial<TrackerOptions> = {}) {
  const relay = await startRelay({ port: 0, logLevel: 'warn' });
  cleanups.push(() => relay.close());
  const tracker = await startTracker({ port: 0, relayUrl: relay.url, logLevel: 'silent', generateIdleTimeoutMs: 5000, ...o }, { modelSpecs: [smallSpec()] });
  cleanups.push(() => tracker.close());
  const openai = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0 });
  return { relay, tracker, openai };
}
