/**
 * A page on WebGPU (SwiftShader) whose GPU device is lost, twice, through
 * the page's worker (`?test_lose_gpu=`: GPUDevice.destroy() before the N-th
 * session run): every call meanwhile is answered 503 at once with the loss
 * named, never left hanging; the span is rebuilt on the same layers, on a
 * fresh WebGPU device after the first loss and on WASM after the second,
 * and then answers the float64 reference's token again, under the same peer
 * id on the same relay registration.
 */
import { expect, test } from '@playwright/test';
import { CHROMIUM_ARGS } from '../playwright.config.ts';
import { encodeTensor } from '../src/protocol/tensor.ts';
import { newRefCache } from '../src/model/reference.ts';
import type { StaticServer } from '../src/cli/static-server.ts';
import type { RelayClient } from '../src/net/relay-client.ts';
import { replyJson } from '../src/protocol/envelopes.ts';
import { forwardRpc, nodeUrl, reference, status, waitForState, type RelayProcess, startRelayMesh, stopRelayMesh } from './support/mesh.ts';

test.use({ launchOptions: { executablePath: process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium', args: [...CHROMIUM_ARGS, '--enable-unsafe-webgpu'] }, serviceWorkers: 'block' });

let relay: RelayProcess;
let model: StaticServer;
let caller: RelayClient;

test.beforeAll(async () => ({ relay, model, caller } = await startRelayMesh()));
test.afterAll(() => stopRelayMesh({ relay, model, caller }));

test('a lost GPU device is rebuilt on a fresh device, then on WASM, and the page keeps answering the reference token', async ({ page }) => {
  test.setTimeout(300_000);
  // Each forward through [2, 4) and the head runs 3 sessions; warm-up and the rebuild's timing step run some too.
  await page.goto(nodeUrl(relay, model, [2, 4], { backend: 'webgpu', test_lose_gpu: '30,30' }));
  const s = await waitForState(page, 'serving', 120_000);
  expect(s.backend).toMatchObject({ kind: 'webgpu' });
  const peerId = s.peerId!;

  const ref = reference('tiny');
  const H = ref.cfg.hiddenSize;
  const ids = [12, 250, 31, 77];
  const x = Float32Array.from(ref.layers(0, 2, ref.embed(ids), ids.length, 0, newRefCache(ref.cfg)));
  const want = ref.greedy(ids, 1)[0];
  const forward = () => forwardRpc(relay, peerId, { activation: encodeTensor(x, 'f32'), shape: [1, 4, H], sampling: { temperature: 0 } });

  const loseAndRecover = async (kind: string): Promise<void> => {
    let lost;
    for (let i = 0; i < 40 && !lost; i++) {
      const r = await forward();
      if (r.status === 200) expect(replyJson<{ token_id: number }>(r).token_id).toBe(want);
      else lost = r;
    }
    expect(lost, 'the device was never lost').toBeDefined();
    expect(lost!.status).toBe(503);
    expect(new TextDecoder().decode(lost!.body)).toMatch(/GPU device was lost/);
    // Until the rebuild serves, calls keep getting 503 at once; then the reference token again.
    for (let t0 = Date.now(); ; ) {
      const r = await forward();
      if (r.status === 200) {
        expect(replyJson<{ token_id: number }>(r).token_id).toBe(want);
        break;
      }
      expect(r.status).toBe(503);
      expect(Date.now() - t0).toBeLessThan(120_000);
      await page.waitForTimeout(250);
    }
    await expect.poll(async () => (await status(page)).backend?.kind, { timeout: 10_000 }).toBe(kind);
  };

  await loseAndRecover('webgpu');
  await loseAndRecover('wasm');
  const after = await status(page);
  expect(after.peerId).toBe(peerId);
  expect(after.state).toBe('serving');
  expect(after.backend?.reason).toMatch(/lost 2 times/);
});
