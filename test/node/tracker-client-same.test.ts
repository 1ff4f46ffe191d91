/**
 * A node's heartbeats leave out what its tracker acknowledged (`same`,
 * docs/protocol.md §9; src/node/beat-baseline.ts), against the real tracker
 * app: the beat after a 200 omits the unchanged fields and names them; a
 * changed field travels again; a 404 (the tracker forgot the node) means a
 * full registration and a full beat after it; another tracker, a relay
 * reconnect or an answer other than 200 make the next beat full.
 */
import { describe, expect, it } from 'vitest';
import { Identity } from '../../src/net/identity.ts';
import { NotRegisteredError, TrackerClient, type TrackerRelay } from '../../src/node/tracker-client.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import type { OutgoingRequest } from '../../src/net/contract.ts';
import type { NodeMessage, NodeStats } from '../../src/protocol/tracker.ts';
import { DEFAULT_INFO, makeTracker, type TestTracker } from '../helpers/tracker.ts';

const STATS: NodeStats = { rpm: 0, layer_ms: 0, queue_depth: 0, kv_free_bytes: 1 << 20, tokens_served: 0 };
const text = new TextDecoder();

async function setup(o: { relay?: boolean; olderTracker?: boolean } = {}) {
  let tracker: TestTracker = await makeTracker({ now: () => Date.now(), heartbeatIntervalMs: 10_000 });
  const identity = await Identity.generate();
  const sent: Array<{ via: 'http' | 'relay'; path: string; body: Record<string, unknown> }> = [];
  /** Rewrites the answers' tracker_peer_id from now on (another tracker named). */
  let renameTo: string | undefined;
  const rename = (body: string): string => {
    if (renameTo === undefined && !o.olderTracker) return body;
    const a = JSON.parse(body) as Record<string, unknown>;
    if (renameTo !== undefined && a.tracker_peer_id !== undefined) a.tracker_peer_id = renameTo;
    // A tracker from before `same`: its answers do not say it takes them.
    if (o.olderTracker) delete a.takes_same;
    return JSON.stringify(a);
  };
  const fetchFn = (async (url: string, init?: RequestInit) => {
    const path = new URL(url).pathname;
    if (init?.body) sent.push({ via: 'http', path, body: (JSON.parse(String(init.body)) as { body: Record<string, unknown> }).body });
    const res = await tracker.app.fetch(new Request(url, init));
    return new Response(rename(await res.text()), { status: res.status, headers: res.headers });
  }) as typeof fetch;
  const relay = {
    state: 'registered',
    currentRegistration: {} as object,
    async request(_peer: string, req: OutgoingRequest) {
      const body = req.body as Uint8Array;
      sent.push({ via: 'relay', path: req.path, body: JSON.parse(text.decode(body)) as Record<string, unknown> });
      const r = tracker.relayBeat(identity.peerId, body);
      return { status: r.status, headers: {}, body: new TextEncoder().encode(rename(text.decode(r.body as Uint8Array))) };
    },
  };
  const client = new TrackerClient({ trackerUrl: 'http://tracker.test', fetch: fetchFn, identity, ...(o.relay ? { relay: relay as TrackerRelay } : {}) });
  const node = { info: { ...DEFAULT_INFO }, stats: { ...STATS } };
  const message = (): NodeMessage => ({
    peer_id: identity.peerId,
    public_key: encodeBase64Url(identity.publicKey),
    relay_addr: 'relay://r1',
    info: node.info,
    stats: node.stats,
    serving: null,
    stored: null,
    timestamp: Date.now(),
  });
  return {
    client,
    node,
    message,
    sent,
    relay,
    last: () => sent.at(-1)!,
    tracker: () => tracker,
    renameTo(id: string) {
      renameTo = id;
    },
    async restartTracker() {
      tracker = await makeTracker({ now: () => Date.now(), heartbeatIntervalMs: 10_000 });
    },
  };
}

const ALL_SAME = ['public_key', 'info', 'relay_addr', 'stored', 'stats'];

describe('heartbeats that leave out what the tracker has', () => {
  it('over HTTP: full after a registration, then only what changed; a 404 registers in full and the next beat is full', async () => {
    const s = await setup();
    await s.client.register(s.message());
    expect(s.last().body.same).toBeUndefined();
    await s.client.heartbeat(s.message());
    expect(s.last().path).toBe('/api/nodes/heartbeat');
    expect(s.last().body.same).toBeUndefined();
    expect(s.last().body.info).toEqual(DEFAULT_INFO);

    await s.client.heartbeat(s.message());
    const delta = s.last().body;
    expect(delta.same).toEqual(ALL_SAME);
    for (const f of ALL_SAME) expect(delta).not.toHaveProperty(f);
    expect(delta).toMatchObject({ peer_id: expect.any(String), serving: null, timestamp: expect.any(Number) });
    const rec = s.tracker().registry.nodes.get(delta.peer_id as string)!;
    expect(rec.lastSeen).toBeGreaterThan(0);
    expect(rec.info).toEqual(DEFAULT_INFO);

    // New stats travel; the rest stays out.
    s.node.stats = { ...STATS, rpm: 7, layer_ms: 3 };
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toEqual(['public_key', 'info', 'relay_addr', 'stored']);
    expect(s.last().body.stats).toEqual(s.node.stats);
    expect(rec.stats).toEqual(s.node.stats);
    // New info travels (a duty cycle set), and is what the tracker keeps.
    s.node.info = { ...DEFAULT_INFO, duty_cycle: 0.5 };
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toEqual(['public_key', 'relay_addr', 'stored', 'stats']);
    expect(rec.info.duty_cycle).toBe(0.5);
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toEqual(ALL_SAME);

    // The tracker restarted: the delta is 404, the node registers in full, and its next beat is full.
    await s.restartTracker();
    await expect(s.client.heartbeat(s.message())).rejects.toBeInstanceOf(NotRegisteredError);
    await s.client.register(s.message());
    expect(s.last().path).toBe('/api/nodes/register');
    expect(s.last().body.info).toEqual(s.node.info);
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toBeUndefined();
    expect(s.last().body.public_key).toBeDefined();
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toEqual(ALL_SAME);
  });

  it('over the relay: another tracker, a relay reconnect or an error answer make the next beat full', async () => {
    const s = await setup({ relay: true });
    await s.client.register(s.message());
    await s.client.heartbeat(s.message());
    expect(s.last()).toMatchObject({ via: 'relay', path: '/api/nodes/beat' });
    expect(s.last().body.same).toBeUndefined();
    await s.client.heartbeat(s.message());
    expect(s.last().via).toBe('relay');
    expect(s.last().body.same).toEqual(ALL_SAME);

    // The answers name another tracker: beats go to it, whole at first.
    s.renameTo('ab'.repeat(16));
    await s.client.heartbeat(s.message());
    expect(s.client.trackerPeerId).toBe('ab'.repeat(16));
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toBeUndefined();
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toEqual(ALL_SAME);

    // The relay connection registered again (maybe another relay): whole.
    s.relay.currentRegistration = {};
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toBeUndefined();
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toEqual(ALL_SAME);

    // The relay is down: the beat goes signed over HTTP, whole (nothing acknowledged there yet), then less.
    s.relay.state = 'connecting';
    await s.client.heartbeat(s.message());
    expect(s.last()).toMatchObject({ via: 'http', path: '/api/nodes/heartbeat' });
    expect(s.last().body.same).toBeUndefined();
    await s.client.heartbeat(s.message());
    expect(s.last().via).toBe('http');
    expect(s.last().body.same).toEqual(ALL_SAME);
    // An answer other than 200 (the tracker refuses the timestamp): the next beat is whole.
    await expect(s.client.heartbeat({ ...s.message(), timestamp: 1 })).rejects.toThrow();
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toBeUndefined();
  });

  it('a tracker that does not say it takes same (an older one) gets whole beats', async () => {
    for (const relay of [false, true]) {
      const s = await setup({ relay, olderTracker: true });
      await s.client.register(s.message());
      for (let i = 0; i < 3; i++) {
        await s.client.heartbeat(s.message());
        expect(s.last().via).toBe(relay ? 'relay' : 'http');
        expect(s.last().body.same).toBeUndefined();
        expect(s.last().body.info).toEqual(DEFAULT_INFO);
      }
    }
  });

  it('the drain beacon is a whole message', async () => {
    const s = await setup();
    await s.client.register(s.message());
    await s.client.heartbeat(s.message());
    await s.client.heartbeat(s.message());
    expect(s.last().body.same).toEqual(ALL_SAME);
    const beacon = JSON.parse((await s.client.signedHeartbeat({ ...s.message(), draining: true })).body) as { body: Record<string, unknown> };
    expect(beacon.body.same).toBeUndefined();
    expect(beacon.body.info).toEqual(DEFAULT_INFO);
  });
});
