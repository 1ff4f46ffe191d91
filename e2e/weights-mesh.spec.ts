/**
 * Browser meshes by weight format: three pages join a tracker with the same
 * `?weights=` and together stream a chat through its OpenAI API. On f32 the
 * greedy tokens equal the float64 reference's; on 4-bit they equal the
 * reference run on the dequantized weights (the independent check of the
 * quantizer and the MatMulNBits kernels together). The tracker sizes spans
 * by the announced format: 1.25 MiB holds one f32 layer of tiny with its KV
 * reserve, two 4-bit ones.
 */
import { expect, test, type Browser, type BrowserContext, type Page } from '@playwright/test';
import OpenAI from 'openai';
import type { StaticServer } from '../src/cli/static-server.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { makeModel } from '../src/model/fixture.ts';
import type { ReferenceModel } from '../src/model/reference.ts';
import type { NodeStatus, WeightFormat } from '../src/host/browser/engine.ts';
import { until, type TrackerProc } from '../test/helpers/mesh.ts';
import { appUrl, reference, status, type RelayProcess, startTrackerMesh, stopTrackerMesh } from './support/mesh.ts';
import { q4Reference } from './support/q4-reference.ts';

const MESSAGES = [{ role: 'user' as const, content: 'Tell me about the quick brown fox.' }];
const MAX_TOKENS = 24;

let relay: RelayProcess;
let model: StaticServer;
let tracker: TrackerProc;

// A tracker per test: the other format's pages must not linger in its registry.
test.beforeEach(async () => ({ relay, model, tracker } = await startTrackerMesh()));
test.afterEach(() => stopTrackerMesh({ relay, model, tracker }));

interface NodePage {
  context: BrowserContext;
  page: Page;
  span: [number, number];
}

async function openNode(browser: Browser, budgetMib: number, weights: WeightFormat): Promise<NodePage> {
  const context = await browser.newContext({ serviceWorkers: 'block' });
  const page = await context.newPage();
  const q = new URLSearchParams({ relay: relay.url, tracker: tracker.url, model: 'tiny', budget: String(budgetMib), backend: 'wasm', threads: '1', weights, rtc: 'off' });
  await page.goto(`${appUrl()}?${q}`);
  const s = await until(async () => {
    const st: NodeStatus = await status(page);
    if (st.state === 'error') throw new Error(`node failed: ${st.error?.code}: ${st.error?.message}`);
    return st.tracker?.assignment ? st : undefined;
  }, 30_000, 'a tracker assignment');
  const a = s.tracker!.assignment!;
  return { context, page, span: [a.startLayer, a.endLayer] };
}

function referenceText(ref: ReferenceModel): { ids: number[]; text: string } {
  const files = makeModel('tiny');
  const utf8d = new TextDecoder();
  const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(files.get('tokenizer_config.json')!)), { extraEosTokenIds: ref.cfg.eosTokenIds });
  const all = ref.greedy(tok.encodeChat(MESSAGES), MAX_TOKENS);
  const eos = all.findIndex((t) => tok.isEos(t));
  const ids = eos >= 0 ? all.slice(0, eos) : all;
  const dec = tok.streamDecoder({ skipSpecialTokens: true });
  return { ids, text: ids.map((t) => dec.push(t)).join('') };
}

async function streamChat(): Promise<{ text: string; completionTokens: number | undefined }> {
  const client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
  const stream = await client.chat.completions.create({ model: 'tiny', messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let completionTokens: number | undefined;
  for await (const c of stream) {
    if (c.usage) completionTokens = c.usage.completion_tokens;
    const d = c.choices[0]?.delta.content;
    if (d) text += d;
  }
  return { text, completionTokens };
}

async function meshChat(browser: Browser, weights: WeightFormat, budgetMib: number, layersEach: number, ref: ReferenceModel): Promise<void> {
  const nodes: NodePage[] = [];
  try {
    for (let i = 0; i < 3; i++) nodes.push(await openNode(browser, budgetMib, weights));
    console.log(`[weights-mesh] ${weights}: assignments ${JSON.stringify(nodes.map((n) => n.span))}`);
    expect(nodes.every((n) => n.span[1] - n.span[0] === layersEach)).toBe(true);
    const all = await until(async () => {
      const st = await Promise.all(nodes.map((n) => status(n.page)));
      return st.every((x) => x.state === 'serving') ? st : undefined;
    }, 90_000, 'three serving pages');
    for (const st of all) expect(st.backend).toMatchObject({ kind: 'wasm', weights, graphs: 'fused' });
    await until(async () => {
      const d = (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { nodes: Array<{ status: string; weight_format: string }>; models: Array<{ complete: boolean }> };
      return d.nodes.length === 3 && d.nodes.every((n) => n.status === 'serving' && n.weight_format === weights) && d.models[0]!.complete;
    }, 30_000, `three serving ${weights} nodes at the tracker, every layer served`);

    // The dashboard shows each node's format.
    const dash = await browser.newPage();
    try {
      await dash.goto(`${tracker.url}/dashboard`);
      await expect(dash.locator('#nodes tr')).toHaveCount(3 + 1);
      await expect(dash.locator('#nodes th').nth(3)).toHaveText('weights');
      await expect(dash.locator('#nodes tr td:nth-child(4)')).toHaveText([weights, weights, weights]);
    } finally {
      await dash.close();
    }

    const want = referenceText(ref);
    expect(want.ids.length).toBeGreaterThan(5);
    const got = await streamChat();
    expect(got.text).toBe(want.text);
    expect(got.completionTokens).toBe(want.ids.length);
  } finally {
    await Promise.all(nodes.map((n) => n.context.close().catch(() => undefined)));
  }
}

test('three f32 pages stream the float64 reference greedy', async ({ browser }) => {
  test.setTimeout(150_000);
  await meshChat(browser, 'f32', 1.5, 2, reference('tiny'));
});

test('three 4-bit pages, two layers each where f32 fits one, stream the reference greedy on the dequantized weights', async ({ browser }) => {
  test.setTimeout(150_000);
  await meshChat(browser, 'q4', 1.25, 2, q4Reference('tiny'));
});
