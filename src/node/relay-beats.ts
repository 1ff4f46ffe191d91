/**
 * A node's heartbeat to its tracker over its relay (docs/protocol.md §9,
 * §9.1): as a `beat` message the relay batches towards the tracker, else as
 * the request `POST /api/nodes/beat`; when neither answers, the tracker
 * client sends it signed over HTTP. Unsigned: the relay vouches for the node.
 *
 * What the relay says of the batched try is remembered for a while, per
 * tracker peer and per registration at the relay: a tracker that takes no
 * batches (an older one), or one not attached to this relay (on another relay
 * of a cluster, or not back after a restart), gets its beats as requests
 * without the try first; the relay's peer-watch of the tracker renews that, or
 * ends it as soon as the tracker attaches (a relay with `peer-back` says so
 * unasked; with an older one the watch is asked again after each beat).
 * Host-agnostic.
 */
import type { MeshError } from '../protocol/errors.ts';
import type { MeshReply } from '../protocol/envelopes.ts';
import type { NodeBeat } from '../protocol/tracker.ts';
import type { OutgoingRequest, RequestOptions } from '../net/contract.ts';
import type { PeerWatchEnd } from '../net/relay-client.ts';
import type { BeatReply } from '../net/beat-calls.ts';

/** The node's relay connection as the tracker client uses it: heartbeats to the tracker's peer over the socket. */
export interface TrackerRelay {
  /** RelayClient's state ('registered' …), or 'none' when the node has no relay. */
  readonly state: string;
  request(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshReply>;
  /**
   * RelayClient.watchPeer: resolves when the relay says the peer detached, or why it will not say; `onAttached` when it
   * says the peer is attached to it; `onAbsent` when it says it is not and holds the watch (`peer-back`: it will say when
   * the peer attaches, and the watch goes on).
   */
  watchPeer?(peerId: string, signal?: AbortSignal, onAttached?: () => void, onAbsent?: () => void): Promise<PeerWatchEnd>;
  /** RelayClient.currentRegistration: a new object at each registration (undefined while not registered); what the relay said is forgotten when it changes. */
  readonly currentRegistration?: object | undefined;
  /** RelayClient.beat: the heartbeat as a `beat` message the relay batches; undefined when the relay does not batch. */
  beat?(peerId: string, body: unknown, timeoutMs: number): Promise<BeatReply> | undefined;
}

/**
 * Heartbeats sent over the relay socket / as signed HTTP requests; of the relay ones, those the relay batched (`beat`
 * messages); `skipped`: beats that went without the batched try, the relay having said it would refuse it.
 */
export interface BeatCounts {
  relay: number;
  http: number;
  batched: number;
  skipped: number;
}

/** After the relay said a tracker takes no batched beats, how long its beats go as requests before trying again, ms. */
const NO_BATCH_RETRY_MS = 60_000;

/**
 * After the relay said the tracker is not attached to it (on another relay of
 * a cluster, or not back after a restart), how long its beats go as requests
 * without the batched try, ms: a random time in [half, whole], so the nodes
 * told at once (a tracker's restart) do not all try again at once. Sooner when
 * the relay's peer-watch says the tracker attached (a relay with `peer-back`
 * says so when it does; with an older one the watch asks again after each beat
 * while it is not), and renewed each time it says it is not (with `peer-back`:
 * at each beat while the relay holds the watch): a bound for a relay
 * connection that gives no such news.
 */
const NOT_ATTACHED_RETRY_MS = 30_000;

/** Why beats to a tracker skip the batched try: the relay said it takes none (an older tracker), or is not attached there. */
export type NoBatchReason = 'unsupported' | 'not-attached';

/** Why beats to a tracker peer skip the batched try for now: what the relay said, on which registration, until when (ms since epoch). */
interface NoBatch {
  peer: string;
  why: NoBatchReason;
  on: object | undefined;
  until: number;
}

export interface RelayBeatsInit<A> {
  /** Per beat, batched or as a request, ms. */
  timeoutMs: number;
  /** Jitter source in [0, 1). */
  random: () => number;
  /** Counted here: `batched`, `skipped` (the caller counts the rest). */
  counts: BeatCounts;
  /** The tracker's answer to a relay beat (batched or not), or undefined to fall back to signed HTTP; may throw (register again). */
  answer: (status: number, json: unknown) => Promise<A | undefined>;
}

const utf8 = new TextEncoder();

export class RelayBeats<A> {
  /** A tracker peer the relay said takes no batched beats (not attached there, or older): its beats skip the batched try meanwhile. */
  private noBatch: NoBatch | undefined;

  constructor(
    private readonly relay: TrackerRelay | undefined,
    private readonly o: RelayBeatsInit<A>,
  ) {}

  /** The beat to tracker `peer` over the relay; undefined when it could not be (no relay, no tracker peer, a relay or tracker error): send it signed. */
  async send(peer: string | undefined, msg: NodeBeat): Promise<A | undefined> {
    const relay = this.relay;
    if (!relay || !peer || !this.tries(peer)) return undefined;
    const batched = await this.batched(relay, peer, msg);
    if (batched !== undefined) return batched === 'timeout' ? undefined : batched;
    let reply: MeshReply;
    try {
      reply = await relay.request(peer, { method: 'POST', path: '/api/nodes/beat', headers: { 'content-type': 'application/json' }, body: utf8.encode(JSON.stringify(msg)) }, { timeoutMs: this.o.timeoutMs });
    } catch {
      return undefined;
    }
    let json: unknown;
    try {
      json = JSON.parse(new TextDecoder().decode(reply.body));
    } catch {
      return undefined;
    }
    return this.o.answer(reply.status, json);
  }

  /** Whether a beat to `peer` goes over the relay now (else straight to signed HTTP). */
  tries(peer: string | undefined): boolean {
    return this.relay !== undefined && peer !== undefined && this.relay.state === 'registered';
  }

  /** Why beats to `peer` skip the batched try now, or undefined: they try it. */
  reason(peer: string | undefined): NoBatchReason | undefined {
    return this.relay !== undefined && peer !== undefined && this.skips(this.relay, peer) ? this.noBatch?.why : undefined;
  }

  /** Another tracker: what the relay said of the last one is not news of this one. */
  forget(): void {
    this.noBatch = undefined;
  }

  /** The relay's peer-watch says `peer` is attached to it: its beats go batched again. */
  attached(peer: string): void {
    if (this.noBatch?.peer === peer && this.noBatch.why === 'not-attached') this.noBatch = undefined;
  }

  /** The relay's peer-watch says `peer` is still not attached to it: renew what a batched beat was told (a relay that batches nothing told none). */
  absent(peer: string): void {
    if (this.relay !== undefined && this.noBatch?.peer === peer && this.noBatch.why === 'not-attached') this.refuses(this.relay, peer, 'not-attached');
  }

  /**
   * The beat as a `beat` message the relay batches (docs/protocol.md §9.1):
   * the answer; 'timeout' when none came in time (the same relay and tracker
   * would be as slow on the request path: straight to HTTP); undefined when
   * it could not go batched (an older relay, a tracker not attached there or
   * not taking batches, a relay error): the request path then, as before.
   */
  private async batched(relay: TrackerRelay, peer: string, msg: NodeBeat): Promise<A | 'timeout' | undefined> {
    if (this.skips(relay, peer)) {
      this.o.counts.skipped++;
      return undefined;
    }
    let reply: BeatReply | undefined;
    try {
      reply = await relay.beat?.(peer, msg, this.o.timeoutMs);
    } catch (e) {
      return (e as MeshError).code === 'MESH_ERR_TIMEOUT' ? 'timeout' : undefined;
    }
    if (reply === undefined) return undefined;
    const error = (reply.body as { error?: { code?: unknown; batch?: unknown } } | null)?.error;
    // The tracker is attached there but takes no batches (an older one), or is not attached there (on another relay of a
    // cluster, or not back yet after a restart): the request path, and for a while without asking first.
    if (error?.code === 'MESH_ERR_NO_SUCH_PEER') {
      this.refuses(relay, peer, error.batch === 'unsupported' ? 'unsupported' : 'not-attached');
      return undefined;
    }
    const answer = await this.o.answer(reply.status, reply.body);
    if (answer !== undefined) this.o.counts.batched++;
    return answer;
  }

  /** The relay said it would refuse `peer`'s batched beats, on the registration in force and within the bound. */
  private skips(relay: TrackerRelay, peer: string): boolean {
    const m = this.noBatch;
    if (m === undefined) return false;
    if (m.peer === peer && m.on === relay.currentRegistration && m.until > Date.now()) return true;
    // Over (the bound passed), or said on another connection (the node's relay reconnected: maybe to another relay).
    this.noBatch = undefined;
    return false;
  }

  /** The relay refuses `peer`'s batched beats (it takes none, or is not attached there): skip the try for a while. */
  private refuses(relay: TrackerRelay, peer: string, why: NoBatchReason): void {
    const ms = why === 'unsupported' ? NO_BATCH_RETRY_MS : NOT_ATTACHED_RETRY_MS * (0.5 + this.o.random() / 2);
    this.noBatch = { peer, why, on: relay.currentRegistration, until: Date.now() + ms };
  }
}
