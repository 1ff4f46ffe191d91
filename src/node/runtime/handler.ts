/**
 * The node's HTTP surface on every path a request can arrive by (relay,
 * direct link, direct HTTP), in front of whatever span serves now:
 *
 *   POST /generate ─▶ drain check ─▶ head handler (a head's pipeline; 421 on a node that is not one)
 *   everything else ─▶ forward gate ─▶ the span's forward handler
 *
 * The gate answers while no span is in (health and info say "loading",
 * the rest 503 so heads route around the node), refuses new sessions while
 * the node drains (drain.ts: held ones go on within the grace), makes each
 * /forward pass the donor's duty cycle (duty-cycle.ts), counts /forward
 * requests running (the heartbeat's queue depth) and per surface (GET
 * /info), and applies a test's injected delay.
 */
import { errorReply, jsonReply, type MeshRequest, type MeshResponse } from '../../protocol/envelopes.ts';
import { MeshError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import type { GenerateEvent } from '../../protocol/tracker.ts';
import { StaleSteps, createChainHop, isChainRequest } from '../hop/chain-hop.ts';
import { createHeadHandler } from '../head/head-handler.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import type { MeshHandler } from '../../net/contract.ts';
import { RTC_SIGNAL_PATH } from '../../net/rtc-signal.ts';
import type { PipelineDriver } from '../head/pipeline.ts';
import { rebuildingError, type LoadedSpan } from './span.ts';
import type { DrainGate } from './drain.ts';
import type { DutyCycle } from './duty-cycle.ts';
import type { TrackerKeys } from '../tracker-client.ts';
import type { NodeActivity } from './stats.ts';
import { CHECK_PATH, type Distrust } from '../../verify/plan.ts';
import type { SignedPlan } from '../verify/verifier.ts';

/** How a request reached the node. */
export type Surface = 'relay' | 'link' | 'http' | 'rtc';

export interface NodeHandlerInit {
  peerId: string;
  activity: NodeActivity;
  span(): LoadedSpan | undefined;
  /** /info while no span is in. */
  loadingInfo(): Record<string, unknown>;
  /** The keys routes must be signed with (one tracker's, or every tracker's of its cluster). */
  trackerKey(): TrackerKeys;
  /** How a chained /forward reaches the next hop (and the last one the head). */
  transport: Pick<HopTransport, 'send' | 'push' | 'inOutageWindow'>;
  /** Test hook: every /forward waits this long first (a slow donor). */
  injectDelayMs: number;
  /** Whether new sessions are taken (paused, frozen, closing: held ones finish). */
  drain: DrainGate;
  /** The donor's cap on the device's busy time. */
  duty: DutyCycle;
  onLog(message: string): void;
  onGenerateEvent(event: GenerateEvent, sessionId: string): void;
  /** POST /check: recompute another hop's span for a head the tracker sent (docs/protocol.md §11). */
  check?: MeshHandler;
  /** The tracker's verified notice that a node is quarantined. */
  onDistrust?: (notice: Distrust) => void;
  /** The tracker's verified walk of a finished generation (head-verify.ts FinishedStore). */
  onWalk?: (plan: SignedPlan) => boolean;
  /** POST /rtc/signal (data-channel signalling, net/rtc-pool.ts); absent: 404, as on a node without WebRTC. */
  signal?: MeshHandler;
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

function safeDecode(s: string): string {
  try {
    return decodeURIComponent(s);
  } catch {
    return s;
  }
}

export class NodeHandler {
  /** /forward requests served per surface, in /info: which paths hops really take. */
  readonly served: Record<Surface, number> = { relay: 0, link: 0, http: 0, rtc: 0 };
  /** Chained /forward requests taken part in (GET /info's chain_forwards): whether heads really chain. */
  chained = 0;
  private readonly head: MeshHandler;
  private readonly bySurface: Record<Surface, MeshHandler>;

  constructor(private readonly init: NodeHandlerInit) {
    const gate: MeshHandler = (req) => this.gate(req);
    const stale = new StaleSteps();
    // A chained /forward runs the span through the gate (counted, delayed like any), then pushes on.
    const chain = createChainHop({ peerId: init.peerId, trackerKey: init.trackerKey, transport: init.transport, local: gate, onLog: init.onLog, stale });
    this.head = createHeadHandler({
      forward: (req) => {
        const path = req.path.split('?')[0]!;
        // A session the head dropped: chained steps of it still queued (a page frozen meanwhile) are not run.
        if (req.method.toUpperCase() === 'DELETE' && path.startsWith('/sessions/')) stale.end(safeDecode(path.slice('/sessions/'.length)));
        if (!isChainRequest(req) || req.method.toUpperCase() !== 'POST' || path !== '/forward') return gate(req);
        this.chained++;
        return chain(req);
      },
      peerId: init.peerId,
      trackerKey: init.trackerKey,
      pipeline: (): PipelineDriver | undefined => init.span()?.pipeline,
      onLog: init.onLog,
      ...(init.onDistrust ? { onDistrust: init.onDistrust } : {}),
      ...(init.onWalk ? { onWalk: init.onWalk } : {}),
      onEvent: (e, sessionId) => {
        // A head computes every token it streams (embedding, its layers) without a /forward: count them as served.
        if (e.type === 'token') init.activity.headToken();
        init.onGenerateEvent(e, sessionId);
      },
    });
    this.bySurface = { relay: this.counted('relay'), link: this.counted('link'), http: this.counted('http'), rtc: this.counted('rtc') };
  }

  /** The handler for requests arriving by `surface`. */
  for(surface: Surface): MeshHandler {
    return this.bySurface[surface];
  }

  private counted(surface: Surface): MeshHandler {
    return (req) => {
      if (req.path === '/forward' || req.path.startsWith('/forward?')) this.served[surface]++;
      const path = req.path.split('?')[0];
      if (path === '/generate' && req.method.toUpperCase() === 'POST') return this.generate(req);
      if (this.init.check && path === CHECK_PATH) return this.init.check(req);
      if (this.init.signal && path === RTC_SIGNAL_PATH) return this.init.signal(req);
      return this.head(req);
    };
  }

  /** A new generation: refused while draining; one that runs ends when the drain's grace does (the tracker restarts it elsewhere). */
  private async generate(req: MeshRequest): Promise<MeshResponse> {
    const drain = this.init.drain;
    if (!drain.admitsGenerate()) return errorReply(drainingError());
    const gen = drain.generation(req.signal);
    let res: MeshResponse;
    try {
      res = await this.head({ ...req, signal: gen.signal });
    } catch (e) {
      gen.end();
      throw e;
    }
    if (res.body instanceof Uint8Array) {
      gen.end();
      return res;
    }
    return { ...res, body: tracked(res.body, gen) };
  }

  private async gate(req: Parameters<MeshHandler>[0]): ReturnType<MeshHandler> {
    const span = this.init.span();
    const path = req.path.split('?')[0]!;
    if (!span) {
      if (path === '/health') return jsonReply(200, { status: 'loading', sessions: 0 });
      if (path === '/info') return jsonReply(200, this.init.loadingInfo());
      return errorReply(new MeshError('MESH_ERR_UNAVAILABLE', 'this node has no span loaded yet; route around it or retry later'));
    }
    if (path !== '/forward' || req.method.toUpperCase() !== 'POST') return span.forward(req);
    // The span's GPU device was lost and it is being rebuilt (device-recovery.ts): come back after about one load.
    if (span.deviceLostReason !== undefined) return errorReply(rebuildingError(span));
    const { activity, drain, duty } = this.init;
    if (drain.draining && !drain.admitsForward(holdsSession(req, span.executor))) return errorReply(drainingError());
    activity.inFlight++;
    try {
      if (this.init.injectDelayMs > 0) await sleep(this.init.injectDelayMs);
      return await drain.run(() => duty.run(() => span.forward(req)));
    } finally {
      activity.inFlight--;
    }
  }
}

/**
 * Whether `req` is a step of a session this node already holds (a chat in flight, which a drain lets finish).
 * Its cache is looked up at the first layer the step runs: a route may use only the end of the span (another
 * node holds its first layers), and then the session has no cache at the span's own first layer.
 */
function holdsSession(req: MeshRequest, executor: { startLayer: number; sessionLength(id: string, layer?: number): number }): boolean {
  const session = req.headers[H.session]?.trim();
  if (session === undefined || session === '') return false;
  const from = Number(req.headers[H.startLayer]?.trim() || Number.NaN);
  return executor.sessionLength(session, Number.isInteger(from) && from >= executor.startLayer ? from : executor.startLayer) > 0;
}

function drainingError(): MeshError {
  return new MeshError('MESH_ERR_UNAVAILABLE', 'this node is draining (its donor paused it, or its page is being frozen or closed): it finishes the sessions it holds and takes no new one; route around it');
}

/** A streamed /generate answer, counted as the drain's activity until it ends. */
async function* tracked(body: AsyncIterable<Uint8Array>, gen: { touch(): void; end(): void }): AsyncGenerator<Uint8Array> {
  try {
    for await (const chunk of body) {
      gen.touch();
      yield chunk;
    }
  } finally {
    gen.end();
  }
}
