/**
 * Trackers of one cluster on a real nats-server, in process (startTracker
 * with --nats), for the cluster tests: call `trackerCluster()` at the top of
 * a test file; it starts nats-server before the file's tests and stops the
 * trackers after each test.
 */
import pino from 'pino';
import { afterAll, afterEach, beforeAll } from 'vitest';
import type { RegisterAnswer } from '../../src/protocol/tracker.ts';
import { startTracker, type RunningTracker } from '../../src/tracker/server.ts';
import { startNats, type NatsServer } from './cluster.ts';
import { layerMib, smallSpec, type TestTracker } from './tracker.ts';

export const spec = smallSpec();
/** A budget that holds a little over four layers of `spec`, MiB. */
export const mb = Math.ceil(4.2 * layerMib(spec));
const silent = pino({ level: 'silent' });

export interface TrackerCluster {
  nats(): NatsServer;
  /** A fresh cluster name per test. */
  name(): string;
  /** A tracker of cluster `name`, with short silences so a test waits seconds, not minutes. */
  tracker(name: string, o?: { heartbeatIntervalMs?: number; relayUrl?: string; rejoinGraceMs?: number }): Promise<RunningTracker>;
  /** A tracker the test closes itself: not closed again after it. */
  release(t: RunningTracker): void;
}

export function trackerCluster(): TrackerCluster {
  let nats: NatsServer | undefined;
  let n = 0;
  const running: RunningTracker[] = [];
  beforeAll(async () => {
    nats = await startNats();
  });
  afterAll(async () => {
    await nats?.stop();
  });
  afterEach(async () => {
    await Promise.all(running.splice(0).map((t) => t.close().catch(() => undefined)));
  });
  return {
    nats: () => nats!,
    name: () => `c${++n}`,
    async tracker(name, o = {}) {
      const t = await startTracker(
        { port: 0, nats: [nats!.url], cluster: name, heartbeatIntervalMs: o.heartbeatIntervalMs ?? 1000, logLevel: 'silent', models: [], ...(o.relayUrl ? { relayUrl: o.relayUrl } : {}), ...(o.rejoinGraceMs !== undefined ? { rejoinGraceMs: o.rejoinGraceMs } : {}) },
        { modelSpecs: [spec], logger: silent, cluster: { leaseMs: 1500, overdueMs: 1500, trackerGoneMs: 4000 } },
      );
      running.push(t);
      return t;
    },
    release(t) {
      const i = running.indexOf(t);
      if (i >= 0) running.splice(i, 1);
    },
  };
}

/** What FakeNode needs of a tracker: its app, and a clock that is the real one. */
export function asTest(t: RunningTracker): TestTracker {
  return Object.assign(Object.create(t) as RunningTracker, { clock: { get now() { return Date.now(); } } }) as unknown as TestTracker;
}

export async function until<T>(f: () => T | undefined | false | Promise<T | undefined | false>, ms = 15_000, what = 'condition'): Promise<T> {
  const end = Date.now() + ms;
  for (;;) {
    const v = await f();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

export const span = (a: RegisterAnswer) => a.assignment && `${a.assignment.start_layer}-${a.assignment.end_layer}`;
