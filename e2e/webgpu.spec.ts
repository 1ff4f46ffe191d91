/**
 * WebGPU, correctness only: headless Chromium's WebGPU is SwiftShader (a
 * software fallback adapter, fp32 only, ~50x slower than WASM), so this uses
 * the `tiny` model. Forced WebGPU must still match the float64 reference;
 * 'auto' must refuse the fallback adapter and pick WASM.
 */
import { expect, test } from '@playwright/test';
import { CHROMIUM_ARGS } from '../playwright.config.ts';
import { decodeTensor, encodeTensor } from '../src/protocol/tensor.ts';
import { newRefCache } from '../src/model/reference.ts';
import type { StaticServer } from '../src/cli/static-server.ts';
import type { RelayClient } from '../src/net/relay-client.ts';
import { replyJson } from '../src/protocol/envelopes.ts';
import { forwardFast, forwardRpc, maxAbsDiff, nodeUrl, reference, waitForState, type RelayProcess, startRelayMesh, stopRelayMesh } from './support/mesh.ts';

test.use({ launchOptions: { executablePath: process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium', args: [...CHROMIUM_ARGS, '--enable-unsafe-webgpu'] }, serviceWorkers: 'block' });

// fp32 WebGPU kernels (different summation order than WASM) vs float64.
const TOL = 1e-4;

let relay: RelayProcess;
let model: StaticServer;
let caller: RelayClient;

test.beforeAll(async () => ({ relay, model, caller } = await startRelayMesh()));
test.afterAll(() => stopRelayMesh({ relay, model, caller }));

test('forced WebGPU (SwiftShader, fp32) answers /forward with the reference activation and token', async ({ page }) => {
  await page.goto(nodeUrl(relay, model, [2, 4], { backend: 'webgpu' }));
  const s = await waitForState(page, 'serving', 90_000);
  expect(s.backend).toMatchObject({ kind: 'webgpu', fp16: false });
  expect(s.backend?.adapter).toContain('swiftshader');
  await expect(page.locator('#backend')).toHaveText('WebGPU');

  const ref = reference('tiny');
  const H = ref.cfg.hiddenSize;
  const ids = [12, 250, 31, 77];
  const x = Float32Array.from(ref.layers(0, 2, ref.embed(ids), ids.length, 0, newRefCache(ref.cfg)));
  // Stop before the head: the activation itself.
  const act = await forwardRpc(relay, s.peerId!, { activation: encodeTensor(x, 'f32'), shape: [1, 4, H], endLayer: 3 });
  expect(act.status, new TextDecoder().decode(act.body)).toBe(200);
  const want = ref.layers(2, 3, Float64Array.from(x), 4, 0, newRefCache(ref.cfg));
  const { err, scale } = maxAbsDiff(decodeTensor(act.body, 'f32'), want);
  expect(err).toBeLessThanOrEqual(TOL * Math.max(1, scale));
  // Through the head: the greedy token of the un-split model.
  const tok = await forwardFast(caller, s.peerId!, { activation: encodeTensor(x, 'f32'), shape: [1, 4, H], sampling: { temperature: 0 } });
  expect(tok.status).toBe(200);
  expect(replyJson<{ token_id: number }>(tok).token_id).toBe(ref.greedy(ids, 1)[0]);
});

test("'auto' sees the fallback adapter and picks WASM, saying why", async ({ page }) => {
  await page.goto(nodeUrl(relay, model, [0, 2], { backend: 'auto' }));
  const s = await waitForState(page, 'serving');
  expect(s.backend?.kind).toBe('wasm');
  expect(s.backend?.reason).toMatch(/software fallback/);
});
