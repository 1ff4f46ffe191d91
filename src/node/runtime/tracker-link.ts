/**
 * The node's side of its tracker: joining it (the client, the model when the
 * config names none, the session that registers and heartbeats), what an
 * assignment answer does to the node, and the drain beacon handed to the
 * host. Apart from runtime.ts, which wires the node's parts and owns its
 * state: this module reads and sets only what the runtime hands it.
 */
import { MeshError } from '../../protocol/errors.ts';
import type { Assignment, NodeMessage } from '../../protocol/tracker.ts';
import type { Identity } from '../../net/identity.ts';
import type { RelayClient } from '../../net/relay-client.ts';
import { TrackerClient } from '../tracker-client.ts';
import { TrackerSession } from '../tracker-session.ts';
import type { DistrustSet } from '../verify/head-verify.ts';
import type { RuntimeConfig } from './config.ts';
import type { RuntimeEvent } from './events.ts';
import type { RuntimeHost } from './host.ts';
import { trackerRelay } from './node-relay.ts';
import { baseUrl, type LoadedSpan, type SpanSlot } from './span.ts';

/** What the tracker side reads and sets of the node (NodeRuntime's public face). */
export interface TrackerLinkNode {
  readonly config: RuntimeConfig;
  readonly host: RuntimeHost;
  readonly identity: Identity;
  readonly slot: SpanSlot;
  readonly distrust: DistrustSet;
  readonly memoryBudgetBytes: number;
  readonly error: unknown;
  model: string | undefined;
  assignment: Assignment | null | undefined;
  notice: MeshError | undefined;
  nodeMessage(): NodeMessage;
}

/** The runtime's own calls the tracker side makes. */
export interface TrackerLinkHooks {
  relay(): RelayClient | undefined;
  /** Throws MESH_ERR_CANCELLED when the node was stopped since `epoch`. */
  current(epoch: number): void;
  changed(): void;
  emit(e: RuntimeEvent): void;
  /** A span whose lost device could not be rebuilt (device-recovery.ts). */
  gaveUp(span: LoadedSpan | undefined): boolean;
}

export class TrackerLink {
  tracker: TrackerClient | undefined;
  session: TrackerSession | undefined;
  /** Said once: a static span's wire dtype differs from the tracker's. */
  private warnedWireDtype = false;

  constructor(
    private readonly node: TrackerLinkNode,
    private readonly hooks: TrackerLinkHooks,
  ) {}

  async join(epoch: number): Promise<void> {
    const node = this.node;
    if (this.session) {
      // Still registered (a retry after a span failed): ask for the assignment again.
      node.slot.clearQueue();
      await this.session.beatNow();
      return;
    }
    const trackerUrl = node.config.trackerUrl!;
    const client = new TrackerClient({ trackerUrl, fetch: node.host.fetch, identity: node.identity, relay: trackerRelay(() => this.hooks.relay()), onDistrust: (list) => node.distrust.replace(list), ...(node.config.operatorKey ? { operatorKey: node.config.operatorKey } : {}) });
    if (node.model === undefined) {
      const models = await client.models();
      if (models.length === 0) throw new MeshError('MESH_ERR_UNAVAILABLE', `the tracker at ${trackerUrl} names no model`);
      node.model = models[0]!;
    }
    this.hooks.current(epoch);
    this.tracker = client;
    const session = new TrackerSession({
      client,
      message: () => node.nodeMessage(),
      onRegistered: (ans) => this.hooks.emit({ type: 'registered', assignment: ans.assignment }),
      onAssignment: (a) => this.onAssignment(a),
      onLog: (level, m) => node.host.log(level, m),
      ...(node.config.drainBeacons ? { onDrainBeacon: (b: { url: string; body: string }) => this.handDrainBeacon(b) } : {}),
    });
    this.session = session;
    try {
      await session.start();
    } catch (e) {
      const err = new MeshError('MESH_ERR_UNAVAILABLE', `the tracker at ${trackerUrl} did not accept this node: ${(e as Error).message}`);
      if (!node.config.retryFailedLoads) throw err;
      node.host.log('warn', `${err.message}; trying again every heartbeat`);
    }
  }

  /** The session ends (the node stops, or fails); the client is kept for a retry. */
  close(): void {
    this.session?.close();
    this.session = undefined;
  }

  private handDrainBeacon(b: { url: string; body: string }): Promise<void> | undefined {
    this.hooks.emit({ type: 'drain-beacon', ...b });
    const take = this.node.config.drainBeacons;
    return typeof take === 'function' ? take(b) : undefined;
  }

  private onAssignment(a: Assignment | null): void {
    const node = this.node;
    node.assignment = a;
    if (!a) {
      node.notice = new MeshError('MESH_ERR_UNAVAILABLE', `the tracker assigned no layers: ${formatMib(node.memoryBudgetBytes)} does not hold one layer of ${node.model}`);
      this.hooks.changed();
      return;
    }
    const staticDtype = node.config.span?.wireDtype ?? 'bf16';
    if (node.config.span && a.wire_dtype && a.wire_dtype !== staticDtype && !this.warnedWireDtype) {
      this.warnedWireDtype = true;
      node.host.log('warn', `the tracker's wire dtype for ${a.model} is ${a.wire_dtype}, this static span's is ${staticDtype}: hops will refuse one another's activations (give --wire-dtype ${a.wire_dtype})`);
    }
    // A span that failed is retried only by retry(), not on every heartbeat (unless failed loads are retried); a static span stays.
    if (node.error !== undefined || node.config.span) return;
    // A span whose lost device could not be rebuilt is loaded afresh at each assignment (the same spec would be kept as is).
    void node.slot.assign({ model: a.model, modelUrl: baseUrl(a.model_url), startLayer: a.start_layer, endLayer: a.end_layer, ...(a.wire_dtype ? { wireDtype: a.wire_dtype } : {}) }, this.hooks.gaveUp(node.slot.current));
  }
}

function formatMib(bytes: number): string {
  return `${Math.round((bytes / 2 ** 20) * 10) / 10} MiB`;
}
