/**
 * The tracker's dashboard page with a swarm behind it, in Chromium: past a
 * few dozen nodes the availability map has one row per span (how many serve
 * it), the node list is a page of 200 with a pager, and the page polls at
 * the pace the tracker suggests.
 */
import { expect, test } from '@playwright/test';
import pino from 'pino';
import { startTracker, type RunningTracker } from '../src/tracker/server.ts';
import { FakeNode, layerMib, smallSpec } from '../test/helpers/tracker.ts';

let tracker: RunningTracker | undefined;
test.afterAll(async () => tracker?.close());

test('pages and sums a swarm of 250 nodes', async ({ page }) => {
  const spec = smallSpec();
  tracker = await startTracker({ port: 0, logLevel: 'silent', models: [] }, { modelSpecs: [spec], logger: pino({ level: 'silent' }) });
  const t = Object.assign(Object.create(tracker) as RunningTracker, { clock: { get now() { return Date.now(); } } });
  const mb = Math.ceil(4.2 * layerMib(spec));
  for (let i = 0; i < 250; i++) {
    const n = await FakeNode.create({ memory_budget_mb: mb, host: 'browser', backend: i % 2 ? 'webgpu' : 'wasm' });
    await n.register(t as never, { load: true });
    await n.heartbeat(t as never, { load: true });
  }
  await page.goto(`${tracker.url}/dashboard`);
  await expect(page.locator('#meta')).toContainText('250 node(s)');
  // The map: a row per span, with how many serve it, not 250 rows.
  const spanRows = page.locator('#maps td.peer', { hasText: /^span \d+–\d+ · \d+ serving/ });
  await expect(spanRows.first()).toBeVisible();
  const rows = await spanRows.allTextContents();
  expect(rows.length).toBeGreaterThan(1);
  expect(rows.length).toBeLessThan(20);
  expect(rows.reduce((a, r) => a + Number(/· (\d+) serving/.exec(r)![1]), 0)).toBe(250);
  // The list: 200 of 250, then the rest.
  await expect(page.locator('#nodes')).toContainText('nodes 1–200 of 250');
  await expect(page.locator('#nodes table tr')).toHaveCount(201);
  await page.getByRole('button', { name: 'next ▶' }).click();
  await expect(page.locator('#nodes')).toContainText('nodes 201–250 of 250');
  await expect(page.locator('#nodes table tr')).toHaveCount(51);
  await page.getByRole('button', { name: '◀ previous' }).click();
  await expect(page.locator('#nodes')).toContainText('nodes 1–200 of 250');
});
