/**
 * A `ws` socket as the stream table sees it (PeerSocket), and the cork that
 * makes one tick's sends to a socket leave in one write: shared by peer
 * sockets, `/rpc` sockets and the links between relays of a cluster.
 */
import type { Duplex } from 'node:stream';
import { WebSocket } from 'ws';
import { trace } from '../protocol/trace.ts';
import type { PeerSocket } from './stream-table.ts';

/**
 * One tick's sends to a socket leave in one writev: the first send in a tick
 * corks the socket, the tick's end uncorks it. One read from a peer often
 * carries many frames (64 requests in flight arrive in a few reads); each
 * ws.send() would be its own write(2). Nothing waits longer than the tick.
 */
export class Corker {
  private corked: Duplex[] = [];
  private readonly flush = (): void => {
    const sockets = this.corked;
    this.corked = [];
    for (const socket of sockets) socket.uncork();
    trace?.('relay-out');
  };
  cork(socket: Duplex): void {
    if (socket.writableCorked !== 0) return;
    socket.cork();
    if (this.corked.push(socket) === 1) process.nextTick(this.flush);
  }
}

/** A `ws` socket as the stream table sees it; `raw` is the TCP socket of its upgrade (ws writes to that one). */
export class WsPeerSocket implements PeerSocket {
  /** Answered the last ping (or has not been pinged yet). */
  alive = true;
  constructor(
    readonly ws: WebSocket,
    private readonly raw: Duplex,
    private readonly corker: Corker,
  ) {
    ws.on('pong', () => {
      this.alive = true;
    });
  }
  get isOpen(): boolean {
    return this.ws.readyState === WebSocket.OPEN;
  }
  get bufferedAmount(): number {
    return this.ws.bufferedAmount;
  }
  send(data: Uint8Array | string): void {
    this.corker.cork(this.raw);
    this.ws.send(data);
  }
  close(code: number, reason: string): void {
    this.ws.close(code, reason);
  }
}

