/**
 * The simulated swarm's donors: thousands of them in one process, each a
 * real peer to the relay and the tracker, none doing model work.
 *
 * A donor is the node core's own control-plane half, unchanged: its own
 * Ed25519 identity, a RelayClient (the /ws challenge, registration,
 * reconnects with backoff), and a TrackerSession over a TrackerClient
 * (signed registration, heartbeats at the interval the tracker hands out,
 * 404 → register again). What a real node does with an assignment (load the
 * layers) takes `loadMs` here and costs nothing; the heartbeat then reports
 * the span as served, with plausible stats.
 *
 * Each donor has its own HTTP connection pool (an undici Agent), as a real
 * donor has its own socket: one pool shared by thousands of donors would
 * reuse a handful of warm connections and hide what each heartbeat costs a
 * tracker that sees one connection per donor. Against a relay with
 * `peer-watch` the donors (as nodes) hold no HTTP watch stream: the pool is
 * used for the registration (and beats that fall back to HTTP) only.
 *
 * Each call is also stamped with the simulator's own stall while it was in
 * flight (LoopClock), so a latency tail the simulator caused is told apart.
 *
 * Every tracker call is timed and counted by kind and outcome in
 * {@link SwarmStats}; a heartbeat answered 404 for a donor that never left
 * is a donor the tracker dropped.
 */
import { Agent, fetch as undiciFetch } from 'undici';
import { WebSocket } from 'ws';
import { Identity } from '../../src/net/identity.ts';
import { RelayClient } from '../../src/net/relay-client.ts';
import type { WebSocketConstructor } from '../../src/net/socket.ts';
import { TrackerClient, type TrackerRelay } from '../../src/node/tracker-client.ts';
import { TrackerSession } from '../../src/node/tracker-session.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import type { Assignment, NodeMessage } from '../../src/protocol/tracker.ts';

export type CallKind = 'register' | 'heartbeat';

/** How often the simulator's loop clock ticks, ms. */
const LOOP_TICK_MS = 5;

/**
 * The simulator's own stalls, to stamp each call with: a timer ticks every
 * LOOP_TICK_MS; how late it fires adds to `stalledMs`. A call's own stall is
 * what was added while it was in flight, plus the stall in progress when its
 * answer is handled (the loop was blocked since the last tick): time the
 * answer sat unread in this process, not time the tracker or relay took.
 */
export class LoopClock {
  stalledMs = 0;
  private last = performance.now();
  private timer: ReturnType<typeof setInterval> | undefined;

  start(): void {
    this.last = performance.now();
    this.timer = setInterval(() => {
      const now = performance.now();
      this.stalledMs += Math.max(0, now - this.last - LOOP_TICK_MS);
      this.last = now;
    }, LOOP_TICK_MS);
    this.timer.unref?.();
  }

  stop(): void {
    if (this.timer !== undefined) clearInterval(this.timer);
    this.timer = undefined;
  }

  /** The stall total now, the one in progress included. */
  now(): number {
    return this.stalledMs + Math.max(0, performance.now() - this.last - LOOP_TICK_MS);
  }
}

/** Counters and latency samples of every tracker call the donors made. */
export class SwarmStats {
  /** Latency samples (ms) taken while `recording`. */
  readonly latency: Record<CallKind, number[]> = { register: [], heartbeat: [] };
  /** The same calls' latency less the simulator's own stall while each was in flight (LoopClock), ms. */
  readonly latencyLessStall: Record<CallKind, number[]> = { register: [], heartbeat: [] };
  /** The simulator's stall clock (started by the bench). */
  readonly loop = new LoopClock();
  /** Outcomes by kind: 'ok', 'http-404', 'http-503', 'timeout', 'network', ... */
  readonly outcomes: Record<CallKind, Map<string, number>> = { register: new Map(), heartbeat: new Map() };
  /** Heartbeats answered 404 (the tracker forgot a live donor), while recording. */
  dropped = 0;
  /** Retry-After / 503 / 429 answers (the tracker shedding load), while recording. */
  shed = 0;
  /** The error codes of the answers that were not 200 (e.g. 'relay-503 MESH_ERR_BACKPRESSURE': who refused, and why), while recording. */
  readonly errorCodes = new Map<string, number>();
  /** Heartbeat intervals the tracker handed out, last seen per donor (ms → donors). */
  recording = false;

  record(kind: CallKind, ms: number, outcome: string, stallAt0?: number): void {
    if (!this.recording) return;
    this.latency[kind].push(ms);
    if (stallAt0 !== undefined) this.latencyLessStall[kind].push(Math.max(0, ms - (this.loop.now() - stallAt0)));
    const m = this.outcomes[kind];
    m.set(outcome, (m.get(outcome) ?? 0) + 1);
    if (kind === 'heartbeat' && outcome === 'http-404') this.dropped++;
    if (outcome === 'http-503' || outcome === 'http-429') this.shed++;
  }

  /** An answer that was not 200, by its error code (`outcome code`). */
  recordCode(outcome: string, code: string | undefined): void {
    if (!this.recording) return;
    const k = `${outcome} ${code ?? '(no code)'}`;
    this.errorCodes.set(k, (this.errorCodes.get(k) ?? 0) + 1);
  }

  count(kind: CallKind, outcome?: string): number {
    const m = this.outcomes[kind];
    if (outcome !== undefined) return m.get(outcome) ?? 0;
    let n = 0;
    for (const v of m.values()) n += v;
    return n;
  }

  /** Calls of `kind` that did not answer 200. */
  failures(kind: CallKind): number {
    return this.count(kind) - this.count(kind, 'ok');
  }

  reset(): void {
    for (const k of ['register', 'heartbeat'] as const) {
      this.latency[k] = [];
      this.latencyLessStall[k] = [];
      this.outcomes[k].clear();
    }
    this.errorCodes.clear();
    this.dropped = 0;
    this.shed = 0;
  }
}

export interface DonorConfig {
  relayUrl: string;
  trackerUrl: string;
  model: string;
  memoryBudgetMb: number;
  weightFormat: 'f32' | 'f16' | 'q4';
  /** Simulated time to load an assigned span, ms. */
  loadMs: number;
  stats: SwarmStats;
  /** Shared by every donor: the WebSocket constructor (one `ws` module). */
  WebSocket?: WebSocketConstructor;
  /**
   * One HTTP pool for every donor instead of one each (swarm --shared-http):
   * fewer objects and sockets in the simulator (10,000 donors within the fd
   * limit), but registrations then reuse warm connections, which a real
   * swarm's tracker does not get.
   */
  agent?: Agent;
  /**
   * While true the donor's beats go nowhere (swarm --beat-modes paused): each is answered at once, in the
   * process, with the tracker's last answer, and not counted; the session keeps its period and state.
   * The tracker then carries its registered, attached donors with no beat at all: its fixed cost.
   */
  paused?: () => boolean;
}

/** The `error.code` of a mesh error body (docs/protocol.md), if it is one. */
function errorCodeOf(body: string): string | undefined {
  try {
    const code = (JSON.parse(body) as { error?: { code?: unknown } })?.error?.code;
    return typeof code === 'string' ? code : undefined;
  } catch {
    return undefined;
  }
}

function outcomeOf(e: unknown): string {
  const err = e as { name?: string; cause?: { code?: string; name?: string } };
  if (err?.name === 'TimeoutError' || err?.cause?.name === 'TimeoutError') return 'timeout';
  if (err?.name === 'AbortError') return 'aborted';
  return `network${err?.cause?.code ? `-${err.cause.code}` : ''}`;
}

/** One simulated donor: a real relay peer and tracker client, no model. */
export class Donor {
  private relay: RelayClient | undefined;
  private session: TrackerSession | undefined;
  /** Its tracker client (how many beats went over the relay, how many as HTTP). */
  client: TrackerClient | undefined;
  // Two connections, as a node has: its tracker session holds GET /api/nodes/watch open on one, and
  // its heartbeats go on the other (with one, every beat queued behind the watch and timed out).
  private readonly agent: Agent;
  private readonly ownAgent: boolean;
  private assignment: Assignment | null = null;
  private serving: { start_layer: number; end_layer: number } | null = null;
  private loadTimer: ReturnType<typeof setTimeout> | undefined;
  private readonly startedAt = Date.now();
  private tokens = 0;
  closed = false;
  /** The tracker answered one of its registrations 200. */
  private registeredOnce = false;
  /** The relay registration events seen (reconnects after the first). */
  relayRegistrations = 0;
  lastRelayRegisteredAt = 0;

  private constructor(
    readonly identity: Identity,
    private readonly c: DonorConfig,
  ) {
    this.ownAgent = c.agent === undefined;
    this.agent = c.agent ?? new Agent({ connections: 2, pipelining: 1 });
  }

  static async create(c: DonorConfig): Promise<Donor> {
    return new Donor(await Identity.generate(), c);
  }

  get peerId(): string {
    return this.identity.peerId;
  }

  /** The heartbeat period its tracker handed out last, ms (undefined before it registered). */
  get periodMs(): number | undefined {
    return this.session?.periodMs;
  }

  get registered(): boolean {
    return this.session?.isRegistered ?? false;
  }

  get relayState(): string {
    return this.relay?.state ?? 'none';
  }

  /** Register at the relay, then at the tracker; heartbeats run until close(). */
  async start(): Promise<void> {
    const relay = new RelayClient({
      relayUrl: this.c.relayUrl,
      WebSocket: this.c.WebSocket ?? (WebSocket as unknown as WebSocketConstructor),
      identity: this.identity,
      info: { role: 'node', model: this.c.model, simulated: true },
      // Nothing is served: every request gets 503 (no route should ever reach a simulated donor).
      handler: async () => ({ status: 503, headers: { 'content-type': 'application/json' }, body: new TextEncoder().encode('{"error":{"code":"MESH_ERR_UNAVAILABLE","message":"simulated donor"}}') }),
    });
    this.relay = relay;
    relay.on('state', (e) => {
      if (e.state === 'registered') {
        this.relayRegistrations++;
        this.lastRelayRegisteredAt = Date.now();
      }
    });
    relay.start();
    await relay.ready(30_000);
    const stats = this.c.stats;
    const agent = this.agent;
    const timed = (async (input: string | URL | Request, init?: RequestInit) => {
      const url = String(input);
      const kind: CallKind | undefined = url.endsWith('/api/nodes/heartbeat') ? 'heartbeat' : url.endsWith('/api/nodes/register') ? 'register' : undefined;
      const t0 = performance.now();
      const s0 = stats.loop.now();
      try {
        const res = await undiciFetch(url, { ...(init as object), dispatcher: agent } as Parameters<typeof undiciFetch>[1]);
        if (kind) stats.record(kind, performance.now() - t0, res.status === 200 ? 'ok' : `http-${res.status}`, s0);
        // A registration of a donor the tracker had registered before (it was dropped, or its relay changed) is told apart from a first one (a joiner).
        const label = kind === 'register' && this.registeredOnce ? 're-register' : kind;
        if (kind === 'register' && res.status === 200) this.registeredOnce = true;
        if (kind && res.status !== 200 && stats.recording) stats.recordCode(`${label} http-${res.status}`, errorCodeOf(await res.clone().text().catch(() => '')));
        return res as unknown as Response;
      } catch (e) {
        if (kind) stats.record(kind, performance.now() - t0, outcomeOf(e), s0);
        throw e;
      }
    }) as typeof fetch;
    const paused = this.c.paused;
    let lastBeat: Awaited<ReturnType<RelayClient['beat']>> | undefined;
    // Heartbeats over the relay socket, timed like the HTTP ones (the client falls back to HTTP when they fail).
    const timedRelay: TrackerRelay = {
      get state() {
        return relay.state;
      },
      get currentRegistration() {
        return relay.currentRegistration;
      },
      async request(peer, req, opts) {
        const t0 = performance.now();
        const s0 = stats.loop.now();
        try {
          const r = await relay.request(peer, req, opts);
          const notFound = r.status === 404 && new TextDecoder().decode(r.body).includes('MESH_ERR_NOT_FOUND');
          const outcome = r.status === 200 ? 'ok' : notFound ? 'http-404' : `relay-${r.status}`;
          stats.record('heartbeat', performance.now() - t0, outcome, s0);
          if (r.status !== 200) stats.recordCode(`heartbeat ${outcome}`, errorCodeOf(new TextDecoder().decode(r.body)));
          return r;
        } catch (e) {
          stats.record('heartbeat', performance.now() - t0, `relay-${(e as { code?: string }).code ?? 'error'}`, s0);
          throw e;
        }
      },
      // As a node: the relay says when the tracker's peer detaches (a relay with peer-watch), no HTTP watch stream.
      watchPeer: (peer, signal, onAttached) => relay.watchPeer(peer, signal, onAttached),
      // As a node: the beat as a `beat` message the relay batches (a relay with beat-batch), timed like the others.
      beat(peer, body, timeoutMs) {
        if (lastBeat && paused?.()) return Promise.resolve(lastBeat);
        const p = relay.beat(peer, body, timeoutMs);
        if (p === undefined) return undefined;
        const t0 = performance.now();
        const s0 = stats.loop.now();
        return p.then(
          (r) => {
            const code = (r.body as { error?: { code?: string } } | null)?.error?.code;
            const outcome = r.status === 200 ? 'ok' : r.status === 404 && code === 'MESH_ERR_NOT_FOUND' ? 'http-404' : `relay-${r.status}`;
            stats.record('heartbeat', performance.now() - t0, outcome, s0);
            if (r.status !== 200) stats.recordCode(`heartbeat batched ${outcome}`, code);
            else lastBeat = r;
            return r;
          },
          (e: unknown) => {
            stats.record('heartbeat', performance.now() - t0, `relay-${(e as { code?: string }).code ?? 'error'}`, s0);
            throw e;
          },
        );
      },
    };
    const client = new TrackerClient({ trackerUrl: this.c.trackerUrl, fetch: timed, identity: this.identity, relay: timedRelay });
    this.client = client;
    this.session = new TrackerSession({
      client,
      message: () => this.message(),
      onAssignment: (a) => this.onAssignment(a),
    });
    if (this.closed) return;
    await this.session.start();
  }

  private message(): NodeMessage {
    const relayAddr = this.relay?.relayAddr;
    const budget = this.c.memoryBudgetMb * 2 ** 20;
    const minutes = Math.max(1, (Date.now() - this.startedAt) / 60_000);
    return {
      peer_id: this.identity.peerId,
      public_key: encodeBase64Url(this.identity.publicKey),
      ...(relayAddr ? { relay_addr: relayAddr } : {}),
      info: { model: this.c.model, backend: 'webgpu', memory_budget_mb: this.c.memoryBudgetMb, host: 'browser', version: 'swarm-sim', weight_format: this.c.weightFormat },
      stats: {
        rpm: Math.round(this.tokens / minutes),
        layer_ms: this.serving ? 4 + (parseInt(this.identity.peerId.slice(0, 2), 16) % 8) : 0,
        queue_depth: 0,
        kv_free_bytes: Math.round(budget / 4),
        tokens_served: this.tokens,
        kv_budget_bytes: Math.round(budget / 4),
        kv_used_bytes: 0,
        kv_sessions: 0,
        kv_bytes_per_token: 131072,
        kv_block_tokens: 16,
        kv_max_tokens: 8192,
        // What a real serving node adds (src/node/runtime/node-message.ts): its batch sizes, and once it has sent hops,
        // the hops per path and its next hop's path; so the tracker checks a beat of a real node's shape.
        ...(this.serving ? this.servingStats() : {}),
      },
      serving: this.serving,
      timestamp: Date.now(),
    };
  }

  private servingStats(): Pick<NonNullable<NodeMessage['stats']>, 'batch_sizes' | 'hops_sent' | 'hop_paths'> {
    const sizes = new Array<number>(17).fill(0);
    sizes[1] = this.tokens;
    const sent = { rtc: 0, fast: this.tokens, rpc: 0, link: 0, direct: 0 };
    // A stand-in next hop: the tracker does not look it up, only checks its form.
    const next = this.identity.peerId.slice(16) + this.identity.peerId.slice(0, 16);
    return { batch_sizes: sizes, hops_sent: sent, hop_paths: [{ peer_id: next, path: 'fast', rtc: 'none', sent: { ...sent } }] };
  }

  private onAssignment(a: Assignment | null): void {
    const same = a && this.assignment && a.start_layer === this.assignment.start_layer && a.end_layer === this.assignment.end_layer;
    this.assignment = a;
    if (same) return;
    if (this.loadTimer) clearTimeout(this.loadTimer);
    if (!a) {
      this.serving = null;
      return;
    }
    // "Load" the span, then serve it and tell the tracker at once, as a node does.
    this.loadTimer = setTimeout(() => {
      this.loadTimer = undefined;
      if (this.closed || !this.assignment) return;
      this.serving = { start_layer: this.assignment.start_layer, end_layer: this.assignment.end_layer };
      void this.session?.beatNow();
    }, this.c.loadMs);
  }

  /** Leave without a word (a closed tab): the tracker finds out by the missing heartbeats. */
  close(): void {
    this.closed = true;
    if (this.loadTimer) clearTimeout(this.loadTimer);
    this.session?.close();
    this.relay?.close();
    if (this.ownAgent) void this.agent.close().catch(() => {});
  }
}
