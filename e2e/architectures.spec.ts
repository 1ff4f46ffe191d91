/**
 * One browser mesh per architecture family beyond Llama (Llama is covered by
 * fortunes-tiny.spec.ts and the `tiny` meshes): Qwen3 (q/k norms, head_dim
 * apart from hidden/heads), Mistral (sliding window, passed within the chat),
 * Phi-3.5 (packed projections, longrope). Three headless Chromium pages (WASM,
 * src/cli/browser-mesh.ts) behind a real tracker and relay, with the least
 * budget with which three pages hold the model, so every chat crosses pages.
 * The tracker puts f32 on the wire: on random weights bf16 rounding at the
 * hops flips greedy near-ties. The streamed token ids must equal the float64
 * reference's greedy ids (cut at the first end-of-sequence id).
 */
import { expect, test } from '@playwright/test';
import OpenAI from 'openai';
import { startBrowserMesh, type BrowserMesh } from '../src/cli/browser-mesh.ts';
import { pageBudget } from '../src/cli/demo.ts';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import { ReferenceModel } from '../src/model/reference.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { loadModelSpec } from '../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../src/tracker/options.ts';
import { fixture } from '../test/helpers/shard.ts';
import { startTrackerProc, until, type TrackerProc } from '../test/helpers/mesh.ts';
import { appUrl, startRelayProcess, type RelayProcess } from './support/mesh.ts';

const PRESETS = ['tiny-qwen3', 'tiny-mistral', 'tiny-phi3'] as const;
const MESSAGES = [{ role: 'user' as const, content: 'Count: one, two, three, four, five, six, seven.' }];
const TOKENS = 24;

const utf8d = new TextDecoder();
function referenceIds(preset: (typeof PRESETS)[number]): number[] {
  const f = fixture(preset);
  const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(f.files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
  const all = new ReferenceModel(f.cfg, f.weights).greedy(tok.encodeChat(MESSAGES), TOKENS);
  const eos = all.findIndex((t) => tok.isEos(t));
  return eos >= 0 ? all.slice(0, eos) : all;
}

for (const preset of PRESETS) {
  test.describe(preset, () => {
    let relay: RelayProcess | undefined;
    let model: StaticServer | undefined;
    let tracker: TrackerProc | undefined;
    let mesh: BrowserMesh | undefined;

    test.afterAll(async () => {
      await mesh?.close();
      await tracker?.stop();
      await Promise.all([relay?.stop(), model?.close()]);
    });

    test(`three browser pages stream the float64 reference's greedy ids (${preset})`, async () => {
      test.setTimeout(240_000);
      // Before any socket opens: the float64 reference is synchronous work.
      const want = referenceIds(preset);
      expect(want.length).toBeGreaterThan(4);
      [relay, model] = await Promise.all([startRelayProcess(), ensureModel(preset).then((root) => startStaticServer({ root, port: 0, host: '127.0.0.1' }))]);
      tracker = await startTrackerProc(['--model', `${preset}=${model.url}`, '--wire-dtype', 'f32', '--relay', relay.url, '--heartbeat-interval-ms', '1000']);
      const budgetMb = pageBudget(await loadModelSpec(preset, `${model.url}/`, fetch, resolveTrackerOptions({})), 3, undefined);
      const logs: string[] = [];
      mesh = await startBrowserMesh({ nodes: 3, trackerUrl: tracker.url, relayUrl: relay.url, appUrl: appUrl(), model: preset, backend: 'wasm', budgetMb, threads: 1, pollMs: 200, log: (m) => logs.push(m) });
      await mesh.waitServing(120_000).catch((e: Error) => {
        throw new Error(`${e.message}: ${JSON.stringify(mesh!.rows())} ${logs.join('; ')}`);
      });
      await until(async () => ((await (await fetch(`${tracker!.url}/api/availability?model=${preset}`)).json()) as { models: Array<{ complete: boolean }> }).models[0]?.complete, 30_000, 'every layer served');

      const client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
      const stream = await client.chat.completions.create({ model: preset, messages: MESSAGES, max_tokens: TOKENS, temperature: 0, stream: true });
      const ids: number[] = [];
      for await (const c of stream) {
        const ch = c.choices[0] as (OpenAI.Chat.Completions.ChatCompletionChunk.Choice & { token_ids?: number[] }) | undefined;
        ids.push(...(ch?.token_ids ?? []));
      }
      expect(ids).toEqual(want);
      const d = (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { recent_routes: Array<{ kind: string; hops: unknown[] }> };
      const hops = d.recent_routes.find((r) => r.kind === 'generate')?.hops ?? [];
      console.log(`[architectures, 3 browser pages] ${preset}: budget ${budgetMb} MiB, ${hops.length} hops, ${ids.length} tokens equal the reference`);
      expect(hops.length).toBeGreaterThanOrEqual(2);
    });
  });
}
