/**
 * Relays in a cluster, from outside: a real nats-server, real `meshnet relay
 * --nats` processes, raw WebSocket peers (test/helpers/raw-peer.ts, not the
 * node's client). A peer of relay A reaches a peer of relay B on the fast
 * path (two-way and one-way) and on /rpc, over a trunk and over NATS alone;
 * one key has one registration in the cluster; what is malformed is counted
 * and dropped; a relay or NATS that goes away costs what it must and no more.
 */
import { connect } from '@nats-io/transport-node';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { FLAG_END, FLAG_ONE_WAY, encodeRequestFrame, hexToBytes } from '../../src/protocol/index.ts';
import { startNats, type NatsServer } from '../helpers/cluster.ts';
import { makeKeys, RawPeer, RpcSocket } from '../helpers/raw-peer.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { spawnMeshnet } from '../helpers/mesh.ts';

let nats: NatsServer;
beforeAll(async () => {
  nats = await startNats();
});
afterAll(async () => {
  await nats?.stop();
});

async function health(r: RelayProcess): Promise<{ peers: number; cluster?: { relay_id: string; nats: string; relays: number; trunks: number; path: string } }> {
  return (await (await fetch(`${r.httpUrl}/healthz`)).json()) as never;
}

async function metric(r: RelayProcess, name: string): Promise<number> {
  const text = await (await fetch(`${r.httpUrl}/metrics`)).text();
  let sum = 0;
  for (const line of text.split('\n')) if (line.startsWith(name)) sum += Number(line.slice(line.lastIndexOf(' ') + 1));
  return sum;
}

async function until<T>(check: () => Promise<T | undefined | false> | T | undefined | false, ms = 10_000, what = 'condition'): Promise<T> {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await Promise.resolve(check()).catch(() => undefined);
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

const echo = (tag: string) => (r: { headers: Record<string, string>; body: Uint8Array; from: string; path: string }) => ({ status: 200, headers: { 'x-tag': tag, 'x-from': r.from, 'x-path': r.path }, body: r.body });

describe.each(['link', 'nats'] as const)('two relays, frames crossing by %s', (path) => {
  let a: RelayProcess;
  let b: RelayProcess;
  beforeAll(async () => {
    [a, b] = await Promise.all([startRelayProcess(['--nats', nats.url, '--cluster-path', path, '--request-timeout-ms', '3000']), startRelayProcess(['--nats', nats.url, '--cluster-path', path, '--request-timeout-ms', '3000'])]);
  });
  afterAll(async () => {
    await Promise.all([a?.stop(), b?.stop()]);
  });

  it('announces the cluster at registration and on /healthz', async () => {
    const p = await RawPeer.connect(a.url);
    await until(async () => (await health(a)).cluster?.relays === 1, 10_000, 'relays to hear of each other');
    const h = await health(a);
    expect(h.cluster).toMatchObject({ nats: 'connected', relays: 1, path });
    await p.close();
  });

  it('a peer of relay A calls a peer of relay B on the fast path: same bytes back, the caller\'s id stamped, many in flight', async () => {
    const target = await RawPeer.connect(b.url, echo('b'));
    const caller = await RawPeer.connect(a.url);
    const bodies = Array.from({ length: 40 }, (_, i) => new Uint8Array(1000 + i * 997).map((_, j) => (i * 31 + j) & 0xff));
    const replies = await Promise.all(bodies.map((body) => caller.request(target.peerId, { body, headers: { 'x-meshnet-shape': '1,1,4' } })));
    for (const [i, r] of replies.entries()) {
      expect(r.status).toBe(200);
      expect(r.headers['x-tag']).toBe('b');
      expect(r.headers['x-from']).toBe(caller.peerId);
      expect(Buffer.from(r.body).equals(Buffer.from(bodies[i]!))).toBe(true);
    }
    // And back the other way: B's peer calls A's.
    const back = await target.request(caller.peerId, { body: new Uint8Array([1, 2, 3]) });
    expect(back.status).toBe(200);
    expect(Array.from(back.body)).toEqual([1, 2, 3]);
    if (path === 'link') await until(async () => (await health(a)).cluster!.trunks >= 1, 10_000, 'a trunk');
    else expect((await health(a)).cluster!.trunks).toBe(0);
    expect(await metric(a, 'meshnet_relay_cluster_requests_total{direction="out"}')).toBeGreaterThanOrEqual(40);
    expect(await metric(b, 'meshnet_relay_cluster_requests_total{direction="in"}')).toBeGreaterThanOrEqual(40);
    await Promise.all([target.close(), caller.close()]);
  });

  it(path === 'link' ? 'a body over NATS\'s max_payload (2 MiB) crosses in the trunk' : 'a body over NATS\'s max_payload (2 MiB) is refused 413 at once, naming the limit', async () => {
    const target = await RawPeer.connect(b.url, echo('b'));
    const caller = await RawPeer.connect(a.url);
    const body = new Uint8Array(2 * 1024 * 1024).map((_, i) => i & 0xff);
    if (path === 'link') await until(async () => (await health(a)).cluster!.trunks >= 1, 10_000, 'a trunk');
    const r = await caller.request(target.peerId, { body });
    if (path === 'link') {
      expect(r.status).toBe(200);
      expect(Buffer.from(r.body).equals(Buffer.from(body))).toBe(true);
    } else {
      expect(r.status).toBe(413);
      expect(JSON.parse(Buffer.from(r.body).toString())).toMatchObject({ error: { code: 'MESH_ERR_TOO_LARGE', message: expect.stringMatching(/max_payload/) } });
    }
    await Promise.all([target.close(), caller.close()]);
  });

  it('an unknown peer is a 404 at once, naming the cluster', async () => {
    const caller = await RawPeer.connect(a.url);
    const t0 = performance.now();
    const r = await caller.request(makeKeys().peerId, { body: new Uint8Array(4) });
    expect(performance.now() - t0).toBeLessThan(1_500);
    expect(r.status).toBe(404);
    expect(JSON.parse(Buffer.from(r.body).toString())).toMatchObject({ error: { code: 'MESH_ERR_NO_SUCH_PEER', message: expect.stringMatching(/any relay of (its|this) cluster/) } });
    await caller.close();
  });

  it('one-way requests cross: delivered, nothing answered; a target that leaves within the window is reported 502', async () => {
    const got: string[] = [];
    // As a node does: a one-way request is run and not answered.
    const target = await RawPeer.connect(b.url, (r) => {
      got.push(Buffer.from(r.body).toString());
      return r.path === '/chain' ? null : { status: 200, headers: {}, body: new Uint8Array(0) };
    });
    const caller = await RawPeer.connect(a.url);
    await caller.request(target.peerId, { body: new Uint8Array([0]) }); // warm the path (lookup, trunk)
    const answers: number[] = [];
    caller.ws.on('message', (d: Buffer, bin: boolean) => bin && d[1] === 2 && d.readUInt32LE(4) >= 1000 && answers.push(d.readUInt32LE(4)));
    for (let i = 0; i < 5; i++) caller.ws.send(encodeRequestFrame({ streamId: 1000 + i, peerId: hexToBytes(target.peerId), method: 'POST', path: '/chain', headers: {}, body: Buffer.from(`push ${i}`), flags: FLAG_END | FLAG_ONE_WAY }));
    await until(() => got.filter((g) => g.startsWith('push')).length === 5, 5_000, 'pushes');
    // Past both relays' windows: neither produces an answer (no 504) for a push nobody answers.
    await new Promise((r) => setTimeout(r, 3_500));
    expect(answers).toEqual([]);
    // A target that takes a push and leaves before answering anything: the caller hears 502 on that stream.
    const silent = await RawPeer.connect(b.url, () => null);
    await caller.request(silent.peerId, { body: new Uint8Array([0]) }).catch(() => undefined);
    const gone = new Promise<number>((resolve) => caller.ws.on('message', (d: Buffer, bin: boolean) => bin && d[1] === 2 && d.readUInt32LE(4) === 2000 && resolve(d.readUInt16LE(8))));
    caller.ws.send(encodeRequestFrame({ streamId: 2000, peerId: hexToBytes(silent.peerId), method: 'POST', path: '/chain', headers: {}, body: Buffer.from('x'), flags: FLAG_END | FLAG_ONE_WAY }));
    await new Promise((r) => setTimeout(r, 100));
    silent.ws.terminate();
    expect(await gone).toBe(502);
    await Promise.all([target.close(), caller.close()]);
  });

  it('/rpc/<id> at relay A reaches a peer of relay B (the ADR-0014 path), and 404s a peer nobody holds', async () => {
    const target = await RawPeer.connect(b.url, echo('b'));
    const rpc = await RpcSocket.open(`${a.url}/rpc/${target.peerId}`);
    const r = await rpc.call({ request_id: 'r1', method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': '1,1,2' }, body_base64: Buffer.from([9, 8, 7, 6]).toString('base64') });
    expect(r).toMatchObject({ request_id: 'r1', status: 200 });
    expect(Buffer.from(r.body_base64 as string, 'base64')).toEqual(Buffer.from([9, 8, 7, 6]));
    rpc.close();
    await expect(RpcSocket.open(`${a.url}/rpc/${makeKeys().peerId}`)).rejects.toMatchObject({ status: 404 });
    await target.close();
  });

  it('one key registered at two relays keeps one registration: the older connection is closed with 4002', async () => {
    const keys = makeKeys();
    const first = new RawPeer(keys, echo('first'));
    await first.open(a.url);
    await new Promise((r) => setTimeout(r, 20));
    const second = new RawPeer(keys, echo('second'));
    await second.open(b.url);
    await until(() => first.closed !== null, 5_000, 'the older connection to close');
    expect(first.closed!.code).toBe(4002);
    expect(second.closed).toBeNull();
    const listed = async (r: RelayProcess) => ((await (await fetch(`${r.httpUrl}/peers`)).json()) as { peers: Array<{ peer_id: string }> }).peers.filter((p) => p.peer_id === keys.peerId).length;
    expect((await listed(a)) + (await listed(b))).toBe(1);
    // Requests from either relay reach the one that is left.
    const caller = await RawPeer.connect(a.url);
    const r = await until(async () => {
      const x = await caller.request(keys.peerId, { body: new Uint8Array([5]) });
      return x.status === 200 ? x : undefined;
    }, 5_000, 'the peer to be reachable at its new relay');
    expect(r.headers['x-tag']).toBe('second');
    await Promise.all([second.close(), caller.close()]);
  });

  it('malformed cluster messages are dropped and counted; both relays keep serving', async () => {
    const target = await RawPeer.connect(b.url, echo('b'));
    const nc = await connect({ servers: nats.url });
    const before = (await metric(a, 'meshnet_relay_cluster_dropped_total')) + (await metric(b, 'meshnet_relay_cluster_dropped_total'));
    const garbage = [new Uint8Array([1, 2, 3]), new TextEncoder().encode('{"peer_id":1}'), new TextEncoder().encode('not json'), new Uint8Array(0)];
    for (const g of garbage) {
      nc.publish('meshnet.meshnet.claim', g);
      nc.publish('meshnet.meshnet.relay.hello', g);
      nc.publish(`meshnet.meshnet.peer.${target.peerId}`, g, { reply: 'meshnet.meshnet.relay.zz.s.1' });
      nc.publish(`meshnet.meshnet.peer.${target.peerId}`, g, { reply: 'meshnet.meshnet.relay.00112233aabbccdd.s.1' });
    }
    await nc.flush();
    await nc.close();
    await until(async () => (await metric(a, 'meshnet_relay_cluster_dropped_total')) + (await metric(b, 'meshnet_relay_cluster_dropped_total')) >= before + 8, 5_000, 'drops counted');
    const caller = await RawPeer.connect(a.url);
    const r = await caller.request(target.peerId, { body: new Uint8Array([7]) });
    expect(r.status).toBe(200);
    expect((await health(a)).cluster!.nats).toBe('connected');
    await Promise.all([target.close(), caller.close()]);
  });
});

describe('failures around the cluster', () => {
  it('NATS unreachable at start: the relay prints one line naming the URL and exits non-zero', async () => {
    const p = spawnMeshnet(['relay', '--port', '0', '--nats', 'nats://127.0.0.1:1']);
    const code = await new Promise<number | null>((resolve) => p.child.once('exit', resolve));
    expect(code).toBe(1);
    const lines = p.stderr().trim().split('\n');
    expect(lines).toHaveLength(1);
    expect(lines[0]).toMatch(/^meshnet relay: cannot reach NATS at nats:\/\/127\.0\.0\.1:1\b/);
  });

  it('a relay killed: its trunk closes and callers on the other relay get 502 at once, not a timeout', async () => {
    const a = await startRelayProcess(['--nats', nats.url, '--request-timeout-ms', '20000']);
    const b = await startRelayProcess(['--nats', nats.url, '--request-timeout-ms', '20000']);
    try {
      // Answers its first request (which finds it and opens the trunk), never the next.
      let calls = 0;
      const slow = await RawPeer.connect(b.url, (r) => (calls++ === 0 ? { status: 200, headers: {}, body: r.body } : new Promise(() => undefined)));
      const caller = await RawPeer.connect(a.url);
      expect((await caller.request(slow.peerId, { body: new Uint8Array(1) })).status).toBe(200);
      await until(async () => (await health(a)).cluster!.trunks === 1, 10_000, 'a trunk');
      const pending = caller.request(slow.peerId, { body: new Uint8Array(1) });
      await new Promise((r) => setTimeout(r, 200));
      const t0 = performance.now();
      await b.stop('SIGKILL');
      const r = await pending;
      expect(r.status).toBe(502);
      expect(performance.now() - t0).toBeLessThan(3_000);
      await caller.close();
    } finally {
      await Promise.all([a.stop(), b.stop()]);
    }
  });

  it('a relay killed while frames cross by NATS: streams to its peers end 502 once it is silent (6 s), not at the request timeout', async () => {
    const a = await startRelayProcess(['--nats', nats.url, '--cluster', 'killnats', '--cluster-path', 'nats', '--request-timeout-ms', '30000']);
    const b = await startRelayProcess(['--nats', nats.url, '--cluster', 'killnats', '--cluster-path', 'nats', '--request-timeout-ms', '30000']);
    try {
      const slow = await RawPeer.connect(b.url, () => new Promise(() => undefined));
      const caller = await RawPeer.connect(a.url);
      await until(async () => (await health(a)).cluster!.relays === 1, 10_000, 'relays to hear of each other');
      const pending = caller.request(slow.peerId, { body: new Uint8Array(1) });
      await new Promise((r) => setTimeout(r, 200));
      const t0 = performance.now();
      await b.stop('SIGKILL');
      const r = await pending;
      expect(r.status).toBe(502);
      expect(performance.now() - t0).toBeLessThan(12_000);
      await caller.close();
    } finally {
      await Promise.all([a.stop(), b.stop()]);
    }
  });

  it('NATS restarted: relays reconnect, new peers are found, and frames cross again', async () => {
    const a = await startRelayProcess(['--nats', nats.url, '--cluster', 'restart', '--cluster-path', 'nats']);
    const b = await startRelayProcess(['--nats', nats.url, '--cluster', 'restart', '--cluster-path', 'nats']);
    try {
      const t1 = await RawPeer.connect(b.url, echo('b'));
      const caller = await RawPeer.connect(a.url);
      expect((await caller.request(t1.peerId, { body: new Uint8Array(1) })).status).toBe(200);
      await nats.restart({ wipe: true });
      await until(async () => (await health(a)).cluster!.nats === 'connected' && (await health(b)).cluster!.nats === 'connected', 15_000, 'relays to reconnect');
      // The old peer's subscription was renewed by the client; a new peer subscribes afresh.
      const t2 = await RawPeer.connect(b.url, echo('b2'));
      const r1 = await until(async () => {
        const x = await caller.request(t1.peerId, { body: new Uint8Array(1) });
        return x.status === 200 ? x : undefined;
      }, 10_000, 'the old peer again');
      expect(r1.headers['x-tag']).toBe('b');
      const r2 = await caller.request(t2.peerId, { body: new Uint8Array(1) });
      expect(r2.headers['x-tag']).toBe('b2');
      await Promise.all([t1.close(), t2.close(), caller.close()]);
    } finally {
      await Promise.all([a.stop(), b.stop()]);
    }
  });
});
