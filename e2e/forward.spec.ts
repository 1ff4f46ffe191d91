/**
 * The browser node answers /forward through the real relay, by the fast
 * path and by /rpc, with the activation the float64 reference computes for
 * its layers.
 */
import { expect, test } from '@playwright/test';
import { decodeTensor, encodeTensor } from '../src/protocol/tensor.ts';
import { newRefCache } from '../src/model/reference.ts';
import type { StaticServer } from '../src/cli/static-server.ts';
import type { RelayClient } from '../src/net/relay-client.ts';
import { formatBytes } from '../src/app/format.ts';
import { forwardFast, forwardRpc, maxAbsDiff, nodeUrl, reference, status, waitForState, type RelayProcess, startRelayMesh, stopRelayMesh } from './support/mesh.ts';

// f32 on the wire, ORT's f32 kernels vs float64: relative to the activation's scale.
const TOL = 1e-4;

let relay: RelayProcess;
let model: StaticServer;
let caller: RelayClient;

test.beforeAll(async () => ({ relay, model, caller } = await startRelayMesh()));
test.afterAll(() => stopRelayMesh({ relay, model, caller }));

test('registers with the relay and answers /forward by the fast path and by /rpc with the reference activation', async ({ page }) => {
  page.on('console', (m) => console.log(`[page] ${m.text()}`));
  await page.goto(nodeUrl(relay, model, [1, 3], { backend: 'wasm' }));
  const s = await waitForState(page, 'serving');
  expect(s.peerId).toMatch(/^[0-9a-f]{32}$/);
  expect(s.backend?.kind).toBe('wasm');
  expect(s.crossOriginIsolated).toBe(true);
  await expect(page.locator('#state')).toHaveText('Serving');

  const ref = reference('tiny');
  const H = ref.cfg.hiddenSize;
  const x = Float32Array.from(ref.embed([5, 40, 77, 300]));
  const want = ref.layers(1, 3, Float64Array.from(x), 4, 0, newRefCache(ref.cfg));
  for (const via of ['fast', 'rpc'] as const) {
    const args = { activation: encodeTensor(x, 'f32'), shape: [1, 4, H] as [number, number, number] };
    const reply = via === 'fast' ? await forwardFast(caller, s.peerId!, args) : await forwardRpc(relay, s.peerId!, args);
    expect(reply.status, new TextDecoder().decode(reply.body)).toBe(200);
    expect(reply.headers['x-meshnet-shape']).toBe(`1,4,${H}`);
    const { err, scale } = maxAbsDiff(decodeTensor(reply.body, 'f32'), want);
    expect(err, via).toBeLessThanOrEqual(TOL * Math.max(1, scale));
  }
});

test('Pause refuses /forward with 503 until Resume; the memory budget control reaches the node and persists', async ({ page }) => {
  await page.goto(nodeUrl(relay, model, [0, 2], { backend: 'wasm' }));
  const s = await waitForState(page, 'serving');
  const ref = reference('tiny');
  const args = { activation: encodeTensor(Float32Array.from(ref.embed([3])), 'f32'), shape: [1, 1, ref.cfg.hiddenSize] as [number, number, number] };

  await page.getByRole('button', { name: 'Pause' }).click();
  await expect(page.locator('#state')).toHaveText('Paused');
  await expect(page.getByRole('button', { name: 'Resume' })).toHaveAttribute('aria-pressed', 'true');
  const refused = await forwardFast(caller, s.peerId!, args);
  expect(refused.status).toBe(503);
  expect(new TextDecoder().decode(refused.body)).toContain('paused');

  await page.getByRole('button', { name: 'Resume' }).click();
  await expect(page.locator('#state')).toHaveText('Serving');
  expect((await forwardFast(caller, s.peerId!, args)).status).toBe(200);

  // A live session survives a new budget: the KV caches get what the weights leave of it, in place (no rebuild, no 409).
  const step = (position: number) =>
    caller.request(s.peerId!, { method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': `1,1,${ref.cfg.hiddenSize}`, 'x-meshnet-dtype': 'f32', 'x-meshnet-session': 'live', 'x-meshnet-position': String(position), ...(position === 0 ? { 'x-meshnet-session-tokens': '16' } : {}) }, body: args.activation }, { timeoutMs: 60_000 });
  expect((await step(0)).status).toBe(200);
  await page.locator('#budget').fill('512');
  await page.locator('#budget').dispatchEvent('change');
  await expect(page.locator('#budget-value')).toHaveText('512 MiB');
  expect((await step(1)).status).toBe(200);
  const info = JSON.parse(new TextDecoder().decode((await caller.request(s.peerId!, { method: 'GET', path: '/info' }, { timeoutMs: 10_000 })).body)) as { kv: { budget_bytes: number; sessions: number } };
  expect(info.kv.sessions).toBe(1);
  expect(info.kv.budget_bytes).toBeGreaterThan(500 * 2 ** 20);
  expect(info.kv.budget_bytes).toBeLessThan(512 * 2 ** 20);
  // The page shows the KV caches against their own share of the budget (the weights' bytes apart).
  await expect.poll(async () => (await status(page)).kvBudgetBytes).toBe(info.kv.budget_bytes);
  await expect(page.locator('#sessions')).toContainText(`of ${formatBytes(info.kv.budget_bytes)} KV cache`);
  expect((await forwardFast(caller, s.peerId!, args)).status).toBe(200);
  // Stored: a reload without ?budget keeps it.
  await page.reload();
  const after = await waitForState(page, 'serving');
  expect(after.memoryBudgetBytes).toBe(512 * 2 ** 20);
});
