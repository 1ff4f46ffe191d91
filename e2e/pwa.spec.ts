/**
 * Storage and PWA: a reload serves from IndexedDB (no weight byte fetched,
 * same peer id); the app is installable; an offline reload shows the app
 * shell from the service worker with the node's last state.
 */
import { expect, test } from '@playwright/test';
import { decodeTensor, encodeTensor } from '../src/protocol/tensor.ts';
import { newRefCache } from '../src/model/reference.ts';
import type { StaticServer } from '../src/cli/static-server.ts';
import type { RelayClient } from '../src/net/relay-client.ts';
import { forwardFast, maxAbsDiff, nodeUrl, reference, status, waitForState, type RelayProcess, startRelayMesh, stopRelayMesh } from './support/mesh.ts';

let relay: RelayProcess;
let model: StaticServer;
let caller: RelayClient;

test.beforeAll(async () => ({ relay, model, caller } = await startRelayMesh()));
test.afterAll(() => stopRelayMesh({ relay, model, caller }));

test('a reload serves from IndexedDB with zero weight bytes fetched and the same peer id', async ({ page }) => {
  await page.goto(nodeUrl(relay, model, [0, 2], { backend: 'wasm' }));
  const first = await waitForState(page, 'serving');
  const safetensors = () => [...model.stats.bytesByPath].filter(([p]) => p.endsWith('.safetensors')).reduce((n, [, b]) => n + b, 0);
  expect(safetensors()).toBeGreaterThan(0);
  expect(first.fetchedBytes).toBeGreaterThan(0);

  model.resetStats();
  await page.reload();
  const second = await waitForState(page, 'serving');
  expect(second.peerId).toBe(first.peerId);
  expect(second.fetchedBytes).toBe(0);
  // Counted at the server: not one request, so not one weight byte.
  expect(safetensors()).toBe(0);
  expect(model.stats.requests).toBe(0);
  expect(second.storedBytes).toBe(first.storedBytes);

  // And it still computes the reference activation from the stored weights.
  const ref = reference('tiny');
  const x = Float32Array.from(ref.embed([9, 8, 7]));
  const reply = await forwardFast(caller, second.peerId!, { activation: encodeTensor(x, 'f32'), shape: [1, 3, ref.cfg.hiddenSize] });
  expect(reply.status).toBe(200);
  const { err, scale } = maxAbsDiff(decodeTensor(reply.body, 'f32'), ref.layers(0, 2, Float64Array.from(x), 3, 0, newRefCache(ref.cfg)));
  expect(err).toBeLessThanOrEqual(1e-4 * Math.max(1, scale));
});

test('is installable: manifest with icons, a service worker controlling the page', async ({ page }) => {
  await page.goto(nodeUrl(relay, model, [0, 2], { backend: 'wasm' }));
  await waitForState(page, 'serving');
  const manifest = await page.evaluate(async () => {
    const href = document.querySelector<HTMLLinkElement>('link[rel=manifest]')!.href;
    return (await fetch(href)).json();
  });
  expect(manifest).toMatchObject({ display: 'standalone', start_url: './' });
  const sizes = (manifest.icons as Array<{ sizes: string }>).map((i) => i.sizes);
  expect(sizes).toEqual(expect.arrayContaining(['192x192', '512x512']));
  await page.waitForFunction(() => navigator.serviceWorker.controller !== null, undefined, { timeout: 30_000 });
  const cdp = await page.context().newCDPSession(page);
  const { installabilityErrors } = (await cdp.send('Page.getInstallabilityErrors')) as { installabilityErrors: Array<{ errorId: string }> };
  // Playwright's contexts are incognito, which alone blocks the install prompt; nothing else may.
  expect(installabilityErrors.map((e) => e.errorId).filter((id) => id !== 'in-incognito')).toEqual([]);
});

test('an offline reload shows the app shell from the service worker with the last state', async ({ page, context }) => {
  await page.goto(nodeUrl(relay, model, [0, 2], { backend: 'wasm' }));
  await waitForState(page, 'serving');
  await page.waitForFunction(() => navigator.serviceWorker.controller !== null, undefined, { timeout: 30_000 });
  // Let the page save its status snapshot (throttled to one per 2 s).
  await page.waitForTimeout(2_200);
  await status(page);

  await context.setOffline(true);
  try {
    const res = await page.reload();
    expect(res?.fromServiceWorker()).toBe(true);
    await expect(page.locator('h1')).toHaveText('meshnet');
    await expect(page.locator('#layers')).toHaveText('0–1 of 4');
    await expect(page.locator('#state')).toBeVisible();
    // The worker comes up from cached runtime files and stored weights; the relay is unreachable offline.
    const s = await status(page);
    expect(['connecting', 'loading', 'serving', 'downloading']).toContain(s.state);
  } finally {
    await context.setOffline(false);
  }
});
