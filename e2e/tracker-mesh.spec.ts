/**
 * Browser nodes that join a tracker: four pages opened with `?tracker=`
 * register (signed with their relay key), get spans sized from their memory
 * budgets, and together answer a streamed chat through the tracker's OpenAI
 * API; one page is the head (POST /generate over the relay). The greedy
 * tokens equal the float64 reference, and closing the route's other page
 * mid-generation changes nothing: the head replays the session onto the
 * page holding the same layers.
 *
 * A budget of 1.5 MiB holds two layers of tiny with its KV reserve, so the
 * pages, registering in order, get [0,2), [2,4), [0,2), [2,4): every layer
 * held twice. That placement is also one the tracker's rebalancing never
 * changes (any move leaves a layer with one holder), and the one it moves
 * towards should a registration race a rebalance; with single-holder
 * layers it moves spares towards slow layers, which a test cannot pin.
 */
import { expect, test, type Browser, type BrowserContext, type Page } from '@playwright/test';
import OpenAI from 'openai';
import type { StaticServer } from '../src/cli/static-server.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { makeModel } from '../src/model/fixture.ts';
import type { NodeStatus } from '../src/host/browser/engine.ts';
import { until, type TrackerProc } from '../test/helpers/mesh.ts';
import { appUrl, reference, status, type RelayProcess, startTrackerMesh, stopTrackerMesh } from './support/mesh.ts';
import { screenshotPath } from './support/screenshots.ts';

const MESSAGES = [{ role: 'user' as const, content: 'Tell me about the quick brown fox.' }];
// Long enough that closing a page after the first token lands mid-generation (no eos within it for this prompt).
const MAX_TOKENS = 100;

let relay: RelayProcess;
let model: StaticServer;
let tracker: TrackerProc;

test.beforeAll(async () => ({ relay, model, tracker } = await startTrackerMesh()));
test.afterAll(() => stopTrackerMesh({ relay, model, tracker }));

interface BrowserNodePage {
  context: BrowserContext;
  page: Page;
  peerId: string;
  span: [number, number];
}

async function openTrackedNode(browser: Browser, budgetMib: number): Promise<BrowserNodePage> {
  const context = await browser.newContext({ serviceWorkers: 'block' });
  const page = await context.newPage();
  const q = new URLSearchParams({ relay: relay.url, tracker: tracker.url, model: 'tiny', budget: String(budgetMib), backend: 'wasm', threads: '1', rtc: 'off' });
  await page.goto(`${appUrl()}?${q}`);
  // Registered and assigned: the next page's assignment depends on this one's.
  const s = await until(async () => {
    const st: NodeStatus = await status(page);
    if (st.state === 'error') throw new Error(`node failed: ${st.error?.code}: ${st.error?.message}`);
    return st.tracker?.assignment ? st : undefined;
  }, 30_000, 'a tracker assignment');
  const a = s.tracker!.assignment!;
  return { context, page, peerId: s.peerId!, span: [a.startLayer, a.endLayer] };
}

function referenceChat(): { ids: number[]; text: string } {
  const files = makeModel('tiny');
  const utf8d = new TextDecoder();
  const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(files.get('tokenizer_config.json')!)), { extraEosTokenIds: reference('tiny').cfg.eosTokenIds });
  const all = reference('tiny').greedy(tok.encodeChat(MESSAGES), MAX_TOKENS);
  const eos = all.findIndex((t) => tok.isEos(t));
  const ids = eos >= 0 ? all.slice(0, eos) : all;
  const dec = tok.streamDecoder({ skipSpecialTokens: true });
  return { ids, text: ids.map((t) => dec.push(t)).join('') };
}

/** `onStarted` runs once the tracker has committed to a route and the head is generating (the first token is out). */
async function streamChat(client: OpenAI, onStarted?: () => Promise<void>): Promise<{ text: string; completionTokens: number | undefined }> {
  const stream = await client.chat.completions.create({ model: 'tiny', messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0, stream: true, stream_options: { include_usage: true } });
  await onStarted?.();
  let text = '';
  let completionTokens: number | undefined;
  for await (const c of stream) {
    if (c.usage) completionTokens = c.usage.completion_tokens;
    const d = c.choices[0]?.delta.content;
    if (d) text += d;
  }
  return { text, completionTokens };
}

interface Dashboard {
  nodes: Array<{ peer_id: string; host: string; status: string; tokens_served: number }>;
  recent_routes: Array<{ kind: string; head: string; hops: Array<{ peer_id: string; start_layer: number; end_layer: number }> }>;
}

const dashboard = async (): Promise<Dashboard> => (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as Dashboard;

test('four pages join the tracker, serve a streamed chat equal to the reference, and survive closing a page mid-generation', async ({ browser }) => {
  test.setTimeout(150_000);
  const nodes: BrowserNodePage[] = [];
  try {
    for (let i = 0; i < 4; i++) nodes.push(await openTrackedNode(browser, 1.5));
    console.log(`[tracker-mesh] first assignments ${JSON.stringify(nodes.map((n) => n.span))}`);
    expect(new Set(nodes.map((n) => n.peerId)).size).toBe(4);
    // Every layer held twice; if registration raced with a rebalance the tracker moves a node there itself.
    await until(async () => {
      const all = await Promise.all(nodes.map((n) => status(n.page)));
      if (!all.every((st) => st.state === 'serving' && st.model)) return false;
      all.forEach((st, i) => (nodes[i]!.span = [st.model!.startLayer, st.model!.endLayer]));
      return nodes.filter((n) => n.span.join() === '0,2').length === 2 && nodes.filter((n) => n.span.join() === '2,4').length === 2;
    }, 60_000, 'two pages on [0,2) and two on [2,4), serving');
    // The tracker routes only over spans the nodes report as served.
    await until(async () => {
      const d = await dashboard();
      return d.nodes.length === 4 && d.nodes.every((n) => n.status === 'serving' && n.host === 'browser');
    }, 20_000, 'four serving browser nodes at the tracker');
    expect(await Promise.all(nodes.map(async (n) => (await status(n.page)).model?.pipelineHead))).toEqual(nodes.map((n) => n.span[0] === 0));

    const want = referenceChat();
    expect(want.ids.length).toBeGreaterThan(5);
    const client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });

    const first = await streamChat(client);
    expect(first.text).toBe(want.text);
    expect(first.completionTokens).toBe(want.ids.length);
    const route = (await dashboard()).recent_routes.find((r) => r.kind === 'generate')!;
    expect(route.hops.map((h) => [h.start_layer, h.end_layer])).toEqual([[0, 2], [2, 4]]);

    // The dashboard draws the same picture: every layer held twice, four browser nodes, the route just taken.
    const dash = await browser.newPage({ viewport: { width: 1280, height: 900 } });
    try {
      await dash.goto(`${tracker.url}/dashboard`);
      await expect(dash.locator('.grid .cov')).toHaveText(['2', '2', '2', '2']);
      await expect(dash.locator('.grid td.peer')).toHaveCount(4 + 1);
      await expect(dash.locator('.badge.ok')).toHaveText('every layer served');
      await expect(dash.locator('#nodes tr')).toHaveCount(4 + 1);
      await expect(dash.locator('#routes td.route').first()).toContainText(`${route.hops[0]!.peer_id.slice(0, 8)} [0–1]`);
      // KV use per node (every browser node reports it) and the admission queue, idle now.
      await expect(dash.locator('#nodes .kv')).toHaveCount(4);
      await expect(dash.locator('#queue')).toContainText('waiting for KV room');
      await dash.screenshot({ path: screenshotPath('dashboard.png'), fullPage: true });
    } finally {
      await dash.close();
    }

    // Second chat: once it is under way, close the route's second page.
    let closed: BrowserNodePage | undefined;
    const t0 = performance.now();
    let closedAfterMs = 0;
    const second = await streamChat(client, async () => {
      const r = (await dashboard()).recent_routes.find((x) => x.kind === 'generate')!;
      closed = nodes.find((p) => p.peerId === r.hops[1]!.peer_id)!;
      await closed.page.close();
      closedAfterMs = performance.now() - t0;
    });
    console.log(`[tracker-mesh] chat with the tail page closed ${Math.round(closedAfterMs)} ms in: ${Math.round(performance.now() - t0)} ms`);
    expect(closed).toBeDefined();
    expect(second.text).toBe(want.text);
    expect(second.completionTokens).toBe(want.ids.length);
    const spare = nodes.find((p) => p !== closed && p.span[0] === 2)!;
    const replaced = (await dashboard()).recent_routes.find((r) => r.kind === 'replace');
    expect(replaced?.hops.map((h) => h.peer_id)).toEqual([spare.peerId]);
    expect((await status(spare.page)).tokensServed).toBeGreaterThan(0);
  } finally {
    await Promise.all(nodes.map((n) => n.context.close().catch(() => undefined)));
  }
});
