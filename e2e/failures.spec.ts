/**
 * Failures the donor must understand: storage over quota, and the model
 * server going away mid-download. Each shows a clear state with what to do,
 * and Retry recovers without losing what was already stored.
 */
import { expect, test } from '@playwright/test';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import { ensureModel } from '../src/cli/models.ts';
import { nodeUrl, startModelServer, startRelayProcess, status, waitForState, type RelayProcess } from './support/mesh.ts';

let relay: RelayProcess;

test.beforeAll(async () => {
  relay = await startRelayProcess();
});
test.afterAll(async () => {
  await relay?.stop();
});

// No service worker: its 40 MB precache would count against the quota this test shrinks.
test.use({ serviceWorkers: 'block' });

test('a storage quota failure shows what to do, and Retry recovers once space is freed', async ({ page }) => {
  const model = await startModelServer('small');
  try {
    const cdp = await page.context().newCDPSession(page);
    const origin = new URL(process.env.MESHNET_APP_URL!).origin;
    // Room for the small files but not for one 8 MiB batch of weights.
    await cdp.send('Storage.overrideQuotaForOrigin', { origin, quotaSize: 2 * 1024 * 1024 });
    await page.goto(nodeUrl(relay, model, [2, 4], { backend: 'wasm' }));
    const s = await waitForState(page, 'error');
    expect(s.error?.code).toBe('MESH_ERR_QUOTA');
    expect(s.error?.message).toMatch(/storage is full/);
    await expect(page.locator('#state')).toHaveText('Error');
    await expect(page.locator('#headline')).toHaveText('Error: MESH_ERR_QUOTA');
    await expect(page.locator('#action')).toContainText('Free disk space');
    await expect(page.locator('#retry')).toBeVisible();

    await cdp.send('Storage.overrideQuotaForOrigin', { origin });
    // The donor freed space: IndexedDB's own quota check follows the override's removal later than
    // navigator.storage.estimate() does (a CI run: Retry at once failed again with the estimate already at 10 GiB).
    // Wait until a 16 MiB write fits, as it would on a disk with room, then Retry.
    await expect.poll(() => page.evaluate(probeWrite), { timeout: 15_000 }).toBe(true);
    await page.locator('#retry').click();
    await waitForState(page, 'serving');
    await expect(page.locator('#state')).toHaveText('Serving');
  } finally {
    await model.close();
  }
});

test('the model server killed mid-download shows the failure, and Retry resumes with only the missing bytes', async ({ page, context }) => {
  const dir = await ensureModel('small');
  let model: StaticServer = await startStaticServer({ root: dir, port: 0, host: '127.0.0.1' });
  const port = model.port;
  // Hold the third weight request (two 8 MiB batches are stored by then), kill the server, then let it go.
  let dataRequests = 0;
  let killed!: () => void;
  const serverKilled = new Promise<void>((r) => (killed = r));
  await context.route(/\.safetensors$/, async (route) => {
    const range = route.request().headers()['range'] ?? '';
    const start = Number(/bytes=(\d+)-/.exec(range)?.[1] ?? 0);
    // Header reads start at 0 (or just after); weight ranges start further in.
    if (start > 64 * 1024) dataRequests++;
    if (dataRequests === 3) await serverKilled;
    await route.continue();
  });
  try {
    await page.goto(nodeUrl(relay, model, [1, 5], { backend: 'wasm' }));
    await expect.poll(() => dataRequests, { timeout: 30_000 }).toBeGreaterThanOrEqual(3);
    const during = await status(page);
    expect(during.state).toBe('downloading');
    const partial = during.download!.loadedBytes;
    expect(partial).toBeGreaterThan(0);
    await model.close();
    killed();

    const s = await waitForState(page, 'error');
    expect(s.error?.code).toBe('MESH_ERR_MODEL_FETCH');
    await expect(page.locator('#action')).toContainText('resumes where it stopped');
    await context.unroute(/\.safetensors$/);

    model = await startStaticServer({ root: dir, port, host: '127.0.0.1' });
    await page.locator('#retry').click();
    const done = await waitForState(page, 'serving');
    const sent = [...model.stats.bytesByPath].filter(([p]) => p.endsWith('.safetensors')).reduce((n, [, b]) => n + b, 0);
    // The second attempt fetched only what was not stored (plus headers), not the whole span again.
    expect(sent).toBeLessThan(done.storedBytes - partial + 256 * 1024);
    expect(sent).toBeGreaterThan(0);
  } finally {
    await model.close();
  }
});

/** Whether a 16 MiB IndexedDB write fits now (in a database of its own, deleted after). */
async function probeWrite(): Promise<boolean> {
  const req = <T>(r: IDBRequest<T>) => new Promise<T>((res, rej) => ((r.onsuccess = () => res(r.result)), (r.onerror = () => rej(r.error))));
  try {
    const open = indexedDB.open('quota-probe', 1);
    open.onupgradeneeded = () => open.result.createObjectStore('x');
    const db = await req(open);
    try {
      const tx = db.transaction('x', 'readwrite');
      tx.objectStore('x').put(new Uint8Array(16 * 1024 * 1024), 'k');
      await new Promise<void>((res, rej) => ((tx.oncomplete = () => res()), (tx.onerror = () => rej(tx.error)), (tx.onabort = () => rej(tx.error))));
      return true;
    } finally {
      db.close();
      await req(indexedDB.deleteDatabase('quota-probe')).catch(() => undefined);
    }
  } catch {
    return false;
  }
}
