/**
 * `meshnet mesh`'s engine (src/cli/browser-mesh.ts) with real processes:
 * it opens headless pages that join the tracker, reopens a page whose
 * renderer crashed under the same identity, and closes cleanly.
 */
import { expect, test } from '@playwright/test';
import type { StaticServer } from '../src/cli/static-server.ts';
import { startBrowserMesh } from '../src/cli/browser-mesh.ts';
import { until, type TrackerProc } from '../test/helpers/mesh.ts';
import { appUrl, type RelayProcess, startTrackerMesh, stopTrackerMesh } from './support/mesh.ts';

let relay: RelayProcess;
let model: StaticServer;
let tracker: TrackerProc;

test.beforeAll(async () => ({ relay, model, tracker } = await startTrackerMesh()));
test.afterAll(() => stopTrackerMesh({ relay, model, tracker }));

test('opens pages that join the tracker, reopens a crashed page with the same peer id, and closes every page', async () => {
  const logs: string[] = [];
  const mesh = await startBrowserMesh({ nodes: 2, trackerUrl: tracker.url, relayUrl: relay.url, appUrl: appUrl(), model: 'tiny', backend: 'wasm', budgetMb: 1.5, threads: 1, pollMs: 200, log: (m) => logs.push(m) });
  try {
    await mesh.waitServing(60_000);
    const before = mesh.rows().map((r) => ({ peer: r.peerId, layers: r.layers }));
    expect(before.map((r) => r.layers)).toEqual([[0, 2], [2, 4]]);
    expect(new Set(before.map((r) => r.peer)).size).toBe(2);
    const avail = (await (await fetch(`${tracker.url}/api/availability?model=tiny`)).json()) as { models: Array<{ complete: boolean }> };
    expect(avail.models[0]!.complete).toBe(true);

    const page = mesh.page(1)!;
    const cdp = await page.context().newCDPSession(page);
    await cdp.send('Page.crash').catch(() => undefined);
    await until(async () => mesh.rows()[1]!.restarts === 1 && mesh.rows()[1]!.state === 'serving', 60_000, 'the crashed page serving again').catch((e: Error) => {
      throw new Error(`${e.message}: ${JSON.stringify(mesh.rows())} ${logs.join('; ')}`);
    });
    expect(mesh.rows()[1]!.peerId).toBe(before[1]!.peer);
    expect(logs.some((l) => /node 2: the page crashed/.test(l))).toBe(true);
  } finally {
    await mesh.close();
  }
  expect(mesh.page(0)?.isClosed() ?? true).toBe(true);
});
