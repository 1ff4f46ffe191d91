/**
 * What hashing a hop's attestations costs per step (docs/verification.md §1):
 * every step hashes its input rows, its output rows and one chain step
 * (src/verify/attest.ts). The node core hashes with @noble/hashes' pure-JS
 * SHA-256 on every host (synchronous, no WebCrypto); this compares it, side
 * by side in one run, with what hosts used before: node:crypto (Node.js
 * hosts) and WebCrypto's awaited digest (browsers) — in Node.js and in
 * Debian's Chromium (the same measuring code, bundled into a page).
 *
 * Cases: one decode step's rows for fortunes-tiny (hidden 64, f32 wire),
 * `small` (hidden 512, bf16), an 8B-class model (hidden 4096, bf16 and f32)
 * and a 70B-class one (hidden 8192, bf16); a 128-row 8B prompt. And, in
 * Node.js, what the attestor's hashing does to the event loop: a session's
 * 32 waiting 8B steps (and a 128-row prompt) hashed in one flush — the
 * hashing's total time, and the longest the event loop waited meanwhile
 * (the attestor hashes in slices of ~1 ms, giving the loop a turn between).
 *
 *   npx tsx bench/attest-hash.ts [--quick] [--no-browser]
 * Table on stdout, JSON in bench/results/attest-hash.json.
 */
import { hash } from 'node:crypto';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { fileURLToPath } from 'node:url';
import { build } from 'esbuild';
import { chromium } from 'playwright-core';
import { CHROMIUM_ARGS } from '../playwright.config.ts';
import { measureHashCost, nobleSha, type HashCostCase, type HashCostRow } from './lib/hash-cost.ts';
import { Identity } from '../src/net/identity.ts';
import { Attestor } from '../src/verify/attestor.ts';
import { median, printTable, writeResult } from './lib/stats.ts';


const quick = process.argv.includes('--quick');
const browser = !process.argv.includes('--no-browser');
const opts = { repeats: quick ? 3 : 9, budgetBytes: quick ? 1 << 21 : 1 << 23, webCrypto: true };

const CASES: HashCostCase[] = [
  { name: 'fortunes-tiny decode (64 × f32)', bytes: 64 * 4 },
  { name: 'small decode (512 × bf16)', bytes: 512 * 2 },
  { name: '8B decode (4096 × bf16)', bytes: 4096 * 2 },
  { name: '8B decode (4096 × f32)', bytes: 4096 * 4 },
  { name: '70B decode (8192 × bf16)', bytes: 8192 * 2 },
  { name: '8B prompt (128 rows × 4096 × bf16)', bytes: 128 * 4096 * 2 },
];

const nodeRows = await measureHashCost(CASES, { 'noble (now, every host)': nobleSha, 'node:crypto (Node.js hosts before)': (b) => hash('sha256', b, 'buffer') }, opts);

// The event loop during a flush: a 0 ms timer re-armed all along; its longest wait is the longest stall.
/** The longest wait of a re-armed 0 ms timer while `work` runs. */
async function worstWait(work: () => Promise<unknown>): Promise<number> {
  let last = performance.now();
  let worst = 0;
  let on = true;
  const tick = () => {
    const now = performance.now();
    worst = Math.max(worst, now - last);
    last = now;
    if (on) setTimeout(tick, 0);
  };
  setTimeout(tick, 0);
  await work();
  on = false;
  return worst;
}

async function stall(steps: Array<[number, number, Uint8Array, Uint8Array]>): Promise<{ hashMs: number; stallMs: number; idleMs: number }> {
  const id = await Identity.generate();
  const att = new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b), signEvery: 1024, signBytes: 1 << 30 });
  const scope = { model: 'm', session: `s${Math.random()}`, startLayer: 0, endLayer: 4, dtype: 'bf16' };
  for (const s of steps) att.record(scope, ...s);
  const t0 = performance.now();
  const stallMs = await worstWait(() => att.finish(scope.session));
  const took = performance.now() - t0;
  // The same wait with nothing to do: what the shared machine's scheduling alone costs the timer.
  const idleMs = await worstWait(() => new Promise((r) => setTimeout(r, took)));
  const sync = performance.now();
  for (const [, , i, o] of steps) {
    nobleSha(i);
    nobleSha(o);
  }
  return { hashMs: performance.now() - sync, stallMs, idleMs };
}
const rowsOf = (n: number) => new Uint8Array(n).map((_, i) => i * 7);
const decode32: Array<[number, number, Uint8Array, Uint8Array]> = Array.from({ length: 32 }, (_, k) => [k, 1, rowsOf(8192), rowsOf(8192)]);
const prompt: Array<[number, number, Uint8Array, Uint8Array]> = [[0, 128, rowsOf(1 << 20), rowsOf(1 << 20)]];
type Stall = { hashMs: number; stallMs: number; idleMs: number };
const stalls = { decode32: [] as Stall[], prompt: [] as Stall[] };
for (let r = 0; r < opts.repeats; r++) {
  stalls.decode32.push(await stall(decode32));
  stalls.prompt.push(await stall(prompt));
}

let pageRows: HashCostRow[] = [];
let chromiumVersion: string | undefined;
if (browser) {
  const bundle = await build({
    stdin: { contents: "import { measureHashCost, nobleSha } from './hash-cost.ts'; (globalThis as any).measure = (cases: any, opts: any) => measureHashCost(cases, { 'noble (now, every host)': nobleSha }, opts);", resolveDir: fileURLToPath(new URL('./lib/', import.meta.url)), loader: 'ts' },
    bundle: true,
    format: 'iife',
    write: false,
  });
  // A page from http://127.0.0.1 (a secure context: WebCrypto is there to compare with; from a LAN address it is not).
  const html = `<!doctype html><title>attest-hash</title><script>${bundle.outputFiles[0]!.text}</script>`;
  const server = createServer((_, res) => res.writeHead(200, { 'content-type': 'text/html' }).end(html));
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const b = await chromium.launch({ executablePath: process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium', args: CHROMIUM_ARGS });
  try {
    chromiumVersion = b.version();
    const page = await b.newPage();
    await page.goto(`http://127.0.0.1:${(server.address() as AddressInfo).port}/`);
    if (!(await page.evaluate(() => isSecureContext && crypto.subtle !== undefined))) throw new Error('the page has no WebCrypto to compare with');
    pageRows = await page.evaluate(([c, o]) => (globalThis as unknown as { measure(c: unknown, o: unknown): Promise<HashCostRow[]> }).measure(c, o), [CASES, opts] as const);
  } finally {
    await b.close();
    server.close();
  }
}

const table = (rows: HashCostRow[]) =>
  CASES.map((k) => {
    const of = (impl: string) => rows.find((r) => r.case === k.name && r.impl.startsWith(impl))?.usPerStep ?? NaN;
    return [k.name, k.bytes, of('noble'), of('node:crypto'), of('WebCrypto')];
  });
printTable(`Node.js ${process.version}: one step's three digests (input rows, output rows, chain step), µs, medians of ${opts.repeats}`, ['case', 'row bytes', 'noble', 'node:crypto', 'WebCrypto (awaited)'], table(nodeRows));
printTable(`Node.js: the event loop while the attestor hashes one flush, ms, medians of ${opts.repeats}`, ['flush', 'hashing (pure JS, one go)', 'longest timer wait during the flush', 'the same, idle'], [
  ['32 decode steps, 8B bf16 rows', median(stalls.decode32.map((x) => x.hashMs)), median(stalls.decode32.map((x) => x.stallMs)), median(stalls.decode32.map((x) => x.idleMs))],
  ['a 128-row 8B bf16 prompt (1 MiB in, 1 MiB out)', median(stalls.prompt.map((x) => x.hashMs)), median(stalls.prompt.map((x) => x.stallMs)), median(stalls.prompt.map((x) => x.idleMs))],
]);
if (browser) printTable(`Chromium ${chromiumVersion}: the same, µs`, ['case', 'row bytes', 'noble', 'node:crypto', 'WebCrypto (awaited)'], table(pageRows));
writeResult(fileURLToPath(new URL('./results/attest-hash.json', import.meta.url)), { quick, repeats: opts.repeats, node: nodeRows, event_loop: { decode32_hash_ms: median(stalls.decode32.map((x) => x.hashMs)), decode32_stall_ms: median(stalls.decode32.map((x) => x.stallMs)), decode32_idle_ms: median(stalls.decode32.map((x) => x.idleMs)), prompt_hash_ms: median(stalls.prompt.map((x) => x.hashMs)), prompt_stall_ms: median(stalls.prompt.map((x) => x.stallMs)), prompt_idle_ms: median(stalls.prompt.map((x) => x.idleMs)) }, chromium: chromiumVersion ? { version: chromiumVersion, rows: pageRows } : null });
