/**
 * A user-space TCP proxy that delays every chunk by a fixed one-way latency
 * in each direction and counts the bytes it carries. This machine has no
 * netem (no qdisc modules), so WAN latency is emulated here. The TCP
 * handshake to the proxy itself is not delayed; the upstream connect is made
 * after `delayMs`, so a fresh connection still costs its round trip.
 */
import { createServer, connect, type Server, type Socket } from 'node:net';

export interface DelayProxy {
  port: number;
  /** Bytes carried client→upstream and upstream→client since start or reset. */
  stats: { up: number; down: number; connections: number };
  reset(): void;
  close(): Promise<void>;
}

export async function startDelayProxy(upstreamPort: number, delayMs: number, upstreamHost = '127.0.0.1'): Promise<DelayProxy> {
  const stats = { up: 0, down: 0, connections: 0 };
  const sockets = new Set<Socket>();
  const later = (fn: () => void) => (delayMs > 0 ? setTimeout(fn, delayMs) : fn());
  const server: Server = createServer((client) => {
    stats.connections++;
    client.setNoDelay(true);
    sockets.add(client);
    let upstream: Socket | null = null;
    const queued: Buffer[] = [];
    later(() => {
      upstream = connect(upstreamPort, upstreamHost);
      upstream.setNoDelay(true);
      sockets.add(upstream);
      for (const q of queued) upstream.write(q);
      queued.length = 0;
      upstream.on('data', (d) => {
        stats.down += d.byteLength;
        later(() => {
          if (client.writable) client.write(d);
        });
      });
      upstream.on('close', () => later(() => client.destroy()));
      upstream.on('error', () => client.destroy());
    });
    client.on('data', (d) => {
      stats.up += d.byteLength;
      later(() => {
        if (!upstream) queued.push(d);
        else if (upstream.writable) upstream.write(d);
      });
    });
    client.on('close', () => later(() => upstream?.destroy()));
    client.on('error', () => upstream?.destroy());
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const addr = server.address();
  return {
    port: typeof addr === 'object' && addr ? addr.port : 0,
    stats,
    reset() {
      stats.up = 0;
      stats.down = 0;
      stats.connections = 0;
    },
    close() {
      for (const s of sockets) s.destroy();
      return new Promise((resolve) => server.close(() => resolve()));
    },
  };
}
