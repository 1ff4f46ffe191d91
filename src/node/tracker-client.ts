/**
 * A node's side of the tracker API (src/protocol/tracker.ts): signed
 * registration and heartbeats, and the head's signed request for a
 * replacement span. Every body is `{body, signature}` with the node's relay
 * identity signing canonicalJson(body), so nobody can speak for another node;
 * replacement routes come back signed by the tracker and are checked here,
 * so a head sends activations only where the tracker said.
 *
 * Beside it: relay-beats.ts (a heartbeat over the relay, batched or as a
 * request, before the signed HTTP one), tracker-trust.ts (which tracker keys
 * routes are taken from), signed-routes.ts (checking a route's signature).
 * Host-agnostic: `fetch` is injected.
 */
import { encodeBase64Url } from '../protocol/base64.ts';
import { MeshError, remoteError } from '../protocol/errors.ts';
import {
  canonicalJson,
  registerAnswerSchema,
  replaceAnswerSchema,
  assignmentSchema,
  trackerKeySchema,
  type NodeMessage,
  type RegisterAnswer,
  type ReplaceRequest,
  type ReplaceAnswer,
  type RouteHop,
  type Assignment,
} from '../protocol/tracker.ts';
import type { Identity } from '../net/identity.ts';
import { z } from 'zod';
import { BeatBaseline } from './beat-baseline.ts';
import { RelayBeats, type BeatCounts, type NoBatchReason, type TrackerRelay } from './relay-beats.ts';
import { NotRegisteredError, TrackerUnreachableError, WatchUnsupportedError } from './tracker-errors.ts';
import { verifySignedRoute } from './signed-routes.ts';
import { TrackerTrust } from './tracker-trust.ts';

// Their homes now; callers import them from here as before.
export type { BeatCounts, NoBatchReason, TrackerRelay } from './relay-beats.ts';
export { verifyChainReply, verifySignedRoute, VerifiedRoutes, type VerifiedRoute } from './signed-routes.ts';
export { signedByAny, TrackerTrust, type TrackerKeys } from './tracker-trust.ts';
export { NotRegisteredError, TrackerUnreachableError, WatchUnsupportedError } from './tracker-errors.ts';

export interface TrackerClientInit {
  /** Base URL, e.g. http://127.0.0.1:8080 */
  trackerUrl: string;
  fetch: typeof fetch;
  identity: Identity;
  /**
   * The node's relay connection: once a tracker has answered (it names its
   * peer id), heartbeats go to it over this socket, unsigned, and fall back
   * to the signed HTTP request when that fails.
   */
  relay?: TrackerRelay;
  /**
   * The cluster operator's key (base64url): routes are taken only from
   * trackers whose keys it certified. Absent: pinned from the first answer
   * that carries a certificate; a tracker alone (no certificates) is trusted
   * as the tracker URL says.
   */
  operatorKey?: string;
  /** Per request. @defaultValue 10000 */
  requestTimeoutMs?: number;
  /** How long a head keeps asking for a replacement span while the tracker answers 503 (no node covers it yet). @defaultValue 30000 */
  replaceDeadlineMs?: number;
  /** The tracker's list of quarantined nodes, with each register and heartbeat answer that carries one (docs/verification.md). */
  onDistrust?: (list: ReadonlyArray<{ peer_id: string; until: number }>) => void;
  /** Jitter source in [0, 1); tests pin it. */
  random?: () => number;
}

/** Answer to a heartbeat: a new assignment when the tracker moved the node, else nothing new. Unknown fields are ignored. */
const heartbeatAnswerSchema = z
  .object({
    assignment: assignmentSchema.nullable().optional(),
    heartbeat_interval_ms: z.number().int().positive().optional(),
    tracker_public_key: z.string().optional(),
    distrust: z.array(z.object({ peer_id: z.string(), until: z.number() })).max(10_000).optional(),
    takes_same: z.boolean().optional(),
    tracker_peer_id: z.string().regex(/^[0-9a-f]{32}$/).optional(),
    tracker_keys: z.array(trackerKeySchema).max(64).optional(),
  })
  .loose();
const trackerInfoSchema = z.object({ models: z.array(z.string()) }).loose();

/** `takesSame`: the tracker takes beats that leave out what it has (`same`). */
export type HeartbeatAnswer = { assignment?: Assignment | null; heartbeatIntervalMs?: number; takesSame?: boolean };

/** Longest pause between two asks for a replacement while the tracker has none, ms. */
const REPLACE_POLL_MAX_MS = 500;

/**
 * How a watch ended (TrackerClient.watch): `ended` the HTTP stream ended (the
 * tracker went away, or the signal aborted); `gone` the relay said the
 * tracker's peer detached; `unreachable` a beat or registration found the
 * tracker unreachable while the relay held the watch for it not attached
 * there (`peer-back`: no `peer-gone` can come then); `rearm` nothing is known
 * (not watching now: the last beat did not go over the relay, the relay
 * connection dropped, the tracker is not on this relay of an older build,
 * another tracker was named, the node registered again, an answer named the
 * tracker's peer while the HTTP stream was held for want of it): watch again
 * after the next beat tells.
 */
export type WatchEnd = 'ended' | 'gone' | 'unreachable' | 'rearm';

/** A watch of the tracker over the relay, while it waits: what the relay said of the tracker (`absent`: not attached there, and it holds the watch: `peer-back`). */
interface RelayWatch {
  peer: string;
  said: 'asked' | 'attached' | 'absent';
  stop: AbortController;
  /** Why the client stopped it (not the caller's signal). */
  why?: 'rearm' | 'unreachable';
}

const utf8 = new TextEncoder();

export async function signBody<T>(identity: Identity, body: T): Promise<{ body: T; signature: string }> {
  const sig = await identity.sign(utf8.encode(canonicalJson(body)));
  return { body, signature: encodeBase64Url(sig) };
}

/** A replacement span, and (when the tracker signed one) the head's whole route with it in place, for chained hops. */
export interface Replacement {
  hops: RouteHop[];
  chain?: { hops: RouteHop[]; signed: { text: string; expires: number; signature: string; reply?: { text: string; signature: string } } };
}

export class TrackerClient {
  private readonly base: string;
  private readonly timeoutMs: number;
  private readonly replaceDeadlineMs: number;
  /** The tracker keys routes are taken from (the answering tracker's, its cluster's). */
  readonly trust: TrackerTrust;
  /** The peer id of the tracker that answered last: heartbeats go to it over the relay. */
  private trackerPeer: string | undefined;
  /** Heartbeats by the way they went (BeatCounts). */
  readonly beats: BeatCounts = { relay: 0, http: 0, batched: 0, skipped: 0 };
  /** Heartbeats over the relay, batched or as requests, and what the relay said of batching. */
  private readonly relayBeats: RelayBeats<HeartbeatAnswer>;
  /** The watch of the tracker over the relay in progress (watch()). */
  private relayWatch: RelayWatch | undefined;
  /** Ends the HTTP watch held only because no answer had named the tracker's peer yet (watch()). */
  private httpUntilPeer: AbortController | undefined;
  /** What the tracker acknowledged of this node's fields: heartbeats leave out what is unchanged (`same`, beat-baseline.ts). */
  private readonly baseline = new BeatBaseline();

  constructor(private readonly init: TrackerClientInit) {
    this.base = init.trackerUrl.replace(/\/+$/, '');
    this.timeoutMs = init.requestTimeoutMs ?? 10_000;
    this.replaceDeadlineMs = init.replaceDeadlineMs ?? 30_000;
    this.trust = new TrackerTrust(init.operatorKey);
    this.relayBeats = new RelayBeats(init.relay, { timeoutMs: this.timeoutMs, random: init.random ?? Math.random, counts: this.beats, answer: (status, json) => this.relayBeatAnswer(status, json) });
  }

  /** The peer id of the tracker that answered last: heartbeats go to it over the relay. */
  get trackerPeerId(): string | undefined {
    return this.trackerPeer;
  }

  private setTrackerPeer(id: string | undefined): void {
    // Another tracker: what the relay said of the last one is not news of this one (and a held watch is of the wrong peer).
    if (id !== this.trackerPeer) {
      this.relayBeats.forget();
      this.baseline.reset();
      this.endHeldWatch('rearm');
    }
    this.trackerPeer = id;
    // Now the relay can watch the tracker: the HTTP stream held meanwhile gives way to it.
    if (id !== undefined) this.httpUntilPeer?.abort();
  }

  /**
   * The relay holds the watch of a tracker not attached to it (`peer-back`):
   * it will say when the tracker attaches there, but nothing of it elsewhere.
   * End it on what it cannot tell: the tracker unreachable (a beat refused),
   * another tracker, a registration again (the slow safety re-ask).
   */
  private endHeldWatch(why: 'rearm' | 'unreachable'): void {
    const w = this.relayWatch;
    if (w?.said !== 'absent') return;
    w.why = why;
    w.stop.abort();
  }

  /** Why beats to the current tracker skip the batched try now (docs/protocol.md §9.1), or undefined: they try it. */
  get noBatchNow(): NoBatchReason | undefined {
    return this.relayBeats.reason(this.trackerPeer);
  }

  /** The keys a route must be signed with (one of them); undefined before any tracker answered. */
  get trackerKey(): readonly Uint8Array[] | undefined {
    const k = this.trust.current;
    return k.length > 0 ? k : undefined;
  }

  /** Take routes from this key alone (a configured tracker key). */
  set trackerKey(key: Uint8Array | undefined) {
    this.trust.only(key);
  }

  /** `beat`: a heartbeat or registration, whose finding the tracker unreachable ends a watch the relay holds for it. */
  private async post(path: string, payload: unknown, signal?: AbortSignal, beat = false): Promise<{ status: number; json: unknown }> {
    const signals = [AbortSignal.timeout(this.timeoutMs), ...(signal ? [signal] : [])];
    let res: Response;
    try {
      res = await this.init.fetch(this.base + path, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify(payload),
        signal: signals.length === 1 ? signals[0]! : AbortSignal.any(signals),
      });
    } catch (e) {
      if (signal?.aborted) throw new MeshError('MESH_ERR_CANCELLED', `${path} cancelled`);
      const why = `tracker ${this.base} unreachable for ${path}: ${(e as { cause?: { code?: string } }).cause?.code ?? (e as Error).message}`;
      // A timeout is a tracker that is slow (behind), not gone.
      if ((e as Error).name === 'TimeoutError' || signals[0]!.aborted) throw new MeshError('MESH_ERR_UNAVAILABLE', why);
      if (beat) this.endHeldWatch('unreachable');
      throw new TrackerUnreachableError(why);
    }
    const text = await res.text();
    let json: unknown = undefined;
    try {
      json = text ? JSON.parse(text) : undefined;
    } catch {
      // non-JSON answers are reported by status below
    }
    return { status: res.status, json };
  }

  private fail(path: string, status: number, json: unknown): never {
    throw remoteError(status, json, `tracker ${path}`);
  }

  /** The models the tracker serves (GET /api/tracker). */
  async models(): Promise<string[]> {
    const url = `${this.base}/api/tracker`;
    let res: Response;
    try {
      res = await this.init.fetch(url, { signal: AbortSignal.timeout(this.timeoutMs) });
    } catch (e) {
      throw new MeshError('MESH_ERR_UNAVAILABLE', `cannot reach the tracker at ${url}: ${(e as Error).message}`);
    }
    const p = trackerInfoSchema.safeParse(await res.json().catch(() => undefined));
    if (!res.ok || !p.success) throw new MeshError('MESH_ERR_UNAVAILABLE', `the tracker at ${url} answered no model list (HTTP ${res.status})`);
    return p.data.models;
  }

  async register(msg: NodeMessage): Promise<RegisterAnswer> {
    this.baseline.reset();
    const { status, json } = await this.post('/api/nodes/register', await signBody(this.init.identity, msg), undefined, true);
    if (status !== 200 && status !== 201) this.fail('/api/nodes/register', status, json);
    const p = registerAnswerSchema.safeParse(json);
    if (!p.success) throw new MeshError('MESH_ERR_UPSTREAM', `tracker register answer: ${p.error.issues[0]!.path.join('.')}: ${p.error.issues[0]!.message}`);
    await this.trust.absorb(p.data.tracker_public_key, p.data.tracker_keys);
    this.setTrackerPeer(p.data.tracker_peer_id);
    if (p.data.distrust) this.init.onDistrust?.(p.data.distrust);
    // Registered again (the tracker forgot this node): a held watch is asked again after the next beat.
    this.endHeldWatch('rearm');
    return p.data;
  }

  /** A heartbeat signed now, to be sent later as it is (a page's beacon): the URL and the JSON body. */
  async signedHeartbeat(msg: NodeMessage): Promise<{ url: string; body: string }> {
    return { url: `${this.base}/api/nodes/heartbeat`, body: JSON.stringify(await signBody(this.init.identity, msg)) };
  }

  /** A planned check this head could not run (src/verify/evidence.ts SkippedCheck), signed. */
  async reportSkipped(skipped: unknown): Promise<unknown> {
    const { status, json } = await this.post('/api/checks/skipped', await signBody(this.init.identity, skipped));
    if (status !== 200) this.fail('/api/checks/skipped', status, json);
    return json;
  }

  /** A check's evidence (src/verify/evidence.ts), signed by this head: the tracker's verdict, and who is distrusted now. */
  async reportCheck(report: unknown): Promise<unknown> {
    const { status, json } = await this.post('/api/checks/report', await signBody(this.init.identity, report));
    if (status !== 200) this.fail('/api/checks/report', status, json);
    const distrust = (json as { distrust?: Array<{ peer_id: string; until: number }> } | undefined)?.distrust;
    if (Array.isArray(distrust)) this.init.onDistrust?.(distrust);
    return json;
  }

  /**
   * Throws NotRegisteredError on 404 (the tracker restarted and forgot us).
   * Over the relay socket when a tracker named its peer id and the relay is
   * up (unsigned: the relay vouches for us); else, or when that fails, the
   * signed HTTP request.
   */
  async heartbeat(msg: NodeMessage): Promise<HeartbeatAnswer> {
    // The relay holds the watch of this tracker, not attached to it (peer-back): it is still not, or the relay would
    // have said. Renewed at each beat, as each watch asked again and answered "not attached" renewed it on an older relay.
    const w = this.relayWatch;
    if (w?.said === 'absent' && w.peer === this.trackerPeer) this.relayBeats.absent(w.peer);
    const peer = this.trackerPeer;
    const on = this.init.relay?.currentRegistration;
    if (this.relayBeats.tries(peer)) {
      const beat = this.baseline.delta(`relay:${peer}`, on, msg);
      const overRelay = await this.baseline.settle(beat, this.relayBeats.send(peer, beat.body), (a) => a && a.takesSame === true);
      if (overRelay) return overRelay;
    }
    this.beats.http++;
    const beat = this.baseline.delta(`http:${this.base}`, on, msg);
    const { status, json } = await this.baseline.settle(beat, this.post('/api/nodes/heartbeat', await signBody(this.init.identity, beat.body), undefined, true), (r) => r.status === 200 && (r.json as { takes_same?: unknown } | undefined)?.takes_same === true);
    if (status === 404) throw new NotRegisteredError();
    if (status !== 200) this.fail('/api/nodes/heartbeat', status, json);
    return this.beatAnswer(json);
  }

  /** A relay beat's answer (batched or not): the tracker's own 404 means register again; anything but 200 falls back. */
  private async relayBeatAnswer(status: number, json: unknown): Promise<HeartbeatAnswer | undefined> {
    // The tracker's own 404 (it forgot us), not the relay's (no such peer: that tracker is gone).
    if (status === 404 && (json as { error?: { code?: string } })?.error?.code === 'MESH_ERR_NOT_FOUND') throw new NotRegisteredError();
    if (status !== 200) return undefined;
    this.beats.relay++;
    return this.beatAnswer(json);
  }

  private async beatAnswer(json: unknown): Promise<HeartbeatAnswer> {
    const p = heartbeatAnswerSchema.safeParse(json ?? {});
    if (!p.success) return {};
    if (p.data.tracker_public_key) await this.trust.absorb(p.data.tracker_public_key, p.data.tracker_keys);
    if (p.data.tracker_peer_id) this.setTrackerPeer(p.data.tracker_peer_id);
    if (p.data.distrust) this.init.onDistrust?.(p.data.distrust);
    const out: HeartbeatAnswer = {};
    if (p.data.assignment !== undefined) out.assignment = p.data.assignment;
    if (p.data.heartbeat_interval_ms !== undefined) out.heartbeatIntervalMs = p.data.heartbeat_interval_ms;
    if (p.data.takes_same === true) out.takesSame = true;
    return out;
  }

  /**
   * Watch for the tracker going away. A node with a relay that has
   * `peer-watch` asks that relay to say when the tracker's peer (the one its
   * beats go to) detaches, and holds no connection to the tracker: `gone`
   * when it did, `rearm` when no such news can come now (the tracker is not
   * attached to a relay without `peer-back`, the relay connection dropped:
   * see WatchEnd). A relay with `peer-back` holds the watch of a tracker not
   * attached to it and says when it attaches: the watch waits for that (no
   * asking again after each beat), then for `peer-gone`; meanwhile a beat
   * that finds the tracker unreachable ends it `unreachable`.
   * Otherwise (no relay, a relay without `peer-watch`, a tracker with no
   * peer id) the HTTP stream, as httpWatch().
   */
  async watch(signal: AbortSignal): Promise<WatchEnd> {
    const relay = this.init.relay;
    const peer = this.trackerPeerId;
    if (relay?.watchPeer !== undefined && relay.state !== 'none' && peer !== undefined) {
      const w: RelayWatch = { peer, said: 'asked', stop: new AbortController() };
      const onAbort = (): void => w.stop.abort();
      signal.addEventListener('abort', onAbort, { once: true });
      if (signal.aborted) w.stop.abort();
      this.relayWatch = w;
      let end;
      try {
        // The relay's answers say whether the tracker is attached to it, so whether its beats may go batched.
        end = await relay.watchPeer(
          peer,
          w.stop.signal,
          () => {
            w.said = 'attached';
            this.relayBeats.attached(peer);
          },
          () => {
            w.said = 'absent';
            this.relayBeats.absent(peer);
            // Another tracker was named while the relay had not answered yet: not this watch's peer any more.
            if (this.trackerPeer !== peer) this.endHeldWatch('rearm');
          },
        );
      } finally {
        signal.removeEventListener('abort', onAbort);
        if (this.relayWatch === w) this.relayWatch = undefined;
      }
      if (end === 'absent') this.relayBeats.absent(peer);
      if (end === 'gone') return 'gone';
      if (end === 'cancelled') return signal.aborted ? 'ended' : (w.why ?? 'rearm');
      if (end !== 'unsupported' || relay.state !== 'registered') return 'rearm';
      // A relay without peer-watch: the HTTP stream, as before.
    } else if (relay?.watchPeer !== undefined && relay.state !== 'none' && peer === undefined) {
      // No answer has named the tracker's peer yet (the first registration failed: refused while the tracker sheds load,
      // unreachable): the HTTP stream meanwhile, and the relay's watch as soon as an answer names it. Held on, such
      // streams outlived the crowd that made them: each costs the tracker a write every 20 s, and at 10,000 donors
      // over a shedding start they were half its beats' write syscalls (docs/benchmarks.md, session 9).
      const stop = new AbortController();
      const onAbort = (): void => stop.abort();
      signal.addEventListener('abort', onAbort, { once: true });
      if (signal.aborted) stop.abort();
      this.httpUntilPeer = stop;
      try {
        await this.httpWatch(stop.signal);
      } finally {
        signal.removeEventListener('abort', onAbort);
        if (this.httpUntilPeer === stop) this.httpUntilPeer = undefined;
      }
      return stop.signal.aborted && !signal.aborted ? 'rearm' : 'ended';
    }
    await this.httpWatch(signal);
    return 'ended';
  }

  /**
   * Hold `GET /api/nodes/watch` open: resolves when the stream ends (the
   * tracker went away, or `signal` aborted), rejects when it cannot be
   * opened (unreachable), and with WatchUnsupportedError when the tracker
   * has no such route (an older one: heartbeats alone tell then).
   */
  async httpWatch(signal: AbortSignal): Promise<void> {
    let res: Response;
    try {
      res = await this.init.fetch(`${this.base}/api/nodes/watch`, { headers: { accept: 'text/event-stream' }, signal });
    } catch (e) {
      if (signal.aborted) return;
      throw new MeshError('MESH_ERR_UNAVAILABLE', `tracker ${this.base} unreachable for its watch: ${(e as { cause?: { code?: string } }).cause?.code ?? (e as Error).message}`);
    }
    if (res.status === 404 || res.status === 405) {
      await res.body?.cancel().catch(() => undefined);
      throw new WatchUnsupportedError();
    }
    if (!res.ok || !res.body) {
      await res.body?.cancel().catch(() => undefined);
      throw new MeshError('MESH_ERR_UNAVAILABLE', `tracker ${this.base} answered its watch with HTTP ${res.status}`);
    }
    const reader = res.body.getReader();
    const onAbort = (): void => void reader.cancel().catch(() => undefined);
    signal.addEventListener('abort', onAbort, { once: true });
    try {
      for (;;) if ((await reader.read()).done) return;
    } catch {
      // cut: the tracker (or the network to it) went away
    } finally {
      signal.removeEventListener('abort', onAbort);
      reader.releaseLock();
    }
  }

  /** The re-signed whole route of a replace answer, verified like any route; nothing when absent or not valid (the head then stays a star). */
  private async replacedRoute(chain: ReplaceAnswer['chain']): Promise<Pick<Replacement, 'chain'>> {
    if (!chain) return {};
    try {
      const hops = await verifySignedRoute(this.trackerKey, this.init.identity.peerId, chain.route, chain.expires_at, chain.signature, Date.now());
      const reply = chain.reply !== undefined && chain.reply_signature !== undefined ? { reply: { text: chain.reply, signature: chain.reply_signature } } : {};
      return { chain: { hops, signed: { text: chain.route, expires: chain.expires_at, signature: chain.signature, ...reply } } };
    } catch {
      return {};
    }
  }

  /**
   * Ask for hops covering a failed hop's layers. Retries with backoff (100
   * ms doubling to 500) while the tracker answers 503 or names the failed peer
   * again without saying it is reachable (it may not have noticed the
   * failure yet), until the deadline. An answer naming the failed peer with
   * `failed_reachable` is taken: nobody else holds the layers, and it is back.
   */
  async replace(model: string, failed: RouteHop, signal?: AbortSignal, route?: readonly RouteHop[]): Promise<Replacement> {
    const deadline = Date.now() + this.replaceDeadlineMs;
    let delay = 100;
    for (let attempt = 1; ; attempt++) {
      const req: ReplaceRequest = {
        head_peer_id: this.init.identity.peerId,
        failed_peer_id: failed.peer_id,
        start_layer: failed.start_layer,
        end_layer: failed.end_layer,
        model,
        timestamp: Date.now(),
        ...(route ? { route: route.map((h) => ({ peer_id: h.peer_id, start_layer: h.start_layer, end_layer: h.end_layer })) } : {}),
      };
      const { status, json } = await this.post('/api/route/replace', await signBody(this.init.identity, req), signal);
      let retryable = status === 503 || status === 404;
      if (status === 200) {
        const p = replaceAnswerSchema.safeParse(json);
        if (!p.success) throw new MeshError('MESH_ERR_UPSTREAM', `tracker replace answer: ${p.error.issues[0]!.path.join('.')}: ${p.error.issues[0]!.message}`);
        const hops = await verifySignedRoute(this.trackerKey, this.init.identity.peerId, p.data.route, p.data.expires_at, p.data.signature, Date.now());
        // The failed peer again: on purpose when it answered the tracker just now (nobody else holds its layers); else the tracker has not noticed yet.
        if (p.data.failed_reachable === true || !hops.some((h) => h.peer_id === failed.peer_id)) return { hops, ...(await this.replacedRoute(p.data.chain)) };
        retryable = true;
      }
      if (!retryable || Date.now() + delay > deadline) {
        if (status === 200) throw new MeshError('MESH_ERR_UNAVAILABLE', `the tracker keeps routing [${failed.start_layer}, ${failed.end_layer}) through the failed peer ${failed.peer_id}`);
        this.fail('/api/route/replace', status, json);
      }
      await new Promise<void>((resolve, reject) => {
        const t = setTimeout(resolve, delay);
        signal?.addEventListener('abort', () => {
          clearTimeout(t);
          reject(new MeshError('MESH_ERR_CANCELLED', 'cancelled while waiting for a replacement'));
        }, { once: true });
      });
      // Short steps: the failed node itself (or a spare) may be back any moment, and the chat waits for it.
      delay = Math.min(delay * 2, REPLACE_POLL_MAX_MS);
      void attempt;
    }
  }
}
