/**
 * The WebSocket a host hands to the node core: the subset that the browser's
 * `WebSocket` and the `ws` package's class share, so the same relay client
 * runs in a Web Worker and in Node.js without knowing which.
 */
import { MeshError } from '../protocol/errors.ts';

export const WS_CONNECTING = 0;
export const WS_OPEN = 1;
export const WS_CLOSING = 2;
export const WS_CLOSED = 3;

/** Only `data` is read: browser and `ws` events differ in everything else. */
export interface SocketMessageEvent {
  data: unknown;
}
export interface SocketCloseEvent {
  code?: number;
  reason?: string;
}

export interface WebSocketLike {
  binaryType: string;
  readonly readyState: number;
  /** Bytes queued but not yet handed to the network: our only flow-control signal. */
  readonly bufferedAmount: number;
  send(data: string | Uint8Array): void;
  close(code?: number, reason?: string): void;
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: SocketMessageEvent) => void) | null;
  onclose: ((ev: SocketCloseEvent) => void) | null;
  onerror: ((ev: unknown) => void) | null;
}

export type WebSocketConstructor = new (url: string) => WebSocketLike;

/**
 * Bytes of a binary message without copying. With binaryType 'arraybuffer'
 * both hosts deliver an ArrayBuffer; a view (`ws`'s 'nodebuffer') is accepted
 * too so a host may choose it for fewer copies.
 */
export function messageBytes(data: unknown): Uint8Array | undefined {
  if (data instanceof ArrayBuffer) return new Uint8Array(data);
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  // Blob (a browser default) and 'fragments' arrays would need async reads: the client sets 'arraybuffer' so they never come.
  return undefined;
}

/**
 * Sends under a high-water mark. WebSockets have no drain event, so a sender
 * that finds `bufferedAmount` over the mark polls (1, 2, 4 … 16 ms) until it
 * falls or `maxWaitMs` passes; the common case sends synchronously and
 * allocates nothing. Waiters go FIFO so a burst of new sends cannot starve
 * one that has been waiting.
 */
export class SendGate {
  private readonly waiters: Array<{ resolve: () => void; reject: (e: unknown) => void; deadline: number }> = [];
  private timer: ReturnType<typeof setTimeout> | undefined;
  private pollMs = 1;

  constructor(
    private readonly socket: WebSocketLike,
    private readonly highWaterBytes: number,
    private readonly maxWaitMs: number,
  ) {}

  /** True when a send now would not push the queue over the mark. */
  get open(): boolean {
    return this.waiters.length === 0 && this.socket.bufferedAmount <= this.highWaterBytes;
  }

  /** Send now, or wait for room; rejects MESH_ERR_BACKPRESSURE after `maxWaitMs`, MESH_ERR_PEER_GONE if the socket closes. */
  send(data: string | Uint8Array): void | Promise<void> {
    if (this.socket.readyState !== WS_OPEN) throw new MeshError('MESH_ERR_PEER_GONE', 'the connection is closed');
    if (this.open) {
      this.socket.send(data);
      return;
    }
    return this.waitForRoom().then(() => {
      if (this.socket.readyState !== WS_OPEN) throw new MeshError('MESH_ERR_PEER_GONE', 'the connection closed while a send waited for room');
      this.socket.send(data);
    });
  }

  private waitForRoom(): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      this.waiters.push({ resolve, reject, deadline: Date.now() + this.maxWaitMs });
      if (this.timer === undefined) {
        this.pollMs = 1;
        this.timer = setTimeout(this.gateOnPoll, this.pollMs);
      }
    });
  }

  private readonly gateOnPoll = (): void => {
    this.timer = undefined;
    const now = Date.now();
    if (this.socket.readyState !== WS_OPEN) {
      this.failAll(new MeshError('MESH_ERR_PEER_GONE', 'the connection closed while sends waited for room'));
      return;
    }
    // Release one waiter per round of room so a released send is counted in bufferedAmount before the next.
    while (this.waiters.length > 0) {
      const w = this.waiters[0]!;
      if (this.socket.bufferedAmount <= this.highWaterBytes) {
        this.waiters.shift();
        w.resolve();
        // Its send happens in a microtask; re-check on the next poll for the rest.
        break;
      }
      if (w.deadline <= now) {
        this.waiters.shift();
        w.reject(new MeshError('MESH_ERR_BACKPRESSURE', `send waited ${this.maxWaitMs} ms for the socket buffer to drain below ${this.highWaterBytes} bytes; the link or the relay is too slow`));
        continue;
      }
      break;
    }
    if (this.waiters.length > 0) {
      this.pollMs = this.socket.bufferedAmount <= this.highWaterBytes ? 0 : Math.min(this.pollMs * 2, 16);
      this.timer = setTimeout(this.gateOnPoll, this.pollMs);
    }
  };

  /** Reject every waiting send (the socket is gone). */
  failAll(err: MeshError): void {
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
    for (const w of this.waiters.splice(0)) w.reject(err);
  }
}
