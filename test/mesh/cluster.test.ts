/**
 * A mesh whose nodes are split across two relays of a cluster (real
 * nats-server, relays, tracker, `meshnet node` processes; test/helpers/
 * cluster-mesh.ts): chats give the float64 reference's tokens with the
 * pushes crossing between relays on the fast path, and when a relay is
 * killed under a chat its nodes move to the other one and that chat, and
 * the next, end with the same tokens.
 */
import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { startCluster, tinyChatReference, type Cluster } from '../helpers/cluster-mesh.ts';
import { until, type NodeProc } from '../helpers/mesh.ts';

const MESSAGES = [{ role: 'user' as const, content: 'Tell me about the quick brown fox.' }];
const MAX_TOKENS = 24;

async function chatIds(client: OpenAI): Promise<number[]> {
  const r = await client.chat.completions.create({ model: 'tiny', messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0 });
  return (r.choices[0] as unknown as { token_ids: number[] }).token_ids;
}

/** A streamed chat's token ids; `onToken` sees the count so far after each chunk. */
async function streamIds(client: OpenAI, onToken: (n: number) => void): Promise<number[]> {
  const ids: number[] = [];
  const stream = await client.chat.completions.create({ model: 'tiny', messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0, stream: true });
  for await (const ch of stream) {
    ids.push(...((ch.choices[0] as unknown as { token_ids?: number[] } | undefined)?.token_ids ?? []));
    onToken(ids.length);
  }
  return ids;
}

async function clusterRequests(url: string, direction: 'in' | 'out'): Promise<number> {
  const text = await (await fetch(`${url.replace(/^ws/, 'http')}/metrics`)).text();
  const line = text.split('\n').find((l) => l.startsWith(`meshnet_relay_cluster_requests_total{direction="${direction}"}`));
  return line ? Number(line.slice(line.lastIndexOf(' ') + 1)) : 0;
}

async function peersOn(url: string): Promise<string[]> {
  const r = (await (await fetch(`${url.replace(/^ws/, 'http')}/peers`)).json()) as { peers: Array<{ peer_id: string }> };
  return r.peers.map((p) => p.peer_id);
}

describe('a mesh split across two relays of a cluster', () => {
  let st: StaticServer;
  let c: Cluster;
  let client: OpenAI;
  let middle: NodeProc;
  const want = tinyChatReference(MESSAGES, MAX_TOKENS);

  beforeAll(async () => {
    st = await startStaticServer({ root: await ensureModel('tiny') });
    c = await startCluster({ relays: 2, trackers: 1, model: { name: 'tiny', url: st.url }, trackerArgs: ['--heartbeat-interval-ms', '1000'] });
    // Relay paths only (no links; the route's hops go relay first): head and tail on relay 0, the middle on relay 1,
    // which it leaves for relay 0 when relay 1 dies.
    const common = ['--budget-mb', '64', '--no-links'];
    // c.nodes is in the order the nodes came up; keep our own handle on the middle one.
    [, middle] = await Promise.all([
      // The head drafts nothing: one trip per token, so the crossings below count tokens.
      c.addNode({ relay: 0, alsoRelays: [1], args: [...common, '--layers', '0-1', '--no-speculation'] }),
      c.addNode({ relay: 1, alsoRelays: [0], args: [...common, '--layers', '1-3'] }),
      // The tail is slowed (each /forward 40 ms) so that a chat is still running when a relay is killed under it.
      c.addNode({ relay: 0, alsoRelays: [1], args: [...common, '--layers', '3-4', '--inject-delay-ms', '40'] }),
    ]);
    await Promise.all(c.nodes.map((n) => n.waitFor((e) => e.event === 'registered')));
    await until(async () => (await fetch(`${c.baseUrl}/api/route?model=tiny`)).ok, 30_000, 'a complete route');
    client = new OpenAI({ baseURL: `${c.baseUrl}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
  }, 180_000);

  afterAll(async () => {
    await c?.stop();
    await st?.close();
  });

  it('chats give the float64 reference tokens, the chain crossing between the relays on the fast path', async () => {
    const before = await clusterRequests(c.relays[0]!.url, 'out');
    expect(await chatIds(client)).toEqual(want);
    // Head (relay 0) → middle (relay 1) and middle → tail (relay 0): every step crosses twice.
    expect((await clusterRequests(c.relays[0]!.url, 'out')) - before).toBeGreaterThanOrEqual(want.length);
    expect(await clusterRequests(c.relays[1]!.url, 'out')).toBeGreaterThanOrEqual(want.length);
  });

  it('a relay killed mid-chat: its node moves to the other relay under the same peer id, the chat goes on with the same tokens, and new chats too', async () => {
    expect(await peersOn(c.relays[1]!.url)).toContain(middle.peerId);
    expect(want.length).toBeGreaterThan(6);
    let killed: Promise<void> | undefined;
    let t0 = 0;
    const streamed = streamIds(client, (n) => {
      if (n >= 6 && killed === undefined) {
        t0 = Date.now();
        killed = c.killRelay(1);
      }
    });
    expect(await streamed).toEqual(want);
    expect(killed).toBeDefined();
    await killed;
    await until(async () => (await peersOn(c.relays[0]!.url)).includes(middle.peerId), 15_000, 'the middle node on relay 0');
    const moved = Date.now() - t0;
    expect(moved).toBeLessThan(5_000);
    const ids = await until(async () => {
      const got = await chatIds(client).catch(() => undefined);
      return got && got.length > 0 ? got : undefined;
    }, 30_000, 'a chat after the relay died');
    expect(ids).toEqual(want);
  });
});
