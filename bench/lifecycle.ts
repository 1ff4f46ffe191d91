/**
 * The donor's tab as Chromium lives it, measured on a 3-page fortunes-tiny
 * mesh (relay, tracker and model server processes; Debian's Chromium, WASM):
 *
 *   freeze   the middle page is frozen by CDP (`Page.setWebLifecycleState`,
 *            in the default context of a Chromium attached over CDP, where
 *            it really freezes): ms until the tracker routes around it (its
 *            `draining_since`), the page's beacon having been sent from the
 *            freeze handler
 *   resume   `active` again: ms until the tracker routes to it again and it
 *            answers a /forward over the relay; weight bytes downloaded meanwhile
 *   duty     one page holding every layer serves 8 concurrent chats at a
 *            100 % and a 50 % duty cycle, alternating rounds: the ratio of
 *            tokens per second, and of the throughput the tracker announces
 *
 *   npx tsx bench/lifecycle.ts [--trials 5] [--rounds 3] [--only freeze|duty]
 *
 * Prints a table; writes bench/results/lifecycle.json.
 */
import { writeFileSync, mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { setLifecycle } from '../src/cli/cdp-chromium.ts';
import { serveBuiltApp, startBrowserMesh } from '../src/cli/browser-mesh.ts';
import { pageBudget } from '../src/cli/demo.ts';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import { loadModelSpec } from '../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../src/tracker/options.ts';
import { FORTUNES_DIR } from '../test/helpers/fortunes-tiny.ts';
import { startTrackerProc, until, type TrackerProc } from '../test/helpers/mesh.ts';
import { startRelayProcess, type RelayProcess } from '../test/helpers/relay-process.ts';
import { REPO_ROOT } from '../src/cli/paths.ts';

const { values } = parseArgs({ options: { trials: { type: 'string', default: '5' }, rounds: { type: 'string', default: '3' }, only: { type: 'string' } } });
const TRIALS = Number(values.trials);
const ROUNDS = Number(values.rounds);
const CONCURRENT = 8;

type AvailabilityNode = { peer_id: string; status: string; draining: boolean; draining_since: number | null; throughput: number; duty_cycle: number };

async function nodesOf(tracker: TrackerProc): Promise<AvailabilityNode[]> {
  const a = (await (await fetch(`${tracker.url}/api/availability?model=fortunes-tiny`)).json()) as { models: Array<{ nodes: AvailabilityNode[] }> };
  return a.models[0]!.nodes;
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s.length === 0 ? NaN : s.length % 2 ? s[s.length >> 1]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2;
}

interface FreezeResult {
  freeze_to_routed_around_ms: number[];
  active_to_routable_ms: number[];
  bytes_downloaded: number[];
}

async function freezeTrials(app: { url: string }, relay: RelayProcess, model: StaticServer, tracker: TrackerProc): Promise<FreezeResult> {
  const budgetMb = pageBudget(await loadModelSpec('fortunes-tiny', `${model.url}/`, fetch, resolveTrackerOptions({})), 3, undefined);
  const mesh = await startBrowserMesh({ nodes: 3, trackerUrl: tracker.url, relayUrl: relay.url, appUrl: `${app.url}/`, model: 'fortunes-tiny', backend: 'wasm', budgetMb, threads: 1, pollMs: 500, realTab: { page: 1 } });
  try {
    await mesh.waitServing(180_000);
    const page = mesh.page(1)!;
    const peer = (await page.evaluate(() => window.meshnet!.engine.status())).peerId!;
    await until(async () => (await nodesOf(tracker)).find((n) => n.peer_id === peer)?.status === 'serving', 30_000, 'the middle page serving');
    const out: FreezeResult = { freeze_to_routed_around_ms: [], active_to_routable_ms: [], bytes_downloaded: [] };
    for (let t = 0; t < TRIALS; t++) {
      const bytes0 = model.stats.bytesSent;
      const t0 = Date.now();
      await setLifecycle(page, 'frozen');
      const drained = await until(async () => (await nodesOf(tracker)).find((n) => n.peer_id === peer && n.draining), 10_000, 'the tracker to see the drain');
      out.freeze_to_routed_around_ms.push(drained.draining_since! - t0);
      await new Promise((r) => setTimeout(r, 2_000));
      const t1 = Date.now();
      await setLifecycle(page, 'active');
      await until(async () => {
        const n = (await nodesOf(tracker)).find((x) => x.peer_id === peer);
        return n && !n.draining && n.status === 'serving';
      }, 30_000, 'the tracker to route to it again');
      out.active_to_routable_ms.push(Date.now() - t1);
      out.bytes_downloaded.push(model.stats.bytesSent - bytes0);
      console.log(`trial ${t + 1}: routed around ${out.freeze_to_routed_around_ms.at(-1)} ms after the freeze, routable again ${out.active_to_routable_ms.at(-1)} ms after active, ${out.bytes_downloaded.at(-1)} bytes downloaded`);
    }
    return out;
  } finally {
    await mesh.close();
  }
}

interface DutyResult {
  tokens_per_s: { full: number[]; half: number[] };
  announced_throughput: { full: number; half: number };
}

/** CONCURRENT chats at once through one page holding every layer; tokens per second over the round. */
async function round(tracker: TrackerProc): Promise<number> {
  const t0 = performance.now();
  const counts = await Promise.all(
    Array.from({ length: CONCURRENT }, async (_, i) => {
      const res = await fetch(`${tracker.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'fortunes-tiny', messages: [{ role: 'user', content: `Tell me fortune number ${i}.` }], max_tokens: 48, temperature: 0 }) });
      const j = (await res.json()) as { usage?: { completion_tokens: number }; error?: { message: string } };
      if (!res.ok || !j.usage) throw new Error(`chat ${i}: HTTP ${res.status} ${j.error?.message ?? ''}`);
      return j.usage.completion_tokens;
    }),
  );
  return counts.reduce((a, b) => a + b, 0) / ((performance.now() - t0) / 1000);
}

async function dutyRounds(app: { url: string }, relay: RelayProcess, tracker: TrackerProc): Promise<DutyResult> {
  const mesh = await startBrowserMesh({ nodes: 1, trackerUrl: tracker.url, relayUrl: relay.url, appUrl: `${app.url}/`, model: 'fortunes-tiny', backend: 'wasm', threads: 1, pollMs: 1000 });
  try {
    await mesh.waitServing(120_000);
    const page = mesh.page(0)!;
    const peer = (await page.evaluate(() => window.meshnet!.engine.status())).peerId!;
    const setDuty = (d: number) => page.evaluate((x) => window.meshnet!.engine.setDonor({ dutyCycle: x }), d);
    await round(tracker); // warm
    const out: DutyResult = { tokens_per_s: { full: [], half: [] }, announced_throughput: { full: 0, half: 0 } };
    const settle = async (duty: number) => {
      await setDuty(duty);
      // The tracker smooths layer_ms over heartbeats: read what it counts on once it settled.
      await new Promise((r) => setTimeout(r, 8_000));
      return (await nodesOf(tracker)).find((n) => n.peer_id === peer)!.throughput;
    };
    for (let r = 0; r < ROUNDS; r++) {
      out.announced_throughput.full = await settle(1);
      out.tokens_per_s.full.push(await round(tracker));
      out.announced_throughput.half = await settle(0.5);
      out.tokens_per_s.half.push(await round(tracker));
      console.log(`round ${r + 1}: ${out.tokens_per_s.full.at(-1)!.toFixed(1)} tokens/s at 100 %, ${out.tokens_per_s.half.at(-1)!.toFixed(1)} at 50 %; the tracker counts on ${out.announced_throughput.full} → ${out.announced_throughput.half} layer-steps/s`);
    }
    return out;
  } finally {
    await mesh.close();
  }
}

async function main(): Promise<void> {
  const app = await serveBuiltApp();
  let relay: RelayProcess | undefined;
  let model: StaticServer | undefined;
  let tracker: TrackerProc | undefined;
  try {
    [relay, model] = await Promise.all([startRelayProcess(), startStaticServer({ root: FORTUNES_DIR, port: 0, host: '127.0.0.1' })]);
    tracker = await startTrackerProc(['--model', `fortunes-tiny=${model.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000']);
    const freeze = values.only === 'duty' ? undefined : await freezeTrials(app, relay, model, tracker);
    let duty: DutyResult | undefined;
    if (values.only !== 'freeze') {
      // A fresh tracker: the freeze mesh's pages are gone, the duty page must hold every layer.
      await tracker.stop();
      tracker = await startTrackerProc(['--model', `fortunes-tiny=${model.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000']);
      duty = await dutyRounds(app, relay, tracker);
    }
    const rows: Array<{ what: string; median: string; all: string }> = [];
    if (freeze) {
      rows.push({ what: 'freeze → routed around (tracker draining_since − CDP call)', median: `${median(freeze.freeze_to_routed_around_ms)} ms`, all: freeze.freeze_to_routed_around_ms.join(', ') });
      rows.push({ what: 'active → routable again', median: `${median(freeze.active_to_routable_ms)} ms`, all: freeze.active_to_routable_ms.join(', ') });
      rows.push({ what: 'weight bytes downloaded per freeze/resume', median: String(median(freeze.bytes_downloaded)), all: freeze.bytes_downloaded.join(', ') });
    }
    if (duty) {
      const full = median(duty.tokens_per_s.full);
      const half = median(duty.tokens_per_s.half);
      rows.push({ what: `${CONCURRENT} chats, tokens/s at 100 % / 50 % duty`, median: `${full.toFixed(1)} / ${half.toFixed(1)} (${(half / full).toFixed(3)}×)`, all: `${duty.tokens_per_s.full.map((x) => x.toFixed(1)).join(', ')} / ${duty.tokens_per_s.half.map((x) => x.toFixed(1)).join(', ')}` });
      rows.push({ what: 'throughput the tracker counts on, 100 % / 50 %', median: `${duty.announced_throughput.full} / ${duty.announced_throughput.half} (${(duty.announced_throughput.half / duty.announced_throughput.full).toFixed(3)}×)`, all: '' });
    }
    console.table(rows);
    mkdirSync(join(REPO_ROOT, 'bench/results'), { recursive: true });
    writeFileSync(join(REPO_ROOT, 'bench/results/lifecycle.json'), JSON.stringify({ date: new Date().toISOString(), machine: 'shared 2-core dev box', trials: TRIALS, rounds: ROUNDS, freeze, duty }, null, 2));
  } finally {
    await tracker?.stop();
    await relay?.stop();
    await model?.close();
    await app.close();
  }
}

await main();
