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

async function setup() {
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
  });
  return {
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

  it('stops beating after close()', async () => {
    const t = await setup();
    await t.session.start();
    t.session.close();
    const n = t.messages();
    await new Promise((r) => setTimeout(r, 150));
    expect(t.messages()).toBe(n);
  });
});
