/**
 * The tab's life as Chromium lives it, told to the node.
 *
 *   freeze, pagehide     the page is about to stop (frozen, closed, put in the
 *                        back/forward cache): a beacon tells the tracker the
 *                        node drains, then the worker is told
 *   resume, pageshow     back: the worker heartbeats at once and serves again
 *   wasDiscarded         the browser discarded the tab and this is its reload:
 *                        said on the page (the node restores identity, span
 *                        and weights from IndexedDB as on any start)
 *   Web Lock             held while the node donates, so Chromium's own
 *                        freezing (Energy Saver, hidden CPU-heavy tabs)
 *                        passes this tab by; released while paused
 *
 * Why a beacon from the page: once `freeze` fires, the page and its worker
 * stop within milliseconds. Measured on Chromium 156 (bench/freeze-paths.ts;
 * docs/architecture.md, "The tab's life"), a beacon sent in the freeze
 * handler got out every time (20 of 20), a fetch from the worker 16 times
 * in 20, and one made after a signature 7 in 20 — and a handler that must
 * not wait cannot sign. So the worker signs a draining heartbeat in
 * advance with each heartbeat and hands it here; the handler only sends it.
 */

export type LifecycleEvent = 'frozen' | 'resumed' | 'leaving';

/** A draining heartbeat the worker signed in advance: sent as is by sendBeacon. */
export interface DrainBeacon {
  url: string;
  body: string;
}

/** What the page tells the node (the worker, through the engine). */
export interface LifecycleNode {
  lifecycle(event: LifecycleEvent): Promise<void>;
}

/** The browser globals this needs (a test passes stand-ins). */
export interface LifecycleEnv {
  document: { addEventListener(type: string, listener: () => void): void; wasDiscarded?: boolean };
  window: { addEventListener(type: string, listener: (e: { persisted?: boolean }) => void): void };
  navigator: {
    sendBeacon?(url: string, data: string): boolean;
    locks?: { request(name: string, options: { mode: 'shared' | 'exclusive' }, callback: () => Promise<void>): Promise<unknown> };
  };
  now?(): number;
}

export const DONATING_LOCK = 'meshnet:donating';

export interface LifecycleRecord {
  event: LifecycleEvent;
  at: number;
  /** Whether a signed drain beacon was queued by the browser for this event. */
  beacon: boolean;
}

export class PageLifecycle {
  private beacon: DrainBeacon | undefined;
  private release: (() => void) | undefined;
  private wantLock = false;
  /** True while the Web Lock is granted to this page. */
  lockHeld = false;
  /** The browser discarded this tab and this is its reload. */
  readonly wasDiscarded: boolean;
  /** The latest events, newest last (the page's log line, tests). */
  readonly events: LifecycleRecord[] = [];
  private readonly now: () => number;

  constructor(
    private readonly env: LifecycleEnv,
    private readonly node: LifecycleNode,
    private readonly log: (message: string) => void = () => {},
  ) {
    this.now = env.now ?? Date.now;
    this.wasDiscarded = env.document.wasDiscarded === true;
    env.document.addEventListener('freeze', () => this.stopping('frozen'));
    env.document.addEventListener('resume', () => this.back());
    // A page put in the back/forward cache may come back (persisted); one that is not is going away.
    env.window.addEventListener('pagehide', (e) => this.stopping(e.persisted ? 'frozen' : 'leaving'));
    env.window.addEventListener('pageshow', (e) => {
      if (e.persisted) this.back();
    });
  }

  /** The newest signed drain beacon (the worker hands one over after each heartbeat). */
  setBeacon(b: DrainBeacon | undefined): void {
    this.beacon = b;
  }

  /** Hold the donating Web Lock while `on` (serving, not paused); let it go otherwise. */
  setDonating(on: boolean): void {
    if (on === this.wantLock) return;
    this.wantLock = on;
    if (!on) {
      this.release?.();
      return;
    }
    const locks = this.env.navigator.locks;
    if (!locks) return;
    locks
      .request(DONATING_LOCK, { mode: 'shared' }, () => {
        // Granted: hold it until released (or, if donating stopped meanwhile, let go at once).
        if (!this.wantLock) return Promise.resolve();
        this.lockHeld = true;
        return new Promise<void>((resolve) => {
          this.release = () => {
            this.release = undefined;
            this.lockHeld = false;
            resolve();
          };
        });
      })
      .catch((e: Error) => this.log(`the Web Lock was refused (${e.message}): the browser may freeze this tab while it is hidden`));
  }

  /** Synchronous on purpose: after this handler returns, the page may not run again. */
  private stopping(event: 'frozen' | 'leaving'): void {
    let sent = false;
    const b = this.beacon;
    if (b && this.env.navigator.sendBeacon) {
      try {
        sent = this.env.navigator.sendBeacon(b.url, b.body);
      } catch {
        sent = false; // a beacon over the browser's limit or a bad URL: the heartbeat timeout still drops the node
      }
    }
    this.record(event, sent);
    void this.node.lifecycle(event).catch(() => undefined);
  }

  private back(): void {
    this.record('resumed', false);
    void this.node.lifecycle('resumed').catch((e: Error) => this.log(`the node did not take the resume: ${e.message}`));
  }

  private record(event: LifecycleEvent, beacon: boolean): void {
    this.events.push({ event, at: this.now(), beacon });
    if (this.events.length > 32) this.events.shift();
  }
}
