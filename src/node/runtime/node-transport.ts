/**
 * The node's one HopTransport: how its hops reach other nodes. The relay's
 * fast path (and `/rpc` at a hop's relay) when the node has a relay, links
 * where the host dials them, data channels where they are on, and direct
 * HTTP (or the host's own direct requests); `hopOrder` picks among them.
 *
 * The relay is asked for at each hop, never kept: a node given several
 * relays fails over between them, and the runtime replaces its client
 * after an error.
 */
import type { LinkDialer } from '../../net/contract.ts';
import { HopTransport } from '../../net/hop-transport.ts';
import type { RelayClient } from '../../net/relay-client.ts';
import { RpcConnection } from '../../net/relay-hop.ts';
import type { RouteProof } from '../../net/rtc-signal.ts';
import type { RuntimeConfig } from './config.ts';
import type { DataChannels } from './data-channels.ts';
import type { RuntimeHost } from './host.ts';

export interface NodeTransportDeps {
  host: RuntimeHost;
  config: Pick<RuntimeConfig, 'relayUrl' | 'hopOrder'>;
  /** The relay connection now, if any. */
  relay: () => RelayClient | undefined;
  links: LinkDialer | undefined;
  channels: DataChannels;
}

export function createNodeTransport({ host, config, relay, links, channels }: NodeTransportDeps): HopTransport {
  const relayFast = config.relayUrl
    ? {
        // The relay it is registered at now (a node given several fails over between them).
        relayUrl: () => relay()?.relayUrl ?? config.relayUrl!,
        cluster: () => relay()?.cluster === true,
        isRegistered: () => relay()?.state === 'registered',
        request: (...a: Parameters<RelayClient['request']>) => relay()!.request(...a),
        push: (...a: Parameters<RelayClient['push']>) => relay()?.push(...a),
        outageLeftMs: () => relay()?.outageLeftMs() ?? 0,
        outageWindowLeftMs: () => relay()?.outageWindowLeftMs() ?? 0,
      }
    : undefined;
  return new HopTransport({
    ...(relayFast
      ? {
          fast: {
            get relayUrl() {
              return relayFast.relayUrl();
            },
            get cluster() {
              return relayFast.cluster();
            },
            get isRegistered() {
              return relayFast.isRegistered();
            },
            request: relayFast.request,
            push: relayFast.push,
            outageLeftMs: relayFast.outageLeftMs,
            outageWindowLeftMs: relayFast.outageWindowLeftMs,
          },
          rpc: (addr: string) => new RpcConnection(addr, { WebSocket: host.WebSocket, ...(host.watchHandshake ? { watchHandshake: host.watchHandshake } : {}) }),
        }
      : {}),
    ...(links ? { link: (endpoint: string, peerId: string) => links.requester(endpoint, peerId) } : {}),
    ...(channels.enabled ? { rtc: (peerId: string, proof?: RouteProof) => channels.requester(peerId, proof) } : {}),
    ...(host.direct ? { direct: host.direct } : { fetch: host.fetch }),
    ...(config.hopOrder ? { order: config.hopOrder } : {}),
    onLog: (m) => host.log('warn', m),
  });
}
