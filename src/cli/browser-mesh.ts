/**
 * A mesh of browser nodes on this machine: N headless Chromium pages, each
 * the donor page opened with `?relay=…&tracker=…`, each in its own browser
 * context (its own IndexedDB, so its own identity, peer id and stored span).
 * The tracker assigns their spans; this module only opens the pages, watches
 * them (the page's own status, polled through `window.meshnet`), reopens a
 * page whose renderer crashed (same context: same peer id, weights kept),
 * and relaunches the browser if it dies.
 *
 * Used by `meshnet mesh` and by `meshnet demo`.
 */
import { chromium, type Browser, type BrowserContext, type Page } from 'playwright-core';
import { launchCdpChromium, type CdpChromium } from './cdp-chromium.ts';
import type { NodeStatus } from '../host/browser/engine.ts';
import { builtApp } from './app-build.ts';
import { startStaticServer, type StaticServer } from './static-server.ts';

export const CHROMIUM_FLAGS = [
  '--no-sandbox',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--no-first-run',
  '--disable-quic',
  // Every page is a node, none is "in the background": without these, pages other than the first
  // ran their layers slower when split (bench/mesh-browser: summed compute per token 17 → 25 ms
  // over 1 → 3 pages; flat at ~22 ms with them).
  '--disable-renderer-backgrounding',
  '--disable-background-timer-throttling',
  '--disable-backgrounding-occluded-windows',
];

/**
 * Unless the mesh asked for data channels inside a namespace of ours, WebRTC gets no UDP. Not a guard on its own
 * (Chromium still offers TCP host candidates): pages not asked for data channels open with `?rtc=off`.
 */
export const NO_WEBRTC_UDP = '--force-webrtc-ip-handling-policy=disable_non_proxied_udp';

/** Inside the network namespace scripts/netns-run.sh makes. */
export function inNetns(): boolean {
  return process.env.MESHNET_NETNS === '1';
}

export interface BrowserMeshOptions {
  /** Pages to open. */
  nodes: number;
  trackerUrl: string;
  relayUrl: string;
  /** The built donor page; absent: dist/ is served here (built first when missing). */
  appUrl?: string;
  /** Model id at the tracker; absent: the tracker's first model. */
  model?: string;
  backend: 'wasm' | 'webgpu' | 'auto';
  /** Memory each page gives the mesh, MiB; absent: the page's default. */
  budgetMb?: number;
  /** WASM threads per page; absent: the page decides (cores - 1). */
  threads?: number;
  /** How a page drives its pipeline when it is a head (`?hop=`); absent: the page's default, chain. */
  hop?: 'chain' | 'star';
  /**
   * Data channels between the pages (`?rtc=`). Absent: off, so a mesh's
   * hops all go by the relay wherever it runs; the tests and benches of the
   * data channels ask for them, and run inside the network namespace
   * scripts/netns-run.sh makes (MESHNET_NETNS=1). Outside one, Chromium's
   * WebRTC gets no UDP at all: on one machine the packets would go to its own
   * network interface, which tests and demos here must not send to (Chromium
   * offers no loopback candidate), so the channels fail and the relay serves.
   */
  rtc?: boolean;
  /** Benches: each message a data channel receives is held this long (`?rtc_delay_ms=`), the one-way delay of a WAN leg. */
  rtcDelayMs?: number;
  /** `?ice_policy=relay`: ICE through TURN servers only; with none given, no channel can open (the fallback's test). */
  icePolicy?: 'relay';
  /** @defaultValue /usr/bin/chromium (or MESHNET_CHROMIUM) */
  chromium?: string;
  /** More Chromium flags (also from MESHNET_CHROMIUM_EXTRA, space-separated: for experiments such as --enable-features=NetworkServiceInProcess). */
  extraArgs?: string[];
  /** Status poll period, ms. @defaultValue 1000 */
  pollMs?: number;
  /** Every poll, with every node's row. */
  onUpdate?(rows: readonly NodeRow[]): void;
  /**
   * Open node `page` (0-based) as a real tab: the browser is then Chromium
   * started with a DevTools port and attached over CDP (cdp-chromium.ts),
   * and that page lives in its default context, where CDP's
   * `Page.setWebLifecycleState` really freezes it and a tab opened over it
   * hides it. The other pages keep their own contexts. `throttle`: leave
   * Chromium's background throttling on (CHROMIUM_FLAGS turn it off for
   * meshes), as in a donor's browser.
   */
  realTab?: { page: number; throttle?: boolean };
  /** Script run in every page before its own (tests: stand-ins for browser APIs this machine lacks, e.g. a battery). */
  initScript?: string;
  /** Lifecycle lines (crash, restart, browser relaunch). */
  log?(message: string): void;
}

/** One page as the terminal shows it. */
export interface NodeRow {
  index: number;
  peerId: string | undefined;
  state: NodeStatus['state'] | 'starting' | 'crashed';
  layers: [number, number] | undefined;
  /** 0..100 while downloading. */
  downloadPct: number | undefined;
  tokensServed: number;
  requestsPerMinute: number;
  backend: string | undefined;
  restarts: number;
  error: string | undefined;
}

export interface BrowserMesh {
  appUrl: string;
  rows(): readonly NodeRow[];
  /** The donor page URL a person can open to join this mesh. */
  donorUrl(): string;
  /** Node `index`'s page now (tools and tests: screenshots, fault injection). */
  page(index: number): Page | undefined;
  /** The browser now (benches read its processes over CDP). */
  browser(): Browser | undefined;
  /** Resolves when every page serves (and the tracker has their spans), or rejects after `timeoutMs`. */
  waitServing(timeoutMs: number): Promise<void>;
  close(): Promise<void>;
}

interface Slot {
  row: NodeRow;
  context: BrowserContext | undefined;
  page: Page | undefined;
  reopening: boolean;
}

export async function startBrowserMesh(o: BrowserMeshOptions): Promise<BrowserMesh> {
  const log = o.log ?? (() => {});
  let app: StaticServer | undefined;
  let appUrl = o.appUrl;
  if (!appUrl) {
    app = await serveBuiltApp();
    appUrl = `${app.url}/`;
  }
  const base = appUrl.endsWith('/') ? appUrl : `${appUrl}/`;
  const q = new URLSearchParams({ relay: o.relayUrl, tracker: o.trackerUrl });
  if (o.model) q.set('model', o.model);
  if (o.backend !== 'auto') q.set('backend', o.backend);
  if (o.budgetMb !== undefined) q.set('budget', String(o.budgetMb));
  if (o.threads !== undefined) q.set('threads', String(o.threads));
  if (o.hop !== undefined) q.set('hop', o.hop);
  q.set('rtc', o.rtc === true ? 'on' : 'off');
  if (o.rtcDelayMs) q.set('rtc_delay_ms', String(o.rtcDelayMs));
  if (o.icePolicy) q.set('ice_policy', o.icePolicy);
  const pageUrl = `${base}?${q}`;

  const executablePath = o.chromium ?? process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium';
  const flags = o.realTab?.throttle ? CHROMIUM_FLAGS.filter((f) => !/background|occluded/.test(f)) : CHROMIUM_FLAGS;
  const args = [...flags, ...(inNetns() && o.rtc === true ? [] : [NO_WEBRTC_UDP]), ...(o.backend === 'webgpu' ? ['--enable-unsafe-webgpu'] : []), ...(o.extraArgs ?? []), ...(process.env.MESHNET_CHROMIUM_EXTRA?.split(' ').filter(Boolean) ?? [])];
  let cdp: CdpChromium | undefined;
  let browser: Browser | undefined;
  let closing = false;

  const slots: Slot[] = Array.from({ length: o.nodes }, (_, index) => ({
    row: { index, peerId: undefined, state: 'starting', layers: undefined, downloadPct: undefined, tokensServed: 0, requestsPerMinute: 0, backend: undefined, restarts: 0, error: undefined },
    context: undefined,
    page: undefined,
    reopening: false,
  }));

  async function launch(): Promise<void> {
    let b: Browser;
    if (o.realTab) {
      const old = cdp;
      cdp = undefined;
      await old?.close();
      cdp = await launchCdpChromium({ executablePath, args });
      b = cdp.browser;
    } else b = await chromium.launch({ executablePath, headless: true, args });
    browser = b;
    b.on('disconnected', () => {
      if (closing || browser !== b) return;
      log('the browser exited; relaunching every node');
      for (const s of slots) {
        s.context = undefined;
        s.page = undefined;
        s.row.state = 'crashed';
        s.row.restarts++;
      }
      void launch().then(
        () => Promise.all(slots.map((s) => openPage(s))),
        (e: Error) => log(`relaunching the browser failed: ${e.message}`),
      );
    });
  }

  async function openPage(s: Slot): Promise<void> {
    if (closing || !browser) return;
    // A context per node: separate IndexedDB, so a separate identity and span. The real tab lives in the default context.
    s.context ??= o.realTab?.page === s.row.index && cdp ? cdp.defaultContext : await browser.newContext({ serviceWorkers: 'block' });
    const page = await s.context.newPage();
    if (o.initScript) await page.addInitScript(o.initScript);
    s.page = page;
    page.on('crash', () => {
      if (closing || s.page !== page) return;
      s.row.state = 'crashed';
      s.row.restarts++;
      log(`node ${s.row.index + 1}: the page crashed; reopening it (same identity, stored layers kept)`);
      void reopen(s);
    });
    page.on('pageerror', (e) => log(`node ${s.row.index + 1}: ${e.message}`));
    await page.goto(pageUrl);
    if (s.row.state === 'crashed') s.row.state = 'starting';
  }

  async function reopen(s: Slot): Promise<void> {
    if (s.reopening) return;
    s.reopening = true;
    try {
      await s.page?.close().catch(() => undefined);
      s.page = undefined;
      await openPage(s);
    } catch (e) {
      log(`node ${s.row.index + 1}: reopening failed: ${(e as Error).message}`);
    } finally {
      s.reopening = false;
    }
  }

  async function poll(s: Slot): Promise<void> {
    const page = s.page;
    // A crashed page answers nothing until its replacement is up.
    if (!page || page.isClosed() || s.reopening || s.page !== page) return;
    const st = await page.evaluate(() => window.meshnet?.engine.status()).catch(() => undefined);
    if (!st) return;
    const r = s.row;
    r.peerId = st.peerId;
    r.state = st.state;
    r.layers = st.model ? [st.model.startLayer, st.model.endLayer] : undefined;
    r.downloadPct = st.state === 'downloading' && st.download && st.download.totalBytes > 0 ? Math.floor((100 * st.download.loadedBytes) / st.download.totalBytes) : undefined;
    r.tokensServed = st.tokensServed;
    r.requestsPerMinute = st.requestsPerMinute;
    r.backend = st.backend?.kind;
    r.error = st.error ? `${st.error.code}: ${st.error.message}` : undefined;
  }

  /** Until the page's node got a span (it downloads, loads or serves), or `timeoutMs` passed (then the next page opens anyway). */
  async function untilAssigned(s: Slot, timeoutMs: number): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    while (!closing && Date.now() < deadline) {
      await poll(s);
      if (s.row.state === 'downloading' || s.row.state === 'loading' || s.row.state === 'serving' || s.row.layers !== undefined) return;
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  let timer: ReturnType<typeof setTimeout> | undefined;
  const tick = async () => {
    await Promise.all(slots.map((s) => poll(s)));
    o.onUpdate?.(slots.map((s) => s.row));
    if (!closing) timer = setTimeout(() => void tick(), o.pollMs ?? 1000);
  };

  await launch();
  // One page at a time, each assigned its span before the next opens: the tracker sizes each span
  // knowing the spans already given, spans follow the pages' order (a test that makes page k the real
  // tab knows which span it holds), and two cores stay responsive while each page starts its worker.
  for (const s of slots) {
    await openPage(s);
    await untilAssigned(s, 30_000);
  }
  void tick();

  return {
    appUrl: base,
    rows: () => slots.map((s) => s.row),
    donorUrl: () => pageUrl,
    page: (index) => slots[index]?.page,
    browser: () => browser,
    async waitServing(timeoutMs) {
      const deadline = Date.now() + timeoutMs;
      for (;;) {
        await Promise.all(slots.map((s) => poll(s)));
        if (slots.every((s) => s.row.state === 'serving')) return;
        if (Date.now() > deadline) {
          throw new Error(`not every node serves after ${timeoutMs} ms: ${slots.map((s) => `node ${s.row.index + 1} ${s.row.state}${s.row.error ? ` (${s.row.error})` : ''}`).join(', ')}`);
        }
        await new Promise((r) => setTimeout(r, 250));
      }
    },
    async close() {
      closing = true;
      if (timer) clearTimeout(timer);
      await Promise.all(slots.map((s) => (s.context === cdp?.defaultContext ? s.page?.close() : s.context?.close())?.catch(() => undefined)));
      await browser?.close().catch(() => undefined);
      await cdp?.close();
      await app?.close();
    },
  };
}

/** The project's dist/ on a local port with COOP/COEP (WASM threads), built with vite first when missing. */
export async function serveBuiltApp(): Promise<StaticServer> {
  return startStaticServer({ root: await builtApp(), port: 0, host: '127.0.0.1' });
}

// ---------------------------------------------------------------- terminal view

const pad = (s: string, n: number) => (s.length >= n ? s.slice(0, n) : s + ' '.repeat(n - s.length));

/** The table's lines: one header, one line per node. */
export function formatRows(rows: readonly NodeRow[]): string[] {
  const head = `${pad('node', 5)} ${pad('peer', 9)} ${pad('state', 16)} ${pad('layers', 8)} ${pad('backend', 8)} ${pad('tokens', 7)} ${pad('req/min', 7)} restarts`;
  return [
    head,
    ...rows.map((r) => {
      const state = r.state === 'downloading' && r.downloadPct !== undefined ? `downloading ${r.downloadPct}%` : r.state;
      const layers = r.layers ? `${r.layers[0]}-${r.layers[1] - 1}` : '-';
      const line = `${pad(String(r.index + 1), 5)} ${pad(r.peerId?.slice(0, 8) ?? '-', 9)} ${pad(state, 16)} ${pad(layers, 8)} ${pad(r.backend ?? '-', 8)} ${pad(String(r.tokensServed), 7)} ${pad(String(r.requestsPerMinute), 7)} ${r.restarts}`;
      return r.error && r.state === 'error' ? `${line}  ${r.error}` : line;
    }),
  ];
}

/**
 * Shows the rows: redrawn in place on a TTY; otherwise one plain line per
 * node whenever its state, span or download decile changes, and its tokens
 * at most every `plainEveryMs`.
 */
export function terminalView(out: NodeJS.WriteStream, plainEveryMs = 10_000): { update(rows: readonly NodeRow[]): void; clear(): void } {
  if (out.isTTY) {
    let drawn = 0;
    return {
      update(rows) {
        const lines = formatRows(rows);
        // Up to the table's first line, clear to the end of the screen, draw again.
        out.write(`${drawn ? `\x1b[${drawn}A` : ''}\x1b[J${lines.join('\n')}\n`);
        drawn = lines.length;
      },
      clear() {
        drawn = 0;
      },
    };
  }
  const last = new Map<number, { key: string; tokens: number; at: number }>();
  return {
    update(rows) {
      const now = Date.now();
      for (const r of rows) {
        const key = `${r.state}|${r.layers?.join('-')}|${r.downloadPct === undefined ? '' : Math.floor(r.downloadPct / 10)}|${r.restarts}`;
        const prev = last.get(r.index);
        const tokensDue = prev !== undefined && r.tokensServed !== prev.tokens && now - prev.at >= plainEveryMs;
        if (prev?.key === key && !tokensDue) continue;
        last.set(r.index, { key, tokens: r.tokensServed, at: now });
        const state = r.state === 'downloading' && r.downloadPct !== undefined ? `downloading ${r.downloadPct}%` : r.state;
        out.write(`node ${r.index + 1}${r.peerId ? ` ${r.peerId.slice(0, 8)}` : ''}: ${state}${r.layers ? `, layers ${r.layers[0]}-${r.layers[1] - 1}` : ''}${r.backend ? `, ${r.backend}` : ''}, ${r.tokensServed} tokens served${r.restarts ? `, ${r.restarts} restarts` : ''}${r.error && r.state === 'error' ? ` — ${r.error}` : ''}\n`);
      }
    },
    clear() {},
  };
}
