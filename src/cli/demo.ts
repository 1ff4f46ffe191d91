/**
 * `meshnet demo` (`npm start`): the whole system on one machine, from a
 * fresh `npm install`, with nothing downloaded but Debian's Chromium:
 *
 *   chromium ─ model (models/fortunes-tiny, shipped; or a fixture generated once into .models/) ─ app (dist/, built once)
 *   relay ─ tracker ─ 3 headless browser nodes (they register, get spans, download them)
 *   one streamed chat through the tracker's OpenAI API, printed as it arrives
 *   then the donor page and dashboard URLs stay up until Ctrl-C
 *
 * The chat uses plain fetch + SSE parsing, not the `openai` package: that is
 * a dev dependency, and the demo must run on production dependencies.
 */
import { pathToFileURL } from 'node:url';
import { join } from 'node:path';
import { startRelay } from '../relay/server.ts';
import { loadModelSpec, type ModelSpec } from '../tracker/model-registry.ts';
import { resolveTrackerOptions } from '../tracker/options.ts';
import { startTracker } from '../tracker/server.ts';
import { startBrowserMesh, serveBuiltApp, terminalView, type BrowserMesh } from './browser-mesh.ts';
import { bareLayers, budgetToCover, layerRanges } from './demo-budget.ts';
import type { DemoModel } from './demo-options.ts';
import { CliError } from './failure.ts';
import { countParameters, demoModelDir, describeDemoModel } from './demo-model.ts';
import { REPO_ROOT } from './paths.ts';
import { startStaticServer } from './static-server.ts';

export interface DemoOptions {
  nodes: number;
  /** MiB per page; absent: the least that lets `nodes` pages hold the model between them (so a chat crosses every page). A given budget too small for `nodes` pages is refused before any page starts. */
  budgetMb?: number;
  preset: DemoModel;
  prompt: string;
  maxTokens: number;
  /** Stop after the chat instead of waiting for Ctrl-C (tests, CI). */
  exitAfterChat: boolean;
  chromium?: string;
  out: NodeJS.WriteStream;
}

export { DEMO_DEFAULTS } from './demo-options.ts';

export interface RunningDemo {
  close(): Promise<void>;
}

export async function runDemo(o: DemoOptions): Promise<RunningDemo> {
  const t0 = performance.now();
  const since = () => `${((performance.now() - t0) / 1000).toFixed(1)} s`;
  const say = (line: string) => o.out.write(`${line}\n`);
  const closers: Array<() => Promise<void>> = [];
  const close = async () => {
    for (const c of closers.reverse()) await c().catch(() => undefined);
  };
  try {
    say('meshnet demo: a relay, a tracker and a mesh of headless browser nodes on this machine, then one chat.');

    const model = await demoModelDir(o.preset, () => say(`[${since()}] model: generating the "${o.preset}" checkpoint (first run only)…`));
    const models = await startStaticServer({ root: model.dir, port: 0, host: '127.0.0.1' });
    closers.push(() => models.close());
    const modelUrl = `${models.url}/`;
    // Sized as the tracker will size it, before anything slow starts: a budget too small for the pages asked for is said now.
    const trackerOptions = { port: 0, host: '127.0.0.1', models: [{ name: o.preset, url: modelUrl }], heartbeatIntervalMs: 2000, logLevel: 'warn' };
    const spec = await loadModelSpec(o.preset, modelUrl, fetch, resolveTrackerOptions(trackerOptions));
    const about = describeDemoModel(o.preset, await countParameters(modelUrl), spec.numLayers, spec.config.hiddenSize);
    say(`[${since()}] model ${about} (${model.status})`);
    const budgetMb = pageBudget(spec, o.nodes, o.budgetMb);

    const setup = (await import(pathToFileURL(join(REPO_ROOT, 'scripts', 'setup.mjs')).href)) as { ensureChromium(): string };
    const chromium = o.chromium ?? setup.ensureChromium();
    say(`[${since()}] chromium: ${chromium}`);

    const app = await serveBuiltApp();
    closers.push(() => app.close());
    say(`[${since()}] app on ${app.url}/, model files on ${modelUrl}`);

    const relay = await startRelay({ port: 0, host: '127.0.0.1', logLevel: 'warn' });
    closers.push(() => relay.close());
    const tracker = await startTracker({ ...trackerOptions, relayUrl: relay.url });
    closers.push(() => tracker.close());
    say(`[${since()}] relay ${relay.url}, tracker ${tracker.url}`);

    say(`[${since()}] starting ${o.nodes} headless browser node${o.nodes === 1 ? '' : 's'} (${budgetMb} MiB each); the tracker assigns their layers…`);
    const view = terminalView(o.out, 5_000);
    let showTable = true;
    const mesh: BrowserMesh = await startBrowserMesh({
      nodes: o.nodes,
      trackerUrl: tracker.url,
      relayUrl: relay.url,
      appUrl: `${app.url}/`,
      model: o.preset,
      backend: 'wasm',
      budgetMb,
      chromium,
      onUpdate: (rows) => showTable && view.update(rows),
      log: (m) => say(`[${since()}] ${m}`),
    });
    closers.push(() => mesh.close());
    await mesh.waitServing(150_000).catch((e: Error) => {
      throw new CliError(`${e.message}: see the node lines above (--verbose for the stack)`);
    });
    await waitComplete(tracker.url, o.preset, 30_000);
    view.update(mesh.rows());
    showTable = false;
    say(`[${since()}] every layer is served; asking the tracker (OpenAI API) for a chat…`);

    say('');
    say(`> ${o.prompt}`);
    const chat = await streamChat(tracker.url, o.preset, o.prompt, o.maxTokens, (text) => o.out.write(text));
    say('');
    const route = await lastRoute(tracker.url);
    say('');
    say(`(model ${about})`);
    say(`[${since()}] ${chat.tokens} tokens in ${(chat.ms / 1000).toFixed(2)} s: ${(chat.tokens / (chat.ms / 1000)).toFixed(1)} tokens/s (first token after ${Math.round(chat.firstTokenMs)} ms, then ${(Math.max(0, chat.tokens - 1) / ((chat.ms - chat.firstTokenMs) / 1000)).toFixed(1)} tokens/s)`);
    if (route) say(`route: ${route}`);
    say('');
    say(`donor page (joins this mesh): ${mesh.donorUrl()}`);
    say(`dashboard:                    ${tracker.url}/dashboard`);
    say(`OpenAI API:                   ${tracker.url}/v1 (model "${o.preset}")`);
    if (!o.exitAfterChat) {
      say('Ctrl-C stops everything.');
      showTable = o.out.isTTY !== true;
    }
    return { close };
  } catch (e) {
    await close();
    throw e;
  }
}

/**
 * The budget each page gets: the one asked for if it covers the model with
 * `nodes` pages (else a CliError saying what does), or the least whole MiB
 * that does, so every page holds a share and a chat crosses all of them
 * whatever the model's size.
 */
export function pageBudget(model: ModelSpec, nodes: number, asked: number | undefined): number {
  const needed = budgetToCover(model, nodes);
  if (asked === undefined) return needed;
  const bare = bareLayers(model, nodes, asked);
  if (bare.length > 0) {
    throw new CliError(`${nodes} page${nodes === 1 ? '' : 's'} of ${asked} MiB leave${nodes === 1 ? 's' : ''} layers ${layerRanges(bare)} of "${model.name}" without a node: give --budget ${needed} or more, or drop --budget (the demo then picks it)`);
  }
  return asked;
}

async function waitComplete(trackerUrl: string, model: string, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const r = (await (await fetch(`${trackerUrl}/api/availability?model=${encodeURIComponent(model)}`)).json()) as { models: Array<{ complete: boolean; missing_layers: number[] }> };
    if (r.models[0]?.complete) return;
    if (Date.now() > deadline) throw new CliError(`the tracker still misses layers ${layerRanges(r.models[0]?.missing_layers ?? [])} after ${timeoutMs / 1000} s: give each page more memory (--budget) or start more pages (--nodes)`);
    await new Promise((res) => setTimeout(res, 200));
  }
}

/** POST /v1/chat/completions with stream: true; `onText` gets each content delta. */
/** `ms`: until the stream ended (usage and [DONE] included); `firstTokenMs`, `lastTokenMs`: when the first and the last text arrived. */
export async function streamChat(trackerUrl: string, model: string, prompt: string, maxTokens: number, onText: (text: string) => void): Promise<{ tokens: number; ms: number; firstTokenMs: number; lastTokenMs: number; text: string }> {
  const t0 = performance.now();
  const res = await fetch(`${trackerUrl}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model, messages: [{ role: 'user', content: prompt }], max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true } }),
  });
  if (!res.ok || !res.body) throw new Error(`chat failed: HTTP ${res.status} ${await res.text()}`);
  let text = '';
  let tokens = 0;
  let firstTokenMs = 0;
  let lastTokenMs = 0;
  let buf = '';
  const dec = new TextDecoder();
  for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
    buf += dec.decode(chunk, { stream: true });
    let i: number;
    // SSE events end with a blank line; each of ours is one `data:` line.
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const event = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of event.split('\n')) {
        if (!line.startsWith('data:')) continue;
        const data = line.slice(5).trim();
        if (data === '[DONE]') continue;
        const msg = JSON.parse(data) as { error?: { message: string }; usage?: { completion_tokens: number }; choices?: Array<{ delta?: { content?: string } }> };
        if (msg.error) throw new Error(`chat failed mid-stream: ${msg.error.message}`);
        if (msg.usage) tokens = msg.usage.completion_tokens;
        const d = msg.choices?.[0]?.delta?.content;
        if (d) {
          lastTokenMs = performance.now() - t0;
          if (!firstTokenMs) firstTokenMs = lastTokenMs;
          text += d;
          onText(d);
        }
      }
    }
  }
  return { tokens, ms: performance.now() - t0, firstTokenMs, lastTokenMs, text };
}

async function lastRoute(trackerUrl: string): Promise<string | undefined> {
  const d = (await (await fetch(`${trackerUrl}/api/dashboard`)).json()) as { nodes: Array<{ peer_id: string; host: string; backend: string }>; recent_routes: Array<{ kind: string; hops: Array<{ peer_id: string; start_layer: number; end_layer: number }> }> };
  const r = d.recent_routes.find((x) => x.kind === 'generate');
  if (!r) return undefined;
  return r.hops.map((h) => `${h.peer_id.slice(0, 8)} [layers ${h.start_layer}-${h.end_layer - 1}]`).join(' → ');
}
