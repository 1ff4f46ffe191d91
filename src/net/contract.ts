/**
 * The transport contract: what reaching a peer means, whatever carries it.
 * The local handler a connection serves, what a caller sends to another
 * peer and gets back, and the ways a hop is reached as the hop transport
 * (hop-transport.ts) sees them: a relay connection's fast path
 * (FastPathClient), a kept-open `/rpc` socket (RpcLike), a direct link
 * (LinkDialer → PeerRequester) and direct HTTP (DirectRequest). A new way to
 * reach a peer (a WebRTC data channel, say) is one more implementation of
 * these, in src/net. A module of its own so that transports, handlers, the
 * runtime and the tracker can name these types without importing a
 * transport.
 */
import type { MeshReply, MeshRequest, MeshResponse } from '../protocol/envelopes.ts';
import type { HeaderMap } from '../protocol/headers.ts';

/** The local side of a bridge: the node's HTTP surface, host-neutral. */
export type MeshHandler = (req: MeshRequest) => Promise<MeshResponse>;

export interface OutgoingRequest {
  method: string;
  path: string;
  headers?: HeaderMap;
  body?: Uint8Array;
}

export interface RequestOptions {
  /** Longest wait for the next frame of the answer (for a one-frame answer: the whole answer). 0 disables. Default: the multiplexer's requestTimeoutMs. */
  timeoutMs?: number;
  /** Aborting sends CANCEL and rejects with MESH_ERR_CANCELLED. */
  signal?: AbortSignal;
}

/** A streamed answer: the head now, the body chunk by chunk. Leaving the loop early cancels the stream. */
export interface MeshStreamReply {
  status: number;
  headers: HeaderMap;
  body: AsyncIterableIterator<Uint8Array>;
}

/** Sends a request to a peer and collects its whole answer (a relay connection, a direct link). */
export type MeshRequestFn = (peerId: string, req: OutgoingRequest, opts?: RequestOptions) => Promise<MeshReply>;

/**
 * A one-way request (FLAG_ONE_WAY): resolves with 202 when no error came
 * back within `opts.timeoutMs`, or with the relay's error answer; undefined
 * when the connection cannot send one (the far side did not announce it).
 */
export type MeshPushFn = (peerId: string, req: OutgoingRequest, opts?: RequestOptions) => Promise<MeshReply> | undefined;

/** `event` is stable for filtering; `ignored` entries are inputs that got no answer, `reason` says why. */
export interface RelayLogEntry {
  level: 'debug' | 'info' | 'warn' | 'error';
  event: 'ignored' | 'answered-error' | 'handler-error' | 'send-failed' | 'relay-error' | 'connection' | 'outage' | 'protocol';
  message: string;
  streamId?: number;
  requestId?: string;
  error?: unknown;
}

/** The kinds of path a hop can be reached by (hop-transport.ts tries them in turn). */
export type TransportKind = 'rtc' | 'fast' | 'rpc' | 'link' | 'direct';

/** A peer's requests with, where the path forwards them, one-way pushes (a direct link's). */
export type PeerRequester = MeshRequestFn & { push?: MeshPushFn };

/** What the transports need of RelayClient (structural, so tests may fake it). */
export interface FastPathClient {
  /** Our relay's base URL (any of ws/wss/http/https); a hop whose relay_addr has the same host:port is on our relay. Read per hop: a node that failed over has another. */
  readonly relayUrl: string;
  /** Our relay is in a cluster: a hop on any relay (of the cluster) is reached on our fast path (a 404 from it: /rpc next). */
  readonly cluster?: boolean;
  /** True while registered: the fast path is usable. */
  readonly isRegistered: boolean;
  /**
   * While a lost relay connection is waited out, ms left of its budget (the
   * client holds requests until it registered again); 0 otherwise. Absent:
   * the client does not wait (the fast path is usable only while registered).
   */
  outageLeftMs?(): number;
  /**
   * Ms left of the last outage's window (from the loss, the budget long),
   * back or not: a hop the relay does not know yet may still be reconnecting
   * from the same outage, so its "no such peer" is waited out. 0: no outage.
   */
  outageWindowLeftMs?(): number;
  request(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshReply>;
  /** A one-way request, where the relay forwards them (see MeshPushFn); absent or undefined: it cannot. */
  push?: MeshPushFn;
}

/**
 * Direct HTTP to `url`. Hosts inject the leanest they have: node:http with a
 * keep-alive agent in Node.js (about half the per-request cost of undici's
 * fetch on loopback), `fetchDirect` (hop-transport.ts) in a browser. Resolves
 * with any status; rejects only when no answer came (refused, reset, timeout).
 */
export type DirectRequest = (url: string, req: OutgoingRequest, timeoutMs: number, signal?: AbortSignal) => Promise<MeshReply>;

/** What the transports need of an RpcConnection. */
export interface RpcLike {
  request(req: OutgoingRequest, opts?: RequestOptions): Promise<MeshReply>;
  close(): void;
}

/** Direct links the host can dial (a Node.js node's `/link`); undefined while not up, or when the link ends at another peer. */
export interface LinkDialer {
  requester(endpoint: string, peerId: string): PeerRequester | undefined;
  close(): void;
}
