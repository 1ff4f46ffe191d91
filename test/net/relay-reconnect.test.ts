/**
 * Against a real `meshnet relay` process: when the relay dies, pending
 * requests reject at once, and when it comes back on the same address both
 * peers re-register under their old ids (within 5 s) and traffic resumes.
 */
import { createServer } from 'node:net';
import { afterAll, describe, expect, it } from 'vitest';
import { Identity } from '../../src/net/identity.ts';
import { RelayClient, type RelayStateEvent } from '../../src/net/relay-client.ts';
import type { MeshResponse } from '../../src/protocol/index.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { NodeWebSocket } from '../helpers/ws-host.ts';

const utf8d = new TextDecoder();

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => resolve(port));
    });
  });
}

let relay: RelayProcess | undefined;
const clients: RelayClient[] = [];
afterAll(async () => {
  for (const c of clients) c.close();
  await relay?.stop('SIGKILL');
});

describe('relay restart', () => {
  it('rejects pending requests when the relay dies, then re-registers the same peer ids within 5 s of its return', async () => {
    const port = await freePort();
    relay = await startRelayProcess(['--port', String(port)]);
    expect(relay.port).toBe(port);
    let hang = true;
    const server = new RelayClient({
      relayUrl: relay.url,
      WebSocket: NodeWebSocket,
      identity: await Identity.generate(),
      minBackoffMs: 50,
      maxBackoffMs: 500,
      handler: async (req): Promise<MeshResponse> => (hang ? new Promise<MeshResponse>(() => {}) : { status: 200, headers: {}, body: req.body }),
    });
    const caller = new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity: await Identity.generate(), minBackoffMs: 50, maxBackoffMs: 500 });
    clients.push(server, caller);
    const states: RelayStateEvent[] = [];
    server.on('state', (e) => states.push(e));
    server.start();
    caller.start();
    const first = await server.ready(10_000);
    await caller.ready(10_000);
    expect(first.peerId).toBe(server.peerId);

    const pending = Array.from({ length: 10 }, () => caller.request(server.peerId, { method: 'POST', path: '/hang' }, { timeoutMs: 30_000 }));
    await until(() => server.pendingIncoming === 10);
    const allSettled = Promise.allSettled(pending);
    const killedAt = Date.now();
    await relay.stop('SIGKILL');
    const settled = await allSettled;
    expect(Date.now() - killedAt).toBeLessThan(2000);
    for (const r of settled) expect((r as PromiseRejectedResult).reason).toMatchObject({ name: 'MeshError', code: 'MESH_ERR_PEER_GONE' });
    await until(() => server.pendingIncoming === 0);

    relay = await startRelayProcess(['--port', String(port)]);
    const back = Date.now();
    const [again] = await Promise.all([server.ready(5000), caller.ready(5000)]);
    expect(Date.now() - back).toBeLessThan(5000);
    expect(again.peerId).toBe(first.peerId);
    expect(states.map((s) => s.state)).toContain('disconnected');
    expect(states.at(-1)!.state).toBe('registered');

    hang = false;
    const reply = await caller.request(server.peerId, { method: 'POST', path: '/echo', body: new TextEncoder().encode('again') });
    expect(utf8d.decode(reply.body)).toBe('again');
  });
});

async function until(cond: () => boolean, timeoutMs = 5000): Promise<void> {
  const t0 = Date.now();
  while (!cond()) {
    if (Date.now() - t0 > timeoutMs) throw new Error('condition not met in time');
    await new Promise((r) => setTimeout(r, 5));
  }
}
