/**
 * TrackerSession, the host-agnostic register/heartbeat loop the browser node
 * runs, against the real tracker app (no socket: the injected fetch calls
 * app.fetch).
 */
import { describe, expect, it } from 'vitest';
import { Identity } from '../../src/net/identity.ts';
import { TrackerClient } from '../../src/node/tracker-client.ts';
import { TrackerSession } from '../../src/node/tracker-session.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import type { Assignment, NodeMessage } from '../../src/protocol/tracker.ts';
import { DEFAULT_INFO, makeTracker, type TestTracker } from '../helpers/tracker.ts';

async function setup(onDrainBeacon?: (b: { url: string; body: string }) => void | Promise<void>) {
  let tracker: TestTracker = await makeTracker({ now: () => Date.now(), heartbeatIntervalMs: 40 });
  const identity = await Identity.generate();
  const fetchFn = ((url: string, init?: RequestInit) => tracker.app.fetch(new Request(url, init))) as typeof fetch;
  const client = new TrackerClient({ trackerUrl: 'http://tracker.test', fetch: fetchFn, identity });
  const assignments: Array<Assignment | null> = [];
  let serving: NodeMessage['serving'] = null;
  let messages = 0;
  const session = new TrackerSession({
    client,
    message: () => {
      messages++;
      return { peer_id: identity.peerId, public_key: encodeBase64Url(identity.publicKey), info: { ...DEFAULT_INFO, host: 'browser', backend: 'wasm' }, serving, timestamp: Date.now() };
    },
    onAssignment: (a) => assignments.push(a),
    ...(onDrainBeacon ? { onDrainBeacon } : {}),
  });
  return {
    fetchFn,
    identity,
    session,
    assignments,
    messages: () => messages,
    serve(s: NodeMessage['serving']) {
      serving = s;
    },
    tracker: () => tracker,
    async restartTracker() {
      tracker = await makeTracker({ now: () => Date.now(), heartbeatIntervalMs: 40 });
    },
  };
}

const until = async (check: () => boolean, ms = 2000) => {
  const deadline = Date.now() + ms;
  while (!check()) {
    if (Date.now() > deadline) throw new Error('timed out');
    await new Promise((r) => setTimeout(r, 10));
  }
};

describe('TrackerSession', () => {
  it('registers, hands over the assignment, then heartbeats at the tracker\'s interval with a freshly built message', async () => {
    const t = await setup();
    await t.session.start();
    try {
      expect(t.session.isRegistered).toBe(true);
      const a = t.assignments[0]!;
      expect(a).toMatchObject({ model: 'small', start_layer: 0 });
      expect(t.tracker().registry.nodes.get(t.identity.peerId)?.info.host).toBe('browser');
      // The host loads the span and says so: the tracker sees it serving after the next beat.
      t.serve({ start_layer: a.start_layer, end_layer: a.end_layer });
      await t.session.beatNow();
      expect(t.tracker().registry.status(t.tracker().registry.nodes.get(t.identity.peerId)!)).toBe('serving');
      const before = t.messages();
      await until(() => t.messages() >= before + 3);
      expect(t.assignments.length).toBeGreaterThanOrEqual(4);
    } finally {
      t.session.close();
    }
  });

  it('registers again when a restarted tracker answers 404, carrying the span it serves', async () => {
    const t = await setup();
    await t.session.start();
    try {
      const a = t.assignments[0]!;
      t.serve({ start_layer: a.start_layer, end_layer: a.end_layer });
      await t.restartTracker();
      expect(t.tracker().registry.nodes.size).toBe(0);
      await t.session.beatNow();
      const rec = t.tracker().registry.nodes.get(t.identity.peerId);
      // The new tracker adopts the served span as the assignment: no reload.
      expect(rec?.assignment).toEqual({ start: a.start_layer, end: a.end_layer });
      expect(t.assignments.at(-1)).toEqual(a);
    } finally {
      t.session.close();
    }
  });

  it('notices its tracker went away by the watch stream and registers with the one back on its address within about a second, not a heartbeat period later', async () => {
    let tracker: TestTracker = await makeTracker({ now: () => Date.now(), heartbeatIntervalMs: 10_000 });
    let down = false;
    let watch: ReadableStreamDefaultController<Uint8Array> | undefined;
    let watches = 0;
    const fetchFn = (async (url: string, init?: RequestInit) => {
      if (down) throw new TypeError('fetch failed', { cause: { code: 'ECONNREFUSED' } });
      if (url.endsWith('/api/nodes/watch')) {
        watches++;
        // The tracker's own stream, held open; the test cuts it as a dying process would.
        const res = await tracker.app.fetch(new Request(url, init));
        const reader = res.body!.getReader();
        return new Response(new ReadableStream<Uint8Array>({
          start(c) {
            watch = c;
            void reader.read().then((r) => {
              try {
                if (r.value) c.enqueue(r.value);
              } catch {
                // cut already
              }
            });
          },
        }), { status: 200, headers: res.headers });
      }
      return tracker.app.fetch(new Request(url, init));
    }) as typeof fetch;
    const identity = await Identity.generate();
    const logs: string[] = [];
    const session = new TrackerSession({
      client: new TrackerClient({ trackerUrl: 'http://tracker.test', fetch: fetchFn, identity }),
      message: () => ({ peer_id: identity.peerId, public_key: encodeBase64Url(identity.publicKey), info: DEFAULT_INFO, serving: null, timestamp: Date.now() }),
      onAssignment: () => {},
      onLog: (_l, m) => logs.push(m),
    });
    await session.start();
    try {
      await until(() => watches === 1);
      expect(tracker.registry.nodes.has(identity.peerId)).toBe(true);
      // The tracker dies: its watch stream breaks, and for a while nothing answers on its address.
      down = true;
      watch!.error(new TypeError('terminated'));
      await new Promise((r) => setTimeout(r, 700));
      tracker = await makeTracker({ now: () => Date.now(), heartbeatIntervalMs: 10_000 });
      down = false;
      const back = Date.now();
      await until(() => tracker.registry.nodes.has(identity.peerId), 3_000);
      expect(Date.now() - back).toBeLessThan(1_500);
      // …and it watches the new one.
      await until(() => watches === 2);
      expect(logs.filter((l) => l.includes('went away'))).toHaveLength(1);
    } finally {
      session.close();
    }
  });

  it('a message leaves only once the host holds its drain beacon: a page frozen right after a heartbeat sends a beacon the tracker applies', async () => {
    // The page's sink answers late (a busy page's message loop); the beacon that reaches it is the one the tracker applies.
    let held: { url: string; body: string } | undefined;
    const t = await setup(async (b) => {
      await new Promise((r) => setTimeout(r, 60));
      held = b;
    });
    await t.session.start();
    try {
      const rec = () => t.tracker().registry.nodes.get(t.identity.peerId)!;
      t.serve({ start_layer: 0, end_layer: 2 });
      await t.session.beatNow();
      // Whatever beat the tracker applied last, the page already holds a beacon at least as new.
      const ts = rec().lastTimestamp;
      expect((JSON.parse(held!.body) as { body: { timestamp: number } }).body.timestamp).toBeGreaterThanOrEqual(ts);
      // Frozen now: the page sends what it holds, and the tracker takes the drain.
      const res = await t.fetchFn(held!.url, { method: 'POST', headers: { 'content-type': 'text/plain' }, body: held!.body });
      expect(res.status).toBe(200);
      expect(rec().draining).toBe(true);
    } finally {
      t.session.close();
    }
  });

  it('a host that never takes the beacon (a frozen page) holds a message back at most 250 ms', async () => {
    const t = await setup(() => new Promise<void>(() => undefined));
    await t.session.start();
    try {
      const t0 = Date.now();
      await t.session.beatNow();
      const waited = Date.now() - t0;
      expect(waited).toBeGreaterThanOrEqual(240);
      expect(waited).toBeLessThan(2_000);
    } finally {
      t.session.close();
    }
  });

  it('stops beating after close()', async () => {
    const t = await setup();
    await t.session.start();
    t.session.close();
    const n = t.messages();
    await new Promise((r) => setTimeout(r, 150));
    expect(t.messages()).toBe(n);
  });
});
