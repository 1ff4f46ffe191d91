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
 *   pause()     /forward answers 503 and heartbeats say "serving nothing"
 *   close()     everything released
 *
 * The state (state.ts) is derived from facts on every change, never set by
 * hand. A host is an adapter (host.ts): src/host/node and src/host/browser.
 */
import type { WeightFormat } from '../../model/weight-format.ts';
import { encodeBase64Url } from '../../protocol/base64.ts';
import { MeshError } from '../../protocol/errors.ts';
import type { Assignment, NodeMessage } from '../../protocol/tracker.ts';
import { HopTransport } from '../../net/hop-transport.ts';
import { Identity } from '../../net/identity.ts';
import type { MeshHandler, OutgoingRequest, RequestOptions } from '../../net/contract.ts';
import { RelayClient } from '../../net/relay-client.ts';
import { RpcConnection } from '../../net/relay-hop.ts';
import { TrackerClient } from '../tracker-client.ts';
import { TrackerSession, kvHeartbeat } from '../tracker-session.ts';
import { NodeHandler, type Surface } from './handler.ts';
import type { RuntimeHost, SpanSpec } from './host.ts';
import type { LinkDialer } from '../../net/contract.ts';
import { SpanSlot, baseUrl, loadSpan, type LoadedSpan, type SpanLoadContext } from './span.ts';
import { DeviceRecovery } from './device-recovery.ts';
import { NodeState, deriveState } from './state.ts';
import { NodeActivity } from './stats.ts';
import type { LoadProgress, RuntimeEvent } from './events.ts';

export const RUNTIME_VERSION = '0.1.0';

export interface RuntimeConfig {
  /** Relay base URL; absent: no relay (a Node.js node on direct HTTP and links only). */
  relayUrl?: string;
  /** Tracker base URL: the span is the tracker's assignment. */
  trackerUrl?: string;
  /** The model's id at the tracker (absent: the tracker's first model), or a static span's name. */
  model?: string;
  /** A fixed span instead of the tracker's. */
  span?: SpanSpec;
  /** Route-signing key of a head without a tracker (tests, static meshes). */
  trackerKey?: Uint8Array;
  /** The tracker cluster's operator key (base64url): routes only from trackers it certified (docs/protocol.md §9). */
  operatorKey?: string;
  /** Memory the donor gives, bytes: the span's weights, and the KV caches get the rest (the meaning the tracker sizes spans by). */
  memoryBudgetBytes: number;
  /** Positions one session may reach (its KV cache is sized by what the head declares, up to this). @defaultValue 2048 */
  maxContext?: number;
  /** A KV session idle this long may be dropped when a new one needs its room, ms (live sessions never are). @defaultValue 120000 */
  kvIdleTtlMs?: number;
  /** Most sessions' one-token steps run as one batch (issue 11); 1 turns batching off. @defaultValue 16 */
  maxBatch?: number;
  hopOrder?: 'relay' | 'direct' | 'adaptive';
  /** How a head drives its pipeline: 'chain' (hops push to the next) or 'star' (every hop answers the head). @defaultValue 'chain' */
  hopMode?: 'chain' | 'star';
  /** Registration info's backend before a span has chosen one. */
  backendKind: string;
  /** Registration info's weight format before a span has chosen one (the tracker sizes the span by it). @defaultValue 'f32' */
  weightFormat?: WeightFormat;
  /**
   * A tracker's span that fails to load: retried at the next heartbeat while
   * the old span keeps serving (true: a daemon), or the node stops in the
   * error state until retry() (false: a donor page shows what to do). A
   * static span's failure always stops.
   */
  retryFailedLoads: boolean;
  /** Test hook: every /forward waits this long. */
  injectDelayMs?: number;
}

export type { RuntimeEvent, LoadProgress } from './events.ts';

const RELAY_WAIT_MS = 15_000;

export class NodeRuntime {
  readonly activity = new NodeActivity();
  readonly slot: SpanSlot;
  readonly transport: HopTransport;
  private readonly handler: NodeHandler;
  private readonly recovery: DeviceRecovery;
  private relay: RelayClient | undefined;
  private readonly links: LinkDialer | undefined;
  private tracker: TrackerClient | undefined;
  private session: TrackerSession | undefined;
  private started = false;
  private paused = false;
  /** Said once: a static span's wire dtype differs from the tracker's. */
  private warnedWireDtype = false;
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
    this.model = config.model ?? config.span?.model;
    const links = host.links?.(identity);
    this.links = links;
    const relayFast = config.relayUrl
      ? {
          relayUrl: config.relayUrl,
          isRegistered: () => this.relay?.state === 'registered',
          request: (...a: Parameters<RelayClient['request']>) => this.relay!.request(...a),
          push: (...a: Parameters<RelayClient['push']>) => this.relay?.push(...a),
        }
      : undefined;
    this.transport = new HopTransport({
      ...(relayFast
        ? {
            fast: {
              relayUrl: relayFast.relayUrl,
              get isRegistered() {
                return relayFast.isRegistered();
              },
              request: relayFast.request,
              push: relayFast.push,
            },
            rpc: (addr: string) => new RpcConnection(addr, { WebSocket: host.WebSocket, ...(host.watchHandshake ? { watchHandshake: host.watchHandshake } : {}) }),
          }
        : {}),
      ...(links ? { link: (endpoint: string, peerId: string) => links.requester(endpoint, peerId) } : {}),
      ...(host.direct ? { direct: host.direct } : { fetch: host.fetch }),
      ...(config.hopOrder ? { order: config.hopOrder } : {}),
      onLog: (m) => host.log('warn', m),
    });
    this.handler = new NodeHandler({
      peerId: identity.peerId,
      activity: this.activity,
      span: () => this.slot.current,
      loadingInfo: () => ({ peer_id: identity.peerId, host: host.name, model: this.model ?? null, start_layer: null, end_layer: null, loading: this.slot.busy }),
      trackerKey: () => this.tracker?.trackerKey ?? config.trackerKey,
      transport: this.transport,
      injectDelayMs: config.injectDelayMs ?? 0,
      onLog: (m) => host.log('warn', m),
      onGenerateEvent: (event, sessionId) => this.emit({ type: 'generate', event, sessionId }),
    });
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
        void this.session?.beatNow();
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
    return this.session?.isRegistered ?? false;
  }
  get memoryBudgetBytes(): number {
    return this.budget;
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
        await this.joinTracker(epoch);
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

  pause(): void {
    this.paused = true;
    this.changed();
    void this.session?.beatNow();
  }

  resume(): void {
    this.paused = false;
    this.changed();
    void this.session?.beatNow();
  }

  /**
   * A new memory budget, applied in place: the KV caches get what the span's
   * weights leave of it from now on, and live sessions keep their room (no
   * rebuild, no 409). The tracker is told (it may move the node).
   */
  async setMemoryBudget(bytes: number): Promise<void> {
    this.budget = bytes;
    this.slot.current?.executor.setMemoryBudget(bytes);
    void this.session?.beatNow();
  }

  /** The KV caches' share of the budget: what the span's weights leave (the whole budget before a span is loaded). */
  kvBudgetBytes(): number {
    return this.slot.current?.executor.kvStats().budgetBytes ?? this.budget;
  }

  /** Stop for good: tracker, relay, links, the span. */
  async close(): Promise<void> {
    this.epoch++;
    this.started = false;
    this.stopNetwork();
    await this.slot.close();
    this.changed();
  }

  /** What the node tells the tracker now: who it is, what it offers, how it does, what it serves. */
  nodeMessage(): NodeMessage {
    const s = this.slot.current;
    const kv = s?.executor.kvStats();
    const relayAddr = this.relay?.relayAddr;
    return {
      peer_id: this.identity.peerId,
      public_key: encodeBase64Url(this.identity.publicKey),
      ...(relayAddr ? { relay_addr: relayAddr } : {}),
      ...(this.endpoint ? { endpoint: this.endpoint } : {}),
      info: {
        model: this.model ?? 'default',
        backend: s?.backend.kind ?? this.config.backendKind,
        memory_budget_mb: this.budget / 2 ** 20,
        host: this.host.name,
        version: RUNTIME_VERSION,
        weight_format: s ? (s.backend.weights ?? s.backend.dtype) : (this.config.weightFormat ?? 'f32'),
        ...(this.config.span ? { pinned: true } : {}),
      },
      stats: { ...this.activity.heartbeat(kvHeartbeat(kv, this.budget)), ...(s ? { batch_sizes: s.executor.batchStats().sizes } : {}) },
      // While paused, or with a lost device it gave up rebuilding, the node answers 503: tell the tracker it serves nothing, so routes avoid it.
      serving: s && !this.paused && !this.recovery.gaveUp(s) ? { start_layer: s.spec.startLayer, end_layer: s.spec.endLayer } : null,
      timestamp: Date.now(),
    };
  }

  // ------------------------------------------------------------ internals

  private connectRelay(): RelayClient | undefined {
    if (!this.config.relayUrl) return undefined;
    if (this.relay) return this.relay;
    const relay = new RelayClient({
      relayUrl: this.config.relayUrl,
      WebSocket: this.host.WebSocket,
      identity: this.identity,
      handler: this.handler.for('relay'),
      info: { host: this.host.name, version: RUNTIME_VERSION, ...(this.model ? { model: this.model } : {}), ...(this.config.trackerUrl ? { tracker: this.config.trackerUrl } : {}) },
      onLog: (e) => {
        if (e.level === 'warn' || e.level === 'error') this.host.log(e.level, `relay: ${e.event}: ${e.message}`);
      },
    });
    relay.on('state', () => {
      if (relay === this.relay) this.changed();
    });
    this.relay = relay;
    relay.start();
    return relay;
  }

  private async joinTracker(epoch: number): Promise<void> {
    if (this.session) {
      // Still registered (a retry after a span failed): ask for the assignment again.
      this.slot.clearQueue();
      await this.session.beatNow();
      return;
    }
    const trackerUrl = this.config.trackerUrl!;
    // Heartbeats ride the relay socket whenever it is up (the relay vouches for us: no signature, no connection).
    const relay = () => this.relay;
    const relayLink = {
      get state() {
        return relay()?.state ?? 'none';
      },
      request: (peer: string, req: OutgoingRequest, opts?: RequestOptions) => relay()?.request(peer, req, opts) ?? Promise.reject(new MeshError('MESH_ERR_UNAVAILABLE', 'no relay')),
    };
    const client = new TrackerClient({ trackerUrl, fetch: this.host.fetch, identity: this.identity, relay: relayLink, ...(this.config.operatorKey ? { operatorKey: this.config.operatorKey } : {}) });
    if (this.model === undefined) {
      const models = await client.models();
      if (models.length === 0) throw new MeshError('MESH_ERR_UNAVAILABLE', `the tracker at ${trackerUrl} names no model`);
      this.model = models[0]!;
    }
    this.current(epoch);
    this.tracker = client;
    const session = new TrackerSession({
      client,
      message: () => this.nodeMessage(),
      onRegistered: (ans) => this.emit({ type: 'registered', assignment: ans.assignment }),
      onAssignment: (a) => this.onAssignment(a),
      onLog: (level, m) => this.host.log(level, m),
    });
    this.session = session;
    try {
      await session.start();
    } catch (e) {
      const err = new MeshError('MESH_ERR_UNAVAILABLE', `the tracker at ${trackerUrl} did not accept this node: ${(e as Error).message}`);
      if (!this.config.retryFailedLoads) throw err;
      this.host.log('warn', `${err.message}; trying again every heartbeat`);
    }
  }

  private onAssignment(a: Assignment | null): void {
    this.assignment = a;
    if (!a) {
      this.notice = new MeshError('MESH_ERR_UNAVAILABLE', `the tracker assigned no layers: ${formatMib(this.budget)} does not hold one layer of ${this.model}`);
      this.changed();
      return;
    }
    const staticDtype = this.config.span?.wireDtype ?? 'bf16';
    if (this.config.span && a.wire_dtype && a.wire_dtype !== staticDtype && !this.warnedWireDtype) {
      this.warnedWireDtype = true;
      this.host.log('warn', `the tracker's wire dtype for ${a.model} is ${a.wire_dtype}, this static span's is ${staticDtype}: hops will refuse one another's activations (give --wire-dtype ${a.wire_dtype})`);
    }
    // A span that failed is retried only by retry(), not on every heartbeat (unless failed loads are retried); a static span stays.
    if (this.error !== undefined || this.config.span) return;
    // A span whose lost device could not be rebuilt is loaded afresh at each assignment (the same spec would be kept as is).
    void this.slot.assign({ model: a.model, modelUrl: baseUrl(a.model_url), startLayer: a.start_layer, endLayer: a.end_layer, ...(a.wire_dtype ? { wireDtype: a.wire_dtype } : {}) }, this.recovery.gaveUp(this.slot.current));
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
      extraInfo: (span) => ({
        peer_id: this.identity.peerId,
        host: this.host.name,
        ...(this.endpoint ? { endpoint: this.endpoint } : {}),
        relay_addr: this.relay?.relayAddr ?? null,
        forwards_served: { ...this.handler.served },
        chain_forwards: this.handler.chained,
        ...span.backend.details,
      }),
      hopMode: this.config.hopMode ?? 'chain',
      replace: this.config.trackerUrl ? (model) => (hop, signal, route) => this.tracker!.replace(model, hop, signal, route) : undefined,
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
    this.session?.close();
    this.session = undefined;
    this.relay?.close();
    this.relay = undefined;
    this.transport.close();
    this.links?.close();
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

function formatMib(bytes: number): string {
  return `${Math.round((bytes / 2 ** 20) * 10) / 10} MiB`;
}
