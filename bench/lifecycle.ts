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
 *   duty     one page holding every layer serves back-to-back one-token
 *            steps at a 100 % and a 50 % duty cycle, side by side: the ratio
 *            of steps per second, and of the throughput the tracker announces
 *
 *   npx tsx bench/lifecycle.ts [--trials 5] [--steps 200]
 *
 * Prints a table; writes bench/results/lifecycle.json.
 */
import { writeFileSync, mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { setLifecycle } from '../src/cli/cdp-chromium.ts';
import { serveBuiltApp, startBrowserMesh, type BrowserMesh } from '../src/cli/browser-mesh.ts';
import { pageBudget } from '../src/cli/demo.ts';
import { startStaticServer, type StaticServer } from '../src/cli/static-server.ts';
import { loadModelSpec } from '../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../src/tracker/options.ts';
import { FORTUNES_DIR } from '../test/helpers/fortunes-tiny.ts';
import { startTrackerProc, until, type TrackerProc } from '../test/helpers/mesh.ts';
import { startRelayProcess, type RelayProcess } from '../test/helpers/relay-process.ts';
import { REPO_ROOT } from '../src/cli/paths.ts';

const { values } = parseArgs({ options: { trials: { type: 'string', default: '5' }, steps: { type: 'string', default: '200' } } });
const TRIALS = Number(values.trials);

type AvailabilityNode = { peer_id: string; status: string; draining: boolean; draining_since: number | null; throughput: number; duty_cycle: number };

async function nodesOf(tracker: TrackerProc): Promise<AvailabilityNode[]> {
  const a = (await (await fetch(`${tracker.url}/api/availability?model=fortunes-tiny`)).json()) as { models: Array<{ nodes: AvailabilityNode[] }> };
  return a.models[0]!.nodes;
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s.length === 0 ? NaN : s.length % 2 ? s[s.length >> 1]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2;
}

async function main(): Promise<void> {
  const app = await serveBuiltApp();
  let relay: RelayProcess | undefined;
  let model: StaticServer | undefined;
  let tracker: TrackerProc | undefined;
  let mesh: BrowserMesh | undefined;
  try {
    [relay, model] = await Promise.all([startRelayProcess(), startStaticServer({ root: FORTUNES_DIR, port: 0, host: '127.0.0.1' })]);
    tracker = await startTrackerProc(['--model', `fortunes-tiny=${model.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000']);
    const budgetMb = pageBudget(await loadModelSpec('fortunes-tiny', `${model.url}/`, fetch, resolveTrackerOptions({})), 3, undefined);
    mesh = await startBrowserMesh({ nodes: 3, trackerUrl: tracker.url, relayUrl: relay.url, appUrl: `${app.url}/`, model: 'fortunes-tiny', backend: 'wasm', budgetMb, threads: 1, pollMs: 500, realTab: { page: 1 } });
    await mesh.waitServing(180_000);
    const page = mesh.page(1)!;
    const peer = (await page.evaluate(() => window.meshnet!.engine.status())).peerId!;
    await until(async () => (await nodesOf(tracker!)).find((n) => n.peer_id === peer)?.status === 'serving', 30_000, 'the middle page serving');
    const freezeMs: number[] = [];
    const resumeMs: number[] = [];
    const fetched: number[] = [];
    for (let t = 0; t < TRIALS; t++) {
      const bytes0 = model.stats.bytesSent;
      const t0 = Date.now();
      await setLifecycle(page, 'frozen');
      const drained = await until(async () => (await nodesOf(tracker!)).find((n) => n.peer_id === peer && n.draining), 10_000, 'the tracker to see the drain');
      freezeMs.push(drained.draining_since! - t0);
      await new Promise((r) => setTimeout(r, 2_000));
      const t1 = Date.now();
      await setLifecycle(page, 'active');
      await until(async () => {
        const n = (await nodesOf(tracker!)).find((x) => x.peer_id === peer);
        return n && !n.draining && n.status === 'serving';
      }, 30_000, 'the tracker to route to it again');
      resumeMs.push(Date.now() - t1);
      fetched.push(model.stats.bytesSent - bytes0);
      console.log(`trial ${t + 1}: routed around ${freezeMs.at(-1)} ms after the freeze, routable again ${resumeMs.at(-1)} ms after active, ${fetched.at(-1)} bytes downloaded`);
    }
    const rows = [
      ['freeze → routed around (tracker draining_since − CDP call)', `${median(freezeMs)} ms`, freezeMs.join(', ')],
      ['active → routable again', `${median(resumeMs)} ms`, resumeMs.join(', ')],
      ['weight bytes downloaded per freeze/resume', String(Math.max(...fetched)), fetched.join(', ')],
    ];
    console.table(rows.map(([what, median, all]) => ({ what, median, all })));
    mkdirSync(join(REPO_ROOT, 'bench/results'), { recursive: true });
    writeFileSync(join(REPO_ROOT, 'bench/results/lifecycle.json'), JSON.stringify({ date: new Date().toISOString(), trials: TRIALS, freeze_to_routed_around_ms: freezeMs, active_to_routable_ms: resumeMs, bytes_downloaded: fetched }, null, 2));
  } finally {
    await mesh?.close();
    await tracker?.stop();
    await relay?.stop();
    await model?.close();
    await app.close();
  }
}

await main();
