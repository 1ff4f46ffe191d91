/**
 * The types every side of the node's request plumbing shares: the local
 * handler a multiplexer serves, and what a caller sends to another peer.
 * A module of its own so that transports, handlers and the runtime can name
 * them without importing the relay client.
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
