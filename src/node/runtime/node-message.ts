/**
 * What a node tells the tracker about itself, at registration and in every
 * heartbeat: who it is, where it is reached, what it offers, how it does,
 * what it serves (docs/protocol.md). Built afresh from the runtime's facts
 * each time; only the timestamps carry over, each later than the last.
 * The same facts give the node's own fields of GET /info (nodeInfo).
 */
import { encodeBase64Url } from '../../protocol/base64.ts';
import type { NodeMessage, NodeStats } from '../../protocol/tracker.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import type { Identity } from '../../net/identity.ts';
import type { RelayClient } from '../../net/relay-client.ts';
import type { RtcState } from '../../net/rtc-pool.ts';
import { kvHeartbeat } from '../tracker-session.ts';
import { RUNTIME_VERSION, type RuntimeConfig } from './config.ts';
import type { DataChannels, DataChannelsInfo } from './data-channels.ts';
import type { RuntimeHost } from './host.ts';
import type { LoadedSpan } from './span.ts';
import type { NodeActivity } from './stats.ts';

/** Per peer this node sends hops to: the path the last one took, what each path carried, and the data channel's state. */
export type HopPath = ReturnType<HopTransport['paths']>[number] & { rtc?: string };

export function hopPaths(transport: HopTransport, channels: DataChannels): HopPath[] {
  return transport.paths().map((x) => {
    const rtc = channels.state(x.peer_id);
    return rtc ? { ...x, rtc } : x;
  });
}

/** Message timestamps: each later than the last (the tracker applies a node's messages in order). */
export class MessageStamps {
  private last = 0;

  next(): number {
    const timestamp = Math.max(Date.now(), this.last + 1);
    this.last = timestamp;
    return timestamp;
  }
}

export interface NodeMessageFacts {
  identity: Identity;
  host: Pick<RuntimeHost, 'name'>;
  config: Pick<RuntimeConfig, 'backendKind' | 'weightFormat' | 'span' | 'storedSpan'>;
  span: LoadedSpan | undefined;
  relay: RelayClient | undefined;
  endpoint: string | undefined;
  model: string | undefined;
  budget: number;
  /** The donor's duty cycle now. */
  duty: number;
  activity: NodeActivity;
  draining: boolean;
  /** Whether the span's lost device could not be rebuilt (the node answers 503). */
  gaveUp: (span: LoadedSpan) => boolean;
  paths: () => HopPath[];
  sent: HopTransport['sent'];
  stamps: MessageStamps;
}

export function nodeMessage(f: NodeMessageFacts): NodeMessage {
  const s = f.span;
  const kv = s?.executor.kvStats();
  const relayAddr = f.relay?.relayAddr;
  const duty = f.duty;
  const stats = f.activity.heartbeat(kvHeartbeat(kv, f.budget));
  // The cap shows as throughput: a step's time per layer as the tracker should count on it.
  if (duty < 1) stats.layer_ms = Math.round((stats.layer_ms / duty) * 1000) / 1000;
  const stored = f.config.storedSpan;
  const timestamp = f.stamps.next();
  return {
    peer_id: f.identity.peerId,
    public_key: encodeBase64Url(f.identity.publicKey),
    ...(relayAddr ? { relay_addr: relayAddr } : {}),
    ...(f.relay ? { relay_connected: f.relay.isRegistered } : {}),
    ...(f.endpoint ? { endpoint: f.endpoint } : {}),
    info: {
      model: f.model ?? 'default',
      backend: s?.backend.kind ?? f.config.backendKind,
      memory_budget_mb: f.budget / 2 ** 20,
      host: f.host.name,
      version: RUNTIME_VERSION,
      weight_format: s ? (s.backend.weights ?? s.backend.dtype) : (f.config.weightFormat ?? 'f32'),
      ...(f.config.span ? { pinned: true } : {}),
      ...(duty < 1 ? { duty_cycle: duty } : {}),
    },
    stats: { ...stats, ...(s ? { batch_sizes: s.executor.batchStats().sizes } : {}), ...(s?.pipeline ? { speculation: s.pipeline.speculationStats() } : {}), ...pathStats(f.paths(), f.sent) },
    // With a lost device it gave up rebuilding, the node answers 503: tell the tracker it serves nothing, so routes avoid it.
    serving: s && !f.gaveUp(s) ? { start_layer: s.spec.startLayer, end_layer: s.spec.endLayer } : null,
    // Paused, frozen or closing: the span stays announced (and assigned), but no new session comes.
    ...(f.draining ? { draining: true } : {}),
    ...(stored && stored.model === f.model ? { stored: { start_layer: stored.startLayer, end_layer: stored.endLayer } } : {}),
    timestamp,
  };
}

/** What the surfaces counted, for /info: /forward served per surface, chained forwards, the data channels. */
export interface NodeInfoCounts {
  served: Readonly<Record<string, number>>;
  chained: number;
  rtc: DataChannelsInfo | undefined;
}

/** The node's fields of GET /info, after the executor's: who and where it is, the paths its hops take, the span's backend. */
export function nodeInfo(f: NodeMessageFacts, c: NodeInfoCounts, span: LoadedSpan): Record<string, unknown> {
  return {
    peer_id: f.identity.peerId,
    host: f.host.name,
    ...(f.endpoint ? { endpoint: f.endpoint } : {}),
    relay_addr: f.relay?.relayAddr ?? null,
    forwards_served: { ...c.served },
    hops_sent: { ...f.sent },
    paths: f.paths(),
    ...(c.rtc === undefined ? {} : { data_channels: c.rtc }),
    chain_forwards: c.chained,
    draining: f.draining,
    duty_cycle: f.duty,
    // A head's speculative decoding: drafted and accepted tokens, trips and the tokens they gave.
    ...(span.pipeline ? { speculation: span.pipeline.speculationStats() } : {}),
    ...span.backend.details,
  };
}

/** The heartbeat's view of the paths (the dashboard shows which path each hop takes). */
function pathStats(paths: HopPath[], sent: HopTransport['sent']): Pick<NodeStats, 'hops_sent' | 'hop_paths'> {
  if (paths.length === 0) return {};
  const recent = paths.sort((a, b) => a.last_ms_ago - b.last_ms_ago).slice(0, 32);
  return {
    hops_sent: { ...sent },
    hop_paths: recent.map((p) => ({ peer_id: p.peer_id, path: p.path, ...(p.rtc ? { rtc: p.rtc as RtcState } : {}), sent: p.sent })),
  };
}
