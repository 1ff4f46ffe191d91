/**
 * What the WAN benches share (bench/wan.ts: Node nodes, bench/wan-browser.ts:
 * browser pages): a relay process behind one delaying proxy, so every
 * node → relay → node leg costs the one-way delay, and small helpers.
 */
import { createServer } from 'node:net';
import { startRelayProcess, type RelayProcess } from '../../test/helpers/relay-process.ts';
import { startDelayProxy, type DelayProxy } from './delay-proxy.ts';

export const median = (xs: number[]): number => {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2;
};

export async function freePort(): Promise<number> {
  const srv = createServer();
  await new Promise<void>((r) => srv.listen(0, '127.0.0.1', r));
  const port = (srv.address() as { port: number }).port;
  await new Promise<void>((r) => srv.close(() => r()));
  return port;
}

export interface DelayedRelay {
  relay: RelayProcess;
  proxy: DelayProxy;
  /** What nodes connect to (the proxy); the relay gives it as every peer's relay_addr. */
  url: string;
  stop(): Promise<void>;
}

/**
 * A relay process whose nodes reach it through a proxy holding each chunk
 * oneWayMs / 2 each way: a leg node → relay → node crosses it twice, so it
 * costs oneWayMs one-way. `--public-url` makes the relay hand out the
 * proxy's address, so legs to a relay address (the chain's last hop → head)
 * are delayed too. Whoever talks to `relay.url` directly (a tracker) is not.
 */
export async function startDelayedRelay(oneWayMs: number): Promise<DelayedRelay> {
  const port = await freePort();
  const proxy = await startDelayProxy(port, oneWayMs / 2);
  const url = `ws://127.0.0.1:${proxy.port}`;
  let relay: RelayProcess;
  try {
    relay = await startRelayProcess(['--port', String(port), '--public-url', url]);
  } catch (e) {
    await proxy.close();
    throw e;
  }
  return {
    relay,
    proxy,
    url,
    async stop() {
      await relay.stop();
      await proxy.close();
    },
  };
}
