/**
 * The nodes' watch streams (`GET /api/nodes/watch`, docs/protocol.md §9),
 * served straight on Node's http objects.
 *
 * Every node holds one open, so a tracker of thousands of donors holds
 * thousands. Through the fetch-style app each one was a web Request, a
 * Response over a ReadableStream, an async generator, an AbortController
 * and a timer of its own: about 13 KiB of heap per stream, most of a
 * donor's cost. Here a stream is only its socket and response: the hub
 * writes the `hello` event, keeps the response in a set, and one timer
 * sends the keep-alive comment to the streams that are due (spread over the
 * period by when each opened, so thousands are never written in one tick).
 * The stream's end is still the news: the tracker going away closes them
 * all.
 */
import type { IncomingMessage, ServerResponse } from 'node:http';

export interface WatchHubOptions {
  /** The `hello` event's data (JSON), read as each stream opens. */
  hello(): string;
  /** A comment on each stream this often, ms (below the idle timeouts of common proxies). @defaultValue 20000 */
  keepAliveMs?: number;
  /** How often the timer looks for due streams, ms. @defaultValue 1000 */
  tickMs?: number;
  now?: () => number;
}

/** What the hub writes to: a ServerResponse, or anything shaped like one (tests). */
export interface WatchSink {
  write(chunk: Uint8Array): boolean;
  end(): void;
  once(event: 'close', listener: () => void): unknown;
}

const KEEP_ALIVE = Buffer.from(': keep-alive\n\n');

export const WATCH_HEADERS = {
  'content-type': 'text/event-stream; charset=utf-8',
  'cache-control': 'no-cache',
  'x-accel-buffering': 'no',
  // Browser nodes (the donor page, another origin) watch with fetch.
  'access-control-allow-origin': '*',
} as const;

export class WatchHub {
  private readonly o: Required<Omit<WatchHubOptions, 'hello'>> & Pick<WatchHubOptions, 'hello'>;
  /** Open streams, each with when it was last written (ms). */
  private readonly sinks = new Map<WatchSink, number>();
  private timer: ReturnType<typeof setInterval> | undefined;

  constructor(o: WatchHubOptions) {
    this.o = { keepAliveMs: 20_000, tickMs: 1000, now: Date.now, ...o };
  }

  /** The `hello` event's data now. */
  hello(): string {
    return this.o.hello();
  }

  get size(): number {
    return this.sinks.size;
  }

  /** Node's http host: answer the request with the stream. */
  serve(req: IncomingMessage, res: ServerResponse): void {
    res.writeHead(200, WATCH_HEADERS);
    // A watch has no body; whatever a client sends is read and dropped so the socket is not held back.
    req.resume();
    this.add(res);
  }

  /** Write `hello` and keep `sink` until it closes. */
  add(sink: WatchSink): void {
    sink.write(Buffer.from(`event: hello\ndata: ${this.hello()}\n\n`));
    this.sinks.set(sink, this.o.now());
    sink.once('close', () => this.sinks.delete(sink));
    if (!this.timer) {
      this.timer = setInterval(() => this.tick(), this.o.tickMs);
      this.timer.unref?.();
    }
  }

  /** Keep-alive comments to the streams due (the timer calls it). */
  tick(): void {
    const due = this.o.now() - this.o.keepAliveMs;
    for (const [sink, last] of this.sinks) {
      if (last > due) continue;
      this.sinks.set(sink, this.o.now());
      sink.write(KEEP_ALIVE);
    }
    if (this.sinks.size === 0 && this.timer) {
      clearInterval(this.timer);
      this.timer = undefined;
    }
  }

  /** End every stream (the tracker is closing: the nodes hear it at once). */
  close(): void {
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
    for (const sink of [...this.sinks.keys()]) sink.end();
    this.sinks.clear();
  }
}
