/**
 * The node's relay client: registered under the node's identity, with what
 * it tells the relay about itself, and what its connection's comings and
 * goings mean to the node. A connection lost and back is logged once each
 * (not per attempt); back after an outage, or registered at another relay
 * (failover), the tracker is told at once rather than at the next beat.
 * The tracker client's heartbeats ride the same connection while it is up.
 */
import { MeshError } from '../../protocol/errors.ts';
import type { MeshHandler, OutgoingRequest, RequestOptions } from '../../net/contract.ts';
import type { Identity } from '../../net/identity.ts';
import { RelayClient } from '../../net/relay-client.ts';
import type { TrackerRelay } from '../tracker-client.ts';
import { RUNTIME_VERSION } from './config.ts';
import type { RuntimeHost } from './host.ts';

export interface NodeRelayDeps {
  relayUrl: string;
  host: RuntimeHost;
  identity: Identity;
  /** Requests arriving over the relay. */
  handler: MeshHandler;
  model: string | undefined;
  trackerUrl: string | undefined;
  /** Whether this client is still the node's: a replaced one's late events change nothing. */
  isCurrent: (relay: RelayClient) => boolean;
  /** The node's state may have changed (it is derived from the relay's, among others). */
  changed: () => void;
  /** Heartbeat now. */
  beatNow: () => void;
}

/** A relay client, not started yet. */
export function createNodeRelay(d: NodeRelayDeps): RelayClient {
  const { host } = d;
  const relay = new RelayClient({
    relayUrl: d.relayUrl,
    WebSocket: host.WebSocket,
    identity: d.identity,
    handler: d.handler,
    info: { host: host.name, version: RUNTIME_VERSION, ...(d.model ? { model: d.model } : {}), ...(d.trackerUrl ? { tracker: d.trackerUrl } : {}) },
    onLog: (e) => {
      // The connection's comings and goings are logged once each below (state events), not per attempt.
      if (e.event === 'connection') return;
      if (e.level === 'warn' || e.level === 'error') host.log(e.level, `relay: ${e.event}: ${e.message}`);
    },
  });
  let lastAddr: string | undefined;
  relay.on('state', (e) => {
    if (!d.isCurrent(relay)) return;
    // One line per event: the connection lost (not each failed attempt after it), and back.
    if (e.state === 'disconnected' && e.lost) host.log('warn', `relay connection lost (${e.reason ?? 'connection closed'}); reconnecting to ${relay.relayUrl}, requests wait up to ${relay.options.outageBudgetMs} ms`);
    // Back after an outage, or registered at another relay (failover): the tracker learns it now, not at the next beat.
    let beat = false;
    if (e.state === 'registered' && e.outageMs !== undefined) {
      host.log('info', `relay ${relay.relayUrl} back after ${e.outageMs} ms`);
      beat = true;
    }
    d.changed();
    if (e.state === 'registered' && e.relayAddr !== undefined && lastAddr !== undefined && e.relayAddr !== lastAddr) beat = true;
    if (e.state === 'registered') lastAddr = e.relayAddr;
    if (beat) d.beatNow();
  });
  return relay;
}

/** The link the tracker client's heartbeats ride while the relay is up (the relay vouches for the node: no signature, no connection of its own). */
export function trackerRelay(relay: () => RelayClient | undefined): TrackerRelay {
  return {
    get state() {
      return relay()?.state ?? 'none';
    },
    // A new object at each registration (and per client): the tracker client forgets what an earlier connection said.
    get currentRegistration() {
      return relay()?.currentRegistration;
    },
    request: (peer: string, req: OutgoingRequest, opts?: RequestOptions) => relay()?.request(peer, req, opts) ?? Promise.reject(new MeshError('MESH_ERR_UNAVAILABLE', 'no relay')),
    // The relay tells when the tracker's peer detaches (peer-watch), and when it attaches (peer-back): no HTTP watch stream held to the tracker.
    watchPeer: (peer: string, signal?: AbortSignal, onAttached?: () => void, onAbsent?: () => void) => relay()?.watchPeer(peer, signal, onAttached, onAbsent) ?? Promise.resolve('unsupported' as const),
    // The beat as a `beat` message the relay batches towards the tracker (beat-batch); undefined: as a request.
    beat: (peer: string, body: unknown, timeoutMs: number) => relay()?.beat(peer, body, timeoutMs),
  };
}
