/**
 * A node's data channels to other nodes (docs/protocol.md §12): the pool of
 * peer connections (net/rtc-pool.ts), signalled over the relay's fast path
 * with `POST /rtc/signal`, and who may open one — only a peer on a route
 * the tracker signed with both of them on it.
 *
 * The runtime asks it for a requester per hop (HopTransport's `rtc` kind:
 * an open channel leads, the relay carries the rest), routes the signals
 * it receives here, and shows the channels' state in `/info` and the
 * heartbeat. Off where the host has no WebRTC, where there is no relay to
 * signal over, or where the config turns them off.
 */
import { errorReply } from '../../protocol/envelopes.ts';
import { MeshError } from '../../protocol/errors.ts';
import type { MeshRequest } from '../../protocol/envelopes.ts';
import type { MeshHandler } from '../../net/contract.ts';
import type { RelayClient } from '../../net/relay-client.ts';
import type { IceServer } from '../../net/rtc-peer.ts';
import { RtcPool } from '../../net/rtc-pool.ts';
import { RTC_SIGNAL_PATH, type RouteProof } from '../../net/rtc-signal.ts';
import { VerifiedRoutes, type TrackerKeys } from '../tracker-client.ts';
import type { RuntimeHost } from './host.ts';

/**
 * Data channels to other nodes (when the host has WebRTC and there is a
 * relay to signal over): `enabled` false keeps every hop on the relay
 * (benches compare the two); `iceServers` for nodes behind NATs (STUN,
 * TURN); `delayMs` (benches) delays every message received on a channel,
 * as the delaying proxy delays the relay's legs.
 */
export interface RtcConfig {
  enabled?: boolean;
  iceServers?: IceServer[];
  icePolicy?: 'relay';
  delayMs?: number;
}

export interface DataChannelsDeps {
  peerId: string;
  host: Pick<RuntimeHost, 'rtc' | 'log'>;
  config: RtcConfig | undefined;
  /** Whether there is a relay to signal over at all. */
  hasRelay: boolean;
  /** The relay connection now (signals go over it). */
  relay: () => RelayClient | undefined;
  /** The key routes offered as proof must be signed with. */
  trackerKey: () => TrackerKeys;
}

export type DataChannelsInfo = { open: number; opened: number; failed: number; closed: number; refused: number; peers: ReturnType<RtcPool['snapshot']> };

export class DataChannels {
  /** Undefined while off, and until {@link attach}. */
  private pool: RtcPool | undefined;
  private handler: MeshHandler | undefined;
  /** Routes offered as proof by peers that open data channels, checked once per signature. */
  private readonly routes = new VerifiedRoutes();

  constructor(private readonly d: DataChannelsDeps) {}

  /** Whether hops may go over data channels: the host has WebRTC, there is a relay to signal over, and the config does not turn them off. */
  get enabled(): boolean {
    return this.d.host.rtc !== undefined && this.d.hasRelay && this.d.config?.enabled !== false;
  }

  /** Start with the node's handler for requests that arrive over a channel. */
  attach(handler: MeshHandler): void {
    this.handler = handler;
    this.pool = this.newPool();
  }

  /** A requester over the open channel to `peerId`, if any (a send to a peer with none dials one in the background). */
  requester(peerId: string, proof?: RouteProof): ReturnType<RtcPool['requester']> | undefined {
    return this.pool?.requester(peerId, proof);
  }

  /** `POST /rtc/signal` from another node. */
  onSignal(req: MeshRequest): ReturnType<MeshHandler> {
    const pool = this.pool;
    if (!pool) return Promise.resolve(errorReply(new MeshError('MESH_ERR_NOT_FOUND', 'this node has no data channels now')));
    // The relay (or a link) names the sender; an anonymous path (an /rpc envelope, HTTP) cannot signal.
    if (req.from === undefined) return Promise.resolve(errorReply(new MeshError('MESH_ERR_FORBIDDEN', 'signalling must come over the relay fast path, which names the sender')));
    return pool.onSignal(req.from, req);
  }

  /** The channels' state as /info and the heartbeat show it; undefined without them. */
  info(): DataChannelsInfo | undefined {
    const p = this.pool;
    if (!p) return undefined;
    return { open: p.openCount, ...p.counts, peers: p.snapshot() };
  }

  /** The channel's state to `peerId`; undefined without data channels. */
  state(peerId: string): ReturnType<RtcPool['state']> | undefined {
    return this.pool?.state(peerId);
  }

  /** Close every channel (tests: a channel that closes mid-generation); they are dialled again on the next hops. */
  closeAll(): void {
    const p = this.pool;
    if (!p) return;
    for (const x of p.snapshot()) p.closePeer(x.peer_id, 'closed by this node (test)');
  }

  /** Everything closed; a new pool for a restart (retry after an error): a closed one dials no more. */
  reset(): void {
    this.pool?.close();
    this.pool = this.newPool();
  }

  private newPool(): RtcPool | undefined {
    if (!this.enabled || !this.handler) return undefined;
    const utf8 = new TextEncoder();
    const rtc = this.d.config ?? {};
    return new RtcPool({
      selfId: this.d.peerId,
      factory: this.d.host.rtc!,
      handler: this.handler,
      iceServers: rtc.iceServers ?? [],
      ...(rtc.icePolicy ? { icePolicy: rtc.icePolicy } : {}),
      ...(rtc.delayMs ? { socket: { delayMs: rtc.delayMs } } : {}),
      sendSignal: (peerId, msg, timeoutMs) => {
        const relay = this.d.relay();
        if (!relay || relay.state !== 'registered') return Promise.reject(new MeshError('MESH_ERR_UNAVAILABLE', 'no relay connection to signal over'));
        return relay.request(peerId, { method: 'POST', path: RTC_SIGNAL_PATH, headers: { 'content-type': 'application/json' }, body: utf8.encode(JSON.stringify(msg)) }, { timeoutMs });
      },
      authorize: (caller, proof) => this.authorize(caller, proof),
      onLog: (level, m) => this.d.host.log(level, m),
    });
  }

  /**
   * A peer may open a data channel to this node only on a route the
   * tracker signed with both on it (the head or a hop): a stranger cannot
   * make a page open connections, nor learn its addresses from an answer.
   */
  private async authorize(caller: string, proof: RouteProof): Promise<void> {
    const got = this.routes.get(this.d.trackerKey(), proof.head, proof.route, proof.expires, proof.signature, Date.now());
    const route = got instanceof Promise ? await got : got;
    const on = (peer: string) => peer === proof.head || route.hops.some((h) => h.peer_id === peer);
    if (!on(caller)) throw new MeshError('MESH_ERR_FORBIDDEN', `${caller} is not on the route it offers as proof: only peers on a route together open data channels`);
    if (!on(this.d.peerId)) throw new MeshError('MESH_ERR_FORBIDDEN', `this node (${this.d.peerId}) is not on the route ${caller} offers as proof`);
  }
}
