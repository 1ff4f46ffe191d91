/**
 * The page's lifecycle wiring (src/app/lifecycle.ts) with stand-in browser
 * globals: the freeze and pagehide handlers send the pre-signed beacon
 * synchronously and tell the node; resume and a persisted pageshow bring it
 * back; the Web Lock follows "donating". The real browser runs it in
 * e2e/lifecycle.spec.ts.
 */
import { describe, expect, it } from 'vitest';
import { DONATING_LOCK, PageLifecycle, type LifecycleEnv, type LifecycleEvent } from '../../src/app/lifecycle.ts';

function env(opts: { discarded?: boolean; beaconOk?: boolean } = {}) {
  const listeners = new Map<string, Array<(e: { persisted?: boolean }) => void>>();
  const on = (type: string, l: (e: { persisted?: boolean }) => void) => listeners.set(type, [...(listeners.get(type) ?? []), l]);
  const beacons: Array<{ url: string; data: string }> = [];
  const held: string[] = [];
  const e: LifecycleEnv = {
    document: { addEventListener: on, wasDiscarded: opts.discarded ?? false },
    window: { addEventListener: on },
    navigator: {
      sendBeacon: (url, data) => {
        beacons.push({ url, data });
        return opts.beaconOk ?? true;
      },
      locks: {
        request: async (name, _o, cb) => {
          held.push(name);
          await cb();
          held.splice(held.indexOf(name), 1);
        },
      },
    },
    now: () => 1000,
  };
  const fire = (type: string, ev: { persisted?: boolean } = {}) => {
    for (const l of listeners.get(type) ?? []) l(ev);
  };
  return { e, fire, beacons, held };
}

function node() {
  const told: LifecycleEvent[] = [];
  return { told, lifecycle: async (ev: LifecycleEvent) => void told.push(ev) };
}

describe('PageLifecycle', () => {
  it('freeze sends the newest signed beacon at once and tells the node; resume tells it back', async () => {
    const { e, fire, beacons } = env();
    const n = node();
    const lc = new PageLifecycle(e, n);
    fire('freeze');
    // No beacon yet (the worker has not signed one): only the node is told.
    expect(beacons).toHaveLength(0);
    lc.setBeacon({ url: 'http://t/api/nodes/heartbeat', body: '{"a":1}' });
    lc.setBeacon({ url: 'http://t/api/nodes/heartbeat', body: '{"a":2}' });
    fire('freeze');
    expect(beacons).toEqual([{ url: 'http://t/api/nodes/heartbeat', data: '{"a":2}' }]);
    fire('resume');
    await Promise.resolve();
    expect(n.told).toEqual(['frozen', 'frozen', 'resumed']);
    expect(lc.events.map((r) => [r.event, r.beacon])).toEqual([
      ['frozen', false],
      ['frozen', true],
      ['resumed', false],
    ]);
  });

  it('pagehide: leaving unless the page goes into the back/forward cache; a persisted pageshow is a resume', async () => {
    const { e, fire, beacons } = env();
    const n = node();
    const lc = new PageLifecycle(e, n);
    lc.setBeacon({ url: 'u', body: 'b' });
    fire('pagehide', { persisted: true });
    fire('pageshow', { persisted: false });
    fire('pageshow', { persisted: true });
    fire('pagehide', { persisted: false });
    await Promise.resolve();
    expect(n.told).toEqual(['frozen', 'resumed', 'leaving']);
    expect(beacons).toHaveLength(2);
  });

  it('holds the donating Web Lock only while donating', async () => {
    const { e, held } = env();
    const lc = new PageLifecycle(e, node());
    lc.setDonating(true);
    await Promise.resolve();
    expect(held).toEqual([DONATING_LOCK]);
    expect(lc.lockHeld).toBe(true);
    lc.setDonating(true);
    expect(held).toHaveLength(1);
    lc.setDonating(false);
    await new Promise((r) => setTimeout(r, 0));
    expect(held).toEqual([]);
    expect(lc.lockHeld).toBe(false);
  });

  it('reports a discarded tab, and a refused beacon as not sent', () => {
    const { e, fire } = env({ discarded: true, beaconOk: false });
    const lc = new PageLifecycle(e, node());
    expect(lc.wasDiscarded).toBe(true);
    lc.setBeacon({ url: 'u', body: 'b' });
    fire('freeze');
    expect(lc.events[0]).toMatchObject({ event: 'frozen', beacon: false });
  });
});
