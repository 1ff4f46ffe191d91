/**
 * The relay's connections as the stream table holds them: a registered peer
 * (or a link to another relay of the cluster), an `/rpc` caller, and the
 * streams in flight between them. Kept apart from the routing so that the
 * table's helpers (stream-book.ts, outbox.ts, peer-watch.ts) and the cluster
 * code (federation.ts, trunks.ts) share these shapes without importing the
 * table itself.
 */
import { BEAT_BATCH_FEATURE } from '../protocol/index.ts';

/** The capability a peer announces in `info.protocols` to receive binary frames. */
export const FAST_PATH_PROTOCOL = 'mesh-frames/1';

/** What the table needs of one connection: the server's WebSocket, a test's array. */
export interface PeerSocket {
  readonly isOpen: boolean;
  /** Bytes queued towards the far side and not yet written. */
  readonly bufferedAmount: number;
  send(data: Uint8Array | string): void;
  close(code: number, reason: string): void;
}

export type StreamPath = 'fast' | 'rpc' | 'envelope';
export type Caller = PeerConn | RpcCaller;

/** One request in flight through the relay. */
export interface Stream {
  caller: Caller;
  /** The caller's own id (fast path: stream id; `/rpc`: request_id). */
  callerId: number | string;
  target: PeerConn;
  /** The relay's id towards the target. */
  relayStreamId: number;
  /** `/rpc` or legacy-target streams travel as JSON envelopes with this id. */
  relayRequestId: string | null;
  deadline: number;
  startedAt: number;
  path: StreamPath;
  /** A one-way request (FLAG_ONE_WAY): forgotten silently at its deadline. */
  oneWay?: boolean;
  /**
   * The target's RESPONSE head went on to the caller (a streamed answer is
   * under way): a failure from now on ends the stream with a DATA|END|ERROR
   * frame, never a second RESPONSE.
   */
  answered?: boolean;
  /** `target` is a link: the peer over there. */
  remotePeer?: string;
}

/**
 * How frames reach another relay of the cluster (a trunk WebSocket, or
 * NATS): a REQUEST or CANCEL is addressed to a peer over there; answers
 * travel as plain frames on the link's PeerSocket.
 */
export interface LinkPipe {
  /** Which relay (for logs and errors). */
  readonly relayId: string;
  sendAddressed(targetId: string, frame: Uint8Array): void;
}

/** A registered peer's connection, or (with `link`) a link to another relay of the cluster. */
export class PeerConn {
  readonly kind = 'peer' as const;
  /** Streams this peer called, by its own stream id. */
  readonly outgoing = new Map<number, Stream>();
  /** Streams addressed to this peer, by the relay's stream id. */
  readonly incoming = new Map<number, Stream>();
  /** Of `incoming`, the one-way requests still in their window (not counted against maxInFlightPerPeer). */
  oneWayIn = 0;
  nextStreamId = 1;
  /** When the peer registered (ms since epoch): of two registrations of one key in a cluster, the newer wins. */
  readonly registeredAt = Date.now();
  /** The peers this one asked to be told about when they detach (`watch-peer`); undefined until it asks. */
  watching: Set<string> | undefined;
  /** A tracker that declared BEAT_BATCH_FEATURE in its register info: beats to it may travel batched. */
  readonly acceptsBeats: boolean;
  /** It was sent `registered` (StreamTable.announced): its client reads messages from then on. */
  announced = false;
  constructor(
    readonly socket: PeerSocket,
    readonly id: string,
    readonly idBytes: Uint8Array,
    readonly info: Record<string, unknown>,
    readonly fastPath: boolean,
    /** Set for a link to another relay: requests to it are addressed, requests from it carry their source already. */
    readonly link?: LinkPipe,
  ) {
    const features = info.features;
    this.acceptsBeats = Array.isArray(features) && features.includes(BEAT_BATCH_FEATURE);
  }

  allocStreamId(): number {
    // Skip ids still in use after a wrap-around (2^32 requests on one socket).
    do {
      this.nextStreamId = this.nextStreamId >= 0xffffffff ? 1 : this.nextStreamId + 1;
    } while (this.incoming.has(this.nextStreamId));
    return this.nextStreamId;
  }
}

/** An `/rpc/<peer_id>` socket: JSON requests to one target. */
export class RpcCaller {
  readonly kind = 'rpc' as const;
  readonly pending = new Map<string, Stream>();
  constructor(
    readonly socket: PeerSocket,
    readonly targetId: string,
  ) {}
}
