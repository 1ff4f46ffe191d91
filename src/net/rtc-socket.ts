/**
 * A data channel as the WebSocket the frame multiplexer expects
 * (socket.ts `WebSocketLike`), so a channel carries the relay fast path's
 * frames (docs/protocol.md §4) exactly as a direct link does.
 *
 * SCTP in Chromium refuses messages over `maxMessageSize` (256 KiB), and a
 * prompt's activation can be larger, so a binary message over `fragmentBytes`
 * travels as fragments: each starts with 0xFF (no frame starts with it: byte
 * 0 of a frame is its version), then 1 (more follow) or 0 (the last), then
 * up to `fragmentBytes` of the message. Whole frames go as they are, with no
 * copy.
 *
 * `delayMs` (benches only) holds every received message that long before
 * delivering it, in order: the one-way delay of a WAN leg, which the relay
 * legs get from a delaying proxy and a channel cannot (no netem here).
 */
import { WS_OPEN, type SocketCloseEvent, type SocketMessageEvent, type WebSocketLike } from './socket.ts';
import type { DataChannelLike } from './rtc-peer.ts';
import { trace } from '../protocol/trace.ts';

export const FRAGMENT_MARK = 0xff;
/** Below Chromium's SCTP maxMessageSize (256 KiB) with room for the 2-byte fragment head. */
export const DEFAULT_FRAGMENT_BYTES = 64 * 1024;

export interface ChannelSocketOptions {
  /** Largest message sent whole; bigger ones go in fragments of this size. @defaultValue 65536 */
  fragmentBytes?: number;
  /** Largest message reassembled from fragments; beyond it the channel is closed (a peer that floods). @defaultValue 64 MiB */
  maxMessageBytes?: number;
  /** Benches: delay every received message this long (ms). @defaultValue 0 */
  delayMs?: number;
}

/** WebSocket readyState values (the WebSocket standard's). */
const WS_CONNECTING = 0;
const WS_CLOSING = 2;
const WS_CLOSED = 3;
const STATES: Record<DataChannelLike['readyState'], number> = { connecting: WS_CONNECTING, open: WS_OPEN, closing: WS_CLOSING, closed: WS_CLOSED };

export class ChannelSocket implements WebSocketLike {
  binaryType = 'arraybuffer';
  onopen: ((ev: unknown) => void) | null = null;
  onmessage: ((ev: SocketMessageEvent) => void) | null = null;
  onclose: ((ev: SocketCloseEvent) => void) | null = null;
  onerror: ((ev: unknown) => void) | null = null;
  private readonly fragmentBytes: number;
  private readonly maxMessageBytes: number;
  private readonly delayMs: number;
  private parts: Uint8Array[] = [];
  private partBytes = 0;
  private closedOnce = false;

  constructor(readonly channel: DataChannelLike, opts: ChannelSocketOptions = {}) {
    this.fragmentBytes = opts.fragmentBytes ?? DEFAULT_FRAGMENT_BYTES;
    this.maxMessageBytes = opts.maxMessageBytes ?? 64 * 2 ** 20;
    this.delayMs = opts.delayMs ?? 0;
    channel.binaryType = 'arraybuffer';
    channel.onopen = (ev) => this.onopen?.(ev);
    channel.onmessage = (ev) => this.receive(ev.data);
    channel.onerror = (ev) => this.onerror?.(ev);
    channel.onclose = () => this.closed('the data channel closed');
  }

  get readyState(): number {
    return this.closedOnce ? WS_CLOSED : STATES[this.channel.readyState];
  }

  get bufferedAmount(): number {
    return this.channel.bufferedAmount;
  }

  send(data: string | Uint8Array): void {
    trace?.('ch-send');
    if (typeof data === 'string' || data.byteLength <= this.fragmentBytes) {
      this.channel.send(data);
      return;
    }
    const n = this.fragmentBytes;
    for (let at = 0; at < data.byteLength; at += n) {
      const end = Math.min(at + n, data.byteLength);
      const part = new Uint8Array(2 + end - at);
      part[0] = FRAGMENT_MARK;
      part[1] = end < data.byteLength ? 1 : 0;
      part.set(data.subarray(at, end), 2);
      this.channel.send(part);
    }
  }

  close(code?: number, reason?: string): void {
    try {
      this.channel.close();
    } catch {
      // already closed
    }
    this.closed(reason ?? 'closed', code);
  }

  private closed(reason: string, code = 1000): void {
    if (this.closedOnce) return;
    this.closedOnce = true;
    this.parts = [];
    const cb = this.onclose;
    const fire = () => cb?.({ code, reason });
    // Messages still held by the delay come first, as they would off the wire.
    if (this.delayMs > 0) setTimeout(fire, this.delayMs);
    else fire();
  }

  private receive(data: unknown): void {
    if (this.closedOnce) return;
    trace?.('ch-recv');
    if (typeof data === 'string') return this.deliver(data);
    const bytes = data instanceof ArrayBuffer ? new Uint8Array(data) : ArrayBuffer.isView(data) ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength) : undefined;
    if (bytes === undefined) return this.deliver(data);
    if (bytes.byteLength === 0 || bytes[0] !== FRAGMENT_MARK) return this.deliver(bytes);
    if (bytes.byteLength < 2) return this.protocolError('a fragment shorter than its head');
    this.parts.push(bytes.subarray(2));
    this.partBytes += bytes.byteLength - 2;
    if (this.partBytes > this.maxMessageBytes) return this.protocolError(`a fragmented message over ${this.maxMessageBytes} bytes`);
    if (bytes[1] !== 0) return;
    const whole = new Uint8Array(this.partBytes);
    let at = 0;
    for (const p of this.parts) {
      whole.set(p, at);
      at += p.byteLength;
    }
    this.parts = [];
    this.partBytes = 0;
    this.deliver(whole);
  }

  private protocolError(why: string): void {
    this.onerror?.(new Error(why));
    this.close(1002, why);
  }

  private deliver(data: unknown): void {
    if (this.delayMs > 0) setTimeout(() => this.onmessage?.({ data }), this.delayMs);
    else this.onmessage?.({ data });
  }
}
