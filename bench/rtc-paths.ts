/**
 * Where a page's data channel can live, and what a message costs on each
 * path (docs/protocol.md §12): two pages of one headless Chromium (two
 * contexts, as the meshes open them), each with a dedicated worker like the
 * node's, ping-ponging binary messages of several sizes:
 *
 *   - ws: worker → WebSocket → a Node forwarder → the other page's worker, and
 *     back (the relay's shape: two WebSocket crossings per leg);
 *   - dc main: a data channel between the two pages' main threads;
 *   - dc bridge: the channel in the page, bridged to the worker over a
 *     MessagePort (what a browser that cannot transfer a channel does);
 *   - dc transfer: the channel transferred to the worker at creation (what
 *     the node does in Chromium).
 *
 * It also reports what the worker has (`RTCPeerConnection` there?) and
 * whether the transfer works. Back to back (gap 0) and after 10 ms idle (a
 * hop that waited for the rest of a step). Needs the network namespace
 * (Chromium offers no loopback ICE candidate):
 *
 *   scripts/netns-run.sh npx tsx bench/rtc-paths.ts [--n 300] [--sizes 1024,4096,16384,65536] [--warm]
 *
 * `--warm`: the transferred channel again with both workers never idle (each
 * posts itself a message after every task): whether a message's cost after
 * an idle spell is the receiving worker's wake or Chromium's threads below it.
 *
 * Table on stdout, JSON in bench/results/rtc-paths.json. The pages' scripts
 * are plain JavaScript in bench/rtc-paths/ (no build).
 */
import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { cpus, loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import { chromium, type Browser, type Page } from 'playwright-core';
import { WebSocketServer, type WebSocket } from 'ws';
import { CHROMIUM_FLAGS } from '../src/cli/browser-mesh.ts';
import { printTable, writeResult } from './lib/stats.ts';

const arg = (name: string): string | undefined => {
  const i = process.argv.indexOf(name);
  return i > 0 ? process.argv[i + 1] : undefined;
};
const N = Number(arg('--n') ?? 300);
const SIZES = (arg('--sizes') ?? '1024,4096,16384,65536').split(',').map(Number);
const GAPS = [0, 10];
/** Rows more: the transferred channel with both workers kept busy (never idle) between messages. */
const WARM = process.argv.includes('--warm');

type Stat = { p50: number; p10: number; p90: number };
declare global {
  interface Window {
    proto: {
      init(id: string, ws: string): Promise<unknown>;
      connect(peer: string, offerer: boolean, transfer: boolean): Promise<{ moved: boolean; transferResult?: string; openMs: number }>;
      bridge(): Promise<void>;
      mainOnly(): void;
      setMainEcho(v: boolean): void;
      mainBench(bytes: number, n: number, gap: number): Promise<Stat>;
      workerCmd(m: Record<string, unknown>): Promise<{ result?: Stat }>;
    };
  }
}

async function main(): Promise<void> {
  if (process.env.MESHNET_NETNS !== '1') {
    console.error('run inside the network namespace: scripts/netns-run.sh npx tsx bench/rtc-paths.ts');
    process.exit(2);
  }
  const dir = new URL('./rtc-paths/', import.meta.url);
  const types: Record<string, string> = { '/page.html': 'text/html', '/page.js': 'text/javascript', '/worker.js': 'text/javascript' };
  const srv = createServer((req, res) => {
    const p = new URL(req.url ?? '/', 'http://x').pathname;
    if (!types[p]) return void res.writeHead(404).end();
    res.writeHead(200, { 'content-type': types[p]! }).end(readFileSync(new URL('.' + p, dir)));
  });
  // The forwarder: JSON text goes to the socket it names ({to}); binary from one data socket to the other.
  const wss = new WebSocketServer({ server: srv });
  const socks = new Map<string, WebSocket>();
  wss.on('connection', (ws, req) => {
    const id = new URL(req.url ?? '/', 'http://x').searchParams.get('id') ?? '';
    socks.set(id, ws);
    ws.on('message', (data, isBinary) => {
      if (!isBinary) {
        const m = JSON.parse(data.toString()) as { to: string };
        socks.get(m.to)?.send(JSON.stringify(m));
        return;
      }
      for (const [k, s] of socks) if (k.endsWith('-data') && k !== id) s.send(data, { binary: true });
    });
  });
  await new Promise<void>((r) => srv.listen(0, '127.0.0.1', r));
  const port = (srv.address() as AddressInfo).port;
  const base = `http://127.0.0.1:${port}`;
  const wsUrl = `ws://127.0.0.1:${port}/`;
  const loadBefore = loadavg()[0]!;
  const browser: Browser = await chromium.launch({ executablePath: process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium', headless: true, args: CHROMIUM_FLAGS });
  const rows: Array<{ path: string; bytes: number; gap_ms: number } & Stat> = [];
  const add = (path: string, bytes: number, gap: number, r: Stat | undefined) => {
    if (!r) throw new Error(`${path}: no result`);
    rows.push({ path, bytes, gap_ms: gap, p50: +r.p50.toFixed(3), p10: +r.p10.toFixed(3), p90: +r.p90.toFixed(3) });
    process.stderr.write(`${path} ${bytes} B gap ${gap}: p50 ${r.p50.toFixed(2)} ms\n`);
  };
  let caps: unknown;
  let transfer: string | undefined;
  async function pair(t: boolean): Promise<{ a: Page; b: Page; close(): Promise<void>; moved: boolean }> {
    socks.clear();
    const ca = await browser.newContext();
    const cb = await browser.newContext();
    const a = await ca.newPage();
    const b = await cb.newPage();
    for (const p of [a, b]) await p.goto(`${base}/page.html`);
    caps = await a.evaluate(([u]) => window.proto.init('A', u!), [wsUrl]);
    await b.evaluate(([u]) => window.proto.init('B', u!), [wsUrl]);
    const [ra, rb] = await Promise.all([a.evaluate(([x]) => window.proto.connect('B', true, x!), [t]), b.evaluate(([x]) => window.proto.connect('A', false, x!), [t])]);
    if (t) transfer = ra.transferResult;
    return { a, b, moved: ra.moved && rb.moved, close: async () => void (await Promise.all([ca.close(), cb.close()])) };
  }
  try {
    {
      const { a, b, close } = await pair(false);
      await b.evaluate(() => window.proto.workerCmd({ cmd: 'echo', kind: 'ws' }));
      for (const bytes of SIZES) for (const gap of GAPS) add('ws: worker → forwarder → worker', bytes, gap, (await a.evaluate(([x, n, g]) => window.proto.workerCmd({ cmd: 'bench', kind: 'ws', bytes: x, n, gap: g }), [bytes, N, gap])).result);
      await a.evaluate(() => window.proto.mainOnly());
      await b.evaluate(() => (window.proto.mainOnly(), window.proto.setMainEcho(true)));
      for (const bytes of SIZES) for (const gap of GAPS) add('dc main: page ↔ page', bytes, gap, await a.evaluate(([x, n, g]) => window.proto.mainBench(x!, n!, g!), [bytes, N, gap]));
      await a.evaluate(() => window.proto.bridge());
      await b.evaluate(() => window.proto.bridge());
      await b.evaluate(() => window.proto.workerCmd({ cmd: 'echo', kind: 'port' }));
      for (const bytes of SIZES) for (const gap of GAPS) add('dc bridge: worker → port → page → dc', bytes, gap, (await a.evaluate(([x, n, g]) => window.proto.workerCmd({ cmd: 'bench', kind: 'port', bytes: x, n, gap: g }), [bytes, N, gap])).result);
      await close();
    }
    {
      const { a, b, close, moved } = await pair(true);
      if (moved) {
        await b.evaluate(() => window.proto.workerCmd({ cmd: 'echo', kind: 'dc' }));
        for (const bytes of SIZES) for (const gap of GAPS) add('dc transfer: worker ↔ worker', bytes, gap, (await a.evaluate(([x, n, g]) => window.proto.workerCmd({ cmd: 'bench', kind: 'dc', bytes: x, n, gap: g }), [bytes, N, gap])).result);
        if (WARM) {
          for (const p of [a, b]) await p.evaluate(() => window.proto.workerCmd({ cmd: 'spin', on: true }));
          for (const bytes of SIZES) for (const gap of GAPS) add('dc transfer, both workers never idle', bytes, gap, (await a.evaluate(([x, n, g]) => window.proto.workerCmd({ cmd: 'bench', kind: 'dc', bytes: x, n, gap: g }), [bytes, N, gap])).result);
          for (const p of [a, b]) await p.evaluate(() => window.proto.workerCmd({ cmd: 'spin', on: false }));
        }
      }
      await close();
    }
  } finally {
    await browser.close();
    srv.close();
  }
  const loadAfter = loadavg()[0]!;
  printTable(
    `RTT per message between two pages' workers, ${N} pings each, medians (p10–p90); load ${loadBefore.toFixed(1)} → ${loadAfter.toFixed(1)} on ${cpus().length} cores; worker has ${JSON.stringify(caps)}; transfer: ${transfer}`,
    ['path', 'bytes', 'gap ms', 'p50 ms', 'p10–p90 ms'],
    rows.map((r) => [r.path, r.bytes, r.gap_ms, r.p50, `${r.p10}–${r.p90}`]),
  );
  writeResult(fileURLToPath(new URL('./results/rtc-paths.json', import.meta.url)), { bench: 'rtc-paths', n: N, load_average_1m: { before: +loadBefore.toFixed(2), after: +loadAfter.toFixed(2) }, capabilities: caps, transfer, rows });
}

await main();
process.exit(0);
