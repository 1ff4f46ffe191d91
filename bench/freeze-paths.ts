/**
 * What reaches a server once Chromium freezes a page: the measurement behind
 * the drain beacon (docs/architecture.md, "The tab's life").
 *
 * A page in the default context of a Chromium attached over CDP
 * (src/cli/cdp-chromium.ts) is frozen with `Page.setWebLifecycleState`,
 * N times. In its `freeze` handler it sends, to a local server:
 *   beacon         navigator.sendBeacon from the handler
 *   keepalive      fetch(…, {keepalive: true}) from the handler
 *   worker         a postMessage to its worker, which fetches at once
 *   worker-signed  the same, after one awaited Ed25519 signature (WebCrypto)
 * and reports, per path, how often it arrived before the page was resumed
 * (2 s later) and how long after the freeze.
 *
 *   npx tsx bench/freeze-paths.ts [--trials 20]
 *
 * Prints a table; writes bench/results/freeze-paths.json.
 */
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { launchCdpChromium, setLifecycle } from '../src/cli/cdp-chromium.ts';
import { REPO_ROOT } from '../src/cli/paths.ts';

const { values } = parseArgs({ options: { trials: { type: 'string', default: '20' } } });
const TRIALS = Number(values.trials);
const PATHS = ['beacon', 'keepalive', 'worker', 'worker-signed'] as const;
const HOLD_MS = 2_000;

const PAGE = `<!doctype html><title>freeze paths</title><script>
const w = new Worker('/worker.js');
let trial = 0;
window.setTrial = (t) => { trial = t; w.postMessage({ trial: t }); };
document.addEventListener('freeze', () => {
  navigator.sendBeacon('/log', JSON.stringify({ path: 'beacon', trial }));
  fetch('/log', { method: 'POST', body: JSON.stringify({ path: 'keepalive', trial }), keepalive: true });
  w.postMessage({ freeze: true });
});
</script>`;
const WORKER = `
let trial = 0;
let key;
crypto.subtle.generateKey({ name: 'Ed25519' }, false, ['sign']).then((k) => (key = k));
onmessage = async (e) => {
  if (e.data.trial !== undefined) { trial = e.data.trial; return; }
  fetch('/log', { method: 'POST', body: JSON.stringify({ path: 'worker', trial }) });
  await crypto.subtle.sign('Ed25519', key.privateKey, new TextEncoder().encode('x'.repeat(800)));
  fetch('/log', { method: 'POST', body: JSON.stringify({ path: 'worker-signed', trial }) });
};`;

const arrivals: Array<{ path: string; trial: number; at: number }> = [];
const server = createServer((req, res) => {
  if (req.url === '/log') {
    let b = '';
    req.on('data', (c: Buffer) => (b += c.toString()));
    req.on('end', () => {
      try {
        arrivals.push({ ...(JSON.parse(b) as { path: string; trial: number }), at: Date.now() });
      } catch {
        // not ours
      }
      res.writeHead(204).end();
    });
    return;
  }
  const worker = req.url === '/worker.js';
  res.writeHead(200, { 'content-type': worker ? 'text/javascript' : 'text/html' }).end(worker ? WORKER : PAGE);
});
await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/`;

const chrome = await launchCdpChromium({ args: ['--no-sandbox'] });
const freezes: Array<{ trial: number; at: number; resumedAt: number }> = [];
try {
  const page = await chrome.defaultContext.newPage();
  await page.goto(url);
  await page.waitForTimeout(500);
  for (let t = 0; t < TRIALS; t++) {
    await page.evaluate((x) => (window as unknown as { setTrial(t: number): void }).setTrial(x), t);
    await page.waitForTimeout(200);
    const at = Date.now();
    await setLifecycle(page, 'frozen');
    await new Promise((r) => setTimeout(r, HOLD_MS));
    const resumedAt = Date.now();
    await setLifecycle(page, 'active');
    freezes.push({ trial: t, at, resumedAt });
    await new Promise((r) => setTimeout(r, 500));
  }
} finally {
  await chrome.close();
  server.close();
}

const median = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length === 0 ? NaN : s[s.length >> 1]!;
};
const result: Record<string, { before_resume: number; trials: number; ms_after_freeze: number[]; median_ms: number }> = {};
for (const p of PATHS) {
  const ms: number[] = [];
  for (const f of freezes) {
    const a = arrivals.find((x) => x.path === p && x.trial === f.trial);
    if (a && a.at < f.resumedAt) ms.push(a.at - f.at);
  }
  result[p] = { before_resume: ms.length, trials: freezes.length, ms_after_freeze: ms, median_ms: median(ms) };
}
console.table(PATHS.map((p) => ({ path: p, 'arrived while frozen': `${result[p]!.before_resume}/${result[p]!.trials}`, 'median ms after the freeze': result[p]!.median_ms, 'max ms': Math.max(...result[p]!.ms_after_freeze) })));
mkdirSync(join(REPO_ROOT, 'bench/results'), { recursive: true });
writeFileSync(join(REPO_ROOT, 'bench/results/freeze-paths.json'), JSON.stringify({ date: new Date().toISOString(), machine: 'shared 2-core dev box', hold_ms: HOLD_MS, result }, null, 2));
