/**
 * Liveness pings, spread over the interval. One loop over every socket each
 * interval stalled a relay holding 5,000 donors for 250–335 ms every 15 s
 * (5,000 ping writes, then 5,000 pongs at once), and that stall was the
 * heartbeat p99 of the swarm bench. Each socket gets a slot when it connects,
 * and a tick every interval / slots pings only that slot's sockets: each
 * socket still gets one ping per interval, and one that did not answer the
 * last is terminated, as before.
 */

/** What the sweep needs of a relay socket. */
export interface Pingable {
  /** Set again by the socket's pong; cleared when a ping goes out. */
  alive: boolean;
  readonly isOpen: boolean;
  readonly ws: { ping(): void; terminate(): void };
}

/** Ticks at least this far apart: short intervals (tests) get fewer slots rather than a busy timer. */
const MIN_TICK_MS = 10;
const MAX_SLOTS = 15;

export class PingSweep<S extends Pingable> {
  private readonly slots: Set<S>[];
  private next = 0;
  private tick = 0;
  private readonly timer: ReturnType<typeof setInterval>;

  constructor(intervalMs: number) {
    const n = Math.max(1, Math.min(MAX_SLOTS, Math.floor(intervalMs / MIN_TICK_MS)));
    this.slots = Array.from({ length: n }, () => new Set<S>());
    this.timer = setInterval(() => this.run(), intervalMs / n);
    this.timer.unref?.();
  }

  add(socket: S): void {
    this.slots[this.next]!.add(socket);
    this.next = (this.next + 1) % this.slots.length;
  }

  delete(socket: S): void {
    for (const slot of this.slots) if (slot.delete(socket)) return;
  }

  stop(): void {
    clearInterval(this.timer);
  }

  private run(): void {
    const slot = this.slots[this.tick]!;
    this.tick = (this.tick + 1) % this.slots.length;
    for (const socket of slot) {
      if (!socket.alive) {
        socket.ws.terminate();
        continue;
      }
      socket.alive = false;
      if (socket.isOpen) socket.ws.ping();
    }
  }
}
