/**
 * The tracker process's OpenAI API over heads it reaches by direct HTTP
 * (Node.js nodes with an endpoint; head-transport.ts), with in-test heads
 * on node:http that check the route signature: a streamed chat, a head
 * that stalls mid-stream (cut after the idle timeout, the chat goes on on
 * another head with the tokens so far), and a client that goes away (the
 * head's /generate connection closes, so the head cancels).
 */
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { Identity } from '../../src/net/identity.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import { generateRequestSchema, type GenerateEvent, type GenerateRequest, type NodeMessage } from '../../src/protocol/tracker.ts';
import { startTracker, type RunningTracker } from '../../src/tracker/server.ts';
import { signBody, verifyRoute } from '../../src/tracker/signing.ts';
import { smallSpec } from '../helpers/tracker.ts';

const WORDS = ['The', ' quick', ' brown', ' fox', ' jumps', ' over', ' the', ' lazy', ' dog', '.'];
const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

interface HttpHead {
  peerId: string;
  requests: GenerateRequest[];
  /** /generate answers whose connection closed before they ended. */
  closedEarly: number;
  routeErrors: string[];
}

const cleanups: Array<() => Promise<void> | void> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

async function until(cond: () => boolean, ms = 5000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!cond() && Date.now() < deadline) await sleep(20);
}

/** A head on node:http serving [0, 12): WORDS after the prefix, one line per token every `gapMs`; silent for good after `stallAfter` tokens. */
async function startHttpHead(tracker: RunningTracker, o: { layerMs: number; gapMs?: number; stallAfter?: number }): Promise<HttpHead> {
  const identity = await Identity.generate();
  const head: HttpHead = { peerId: identity.peerId, requests: [], closedEarly: 0, routeErrors: [] };
  const server: Server = createServer((req, res) => {
    if (req.method !== 'POST' || req.url !== '/generate') {
      // This head serves /generate only.
      res.writeHead(404, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ error: { code: 'MESH_ERR_NOT_FOUND', message: 'no' } }));
      return;
    }
    let raw = '';
    req.on('data', (c: Buffer) => (raw += c.toString()));
    req.on('end', () => {
      void (async () => {
        const reason = await verifyRoute(tracker.publicKey, identity.peerId, { header: String(req.headers['x-meshnet-route'] ?? ''), expiresAt: Number(req.headers['x-meshnet-route-expires']), signature: String(req.headers['x-meshnet-route-signature'] ?? '') });
        if (reason) {
          head.routeErrors.push(reason);
          res.writeHead(403, { 'content-type': 'application/json' });
          res.end(JSON.stringify({ error: { code: 'MESH_ERR_FORBIDDEN', message: reason } }));
          return;
        }
        const body = generateRequestSchema.parse(JSON.parse(raw));
        head.requests.push(body);
        let closed = false;
        res.on('close', () => {
          closed = true;
          if (!res.writableFinished) head.closedEarly++;
        });
        const line = (e: GenerateEvent) => res.write(JSON.stringify(e) + '\n');
        res.writeHead(200, { 'content-type': 'application/x-ndjson' });
        line({ type: 'start', prompt_tokens: 4, route: [] });
        let emitted = 0;
        for (let i = body.prefix_token_ids.length; i < Math.min(WORDS.length, body.max_tokens); i++) {
          await sleep(o.gapMs ?? 5);
          if (closed) return;
          if (o.stallAfter !== undefined && emitted >= o.stallAfter) return; // alive, connected, and silent
          line({ type: 'token', index: i, token_id: 1000 + i, text: WORDS[i]!, logprob: -0.5 });
          emitted++;
        }
        res.end(JSON.stringify({ type: 'done', finish_reason: 'stop', completion_tokens: emitted, prompt_tokens: 4 } satisfies GenerateEvent) + '\n');
      })();
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  cleanups.push(
    () =>
      new Promise<void>((r) => {
        server.closeAllConnections();
        server.close(() => r());
      }),
  );
  const msg: NodeMessage = {
    peer_id: identity.peerId,
    public_key: encodeBase64Url(identity.publicKey),
    endpoint: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    info: { model: 'small', backend: 'cpu', memory_budget_mb: 4096, host: 'node' },
    stats: { rpm: 0, layer_ms: o.layerMs, queue_depth: 0, kv_free_bytes: 1e9, tokens_served: 0 },
    serving: { start_layer: 0, end_layer: 12 },
    timestamp: Date.now(),
  };
  const res = await fetch(`${tracker.url}/api/nodes/register`, { method: 'POST', body: JSON.stringify(await signBody(identity, msg)) });
  expect(res.status).toBe(200);
  return head;
}

async function startHttpTracker(idleMs: number): Promise<RunningTracker> {
  const tracker = await startTracker({ port: 0, logLevel: 'silent', generateIdleTimeoutMs: idleMs }, { modelSpecs: [smallSpec()] });
  cleanups.push(() => tracker.close());
  return tracker;
}

const chatBody = (max = 50) => JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'go' }], stream: true, max_tokens: max });

/** The content deltas of an SSE body, and whether it ended with [DONE]. */
async function sseText(res: Response): Promise<{ text: string; done: boolean; errors: unknown[] }> {
  const raw = await res.text();
  let text = '';
  let done = false;
  const errors: unknown[] = [];
  for (const block of raw.split('\n\n')) {
    if (!block.startsWith('data: ')) continue;
    const data = block.slice(6);
    if (data === '[DONE]') done = true;
    else {
      const o = JSON.parse(data) as { choices?: Array<{ delta?: { content?: string } }>; error?: unknown };
      if (o.error) errors.push(o.error);
      text += o.choices?.[0]?.delta?.content ?? '';
    }
  }
  return { text, done, errors };
}

describe('chats through heads reached by direct HTTP', () => {
  it('streams a chat, and a head that stalls mid-stream is cut after the idle timeout: the chat goes on on another head with the tokens so far', async () => {
    const tracker = await startHttpTracker(400);
    // The fast head is picked first and goes silent after 3 tokens; the slow one finishes.
    const stalling = await startHttpHead(tracker, { layerMs: 1, stallAfter: 3 });
    const backup = await startHttpHead(tracker, { layerMs: 50 });
    const res = await fetch(`${tracker.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: chatBody() });
    expect(res.status).toBe(200);
    const { text, done, errors } = await sseText(res);
    expect(errors).toEqual([]);
    expect(done).toBe(true);
    expect(text).toBe(WORDS.join(''));
    expect(stalling.requests.length).toBe(1);
    expect(backup.requests.length).toBe(1);
    expect(backup.requests[0]!.prefix_token_ids).toEqual([1000, 1001, 1002]);
    expect([...stalling.routeErrors, ...backup.routeErrors]).toEqual([]);
    // The tracker hung up on the silent head: it would cancel the generation.
    await until(() => stalling.closedEarly === 1);
    expect(stalling.closedEarly).toBe(1);
    expect(backup.closedEarly).toBe(0);
    const metrics = await (await fetch(`${tracker.url}/metrics`)).text();
    expect(metrics).toMatch(/meshnet_tracker_head_failovers_total 1/);
  });

  it('closes the head\'s /generate connection when the client goes away mid-stream, and the head is not asked again', async () => {
    const tracker = await startHttpTracker(5000);
    const head = await startHttpHead(tracker, { layerMs: 1, gapMs: 100 });
    const ctl = new AbortController();
    const res = await fetch(`${tracker.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: chatBody(), signal: ctl.signal });
    expect(res.status).toBe(200);
    const reader = res.body!.getReader();
    let seen = '';
    while (!seen.includes('"content":"The"')) seen += new TextDecoder().decode((await reader.read()).value);
    ctl.abort();
    await reader.cancel().catch(() => {});
    await until(() => head.closedEarly === 1);
    expect(head.closedEarly).toBe(1);
    expect(head.requests.length).toBe(1);
    // Nothing is left running: the tracker's lease on the route is given back.
    await until(() => tracker.admission.running === 0);
    const dash = (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { queue: { running: number }; nodes: Array<{ in_flight: number }> };
    expect(dash.queue.running).toBe(0);
    expect(dash.nodes.map((n) => n.in_flight)).toEqual([0]);
  });
});
