/**
 * The WebSocket a Node.js host hands the node core (RelayClient, RpcConnection,
 * direct links): the `ws` client, set up for the data path.
 *
 * - **Zero masking key.** RFC 6455 makes clients mask every frame so that
 *   script in a browser cannot forge bytes an intermediary might misread;
 *   a Node.js process has no such script to guard against. `ws` skips the
 *   XOR (and the copy of the whole message it needs) when the key is all
 *   zeros, which saves one copy of every frame we send. Browsers always mask
 *   with a random key; the relay accepts both.
 * - **No permessage-deflate.** Activations are bf16 noise; compressing them
 *   costs CPU and buys nothing.
 * - **One write per tick.** The first send in a tick corks the TCP socket and
 *   the end of the tick uncorks it, so the frames a burst of requests (or
 *   answers) sends leave in one writev instead of one write(2) each. At 64
 *   requests in flight this roughly halves CPU per hop on every process; no
 *   frame waits past the current tick.
 *
 * The node core (src/node) stays host-neutral: it only sees a
 * {@link WebSocketConstructor}.
 */
import { WebSocket } from 'ws';
import type { WebSocketConstructor } from '../../net/socket.ts';
import { trace } from '../../protocol/trace.ts';

function zeroMask(mask: Buffer): void {
  mask.fill(0);
}

interface Corkable {
  cork(): void;
  uncork(): void;
}

export class NodeWebSocket extends WebSocket {
  private corked: Corkable | undefined;

  constructor(url: string, protocols?: string | string[]) {
    super(url, protocols ?? [], { perMessageDeflate: false, generateMask: zeroMask });
  }

  override send(data: unknown, options?: unknown, cb?: unknown): void {
    if (this.corked === undefined && this.readyState === WebSocket.OPEN) {
      const socket = (this as unknown as { _socket: Corkable | null })._socket;
      if (socket) {
        socket.cork();
        this.corked = socket;
        process.nextTick(uncork, this);
      }
    }
    (super.send as (d: unknown, o?: unknown, c?: unknown) => void)(data, options, cb);
  }

  /** Uncork what this tick's sends buffered (runs at the end of the tick). */
  flush(): void {
    const socket = this.corked;
    if (socket === undefined) return;
    this.corked = undefined;
    socket.uncork();
    trace?.('uncork');
  }
}

function uncork(ws: NodeWebSocket): void {
  ws.flush();
}

/** {@link NodeWebSocket} typed for the node core. */
export const NodeWebSocketConstructor = NodeWebSocket as unknown as WebSocketConstructor;
