/**
 * Wires the page to a NodeEngine: starts it with the URL's span, polls its
 * status (pull, so a busy worker is never flooded), and turns the controls
 * into engine calls. Knows the interface only, never how the node is hosted.
 *
 * With the page's globals (`page`), it also brings what only a page has to
 * the node: the tab's lifecycle and the donating Web Lock (lifecycle.ts),
 * the battery (power.ts), and the storage persistence the donor asks for
 * (storage-info.ts).
 */
import { isMeshErrorCode } from '../protocol/errors.ts';
import type { NodeConfig, NodeEngine, NodeStatus } from '../host/browser/engine.ts';
import { formatBytes } from './format.ts';
import { PageLifecycle, type LifecycleEnv } from './lifecycle.ts';
import { watchPower, type BatteryLike } from './power.ts';
import { askPersist, describeStorage, storageInfo, type StorageManagerLike } from './storage-info.ts';
import { renderPage, renderStatus, type ViewRoot } from './view.ts';

/** The browser globals the page-only features need (a test may leave them out). */
export interface PageEnv {
  lifecycle: LifecycleEnv;
  battery: { getBattery?(): Promise<BatteryLike> };
  storage: StorageManagerLike | undefined;
  /** Calls back when the PWA is installed (`appinstalled`). */
  onInstalled(listener: () => void): void;
}

export interface ControllerOptions {
  /** Status poll period, ms. @defaultValue 500 */
  pollMs?: number;
  /** Called after every render (tests, the service worker's cached-state snapshot). */
  onStatus?(s: NodeStatus): void;
  page?: PageEnv;
}

/** Storage figures are read again every this many polls (estimate() is not free). */
const STORAGE_EVERY_POLLS = 20;

export class PageController {
  private timer: ReturnType<typeof setTimeout> | undefined;
  private stopped = false;
  /** Status polls so far (a hidden page's timers are throttled: this shows by how much). */
  polls = 0;
  /** The persistence request was made and answered (false: refused). */
  private persistAnswer: boolean | undefined;
  private persistAsked = false;
  last: NodeStatus | undefined;
  lifecycle: PageLifecycle | undefined;

  constructor(
    private readonly engine: NodeEngine,
    private readonly root: ViewRoot & { addEventListener?: unknown },
    private readonly opts: ControllerOptions = {},
  ) {}

  async start(config: NodeConfig): Promise<void> {
    this.bindControls();
    this.bindPage();
    this.poll();
    try {
      this.show(await this.engine.start(config));
    } catch (e) {
      this.showThrown(e);
    }
  }

  /** Render a status that did not come from the engine (the cached snapshot before the worker answers). */
  show(s: NodeStatus): void {
    this.last = s;
    renderStatus(this.root, s);
    // A donor who asked to keep the shard: ask again on each visit (the browser may grant it now: installed, or engaged).
    if (s.donor.keepShard && this.opts.page && this.persistAnswer === undefined && !this.persistAsked) {
      this.persistAsked = true;
      void this.persist();
    }
    if (this.lifecycle) {
      // Donating: serving and not draining. A paused tab lets the browser freeze it.
      this.lifecycle.setDonating(s.state === 'serving' && !s.drain);
      renderPage(this.root, { lock: this.lifecycle.lockHeld, lifecycle: this.lifecycleText() });
    }
    this.opts.onStatus?.(s);
  }

  stop(): void {
    this.stopped = true;
    if (this.timer !== undefined) clearTimeout(this.timer);
  }

  private poll = (): void => {
    if (this.stopped) return;
    if (this.opts.page && this.polls++ % STORAGE_EVERY_POLLS === 0) void this.refreshStorage();
    this.engine.status().then(
      (s) => this.show(s),
      (e) => this.showThrown(e),
    ).finally(() => {
      if (!this.stopped) this.timer = setTimeout(this.poll, this.opts.pollMs ?? 500);
    });
  };

  private showThrown(e: unknown): void {
    const err = e as { code?: unknown; message?: string };
    const base: NodeStatus = this.last ?? emptyStatus();
    this.show({
      ...base,
      state: 'error',
      error: { code: isMeshErrorCode(err.code) ? err.code : 'MESH_ERR_INTERNAL', message: err.message ?? String(e), action: 'Reload the page; if it happens again, report it with this message.', retryable: true },
    });
  }

  private bindControls(): void {
    const pause = this.root.getElementById('pause') as HTMLButtonElement | null;
    pause?.addEventListener('click', () => {
      // The donor's own pause (a pause for the battery is lifted by the charger, not by this button).
      const paused = this.last?.donor.paused === true;
      pause.disabled = true;
      (paused ? this.engine.resume() : this.engine.pause()).then(() => this.refresh(), (e) => this.showThrown(e));
    });
    const retry = this.root.getElementById('retry') as HTMLButtonElement | null;
    retry?.addEventListener('click', () => {
      retry.hidden = true;
      this.engine.retry().then((s) => this.show(s), (e) => this.showThrown(e));
    });
    const duty = this.root.getElementById('duty') as HTMLInputElement | null;
    duty?.addEventListener('change', () => {
      const pct = Number(duty.value);
      if (Number.isFinite(pct) && pct > 0) this.engine.setDonor({ dutyCycle: pct / 100 }).then(() => this.refresh(), (e) => this.showThrown(e));
    });
    const charging = this.root.getElementById('charging-only') as HTMLInputElement | null;
    charging?.addEventListener('change', () => {
      this.engine.setDonor({ chargingOnly: charging.checked }).then(() => this.refresh(), (e) => this.showThrown(e));
    });
    const keep = this.root.getElementById('keep-shard') as HTMLInputElement | null;
    keep?.addEventListener('change', () => {
      this.engine.setDonor({ keepShard: keep.checked }).then(
        () => (keep.checked ? this.persist() : this.refreshStorage()),
        (e) => this.showThrown(e),
      );
    });
    const budget = this.root.getElementById('budget') as HTMLInputElement | null;
    budget?.addEventListener('change', () => {
      const mib = Number(budget.value);
      if (Number.isFinite(mib) && mib > 0) this.engine.setMemoryBudget(mib * 1024 * 1024).then(() => this.refresh(), (e) => this.showThrown(e));
    });
  }

  /** Page-only features: the tab's lifecycle and Web Lock, the battery, installing the app. */
  private bindPage(): void {
    const page = this.opts.page;
    if (!page) return;
    const lc = new PageLifecycle(page.lifecycle, this.engine, (m) => console.warn(m));
    this.lifecycle = lc;
    this.engine.onDrainBeacon((b) => lc.setBeacon(b)).catch((e: Error) => console.warn(`no drain beacon: ${e.message}`));
    void watchPower(page.battery, (p) => {
      if (p.available) this.engine.setPower(p.charging).catch(() => undefined);
    });
    // Installing the app is the donor saying "keep this": ask the browser to keep the shard too.
    page.onInstalled(() => void this.persist());
  }

  /** Ask the browser to keep this site's storage, and show its answer. */
  private async persist(): Promise<void> {
    this.persistAnswer = await askPersist(this.opts.page?.storage);
    await this.refreshStorage();
  }

  private async refreshStorage(): Promise<void> {
    const page = this.opts.page;
    if (!page) return;
    const info = await storageInfo(page.storage);
    // Refused once asked: say so (persisted() stays false); the node keeps working either way.
    renderPage(this.root, { storage: describeStorage(info, this.persistAnswer !== undefined || this.last?.donor.keepShard === true, formatBytes) });
  }

  private lifecycleText(): string {
    const lc = this.lifecycle!;
    const last = lc.events[lc.events.length - 1];
    const parts: string[] = [];
    if (lc.wasDiscarded) parts.push('The browser discarded this tab to save memory; it rejoined with the layers it keeps.');
    if (last) parts.push(`Last ${last.event === 'resumed' ? 'back from being frozen' : last.event === 'frozen' ? 'frozen' : 'closing'} at ${new Date(last.at).toLocaleTimeString()}${last.event !== 'resumed' ? (last.beacon ? ' (the tracker was told)' : ' (the tracker could not be told)') : ''}.`);
    return parts.join(' ');
  }

  private refresh(): void {
    this.engine.status().then((s) => this.show(s), (e) => this.showThrown(e));
  }
}

export function emptyStatus(): NodeStatus {
  return {
    state: 'idle',
    storedBytes: 0,
    fetchedBytes: 0,
    quantization: { quantized: 0, loaded: 0, quantizeMs: 0 },
    requestsServed: 0,
    tokensServed: 0,
    requestsPerMinute: 0,
    throughput: [],
    recentForwardMs: [],
    sessions: 0,
    kvBytes: 0,
    kvBudgetBytes: 256 * 1024 * 1024,
    memoryBudgetBytes: 256 * 1024 * 1024,
    crossOriginIsolated: false,
    donor: { paused: false, dutyCycle: 1, chargingOnly: false, keepShard: false },
    contribution: { tokensServed: 0, servingMs: 0, since: undefined, layersHeld: 0 },
  };
}
