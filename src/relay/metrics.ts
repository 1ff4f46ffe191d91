import { Counter, Gauge, Histogram, Registry } from 'prom-client';

/** Relay metrics on a registry of its own, so several relays can share a process (tests). */
/**
 * Hot-path tallies are plain numbers the data path bumps; prom-client reads
 * them at scrape time (`collect`), so a hop pays an addition, not a labelled
 * counter update.
 */
export interface HotCounters {
  bytesIn: number;
  bytesOut: number;
  hops: { fast: number; rpc: number; envelope: number };
  /** Of the fast-path hops, one-way requests (no stream, no answer). */
  oneWay: number;
  /** Messages the relay sent on to a peer or an /rpc caller: requests, answers, errors (what wakes a receiver). */
  messages: number;
  /** Requests in flight now; the server installs the real getter. */
  inFlight: () => number;
  /** Peer watches held now (PeerWatch installs the real getter): of peers attached here, and of peers not attached here yet. */
  watches: () => { attached: number; pending: number };
  /** Requests that crossed to (out) or came from (in) another relay of the cluster. */
  cluster: { in: number; out: number };
}

export function createRelayMetrics() {
  const registry = new Registry();
  const hot: HotCounters = { bytesIn: 0, bytesOut: 0, hops: { fast: 0, rpc: 0, envelope: 0 }, oneWay: 0, messages: 0, inFlight: () => 0, watches: () => ({ attached: 0, pending: 0 }), cluster: { in: 0, out: 0 } };
  const reported = { bytesIn: 0, bytesOut: 0, hops: { fast: 0, rpc: 0, envelope: 0 }, oneWay: 0, messages: 0, cluster: { in: 0, out: 0 } };
  const peers = new Gauge({ name: 'meshnet_relay_peers', help: 'Registered peers', registers: [registry] });
  const inFlight = new Gauge({
    name: 'meshnet_relay_in_flight',
    help: 'Requests awaiting their final answer frame',
    registers: [registry],
    collect() {
      this.set(hot.inFlight());
    },
  });
  const peerWatches = new Gauge({
    name: 'meshnet_relay_peer_watches',
    help: 'Peer watches held: of peers attached here (peer-gone to come), of peers not attached here (pending: attached to come, peer-back)',
    labelNames: ['state'] as const,
    registers: [registry],
    collect() {
      const w = hot.watches();
      this.set({ state: 'attached' }, w.attached);
      this.set({ state: 'pending' }, w.pending);
    },
  });
  const watchAsks = new Counter({ name: 'meshnet_relay_watch_peer_total', help: 'watch-peer messages received (a node of an older build asks again after every heartbeat while its tracker is not attached here)', registers: [registry] });
  const hops = new Counter({
    name: 'meshnet_relay_hops_total',
    help: 'Requests forwarded to a peer, by path',
    labelNames: ['path'] as const,
    registers: [registry],
    collect() {
      for (const path of ['fast', 'rpc', 'envelope'] as const) {
        this.inc({ path }, hot.hops[path] - reported.hops[path]);
        reported.hops[path] = hot.hops[path];
      }
    },
  });
  const bytes = new Counter({
    name: 'meshnet_relay_bytes_total',
    help: 'Bytes forwarded, by direction',
    labelNames: ['direction'] as const,
    registers: [registry],
    collect() {
      this.inc({ direction: 'in' }, hot.bytesIn - reported.bytesIn);
      this.inc({ direction: 'out' }, hot.bytesOut - reported.bytesOut);
      reported.bytesIn = hot.bytesIn;
      reported.bytesOut = hot.bytesOut;
    },
  });
  const messages = new Counter({
    name: 'meshnet_relay_messages_total',
    help: 'Messages forwarded or produced towards peers (requests, answers, errors), and of the requests the one-way ones',
    labelNames: ['kind'] as const,
    registers: [registry],
    collect() {
      this.inc({ kind: 'all' }, hot.messages - reported.messages);
      this.inc({ kind: 'one_way' }, hot.oneWay - reported.oneWay);
      reported.messages = hot.messages;
      reported.oneWay = hot.oneWay;
    },
  });
  const cluster = new Counter({
    name: 'meshnet_relay_cluster_requests_total',
    help: 'Requests that crossed to another relay of the cluster (out) or came from one (in)',
    labelNames: ['direction'] as const,
    registers: [registry],
    collect() {
      for (const d of ['in', 'out'] as const) {
        this.inc({ direction: d }, hot.cluster[d] - reported.cluster[d]);
        reported.cluster[d] = hot.cluster[d];
      }
    },
  });
  const clusterDropped = new Counter({ name: 'meshnet_relay_cluster_dropped_total', help: 'Malformed messages from the cluster (other relays, NATS) dropped, by kind', labelNames: ['kind'] as const, registers: [registry] });
  const clusterLinks = new Gauge({ name: 'meshnet_relay_cluster_links', help: 'Open links to other relays of the cluster', registers: [registry] });
  const beats = new Counter({ name: 'meshnet_relay_beats_batched_total', help: 'Heartbeats queued for a tracker in a batch (beat-batch)', registers: [registry] });
  const beatBatches = new Counter({ name: 'meshnet_relay_beat_batches_total', help: 'Batches of heartbeats sent to trackers (beats_batched / this = beats per batch)', registers: [registry] });
  const errors = new Counter({ name: 'meshnet_relay_errors_total', help: 'Error answers the relay itself produced, by code', labelNames: ['code'] as const, registers: [registry] });
  const latency = new Histogram({
    name: 'meshnet_relay_hop_seconds',
    help: 'Time from forwarding a request to forwarding its final answer frame',
    labelNames: ['path'] as const,
    buckets: [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30],
    registers: [registry],
  });
  return { registry, hot, peers, inFlight, peerWatches, watchAsks, hops, messages, bytes, errors, latency, cluster, clusterDropped, clusterLinks, beats, beatBatches };
}
export type RelayMetrics = ReturnType<typeof createRelayMetrics>;
