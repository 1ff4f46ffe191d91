/**
 * Chromium started by us with a DevTools port, and Playwright attached to it
 * over CDP: the one way found to drive a page's real lifecycle from a test.
 *
 * Pages Playwright opens with `browser.newContext()` (or `chromium.launch`)
 * get focus emulation, which keeps them visible: `Page.setWebLifecycleState
 * frozen` answers success and freezes nothing. Pages in the browser's
 * default context, attached with `noDefaults` (Playwright then leaves its
 * overrides off there), behave as a real tab: frozen by CDP, `freeze` and
 * `resume` fired, hidden when another tab of the window is opened, timers
 * throttled when hidden. All default-context pages of one origin share
 * IndexedDB (so one identity): open one node page there per origin.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { chromium, type Browser, type BrowserContext, type Page } from 'playwright-core';

export interface CdpChromium {
  browser: Browser;
  /** The default context: pages here have a real lifecycle. */
  defaultContext: BrowserContext;
  /** The Chromium process's pid (benches read its children). */
  pid: number | undefined;
  close(): Promise<void>;
}

export interface CdpChromiumOptions {
  executablePath?: string;
  args?: string[];
  /** @defaultValue 20000 */
  startTimeoutMs?: number;
}

export async function launchCdpChromium(o: CdpChromiumOptions = {}): Promise<CdpChromium> {
  const executablePath = o.executablePath ?? process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium';
  const profile = await mkdtemp(join(tmpdir(), 'meshnet-chromium-'));
  const proc: ChildProcess = spawn(executablePath, ['--headless=new', '--remote-debugging-port=0', `--user-data-dir=${profile}`, '--no-first-run', '--no-default-browser-check', ...(o.args ?? []), 'about:blank'], { stdio: ['ignore', 'ignore', 'pipe'] });
  let stderr = '';
  const wsUrl = await new Promise<string>((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`Chromium printed no DevTools URL within ${o.startTimeoutMs ?? 20_000} ms: ${stderr.slice(-400)}`)), o.startTimeoutMs ?? 20_000);
    proc.stderr!.on('data', (d: Buffer) => {
      stderr += d.toString();
      const m = /DevTools listening on (ws:\/\/\S+)/.exec(stderr);
      if (m) {
        clearTimeout(t);
        resolve(m[1]!);
      }
    });
    proc.once('exit', (code) => {
      clearTimeout(t);
      reject(new Error(`Chromium exited (${code}) before it listened: ${stderr.slice(-400)}`));
    });
  });
  proc.stderr!.resume();
  let browser: Browser;
  try {
    // noDefaults (Playwright's documented option): no focus emulation on default-context pages, or they would never freeze or hide.
    browser = await chromium.connectOverCDP(wsUrl, { noDefaults: true, isLocal: true });
  } catch (e) {
    proc.kill('SIGKILL');
    await rm(profile, { recursive: true, force: true, maxRetries: 10, retryDelay: 100 });
    throw e;
  }
  const defaultContext = browser.contexts()[0]!;
  return {
    browser,
    defaultContext,
    pid: proc.pid,
    async close() {
      await browser.close().catch(() => undefined);
      if (proc.exitCode === null) {
        proc.kill('SIGTERM');
        await new Promise<void>((r) => {
          const t = setTimeout(() => {
            proc.kill('SIGKILL');
            r();
          }, 3_000);
          proc.once('exit', () => {
            clearTimeout(t);
            r();
          });
        });
      }
      await rm(profile, { recursive: true, force: true, maxRetries: 10, retryDelay: 100 });
    },
  };
}

/** Freezes (`frozen`) or resumes (`active`) a page as Chromium itself would; returns when CDP answered. */
export async function setLifecycle(page: Page, state: 'frozen' | 'active'): Promise<void> {
  const cdp = await page.context().newCDPSession(page);
  try {
    await cdp.send('Page.setWebLifecycleState', { state });
  } finally {
    await cdp.detach().catch(() => undefined);
  }
}
