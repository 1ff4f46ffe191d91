/**
 * `peer-back` (docs/protocol.md §9): the relay holds a watch of a peer not
 * attached to it and says `attached: true` when that peer registers, so a
 * node whose tracker is not on its relay asks once instead of after every
 * heartbeat, and batches its beats again as soon as the tracker attaches
 * (§9.1). An in-process relay, raw sockets and real RelayClients; a node on a
 * relay without the feature (a stub) still asks after every beat.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from 'vitest';
import { WebSocket } from 'ws';
import { Identity } from '../../src/net/identity.ts';
import { PeerWatches, type PeerWatchEnd } from '../../src/net/peer-watches.ts';
import { RelayClient } from '../../src/net/relay-client.ts';
import { startRelay, type Relay } from '../../src/relay/server.ts';
import { TrackerClient, type TrackerRelay, type WatchEnd } from '../../src/node/tracker-client.ts';
import { TrackerSession } from '../../src/node/tracker-session.ts';
import type { NodeMessage } from '../../src/protocol/tracker.ts';
import { NodeWebSocket } from '../helpers/ws-host.ts';
import { makeKeys, nextJson, registerMessage } from '../helpers/raw-peer.ts';

let relay: Relay;
const closers: Array<() => void> = [];
beforeAll(async () => {
  relay = await startRelay({ port: 0, host: '127.0.0.1', logLevel: 'silent' });
});
afterAll(async () => {
  for (const c of closers) c();
  await relay.close();
});

const until = async (cond: () => boolean, ms = 2_000): Promise<void> => {
  const t0 = Date.now();
  while (!cond()) {
    if (Date.now() - t0 > ms) throw new Error('condition not met in time');
    await new Promise((r) => setTimeout(r, 5));
  }
};

async function client(identity: Identity, info?: Record<string, unknown>): Promise<RelayClient> {
  const c = new RelayClient({ relayUrl: relay.url, WebSocket: NodeWebSocket, identity, ...(info ? { info } : {}) });
  closers.push(() => c.close());
  c.start();
  await c.ready(5_000);
  return c;
}

/** A registered raw socket: the relay's messages as they are on the wire. */
async function rawWatcher(): Promise<WebSocket> {
  const ws = new WebSocket(`${relay.url}/ws`);
  closers.push(() => ws.close());
  const challenge = await nextJson(ws);
  ws.send(JSON.stringify(registerMessage(makeKeys(), challenge.nonce as string)));
  expect((await nextJson(ws)).features).toContain('peer-back');
  return ws;
}

async function ask(ws: WebSocket, msg: object): Promise<Record<string, unknown>> {
  const next = nextJson(ws);
  ws.send(JSON.stringify(msg));
  return next;
}

/** The relay's gauge of the watches it holds, by state. */
async function held(): Promise<{ attached: number; pending: number }> {
  const text = await relay.metrics.registry.metrics();
  const n = (state: string) => Number(new RegExp(`meshnet_relay_peer_watches\\{state="${state}"\\} (\\d+)`).exec(text)?.[1]);
  return { attached: n('attached'), pending: n('pending') };
}

/** Waits until the relay holds `n` pending watches. */
async function pendingIs(n: number): Promise<void> {
  const t0 = Date.now();
  while ((await held()).pending !== n) {
    if (Date.now() - t0 > 2_000) throw new Error(`the relay holds ${(await held()).pending} pending watches, not ${n}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

async function watchAsks(): Promise<number> {
  return Number(/meshnet_relay_watch_peer_total (\d+)/.exec(await relay.metrics.registry.metrics())?.[1]);
}

describe('relay peer-back', () => {
  it('holds a watch of a peer not attached: the watcher hears attached:true when it registers, then peer-gone when it leaves', async () => {
    const target = await Identity.generate();
    const ws = await rawWatcher();
    expect(await ask(ws, { type: 'watch-peer', peer_id: target.peerId })).toEqual({ type: 'peer-watch', peer_id: target.peerId, attached: false });
    // A RelayClient's watch goes on: told absent, then attached, then gone.
    const node = await client(await Identity.generate());
    expect((await node.ready()).peerBack).toBe(true);
    const told: string[] = [];
    const w = node.watchPeer(target.peerId, undefined, () => told.push('attached'), () => told.push('absent'));
    await until(() => told.length === 1);
    expect(told).toEqual(['absent']);
    expect(await held()).toEqual({ attached: 0, pending: 2 });

    const notice = nextJson(ws);
    const t = await client(target);
    expect(await notice).toEqual({ type: 'peer-watch', peer_id: target.peerId, attached: true });
    await until(() => told.length === 2);
    expect(told).toEqual(['absent', 'attached']);
    expect(await held()).toEqual({ attached: 2, pending: 0 });
    // From then on an attached watch: peer-gone once when it leaves.
    const gone = nextJson(ws);
    t.close();
    expect(await gone).toEqual({ type: 'peer-gone', peer_id: target.peerId });
    expect(await w).toBe('gone');
    expect(await held()).toEqual({ attached: 0, pending: 0 });
  });

  it('unwatch-peer and the watcher leaving free a held watch: no notice after', async () => {
    const target = await Identity.generate();
    const [a, b] = [await rawWatcher(), await rawWatcher()];
    const before = await held();
    expect((await ask(a, { type: 'watch-peer', peer_id: target.peerId })).attached).toBe(false);
    expect((await ask(b, { type: 'watch-peer', peer_id: target.peerId })).attached).toBe(false);
    expect((await held()).pending).toBe(before.pending + 2);
    a.send(JSON.stringify({ type: 'unwatch-peer', peer_id: target.peerId }));
    b.close();
    await until(() => b.readyState === WebSocket.CLOSED);
    await new Promise((r) => setTimeout(r, 20));
    expect(await held()).toEqual(before);
    // The target registers: `a` hears nothing of it (its next message is the answer to its next question).
    await client(target);
    const other = '0'.repeat(32);
    expect(await ask(a, { type: 'watch-peer', peer_id: other })).toEqual({ type: 'peer-watch', peer_id: other, attached: false });
    a.send(JSON.stringify({ type: 'unwatch-peer', peer_id: other }));
  });

  it('counts held watches in the 16 a peer may have', async () => {
    const ws = await rawWatcher();
    const absent = Array.from({ length: 16 }, (_, i) => i.toString(16).padStart(32, 'a'));
    for (const id of absent) expect((await ask(ws, { type: 'watch-peer', peer_id: id })).attached).toBe(false);
    // Asked again: the same answer, nothing more held.
    expect((await ask(ws, { type: 'watch-peer', peer_id: absent[0] })).attached).toBe(false);
    const here = await client(await Identity.generate());
    expect(await ask(ws, { type: 'watch-peer', peer_id: here.peerId })).toMatchObject({ type: 'error', code: 'MESH_ERR_TOO_LARGE' });
    expect(await ask(ws, { type: 'watch-peer', peer_id: 'f'.repeat(32) })).toMatchObject({ type: 'error', code: 'MESH_ERR_TOO_LARGE' });
    ws.send(JSON.stringify({ type: 'unwatch-peer', peer_id: absent[3] }));
    expect(await ask(ws, { type: 'watch-peer', peer_id: here.peerId })).toEqual({ type: 'peer-watch', peer_id: here.peerId, attached: true });
    ws.close();
  });
});

describe('PeerWatches on a relay with and without peer-back', () => {
  it('ends a watch absent on an older relay; holds it, absent then attached, on one with peer-back', async () => {
    const sent: string[] = [];
    const pw = new PeerWatches((e) => {
      throw e;
    });
    const id = '1'.repeat(32);
    const old = pw.watch(id, (t) => sent.push(t), false);
    pw.onNotice({ type: 'peer-watch', peer_id: id, attached: false });
    expect(await old).toBe('absent');

    const told: string[] = [];
    const hooks = { onAttached: () => told.push('attached'), onAbsent: () => told.push('absent') };
    let end: PeerWatchEnd | undefined;
    void pw.watch(id, (t) => sent.push(t), true, undefined, hooks).then((e) => (end = e));
    pw.onNotice({ type: 'peer-watch', peer_id: id, attached: false });
    // A second caller joins a held watch: told at once, no second watch-peer.
    const cancel = new AbortController();
    const joined = pw.watch(id, (t) => sent.push(t), true, cancel.signal, hooks);
    expect(told).toEqual(['absent', 'absent']);
    cancel.abort();
    expect(await joined).toBe('cancelled');
    pw.onNotice({ type: 'peer-watch', peer_id: id, attached: true });
    pw.onNotice({ type: 'peer-watch', peer_id: id, attached: true });
    expect(told).toEqual(['absent', 'absent', 'attached']);
    await new Promise((r) => setTimeout(r, 0));
    expect(end).toBeUndefined();
    pw.onNotice({ type: 'peer-gone', peer_id: id });
    await new Promise((r) => setTimeout(r, 0));
    expect(end).toBe('gone');
    expect(sent.map((t) => (JSON.parse(t) as { type: string }).type)).toEqual(['watch-peer', 'watch-peer']);
  });
});

describe('a tracker session whose tracker is not attached to its relay', () => {
  afterEach(() => vi.useRealTimers());
  const msg = (node: Identity) => (): NodeMessage => ({ peer_id: node.peerId, public_key: 'x', info: { model: 'm', backend: 'wasm', memory_budget_mb: 1 }, stats: { rpm: 0, layer_ms: 0, queue_depth: 0, kv_free_bytes: 0, tokens_served: 0 }, serving: null, timestamp: Date.now() }) as NodeMessage;
  const BEAT_MS = 40;

  it('with peer-back: asks once, beats without the batched try meanwhile, and batches again on the relay’s notice', async () => {
    const trackerIdentity = await Identity.generate();
    const answer = { assignment: null, heartbeat_interval_ms: BEAT_MS, tracker_public_key: 'k', tracker_peer_id: trackerIdentity.peerId };
    const fetchFn = (async () => new Response(JSON.stringify(answer), { status: 200, headers: { 'content-type': 'application/json' } })) as unknown as typeof fetch;
    const nodeIdentity = await Identity.generate();
    const node = await client(nodeIdentity);
    let asks = 0;
    let tries = 0;
    const counted: TrackerRelay = {
      get state() {
        return node.state;
      },
      get currentRegistration() {
        return node.currentRegistration;
      },
      request: (p, r, o) => node.request(p, r, o),
      beat: (p, body, ms) => {
        tries++;
        return node.beat(p, body, ms);
      },
      watchPeer: (p, s, attached, absent) => {
        asks++;
        return node.watchPeer(p, s, attached, absent);
      },
    };
    const asksBefore = await watchAsks();
    const tc = new TrackerClient({ trackerUrl: 'http://tracker.test', fetch: fetchFn, identity: nodeIdentity, relay: counted, random: () => 0 });
    const session = new TrackerSession({ client: tc, message: msg(nodeIdentity), onAssignment: () => {} });
    try {
      await session.start();
      await until(() => tc.beats.http >= 8);
      // One question to the relay for all those beats (before peer-back: one per beat); one batched try, then none.
      expect(asks).toBe(1);
      expect((await watchAsks()) - asksBefore).toBe(1);
      expect(tc.noBatchNow).toBe('not-attached');
      expect(tc.beats.batched).toBe(0);
      expect(tc.beats.skipped).toBeGreaterThanOrEqual(tc.beats.http - 1);
      expect(tries).toBe(1);
      // Past the memo's bound (15 s with random 0): still no batched try, the held watch renews it at each beat.
      vi.useFakeTimers({ toFake: ['Date'] });
      vi.setSystemTime(Date.now() + 60_000);
      const http = tc.beats.http;
      await until(() => tc.beats.http >= http + 3);
      vi.useRealTimers();
      expect(tries).toBe(1);
      expect(tc.noBatchNow).toBe('not-attached');

      // The tracker attaches to the node's relay: the relay says so unasked, and the next beat goes batched.
      const tracker = await client(trackerIdentity, { features: ['beat-batch'] });
      tracker.setBeatsHandler((m) => {
        const batch = m as { batch: number; beats: unknown[] };
        return JSON.stringify({ type: 'beats-answer', batch: batch.batch, answers: batch.beats.map(() => ({ status: 200, body: answer })) });
      });
      await until(() => tc.noBatchNow === undefined);
      await until(() => tc.beats.batched >= 2);
      expect(asks).toBe(1);
      expect((await watchAsks()) - asksBefore).toBe(1);
    } finally {
      session.close();
    }
  });

  it('with peer-back: a held watch ends on a refused beat (unreachable), another tracker, or a registration again', async () => {
    const trackerIdentity = await Identity.generate();
    let named = trackerIdentity.peerId;
    let up = true;
    const fetchFn = (async () => {
      if (!up) throw Object.assign(new TypeError('fetch failed'), { cause: { code: 'ECONNREFUSED' } });
      return new Response(JSON.stringify({ assignment: null, heartbeat_interval_ms: 60_000, tracker_public_key: 'k', tracker_peer_id: named }), { status: 200 });
    }) as unknown as typeof fetch;
    const nodeIdentity = await Identity.generate();
    const node = await client(nodeIdentity);
    let heldTold = 0;
    const relayOf: TrackerRelay = {
      get state() {
        return node.state;
      },
      request: (p, r, o) => node.request(p, r, o),
      watchPeer: (p, s, attached, absent) =>
        node.watchPeer(p, s, attached, () => {
          heldTold++;
          absent?.();
        }),
    };
    const tc = new TrackerClient({ trackerUrl: 'http://tracker.test', fetch: fetchFn, identity: nodeIdentity, relay: relayOf });
    const stop = new AbortController();
    try {
      await tc.register(msg(nodeIdentity)());
      const pendingBefore = (await held()).pending;
      /** A watch of the tracker, once the relay holds it (the tracker is not attached there). */
      const heldWatch = async (): Promise<{ end: Promise<WatchEnd> }> => {
        const told = heldTold;
        const end = tc.watch(stop.signal);
        await until(() => heldTold === told + 1);
        await pendingIs(pendingBefore + 1);
        return { end };
      };
      let w = await heldWatch();
      up = false;
      await expect(tc.heartbeat(msg(nodeIdentity)())).rejects.toThrow(/unreachable/);
      expect(await w.end).toBe('unreachable');
      up = true;
      w = await heldWatch();
      await tc.register(msg(nodeIdentity)());
      expect(await w.end).toBe('rearm');
      w = await heldWatch();
      named = (await Identity.generate()).peerId;
      await tc.heartbeat(msg(nodeIdentity)());
      expect(await w.end).toBe('rearm');
      // Each end told the relay (unwatch-peer): nothing is left held for this node.
      await pendingIs(pendingBefore);
    } finally {
      stop.abort();
    }
  });

  it('without peer-back (an older relay): asks again after every beat, as before', async () => {
    const t1 = '1'.repeat(32);
    const answer = { assignment: null, heartbeat_interval_ms: BEAT_MS, tracker_public_key: 'k', tracker_peer_id: t1 };
    const reply = (body: unknown) => ({ status: 200, headers: {}, body: new TextEncoder().encode(JSON.stringify(body)) });
    let attached = false;
    let asks = 0;
    const old: TrackerRelay = {
      state: 'registered',
      currentRegistration: {},
      request: async () => reply(answer),
      beat: async () => (attached ? { status: 200, body: answer } : { status: 404, body: { error: { code: 'MESH_ERR_NO_SUCH_PEER', message: 'not here' } } }),
      watchPeer: async (_p, _s, onAttached) => {
        asks++;
        if (!attached) return 'absent';
        onAttached?.();
        return new Promise<never>(() => {});
      },
    };
    const nodeIdentity = await Identity.generate();
    const fetchFn = (async () => new Response(JSON.stringify(answer), { status: 200 })) as unknown as typeof fetch;
    const tc = new TrackerClient({ trackerUrl: 'http://tracker.test', fetch: fetchFn, identity: nodeIdentity, relay: old, random: () => 0 });
    const session = new TrackerSession({ client: tc, message: msg(nodeIdentity), onAssignment: () => {} });
    try {
      await session.start();
      await until(() => tc.beats.relay >= 6);
      // A question after each beat: the watch, then again after every beat that the relay answers "not attached".
      expect(asks).toBeGreaterThanOrEqual(tc.beats.relay - 1);
      expect(tc.noBatchNow).toBe('not-attached');
      attached = true;
      await until(() => tc.beats.batched >= 1);
    } finally {
      session.close();
    }
  });
});
