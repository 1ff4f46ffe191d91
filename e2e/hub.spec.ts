/**
 * A browser node serving a hub model: the tracker's model is `hf:org/tiny`
 * on the hub mimic (two origins: the hub's /resolve/ answers .safetensors
 * with a 302 to the CDN origin). The page gets the tracker's pinned
 * /resolve/SHA/ URL in its assignment, follows the cross-origin redirect
 * with its Range header (CORS), fetches only byte ranges of the weights,
 * and streams the float64 reference's greedy tokens through the tracker.
 */
import { expect, test } from '@playwright/test';
import OpenAI from 'openai';
import { makeModel } from '../src/model/fixture.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import type { NodeStatus } from '../src/host/browser/engine.ts';
import { spawnMeshnet, until, type Proc } from '../test/helpers/mesh.ts';
import { startHubMimic, type HubMimic } from '../test/helpers/hub-mimic.ts';
import { appUrl, reference, startRelayProcess, status, type RelayProcess } from './support/mesh.ts';

const MESSAGES = [{ role: 'user' as const, content: 'Tell me about the quick brown fox.' }];
const MAX_TOKENS = 16;

let mimic: HubMimic;
let relay: RelayProcess;
let tracker: Proc;
let trackerUrl: string;

test.beforeAll(async () => {
  mimic = await startHubMimic({ 'org/tiny': { files: makeModel('tiny') } });
  relay = await startRelayProcess();
  tracker = spawnMeshnet(['tracker', '--port', '0', '--log-level', 'warn', '--model', 'tiny=hf:org/tiny', '--relay', relay.url, '--heartbeat-interval-ms', '1000'], { HF_ENDPOINT: mimic.endpoint });
  trackerUrl = (await tracker.waitFor((e) => e.event === 'listening')).url as string;
});
test.afterAll(async () => {
  await tracker?.stop();
  await relay?.stop();
  await mimic?.close();
});

test('a browser node loads its span from the pinned hub URL by Range through the CDN redirect and chats the reference tokens', async ({ browser }) => {
  const files = makeModel('tiny');
  const d = new TextDecoder();
  const tok = ModelTokenizer.fromJson(JSON.parse(d.decode(files.get('tokenizer.json')!)), JSON.parse(d.decode(files.get('tokenizer_config.json')!)), { extraEosTokenIds: reference('tiny').cfg.eosTokenIds });
  const all = reference('tiny').greedy(tok.encodeChat(MESSAGES), MAX_TOKENS);
  const eos = all.findIndex((t) => tok.isEos(t));
  const want = eos >= 0 ? all.slice(0, eos) : all;
  const sha = mimic.sha('org/tiny');

  const context = await browser.newContext({ serviceWorkers: 'block' });
  const page = await context.newPage();
  const q = new URLSearchParams({ relay: relay.url, tracker: trackerUrl, model: 'tiny', budget: '64', backend: 'wasm', threads: '1', rtc: 'off' });
  await page.goto(`${appUrl()}?${q}`);
  await until(async () => {
    const st: NodeStatus = await status(page);
    if (st.state === 'error') throw new Error(`node failed: ${st.error?.code}: ${st.error?.message}`);
    return st.state === 'serving' ? st : undefined;
  }, 60_000, 'the page serving');
  await until(async () => (await fetch(`${trackerUrl}/api/route?model=tiny`)).ok, 30_000, 'a complete route');

  const client = new OpenAI({ baseURL: `${trackerUrl}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
  const stream = await client.chat.completions.create({ model: 'tiny', messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0, stream: true });
  const ids: number[] = [];
  for await (const c of stream) ids.push(...((c.choices[0] as { token_ids?: number[] } | undefined)?.token_ids ?? []));
  expect(ids).toEqual(want);

  // Every file named the pinned commit; the weights came from the CDN origin, by Range only.
  const files_ = mimic.log.filter((r) => r.path.includes('/resolve/'));
  expect(files_.every((r) => r.path.includes(`/resolve/${sha}/`) || r.path.startsWith('/api/'))).toBe(true);
  const weights = mimic.log.filter((r) => r.origin === 'cdn' && r.method === 'GET');
  expect(weights.length).toBeGreaterThan(0);
  expect(weights.every((r) => r.range !== null && r.status === 206)).toBe(true);
  // The page's own: it followed the hub's 302 across origins (CORS) with Range.
  const fromPage = weights.filter((r) => /Chrome/.test(r.userAgent));
  expect(fromPage.length).toBeGreaterThan(0);
  expect(mimic.log.some((r) => r.origin === 'hub' && r.status === 302 && /Chrome/.test(r.userAgent) && r.range !== null)).toBe(true);
  await context.close();
});
