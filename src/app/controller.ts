/**
 * Wires the page to a NodeEngine: starts it with the URL's span, polls its
 * status (pull, so a busy worker is never flooded), and turns the controls
 * into engine calls. Knows the interface only, never how the node is hosted.
 */
import { isMeshErrorCode } from '../protocol/errors.ts';
import type { NodeConfig, NodeEngine, NodeStatus } from '../host/browser/engine.ts';
import { renderStatus, type ViewRoot } from './view.ts';

export interface ControllerOptions {
  /** Status poll period, ms. @defaultValue 500 */
  pollMs?: number;
  /** Called after every render (tests, the service worker's cached-state snapshot). */
  onStatus?(s: NodeStatus): void;
}

export class PageController {
  private timer: ReturnType<typeof setTimeout> | undefined;
  private stopped = false;
  last: NodeStatus | undefined;

  constructor(
    private readonly engine: NodeEngine,
    private readonly root: ViewRoot & { addEventListener?: unknown },
    private readonly opts: ControllerOptions = {},
  ) {}

  async start(config: NodeConfig): Promise<void> {
    this.bindControls();
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
    this.opts.onStatus?.(s);
  }

  stop(): void {
    this.stopped = true;
    if (this.timer !== undefined) clearTimeout(this.timer);
  }

  private poll = (): void => {
    if (this.stopped) return;
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
      const paused = this.last?.state === 'paused';
      pause.disabled = true;
      (paused ? this.engine.resume() : this.engine.pause()).then(() => this.refresh(), (e) => this.showThrown(e));
    });
    const retry = this.root.getElementById('retry') as HTMLButtonElement | null;
    retry?.addEventListener('click', () => {
      retry.hidden = true;
      this.engine.retry().then((s) => this.show(s), (e) => this.showThrown(e));
    });
    const budget = this.root.getElementById('budget') as HTMLInputElement | null;
    budget?.addEventListener('change', () => {
      const mib = Number(budget.value);
      if (Number.isFinite(mib) && mib > 0) this.engine.setMemoryBudget(mib * 1024 * 1024).then(() => this.refresh(), (e) => this.showThrown(e));
    });
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
  };
}
