/**
 * Every NATS subject of a cluster, in one place (docs/protocol.md §4b).
 * All live under `meshnet.<cluster>.`, so several clusters may share one
 * NATS deployment. Relays own `peer.*` and `relay.*`; trackers own `trk.*`
 * and the registry bucket.
 */

/** A cluster name: one NATS subject token. */
export function checkClusterName(name: string): string {
  if (!/^[A-Za-z0-9_-]{1,64}$/.test(name)) throw new TypeError(`cluster name must be 1-64 letters, digits, "-" or "_", got "${name}"`);
  return name;
}

export interface RelaySubjects {
  /** Subscribed by the relay a peer is attached to: frames for the peer, and lookups (an empty request). */
  peer(peerId: string): string;
  /** Answers to the frames a relay sent over NATS, one reply subject per stream (a "no responders" status names its stream). */
  relayStream(relayId: string, streamId: number): string;
  /** Everything `relayStream` makes for one relay. */
  relayStreams(relayId: string): string;
  /** Request: a single-use token to dial that relay's trunk. */
  relayTrunk(relayId: string): string;
  /** Broadcast: a peer registered at a relay (newest wins; caches follow). */
  readonly claim: string;
  /** Broadcast: a relay is alive (every 2 s). */
  readonly relayHello: string;
  /** `relayStream` subjects start with this; the relay id and stream id follow. */
  readonly relayPrefix: string;
}

export function relaySubjects(cluster: string): RelaySubjects {
  const p = `meshnet.${checkClusterName(cluster)}.`;
  return {
    peer: (id) => `${p}peer.${id}`,
    relayStream: (relayId, streamId) => `${p}relay.${relayId}.s.${streamId}`,
    relayStreams: (relayId) => `${p}relay.${relayId}.s.>`,
    relayTrunk: (relayId) => `${p}relay.${relayId}.trunk`,
    claim: `${p}claim`,
    relayHello: `${p}relay.hello`,
    relayPrefix: `${p}relay.`,
  };
}

export interface TrackerSubjects {
  /** Broadcast: the peers a tracker heard from in the last second (and its sign of life). */
  readonly seen: string;
  /** The JetStream KV bucket holding the registry (nodes, routes in flight, trackers, the leader lease). */
  readonly registryBucket: string;
}

export function trackerSubjects(cluster: string): TrackerSubjects {
  const c = checkClusterName(cluster);
  return {
    seen: `meshnet.${c}.trk.seen`,
    // Bucket names allow letters, digits, "-" and "_": the cluster name is one of those already.
    registryBucket: `meshnet_${c}_registry`,
  };
}
