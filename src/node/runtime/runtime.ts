/**
 * The node runtime: one node's life, the same on every host.
 *
 *   create()    identity from the host's key store (same peer id after a restart)
 *   start()     relay (RelayClient, optional), then the span: the tracker's
 *               assignment (TrackerSession: register, heartbeat, adopt every
 *               assignment) or a static span
 *   serving     every surface's requests go through one NodeHandler; a head
 *               drives pipelines over one HopTransport (relay, /rpc, links,
 *               direct HTTP); a moved assignment loads beside the old span
 *               and is swapped in (SpanSlot)
 *   pause()     drains (drain.ts): held sessions finish within a grace, new
 *               ones are refused, heartbeats say `draining` (the tracker
 *               routes around the node at once); resume() serves again,
 *               nothing reloaded. The page's lifecycle (frozen, closing)
 *               and "donate only while charging" drain the same way
 *   duty cycle  the donor's cap on the device's busy time (duty-cycle.ts),
 *               announced as a proportionally longer layer_ms
 *   close()     everything released
 *
 * The state (state.ts) is derived from facts on every change, never set by
 * hand. A host is an adapter (host.ts): src/host/node and src/host/browser.
 * The runtime holds the pieces together; each is built in its own module:
 * the hop transport (node-transport.ts), the relay client (node-relay.ts),
 * verification's parts (node-trust.ts), data channels (data-channels.ts),
 * what the tracker is told (node-message.ts), and joining the tracker and
 * taking its assignments (tracker-link.ts).
 */
import { MeshError } from '../../protocol/errors.ts';
import type { Assignment, NodeMessage } from '../../protocol/tracker.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import { Identity } from '../../net/identity.ts';
import type { LinkDialer, MeshHandler } from '../../net/contract.ts';
import type { RelayClient } from '../../net/relay-client.ts';
import { NodeHandler, type Surface } from './handler.ts';
import type { RuntimeHost, SpanSpec } from './host.ts';
import { SpanSlot, baseUrl, loadSpan, type LoadedSpan, type SpanLoadContext } from './span.ts';
import { RUNTIME_VERSION, type LifecycleEvent, type RuntimeConfig } from './config.ts';
import { DataChannels, type DataChannelsInfo } from './data-channels.ts';
import { DeviceRecovery } from './device-recovery.ts';
import { DrainGate, type DrainReason, type DrainStatus } from './drain.ts';
import { DutyCycle } from './duty-cycle.ts';
import { MessageStamps, hopPaths, nodeMessage, type HopPath } from './node-message.ts';
import { createNodeRelay } from './node-relay.ts';
import { createNodeTransport } from './node-transport.ts';
import { createNodeTrust } from './node-trust.ts';
import { NodeState, deriveState } from './state.ts';
import { NodeActivity } from './stats.ts';
import { TrackerLink } from './tracker-link.ts';
import type { LoadProgress, RuntimeEvent } from './events.ts';
import type { Attestor } from '../../verify/attestor.ts';
import { DistrustSet, FinishedStore, HeadVerify } from '../verify/head-verify.ts';
import type { Verifier } from '../verify/verifier.ts';

export { RUNTIME_VERSION, type LifecycleEvent, type RuntimeConfig } from './config.ts';
export type { RuntimeEvent, LoadProgress } from './events.ts';

const RELAY_WAIT_MS = 15_000;

export class NodeRuntime {
  readonly activity = new NodeActivity();
  readonly slot: SpanSlot;
  readonly transport: HopTransport;
  private readonly handler: NodeHandler;
  private readonly recovery: DeviceRecovery;
  /** Signs what this node answers, per session (docs/protocol.md §11). */
  readonly attestor: Attestor;
  /** Nodes the tracker quarantined: a head replaces them before its next step. */
  readonly distrust = new DistrustSet();
  /** As a head: the checks the tracker's plans ask for, run after each generation. */
  readonly verifier: Verifier;
  /** As a head: finished generations kept a few minutes, for the tracker's walks after an audit. */
  readonly finished = new FinishedStore();
  private relay: RelayClient | undefined;
  private readonly links: LinkDialer | undefined;
  /** Data channels to other nodes (pages); none on a host without WebRTC, or with them turned off. */
  private readonly channels: DataChannels;
  /** The tracker's client and session, the assignment's answer (tracker-link.ts). */
  private readonly trackerLink: TrackerLink;
  private started = false;
  /** Whether new sessions are taken: the donor's pause, the battery, the page's lifecycle. */
  readonly drain: DrainGate;
  /** The donor's cap on the device's busy time. */
  readonly duty = new DutyCycle();
  /** Every message the tracker gets is stamped later than the last. */
  private readonly stamps = new MessageStamps();
  private budget: number;
  private epoch = 0;
  private stateValue: NodeState = NodeState.Idle;
  private readonly listeners = new Set<(e: RuntimeEvent) => void>();
  /** Why the node stopped (the error state). */
  error: unknown;
  /** Not an error, but the reason nothing serves (the tracker assigned no layer). */
  notice: MeshError | undefined;
  /** The tracker's last answer: an assignment, null (nothing fits), undefined (none yet). */
  assignment: Assignment | null | undefined;
  /** The load in progress, if any; `lastSpan` the span last loaded or tried (the page shows it). */
  loading: LoadProgress | undefined;
  lastSpan: { spec: SpanSpec; numLayers: number } | undefined;
  /** The model this node serves (resolved from the tracker when not configured). */
  model: string | undefined;
  /** Where hops reach this node directly (a Node.js node's HTTP endpoint, known once it listens). */
  endpoint: string | undefined;

  static async create(host: RuntimeHost, config: RuntimeConfig): Promise<NodeRuntime> {
    return new NodeRuntime(host, config, await Identity.loadOrCreate(host.keys));
  }

  private constructor(
    readonly host: RuntimeHost,
    readonly config: RuntimeConfig,
    readonly identity: Identity,
  ) {
    this.budget = config.memoryBudgetBytes;
    this.trackerLink = new TrackerLink(this, { relay: () => this.relay, current: (epoch) => this.current(epoch), changed: () => this.changed(), emit: (e) => this.emit(e), gaveUp: (span) => this.recovery.gaveUp(span) });
    this.drain = new DrainGate({
      ...(config.drainGraceMs !== undefined ? { graceMs: config.drainGraceMs } : {}),
      onChange: () => {
        this.changed();
        void this.trackerLink.session?.beatNow();
      },
    });
    if (config.dutyCycle !== undefined) this.duty.set(config.dutyCycle);
    this.model = config.model ?? config.span?.model;
    this.channels = new DataChannels({
      peerId: identity.peerId,
      host,
      config: config.rtc,
      hasRelay: config.relayUrl !== undefined,
      relay: () => this.relay,
      trackerKey: () => this.trackerLink.tracker?.trackerKey ?? config.trackerKey,
    });
    const links = host.links?.(identity);
    this.links = links;
    this.transport = createNodeTransport({ host, config, relay: () => this.relay, links, channels: this.channels });
    const trust = createNodeTrust({
      identity,
      host,
      transport: this.transport,
      tracker: () => this.trackerLink.tracker,
      trackerKey: () => this.trackerLink.tracker?.trackerKey ?? config.trackerKey,
      model: () => this.slot.current?.spec.model ?? this.model ?? '',
      executor: () => this.slot.current?.executor,
    });
    this.attestor = trust.attestor;
    this.verifier = trust.verifier;
    this.handler = new NodeHandler({
      check: trust.checks,
      onDistrust: (d) => this.distrust.add(d),
      onWalk: (plan) => this.finished.walk(plan, this.verifier),
      peerId: identity.peerId,
      activity: this.activity,
      span: () => this.slot.current,
      loadingInfo: () => ({ peer_id: identity.peerId, host: host.name, model: this.model ?? null, start_layer: null, end_layer: null, loading: this.slot.busy }),
      trackerKey: () => this.trackerLink.tracker?.trackerKey ?? config.trackerKey,
      transport: this.transport,
      injectDelayMs: config.injectDelayMs ?? 0,
      drain: this.drain,
      duty: this.duty,
      onLog: (m) => host.log('warn', m),
      onGenerateEvent: (event, sessionId) => this.emit({ type: 'generate', event, sessionId }),
      ...(this.rtcEnabled ? { signal: (req) => this.channels.onSignal(req) } : {}),
    });
    this.channels.attach(this.handler.for('rtc'));
    this.slot = new SpanSlot((spec) => (this.recovery.loading(spec), loadSpan(spec, this.loadContext(this.epoch))), {
      onSwap: (next, _old, loadMs) => {
        this.loading = undefined;
        this.notice = undefined;
        // A budget changed while it loaded applies to it too.
        next.executor.setMemoryBudget(this.budget);
        next.loadMs = loadMs;
        this.recovery.watch(next);
        if (next.rebuilt) this.activity.resetSteps(next.rebuilt.layerMs);
        this.changed();
        this.emit({ type: 'serving', span: next.spec, loadMs, backend: next.backend.kind, ...(next.rebuilt ? { rebuilt: next.rebuilt } : {}) });
        // Tell the tracker what we serve as soon as the span is up.
        void this.trackerLink.session?.beatNow();
      },
      onFailure: (error, spec) => {
        this.loading = undefined;
        if (error instanceof MeshError && error.code === 'MESH_ERR_CANCELLED') return this.changed();
        this.emit({ type: 'load-failed', span: spec, error });
        this.host.log('error', `loading [${spec.startLayer}, ${spec.endLayer}) of ${spec.modelUrl}: ${(error as Error)?.message ?? String(error)}`);
        if (this.recovery.loadFailed(spec, error)) return this.changed();
        if (this.config.retryFailedLoads && this.config.trackerUrl) this.changed();
        else this.fail(error);
      },
    });
    this.recovery = new DeviceRecovery({ slot: this.slot, budget: () => this.budget, setBudget: (b) => void this.setMemoryBudget(b), pinned: config.span !== undefined, log: (l, m) => host.log(l, m) });
  }

  get peerId(): string {
    return this.identity.peerId;
  }
  get state(): NodeState {
    return this.stateValue;
  }
  get span(): LoadedSpan | undefined {
    return this.slot.current;
  }
  get relayAddr(): string | undefined {
    return this.relay?.relayAddr;
  }
  get trackerRegistered(): boolean {
    return this.trackerLink.session?.isRegistered ?? false;
  }
  get memoryBudgetBytes(): number {
    return this.budget;
  }
  /** Whether hops may go over data channels: the host has WebRTC, there is a relay to signal over, and the config does not turn them off. */
  get rtcEnabled(): boolean {
    return this.channels.enabled;
  }

  /** The data channels' state as /info and the heartbeat show it; undefined without them. */
  rtcInfo(): DataChannelsInfo | undefined {
    return this.channels.info();
  }

  /** Per peer this node sends hops to: the path the last one took, what each path carried, and the data channel's state. */
  hopPaths(): HopPath[] {
    return hopPaths(this.transport, this.channels);
  }

  /** Close every data channel (tests: a channel that closes mid-generation); they are dialled again on the next hops. */
  closeDataChannels(): void {
    this.channels.closeAll();
  }

  /** /forward requests served per surface. */
  get served(): Readonly<Record<Surface, number>> {
    return this.handler.served;
  }

  /** The node's HTTP surface for requests arriving by `surface`. */
  handlerFor(surface: Surface): MeshHandler {
    return this.handler.for(surface);
  }

  on(listener: (e: RuntimeEvent) => void): () => void {
    this.listeners.add(listener);
    return () => this.listeners.delete(listener);
  }

  /**
   * Relay, then the span (the tracker's, or a static one, which a tracker then adopts as served). `waitForSpan`:
   * resolve once the first span serves or failed; a static span's failure,
   * or the tracker refusing this node (unless failed loads are retried), rejects.
   * Again after an error: starts over with what is still loaded.
   */
  async start(opts: { waitForSpan?: boolean } = {}): Promise<void> {
    const epoch = this.epoch;
    this.started = true;
    this.error = undefined;
    this.changed();
    await this.connect();
    this.current(epoch);
    // A static span is pinned: loaded first, and the tracker (if any) adopts it as served.
    if (this.config.span) {
      void this.slot.assign({ ...this.config.span, modelUrl: baseUrl(this.config.span.modelUrl) });
      if (opts.waitForSpan ?? true) await this.slot.idle();
      if (this.error !== undefined) throw this.error;
    }
    if (this.config.trackerUrl) {
      try {
        await this.trackerLink.join(epoch);
      } catch (e) {
        if (epoch === this.epoch) this.fail(e);
        throw e;
      }
    }
    if (opts.waitForSpan ?? true) {
      await this.slot.idle();
      this.current(epoch);
      if (this.error !== undefined) throw this.error;
    }
  }

  /** Connect to the relay (if any) and wait a while for the registration; a relay that is down is not fatal: the client keeps reconnecting, and other paths serve meanwhile. */
  async connect(): Promise<void> {
    const relay = this.connectRelay();
    if (!relay) return;
    await relay.ready(RELAY_WAIT_MS).then(
      () => undefined,
      (e: unknown) => {
        if (relay === this.relay) this.host.log('warn', `relay: ${(e as Error).message}; the client keeps trying`);
      },
    );
  }

  /** After an error: start again with the same config (stored weights and the identity are kept). */
  retry(opts: { waitForSpan?: boolean } = {}): Promise<void> {
    return this.start(opts);
  }

  /** The donor paused: drain (the sessions in flight finish within the grace, no new ones); the span stays loaded. */
  pause(): void {
    this.drain.start('donor');
  }

  /** Serve again at once: nothing is reloaded. */
  resume(): void {
    this.drain.stop('donor');
  }

  /** Donate only while charging: `hold` while the donor asked for it and the device is on battery. */
  holdForBattery(hold: boolean): void {
    if (hold) this.drain.start('battery');
    else this.drain.stop('battery');
  }

  /** Paused by the donor (or the battery): the page's Paused badge. */
  get paused(): boolean {
    return this.drain.has('donor') || this.drain.has('battery');
  }

  drainStatus(): DrainStatus {
    return this.drain.status();
  }

  /**
   * The host's lifecycle: frozen (the page is being frozen, or kept in the
   * back/forward cache), leaving (closed), resumed. The tracker already had
   * the page's beacon; back, the node heartbeats at once (registering again
   * if the tracker dropped it meanwhile) and serves.
   */
  lifecycle(event: LifecycleEvent): void {
    const reason: DrainReason | undefined = event === 'frozen' ? 'frozen' : event === 'leaving' ? 'leaving' : undefined;
    if (reason) return this.drain.start(reason);
    const changed = this.drain.has('frozen') || this.drain.has('leaving');
    this.drain.stop('frozen');
    this.drain.stop('leaving');
    // Beat even when nothing changed here: the worker may have been frozen before it saw "frozen", while the tracker saw the beacon.
    if (!changed) void this.trackerLink.session?.beatNow();
  }

  /** The donor's duty cycle, applied at once and told to the tracker. */
  setDutyCycle(fraction: number): void {
    this.duty.set(fraction);
    void this.trackerLink.session?.beatNow();
  }

  /**
   * A new memory budget, applied in place: the KV caches get what the span's
   * weights leave of it from now on, and live sessions keep their room (no
   * rebuild, no 409). The tracker is told (it may move the node).
   */
  async setMemoryBudget(bytes: number): Promise<void> {
    this.budget = bytes;
    this.slot.current?.executor.setMemoryBudget(bytes);
    void this.trackerLink.session?.beatNow();
  }

  /** The KV caches' share of the budget: what the span's weights leave (the whole budget before a span is loaded). */
  kvBudgetBytes(): number {
    return this.slot.current?.executor.kvStats().budgetBytes ?? this.budget;
  }

  /** Stop for good: tracker, relay, links, the span. */
  async close(): Promise<void> {
    this.epoch++;
    this.started = false;
    this.drain.close();
    this.duty.close();
    this.stopNetwork();
    await this.slot.close();
    this.changed();
  }

  /** What the node tells the tracker now: who it is, what it offers, how it does, what it serves. */
  nodeMessage(): NodeMessage {
    return nodeMessage({
      identity: this.identity,
      host: this.host,
      config: this.config,
      span: this.slot.current,
      relay: this.relay,
      endpoint: this.endpoint,
      model: this.model,
      budget: this.budget,
      duty: this.duty.fraction,
      activity: this.activity,
      draining: this.drain.draining,
      gaveUp: (s) => this.recovery.gaveUp(s),
      paths: () => this.hopPaths(),
      sent: this.transport.sent,
      stamps: this.stamps,
    });
  }

  // ------------------------------------------------------------ internals

  private connectRelay(): RelayClient | undefined {
    if (!this.config.relayUrl) return undefined;
    if (this.relay) return this.relay;
    const relay = createNodeRelay({
      relayUrl: this.config.relayUrl,
      host: this.host,
      identity: this.identity,
      handler: this.handler.for('relay'),
      model: this.model,
      trackerUrl: this.config.trackerUrl,
      isCurrent: (r) => r === this.relay,
      changed: () => this.changed(),
      beatNow: () => void this.trackerLink.session?.beatNow(),
    });
    this.relay = relay;
    relay.start();
    return relay;
  }

  private loadContext(epoch: number): SpanLoadContext {
    return {
      host: this.host,
      activity: this.activity,
      transport: this.transport,
      memoryBudgetBytes: () => this.budget,
      maxContext: this.config.maxContext ?? 2048,
      ...(this.config.maxBatch !== undefined ? { maxBatch: this.config.maxBatch } : {}),
      ...(this.config.kvIdleTtlMs !== undefined ? { kvIdleTtlMs: this.config.kvIdleTtlMs } : {}),
      version: RUNTIME_VERSION,
      isPaused: () => this.paused,
      duty: this.duty,
      extraInfo: (span) => ({
        peer_id: this.identity.peerId,
        host: this.host.name,
        ...(this.endpoint ? { endpoint: this.endpoint } : {}),
        relay_addr: this.relay?.relayAddr ?? null,
        forwards_served: { ...this.handler.served },
        hops_sent: { ...this.transport.sent },
        paths: this.hopPaths(),
        ...optional('data_channels', this.rtcInfo()),
        chain_forwards: this.handler.chained,
        draining: this.drain.draining,
        duty_cycle: this.duty.fraction,
        // A head's speculative decoding: drafted and accepted tokens, trips and the tokens they gave.
        ...(span.pipeline ? { speculation: span.pipeline.speculationStats() } : {}),
        ...span.backend.details,
      }),
      hopMode: this.config.hopMode ?? 'chain',
      ...(this.config.draftModelUrl ? { draftModelUrl: this.config.draftModelUrl } : {}),
      ...(this.config.speculation === false ? { speculation: false } : {}),
      attestor: this.attestor,
      headVerify: (model) => new HeadVerify({ peerId: this.identity.peerId, model, attestor: this.attestor, verifier: this.verifier, distrust: this.distrust, transport: this.transport, finished: this.finished }),
      replace: this.config.trackerUrl ? (model) => (hop, signal, route) => this.trackerLink.tracker!.replace(model, hop, signal, route) : undefined,
      onPhase: (phase, spec, config, progress) => {
        this.loading = { phase, spec, config, progress };
        this.lastSpan = { spec, numLayers: config.numLayers };
        this.changed();
      },
      checkCurrent: () => this.current(epoch),
      deviceLoss: () => this.recovery.lossFor(),
      onForwardStatus: (span, status) => this.recovery.requestFailed(span, status),
    };
  }

  private current(epoch: number): void {
    if (epoch !== this.epoch) throw new MeshError('MESH_ERR_CANCELLED', 'the node was stopped meanwhile');
  }

  /** The error state: tracker and relay stop (heartbeats would announce a span, the relay would flip the state back); the loaded span stays for a retry. */
  private fail(e: unknown): void {
    this.error = e;
    this.stopNetwork();
    this.changed();
  }

  private stopNetwork(): void {
    this.trackerLink.close();
    this.relay?.close();
    this.relay = undefined;
    this.transport.close();
    this.links?.close();
    this.channels.reset();
  }

  private changed(): void {
    const next = deriveState({
      started: this.started,
      failed: this.error !== undefined,
      loading: this.loading?.phase,
      hasSpan: this.slot?.current !== undefined,
      relayRegistered: this.config.relayUrl ? this.relay?.state === 'registered' : undefined,
      paused: this.paused,
    });
    if (next === this.stateValue) return;
    this.stateValue = next;
    this.emit({ type: 'state', state: next });
  }

  private emit(e: RuntimeEvent): void {
    for (const l of this.listeners) {
      try {
        l(e);
      } catch (err) {
        this.host.log('error', `a runtime listener threw: ${(err as Error).message}`);
      }
    }
  }
}

/** `{ [key]: value }`, or nothing when the value is undefined. */
function optional<K extends string, V>(key: K, value: V | undefined): { [k in K]?: V } {
  return value === undefined ? {} : ({ [key]: value } as { [k in K]?: V });
}
