/**
 * A node given several relays (`--relay a,b`): when the relay it is
 * registered at dies, the dialer registers at the next one under the same
 * peer id, and a relay of a cluster teaches a node given one URL the others.
 * Real relay processes and a real nats-server; the node's own RelayClient.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Identity } from '../../src/net/identity.ts';
import { RelayClient, relayWsUrls, type RelayStateEvent } from '../../src/net/relay-client.ts';
import type { MeshResponse } from '../../src/protocol/index.ts';
import { startNats, type NatsServer } from '../helpers/cluster.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { NodeWebSocket } from '../helpers/ws-host.ts';

const clients: RelayClient[] = [];
const relays: RelayProcess[] = [];
let nats: NatsServer;
beforeAll(async () => {
  nats = await startNats({ jetstream: false });
});
afterAll(async () => {
  for (const c of clients) c.close();
  await Promise.all(relays.map((r) => r.stop()));
  await nats?.stop();
});

async function client(relayUrl: string | string[], identity?: Identity, handler?: (body: Uint8Array) => MeshResponse): Promise<RelayClient> {
  const c = new RelayClient({ relayUrl, WebSocket: NodeWebSocket, identity: identity ?? (await Identity.generate()), handler: async (req) => handler?.(req.body) ?? { status: 200, headers: {}, body: req.body } });
  clients.push(c);
  c.start();
  await c.ready(10_000);
  return c;
}

describe('relay URLs', () => {
  it('accepts a list or a comma-separated string, maps http to ws, adds /ws, drops duplicates', () => {
    expect(relayWsUrls('ws://a:1, http://b:2/ ,ws://a:1')).toEqual(['ws://a:1/ws', 'ws://b:2/ws']);
    expect(relayWsUrls(['ws://a:1', 'wss://c:3/ws'])).toEqual(['ws://a:1/ws', 'wss://c:3/ws']);
    expect(() => relayWsUrls(' , ')).toThrow(/no relay URL/);
    expect(() => relayWsUrls('ftp://x')).toThrow(/ws\(s\):\/\/ or http\(s\):\/\//);
  });
});

describe('failing over between relays', () => {
  it('registers at the next relay of its list when its relay dies: same peer id, requests flow again within a second or two', async () => {
    const [a, b] = await Promise.all([startRelayProcess(['--nats', nats.url, '--cluster', 'fo1']), startRelayProcess(['--nats', nats.url, '--cluster', 'fo1'])]);
    relays.push(a, b);
    const id = await Identity.generate();
    const node = await client([a.url, b.url], id, (body) => ({ status: 200, headers: { 'x-who': 'node' }, body }));
    expect(node.relayUrl).toBe(a.url);
    const states: RelayStateEvent[] = [];
    node.on('state', (e) => states.push(e));
    // A caller on relay b, the one that survives: it reaches the node on a, then on b.
    const caller = await client(b.url);
    expect((await caller.request(id.peerId, { method: 'POST', path: '/x', body: new Uint8Array([1]) })).status).toBe(200);
    const moved = new Promise<number>((resolve) => node.on('state', (e) => e.state === 'registered' && resolve(performance.now())));
    const t0 = performance.now();
    await a.stop('SIGKILL');
    const movedMs = (await moved) - t0;
    const reg = await node.ready();
    expect(reg.peerId).toBe(id.peerId);
    expect(node.relayUrl).toBe(b.url);
    expect(reg.relayAddr).toBe(`${b.url}/rpc/${id.peerId}`);
    expect(movedMs).toBeLessThan(3_000);
    expect(states.some((e) => e.state === 'disconnected')).toBe(true);
    const r = await caller.request(id.peerId, { method: 'POST', path: '/x', body: new Uint8Array([2]) });
    expect(r.status).toBe(200);
    expect(r.headers['x-who']).toBe('node');
  });

  it('a node given one relay of a cluster learns the others at registration and fails over to them', async () => {
    const [a, b] = await Promise.all([startRelayProcess(['--nats', nats.url, '--cluster', 'fo2']), startRelayProcess(['--nats', nats.url, '--cluster', 'fo2'])]);
    relays.push(a, b);
    // The relays hear of each other by hello (every 2 s): a node that registers after that is told both.
    await new Promise((r) => setTimeout(r, 2_500));
    const node = await client(a.url);
    expect(node.cluster).toBe(true);
    await a.stop('SIGKILL');
    await new Promise<void>((resolve) => node.on('state', (e) => e.state === 'registered' && resolve()));
    expect(node.relayUrl).toBe(b.url);
  });

  it('with one relay and no cluster, it reconnects to that same relay as before', async () => {
    const a = await startRelayProcess();
    relays.push(a);
    const node = await client(a.url);
    expect(node.cluster).toBe(false);
    expect(node.relayUrl).toBe(a.url);
  });
});
