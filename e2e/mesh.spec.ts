/**
 * Browser pages as a pipeline: three pages each hold a span, and /forward
 * chained across them reproduces the un-split model's greedy tokens. One
 * page answers 500 concurrent requests. Also writes docs/browser-node.png.
 */
import { expect, test, type Browser, type BrowserContext, type Page } from '@playwright/test';
import { decodeTensor, encodeTensor } from '../src/protocol/tensor.ts';
import type { StaticServer } from '../src/cli/static-server.ts';
import type { RelayClient } from '../src/net/relay-client.ts';
import { replyJson } from '../src/protocol/envelopes.ts';
import { forwardFast, nodeUrl, reference, waitForState, type RelayProcess, startRelayMesh, stopRelayMesh } from './support/mesh.ts';
import { screenshotPath } from './support/screenshots.ts';

let relay: RelayProcess;
let model: StaticServer;
let caller: RelayClient;

test.beforeAll(async () => ({ relay, model, caller } = await startRelayMesh()));
test.afterAll(() => stopRelayMesh({ relay, model, caller }));

async function openNode(browser: Browser, layers: [number, number]): Promise<{ context: BrowserContext; page: Page; peerId: string }> {
  // A context per node: its own IndexedDB, so its own identity and peer id.
  const context = await browser.newContext({ serviceWorkers: 'block' });
  const page = await context.newPage();
  await page.goto(nodeUrl(relay, model, layers, { backend: 'wasm', threads: '1' }));
  const s = await waitForState(page, 'serving');
  return { context, page, peerId: s.peerId! };
}

test('three pages holding 0-2, 2-3, 3-4 chain /forward to the un-split model’s greedy tokens', async ({ browser }) => {
  const spans: Array<[number, number]> = [[0, 2], [2, 3], [3, 4]];
  const nodes = await Promise.all(spans.map((s) => openNode(browser, s)));
  try {
    expect(new Set(nodes.map((n) => n.peerId)).size).toBe(3);
    const ref = reference('tiny');
    const H = ref.cfg.hiddenSize;
    const prompt = [1, 44, 210, 73, 380, 15];
    const want = ref.greedy(prompt, 8);

    const got: number[] = [];
    let input = prompt;
    let position = 0;
    for (let step = 0; step < want.length; step++) {
      // The embedding is a table lookup: the caller plays the head node and embeds.
      let act: Uint8Array = encodeTensor(Float32Array.from(ref.embed(input)), 'bf16');
      let token: number | undefined;
      for (const [i, node] of nodes.entries()) {
        const reply = await forwardFast(caller, node.peerId, { activation: act, shape: [1, input.length, H], dtype: 'bf16', session: 'chat-1', position, sampling: { temperature: 0 } });
        expect(reply.status, new TextDecoder().decode(reply.body)).toBe(200);
        if (i < nodes.length - 1) {
          expect(reply.headers['x-meshnet-dtype']).toBe('bf16');
          act = reply.body;
        } else token = replyJson<{ token_id: number; text: string }>(reply).token_id;
      }
      got.push(token!);
      position += input.length;
      input = [token!];
    }
    expect(got).toEqual(want);
    await expect(nodes[2]!.page.locator('#tokens')).not.toHaveText('0');
  } finally {
    await Promise.all(nodes.map((n) => n.context.close()));
  }
});

test('one page answers 500 concurrent /forward requests, all correctly', async ({ browser }) => {
  const node = await openNode(browser, [0, 4]);
  try {
    const ref = reference('tiny');
    const H = ref.cfg.hiddenSize;
    const x = Float32Array.from(ref.embed([7]));
    const body = encodeTensor(x, 'f32');
    const t0 = Date.now();
    const replies = await Promise.all(Array.from({ length: 500 }, (_, i) => forwardFast(caller, node.peerId, { activation: body, shape: [1, 1, H], session: `c${i}`, position: 0, endLayer: 3 })));
    const ms = Date.now() - t0;
    const statuses = new Map<number, number>();
    for (const r of replies) statuses.set(r.status, (statuses.get(r.status) ?? 0) + 1);
    expect(Object.fromEntries(statuses)).toEqual({ 200: 500 });
    // Same input, same layers: every answer is the same activation.
    const first = decodeTensor(replies[0]!.body, 'f32');
    for (const r of replies) expect(decodeTensor(r.body, 'f32')).toEqual(first);
    console.log(`500 concurrent requests answered in ${ms} ms`);
    await expect(node.page.locator('#requests')).toContainText('500');
  } finally {
    await node.context.close();
  }
});

test('screenshot of the page while serving (docs/browser-node.png)', async ({ browser }) => {
  const node = await openNode(browser, [0, 2]);
  try {
    const ref = reference('tiny');
    const x = encodeTensor(Float32Array.from(ref.embed([3, 4, 5])), 'f32');
    // A few seconds of traffic so the sparkline and counters show something.
    for (let i = 0; i < 40; i++) {
      await forwardFast(caller, node.peerId, { activation: x, shape: [1, 3, ref.cfg.hiddenSize] });
      if (i % 10 === 9) await node.page.waitForTimeout(700);
    }
    await node.page.waitForTimeout(700);
    await expect(node.page.locator('#state')).toHaveText('Serving');
    await node.page.setViewportSize({ width: 1100, height: 820 });
    await node.page.screenshot({ path: screenshotPath('browser-node.png'), fullPage: true });
  } finally {
    await node.context.close();
  }
});
