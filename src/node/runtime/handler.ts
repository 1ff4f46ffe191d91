/**
 * The node's HTTP surface on every path a request can arrive by (relay,
 * direct link, direct HTTP), in front of whatever span serves now:
 *
 *   POST /generate ─▶ head handler (a head's pipeline; 421 on a node that is not one)
 *   everything else ─▶ forward gate ─▶ the span's forward handler
 *
 * The gate answers while no span is in (health and info say "loading",
 * the rest 503 so heads route around the node), counts /forward requests
 * running (the heartbeat's queue depth) and per surface (GET /info), and
 * applies a test's injected delay.
 */
import { errorReply, jsonReply } from '../../protocol/envelopes.ts';
import { MeshError } from '../../protocol/errors.ts';
import type { GenerateEvent } from '../../protocol/tracker.ts';
import { createChainHop, isChainRequest } from '../hop/chain-hop.ts';
import { createHeadHandler } from '../head/head-handler.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import type { MeshHandler } from '../../net/contract.ts';
import type { PipelineDriver } from '../head/pipeline.ts';
import type { TrackerKeys } from '../tracker-client.ts';
import { rebuildingError } from './device-recovery.ts';
import type { LoadedSpan } from './span.ts';
import type { NodeActivity } from './stats.ts';

/** How a request reached the node. */
export type Surface = 'relay' | 'link' | 'http';

export interface NodeHandlerInit {
  peerId: string;
  activity: NodeActivity;
  span(): LoadedSpan | undefined;
  /** /info while no span is in. */
  loadingInfo(): Record<string, unknown>;
  /** The keys routes must be signed with (one tracker's, or every tracker's of its cluster). */
  trackerKey(): TrackerKeys;
  /** How a chained /forward reaches the next hop (and the last one the head). */
  transport: Pick<HopTransport, 'send' | 'push'>;
  /** Test hook: every /forward waits this long first (a slow donor). */
  injectDelayMs: number;
  onLog(message: string): void;
  onGenerateEvent(event: GenerateEvent, sessionId: string): void;
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

export class NodeHandler {
  /** /forward requests served per surface, in /info: which paths hops really take. */
  readonly served: Record<Surface, number> = { relay: 0, link: 0, http: 0 };
  /** Chained /forward requests taken part in (GET /info's chain_forwards): whether heads really chain. */
  chained = 0;
  private readonly head: MeshHandler;
  private readonly bySurface: Record<Surface, MeshHandler>;

  constructor(private readonly init: NodeHandlerInit) {
    const gate: MeshHandler = (req) => this.gate(req);
    // A chained /forward runs the span through the gate (counted, delayed like any), then pushes on.
    const chain = createChainHop({ peerId: init.peerId, trackerKey: init.trackerKey, transport: init.transport, local: gate, onLog: init.onLog });
    this.head = createHeadHandler({
      forward: (req) => {
        if (!isChainRequest(req) || req.method.toUpperCase() !== 'POST' || req.path.split('?')[0] !== '/forward') return gate(req);
        this.chained++;
        return chain(req);
      },
      peerId: init.peerId,
      trackerKey: init.trackerKey,
      pipeline: (): PipelineDriver | undefined => init.span()?.pipeline,
      onLog: init.onLog,
      onEvent: (e, sessionId) => {
        // A head computes every token it streams (embedding, its layers) without a /forward: count them as served.
        if (e.type === 'token') init.activity.headToken();
        init.onGenerateEvent(e, sessionId);
      },
    });
    this.bySurface = { relay: this.counted('relay'), link: this.counted('link'), http: this.counted('http') };
  }

  /** The handler for requests arriving by `surface`. */
  for(surface: Surface): MeshHandler {
    return this.bySurface[surface];
  }

  private counted(surface: Surface): MeshHandler {
    return (req) => {
      if (req.path === '/forward' || req.path.startsWith('/forward?')) this.served[surface]++;
      return this.head(req);
    };
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
    const activity = this.init.activity;
    activity.inFlight++;
    try {
      if (this.init.injectDelayMs > 0) await sleep(this.init.injectDelayMs);
      return await span.forward(req);
    } finally {
      activity.inFlight--;
    }
  }
}
