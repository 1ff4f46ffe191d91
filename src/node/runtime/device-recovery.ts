/**
 * What a node does when its GPU fails it (docs/architecture.md, "The GPU path"),
 * the same on every host:
 *
 *   device lost     the span is built again on the same layers (SpanSlot
 *                   reload, beside the dead one): the host is asked for a
 *                   backend with `DeviceLoss` (a fresh GPUDevice on the first
 *                   loss, the CPU after that), one step is timed on it for
 *                   the new layer_ms, and the swap re-announces backend,
 *                   layer_ms, weight_format and memory to the tracker. The
 *                   relay connection and the peer id are untouched. Until the
 *                   swap the dead executor answers every call at once with
 *                   503 MESH_ERR_UNAVAILABLE and a Retry-After (the tracker
 *                   routes the chat again, its tokens so far kept); sessions
 *                   whose KV was on the lost device are gone, and the new
 *                   executor answers them 409, which the head repairs by
 *                   replaying their history.
 *   rebuild failed  the next fallback (the host's choice, by `losses`), up
 *                   to MAX_REBUILDS; after that the load failure is the
 *                   runtime's as any other, and the dead span is given up
 *                   on (gaveUp): heartbeats announce nothing served, so the
 *                   tracker routes around the node, and the tracker's next
 *                   assignment loads the span afresh.
 *   out of memory   a span load or a KV cache the device could not allocate
 *                   (MESH_ERR_DEVICE_MEMORY, 507): the request already got
 *                   its clear 507; the node halves its announced memory
 *                   budget so that the tracker assigns it a smaller span
 *                   (once per span). A pinned span (--layers) is not the
 *                   tracker's to shrink: it is only logged.
 */
import { MeshError } from '../../protocol/errors.ts';
import type { DeviceLoss, LogLevel, SpanSpec } from './host.ts';
import { sameSpec, type LoadedSpan, type SpanSlot } from './span.ts';

/** Rebuilds of one lost span tried before the failure is left to stand (a fresh GPU, then the CPU, then once more the CPU). */
export const MAX_REBUILDS = 3;

/** The smallest budget a shrink goes to, bytes: below this no layer of any model fits anyway. */
const MIN_BUDGET_BYTES = 1 << 20;

export interface DeviceRecoveryInit {
  slot: SpanSlot;
  /** The budget announced now, and a new one to announce (the runtime's setMemoryBudget). */
  budget(): number;
  setBudget(bytes: number): void;
  /** A static span (--layers): the tracker does not move it, so a smaller budget would not help. */
  pinned: boolean;
  log(level: LogLevel, message: string): void;
}

export class DeviceRecovery {
  /** The node's losses so far (and why the last); undefined while the GPU never failed. */
  private loss: DeviceLoss | undefined;
  /** Rebuilds tried since the last one that served. */
  private rebuilds = 0;
  /** Spans that already asked for a smaller span after a KV allocation failure. */
  private readonly shrunkFor = new WeakSet<LoadedSpan>();
  /** The budget each load started under: a failure halves that, so a load queued before a shrink does not halve it again. */
  private readonly budgetAtLoad = new WeakMap<SpanSpec, number>();
  /** Layers ("start-end") that did not fit the device → the budget announced after they failed. */
  private readonly tooBig = new Map<string, number>();
  /** Lost spans whose rebuilds all failed: nothing serves them any more. */
  private readonly abandoned = new WeakSet<LoadedSpan>();

  constructor(private readonly o: DeviceRecoveryInit) {}

  /** What a load tells the host's backend choice: every load after a loss, so a host that fell back to the CPU stays there. */
  lossFor(): DeviceLoss | undefined {
    return this.loss ? { ...this.loss } : undefined;
  }

  /**
   * True once every rebuild of `span`'s lost device failed: the node must not
   * announce it (requests would meet 503 forever while the tracker routed to
   * it) and a later assignment loads it afresh instead of keeping it.
   */
  gaveUp(span: LoadedSpan | undefined): boolean {
    return span !== undefined && this.abandoned.has(span);
  }

  /** `span` serves from now on: rebuild it when its device is lost. */
  watch(span: LoadedSpan): void {
    if (span.rebuilt) this.rebuilds = 0;
    void span.deviceLost?.then((reason) => this.lost(span, reason));
  }

  /** A load of `spec` starts now (the same object comes back to loadFailed). */
  loading(spec: SpanSpec): void {
    this.budgetAtLoad.set(spec, this.o.budget());
  }

  /** A load failed. True when handled here (a rebuild tried again, a smaller span asked); false: the runtime's usual failure. */
  loadFailed(spec: SpanSpec, error: unknown): boolean {
    if (isDeviceMemory(error)) {
      const layers = `${spec.startLayer}-${spec.endLayer}`;
      const asked = this.tooBig.get(layers);
      // The same layers failed already and the smaller budget is still what we announce: this assignment was made
      // before the tracker saw it (a heartbeat's answer in flight), so it is no news and must not halve again.
      if (asked !== undefined && this.o.budget() <= asked) return !this.o.pinned;
      this.shrink(`loading layers [${spec.startLayer}, ${spec.endLayer})`, error as MeshError, this.budgetAtLoad.get(spec) ?? this.o.budget());
      this.tooBig.set(layers, this.o.budget());
      return !this.o.pinned;
    }
    const cur = this.o.slot.current;
    if (!this.loss || !cur?.deviceLostReason || !sameSpec(cur.spec, spec)) return false;
    if (this.rebuilds >= MAX_REBUILDS) {
      if (!this.abandoned.has(cur)) this.o.log('error', `rebuilding layers [${spec.startLayer}, ${spec.endLayer}) failed ${this.rebuilds} times; giving up: ${(error as Error)?.message ?? String(error)}`);
      this.abandoned.add(cur);
      return false;
    }
    this.loss = { reason: `${this.loss.reason}; rebuilding failed: ${(error as Error)?.message ?? String(error)}`, losses: this.loss.losses + 1 };
    this.rebuild(cur);
    return true;
  }

  /** A request answered 507 (the device could not allocate a KV cache): ask for a smaller span, once per span. */
  requestFailed(span: LoadedSpan, status: number): void {
    if (status !== 507 || this.shrunkFor.has(span)) return;
    this.shrunkFor.add(span);
    this.shrink(`a KV cache for layers [${span.spec.startLayer}, ${span.spec.endLayer})`, undefined, this.o.budget());
  }

  private lost(span: LoadedSpan, reason: string): void {
    span.deviceLostReason = reason;
    if (this.o.slot.current !== span) return; // replaced meanwhile: nothing serves on that device
    this.loss = { reason, losses: (this.loss?.losses ?? 0) + 1 };
    this.o.log('warn', `the GPU device of layers [${span.spec.startLayer}, ${span.spec.endLayer}) was lost (${reason}); rebuilding the span (loss ${this.loss.losses}), requests answer 503 until then`);
    this.rebuild(span);
  }

  private rebuild(span: LoadedSpan): void {
    this.rebuilds++;
    // After the current slot step: a failed rebuild is still the slot's wanted spec until its load settles,
    // and the slot would take the same spec for one already queued.
    queueMicrotask(() => void this.o.slot.assign({ ...span.spec }, true));
  }

  /** Announce half of `base` (the budget the failed allocation was sized under), unless less is announced already. */
  private shrink(what: string, error: MeshError | undefined, base: number): void {
    const why = error ? `: ${error.message}` : '';
    if (this.o.pinned) {
      this.o.log('error', `the device could not allocate ${what}${why}; this span is pinned (--layers), so it keeps answering 507: give it fewer layers`);
      return;
    }
    const before = this.o.budget();
    const after = Math.max(MIN_BUDGET_BYTES, Math.floor(base / 2));
    if (after >= before) return;
    this.o.log('warn', `the device could not allocate ${what}${why}; announcing ${mib(after)} instead of ${mib(before)} so that the tracker assigns a smaller span`);
    this.o.setBudget(after);
  }
}

function isDeviceMemory(e: unknown): boolean {
  return e instanceof MeshError && e.code === 'MESH_ERR_DEVICE_MEMORY';
}

function mib(bytes: number): string {
  return `${Math.round((bytes / 2 ** 20) * 100) / 100} MiB`;
}
