/**
 * The browser node's weight formats in real Chromium: 4-bit weights are
 * quantized layer by layer in the worker while the span loads and kept in
 * IndexedDB, so a reload quantizes nothing and answers byte for byte the
 * same (a damaged record is quantized again, alone); its answers match the
 * float64 reference on the dequantized weights.
 * On SwiftShader (no `shader-f16`) an f16 request runs f32 and the page
 * says why.
 */
import { expect, test } from '@playwright/test';
import { CHROMIUM_ARGS } from '../playwright.config.ts';
import { decodeTensor, encodeTensor } from '../src/protocol/tensor.ts';
import { newRefCache } from '../src/model/reference.ts';
import type { StaticServer } from '../src/cli/static-server.ts';
import type { RelayClient } from '../src/net/relay-client.ts';
import { replyJson } from '../src/protocol/envelopes.ts';
import { forwardFast, maxAbsDiff, nodeUrl, reference, waitForState, type RelayProcess, startRelayMesh, stopRelayMesh } from './support/mesh.ts';
import { q4Reference } from './support/q4-reference.ts';

test.use({ launchOptions: { executablePath: process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium', args: [...CHROMIUM_ARGS, '--enable-unsafe-webgpu'] }, serviceWorkers: 'block' });

// f32 kernels (onnxruntime's summation order, MatMulNBits dequantizing in f32) vs float64.
const TOL = 1e-4;

let relay: RelayProcess;
let model: StaticServer;
let caller: RelayClient;

test.beforeAll(async () => ({ relay, model, caller } = await startRelayMesh()));
test.afterAll(() => stopRelayMesh({ relay, model, caller }));

test('4-bit on WASM: quantized once while loading, read back from IndexedDB after a reload, same answers, equal to the reference on dequantized weights', async ({ page }) => {
  const logs: string[] = [];
  page.on('console', (m) => logs.push(m.text()));
  await page.goto(nodeUrl(relay, model, [1, 4], { backend: 'wasm', weights: 'q4', threads: '1' }));
  let s = await waitForState(page, 'serving', 90_000);
  expect(s.backend).toMatchObject({ kind: 'wasm', weights: 'q4', graphs: 'fused', fp16: false });
  // Three layers of seven projections each; tiny's head is tied (the embedding, kept f32).
  expect(s.quantization).toMatchObject({ quantized: 21, loaded: 0 });
  await expect(page.locator('#weights')).toContainText('4-bit weights · fused graphs · quantized 21 matrices here');
  expect(logs.some((l) => /layers 1-3 on wasm, fused graphs, q4 weights/.test(l))).toBe(true);

  const ref = reference('tiny');
  const q4 = q4Reference('tiny');
  const H = ref.cfg.hiddenSize;
  const ids = [12, 250, 31, 77];
  // Layer 0 by the dequantized reference: the page's input is what a q4 node before it would send.
  const x = Float32Array.from(q4.layers(0, 1, q4.embed(ids), ids.length, 0, newRefCache(q4.cfg)));
  const ask = () => forwardFast(caller, s.peerId!, { activation: encodeTensor(x, 'f32'), shape: [1, 4, H], endLayer: 3 });
  const head = () => forwardFast(caller, s.peerId!, { activation: encodeTensor(x, 'f32'), shape: [1, 4, H], sampling: { temperature: 0 } });

  const before = await ask();
  expect(before.status, new TextDecoder().decode(before.body)).toBe(200);
  const want = q4.layers(1, 3, Float64Array.from(x), 4, 0, newRefCache(q4.cfg));
  const { err, scale } = maxAbsDiff(decodeTensor(before.body, 'f32'), want);
  expect(err).toBeLessThanOrEqual(TOL * Math.max(1, scale));
  const tokBefore = await head();
  expect(tokBefore.status).toBe(200);
  expect(replyJson<{ token_id: number }>(tokBefore).token_id).toBe(q4.greedy(ids, 1)[0]);

  await page.reload();
  s = await waitForState(page, 'serving', 90_000);
  // Nothing fetched, nothing quantized: every projection came back from IndexedDB.
  expect(s.fetchedBytes).toBe(0);
  expect(s.quantization).toMatchObject({ quantized: 0, loaded: 21 });
  await expect(page.locator('#weights')).toContainText('21 matrices from storage, none quantized');
  const after = await ask();
  expect(after.status).toBe(200);
  expect(Buffer.from(after.body).equals(Buffer.from(before.body))).toBe(true);
  expect(replyJson<{ token_id: number }>(await head()).token_id).toBe(replyJson<{ token_id: number }>(tokBefore).token_id);

  // A damaged record (scales cut short) is dropped and quantized again; the rest still come from storage.
  const damaged = await page.evaluate(
    () =>
      new Promise<string>((resolve, reject) => {
        const open = indexedDB.open('meshnet');
        open.onerror = () => reject(open.error);
        open.onsuccess = () => {
          const tx = open.result.transaction('q4', 'readwrite');
          const store = tx.objectStore('q4');
          const cur = store.openCursor();
          cur.onsuccess = () => {
            const c = cur.result!;
            const r = c.value as { name: string; scales: ArrayBuffer };
            c.update({ ...r, scales: r.scales.slice(0, 8) });
            tx.oncomplete = () => resolve(r.name);
          };
        };
      }),
  );
  expect(damaged).toMatch(/_proj\.weight$/);
  await page.reload();
  s = await waitForState(page, 'serving', 90_000);
  expect(s.quantization).toMatchObject({ quantized: 1, loaded: 20 });
  const again = await ask();
  expect(Buffer.from(again.body).equals(Buffer.from(before.body))).toBe(true);
});

test('f16 asked on SwiftShader (no shader-f16): runs f32 on the fused graphs, says why on the page, and matches the reference', async ({ page }) => {
  await page.goto(nodeUrl(relay, model, [2, 4], { backend: 'webgpu', weights: 'f16' }));
  const s = await waitForState(page, 'serving', 90_000);
  expect(s.backend).toMatchObject({ kind: 'webgpu', fp16: false, weights: 'f32', graphs: 'fused' });
  expect(s.backend?.precision).toBe('f32 activations: f16 was asked but the adapter has no shader-f16');
  await expect(page.locator('#precision')).toHaveText('f32 activations: f16 was asked but the adapter has no shader-f16');

  const ref = reference('tiny');
  const H = ref.cfg.hiddenSize;
  const ids = [12, 250, 31, 77];
  const x = Float32Array.from(ref.layers(0, 2, ref.embed(ids), ids.length, 0, newRefCache(ref.cfg)));
  const tok = await forwardFast(caller, s.peerId!, { activation: encodeTensor(x, 'f32'), shape: [1, 4, H], sampling: { temperature: 0 } });
  expect(tok.status, new TextDecoder().decode(tok.body)).toBe(200);
  expect(replyJson<{ token_id: number }>(tok).token_id).toBe(ref.greedy(ids, 1)[0]);
});
