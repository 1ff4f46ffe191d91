/**
 * A node's side of the tracker API (src/protocol/tracker.ts): signed
 * registration and heartbeats, and the head's signed request for a
 * replacement span. Every body is `{body, signature}` with the node's relay
 * identity signing canonicalJson(body), so nobody can speak for another node;
 * replacement routes come back signed by the tracker and are checked here,
 * so a head sends activations only where the tracker said.
 *
 * Host-agnostic: `fetch` is injected.
 */
import { decodeBase64 as decodeBase64Url, encodeBase64Url } from '../protocol/base64.ts';
import { MeshError, remoteError } from '../protocol/errors.ts';
import {
  canonicalJson,
  registerAnswerSchema,
  replaceAnswerSchema,
  routeSchema,
  routeSigningMessage,
  chainReplySigningMessage,
  assignmentSchema,
  trackerCertMessage,
  trackerKeySchema,
  type TrackerKey,
  type NodeMessage,
  type RegisterAnswer,
  type ReplaceRequest,
  type ReplaceAnswer,
  type RouteHop,
  type Assignment,
} from '../protocol/tracker.ts';
import { verifyEd25519, type Identity } from '../net/identity.ts';
import type { MeshReply } from '../protocol/envelopes.ts';
import type { OutgoingRequest, RequestOptions } from '../net/contract.ts';
import type { PeerWatchEnd } from '../net/relay-client.ts';
import type { BeatReply } from '../net/beat-calls.ts';
import { z } from 'zod';

/** The node's relay connection as the tracker client uses it: heartbeats to the tracker's peer over the socket. */
export interface TrackerRelay {
  /** RelayClient's state ('registered' …), or 'none' when the node has no relay. */
  readonly state: string;
  request(peerId: string, req: OutgoingRequest, opts?: RequestOptions): Promise<MeshReply>;
  /** RelayClient.watchPeer: resolves when the relay says the peer detached, or why it will not say; `onAttached` when it says the peer is attached to it. */
  watchPeer?(peerId: string, signal?: AbortSignal, onAttached?: () => void): Promise<PeerWatchEnd>;
  /** RelayClient.currentRegistration: a new object at each registration (undefined while not registered); what the relay said is forgotten when it changes. */
  readonly currentRegistration?: object | undefined;
  /** RelayClient.beat: the heartbeat as a `beat` message the relay batches; undefined when the relay does not batch. */
  beat?(peerId: string, body: unknown, timeoutMs: number): Promise<BeatReply> | undefined;
}

/** The keys a node takes routes from: one tracker's, or every tracker of its cluster. */
export type TrackerKeys = Uint8Array | readonly Uint8Array[] | undefined;

function keyList(k: TrackerKeys): readonly Uint8Array[] {
  return k === undefined ? [] : k instanceof Uint8Array ? [k] : k;
}

/** True when any of `keys` verifies `sig` over `message` (a notice, a check plan: signed by one tracker of the cluster). */
export async function signedByAny(keys: TrackerKeys, message: Uint8Array, sig: Uint8Array, verify: (key: Uint8Array, message: Uint8Array, sig: Uint8Array) => Promise<boolean>): Promise<boolean> {
  for (const k of keyList(keys)) if (await verify(k, message, sig)) return true;
  return false;
}

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
    tracker_peer_id: z.string().regex(/^[0-9a-f]{32}$/).optional(),
    tracker_keys: z.array(trackerKeySchema).max(64).optional(),
  })
  .loose();
const trackerInfoSchema = z.object({ models: z.array(z.string()) }).loose();

export type HeartbeatAnswer = { assignment?: Assignment | null; heartbeatIntervalMs?: number };

/** The tracker has no `GET /api/nodes/watch` (an older one). */
export class WatchUnsupportedError extends MeshError {
  constructor() {
    super('MESH_ERR_NOT_FOUND', 'the tracker has no /api/nodes/watch');
  }
}

/** After the relay said a tracker takes no batched beats, how long its beats go as requests before trying again, ms. */
const NO_BATCH_RETRY_MS = 60_000;

/**
 * After the relay said the tracker is not attached to it (on another relay of
 * a cluster, or not back after a restart), how long its beats go as requests
 * without the batched try, ms: a random time in [half, whole], so the nodes
 * told at once (a tracker's restart) do not all try again at once. Sooner when
 * the relay's peer-watch says the tracker attached (the watch asks again after
 * each beat while it is not), and renewed each time it says it is not: a
 * bound for a relay connection that gives no such news.
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

/** Longest pause between two asks for a replacement while the tracker has none, ms. */
const REPLACE_POLL_MAX_MS = 500;

/** The tracker could not be reached at all (connection refused or reset, no such host): not a timeout, not an answer. */
export class TrackerUnreachableError extends MeshError {
  constructor(message: string) {
    super('MESH_ERR_UNAVAILABLE', message);
  }
}

/**
 * How a watch ended (TrackerClient.watch): `ended` the HTTP stream ended (the
 * tracker went away, or the signal aborted); `gone` the relay said the
 * tracker's peer detached; `rearm` nothing is known (not watching now: the
 * last beat did not go over the relay, the relay connection dropped, the
 * tracker is not on this relay): watch again after the next beat tells.
 */
export type WatchEnd = 'ended' | 'gone' | 'rearm';

/** The tracker forgot this node (it restarted): register again. */
export class NotRegisteredError extends MeshError {
  constructor() {
    super('MESH_ERR_NOT_FOUND', 'the tracker does not know this node (it restarted?); register again');
  }
}

const utf8 = new TextEncoder();

export async function signBody<T>(identity: Identity, body: T): Promise<{ body: T; signature: string }> {
  const sig = await identity.sign(utf8.encode(canonicalJson(body)));
  return { body, signature: encodeBase64Url(sig) };
}

/** Verify a tracker-signed route text for `headPeerId`; returns the parsed hops or throws MESH_ERR_FORBIDDEN. */
export async function verifySignedRoute(trackerKey: TrackerKeys, headPeerId: string, routeText: string, expiresAt: number, signature: string, now: number): Promise<RouteHop[]> {
  return (await verifyRouteWith(trackerKey, headPeerId, routeText, expiresAt, signature, now)).hops;
}

/** verifySignedRoute, and which key it verified with (any tracker of the cluster may have signed). */
async function verifyRouteWith(trackerKey: TrackerKeys, headPeerId: string, routeText: string, expiresAt: number, signature: string, now: number): Promise<{ hops: RouteHop[]; key: Uint8Array }> {
  const keys = keyList(trackerKey);
  if (keys.length === 0) throw new MeshError('MESH_ERR_FORBIDDEN', 'this head has no tracker key yet (not registered with a tracker, and none configured): it accepts no route');
  if (!Number.isSafeInteger(expiresAt)) throw new MeshError('MESH_ERR_FORBIDDEN', 'route expiry is not an integer (ms since epoch)');
  if (expiresAt < now) throw new MeshError('MESH_ERR_FORBIDDEN', `the route expired ${now - expiresAt} ms ago; ask the tracker for a fresh one`);
  let sig: Uint8Array;
  try {
    sig = decodeBase64Url(signature);
  } catch {
    throw new MeshError('MESH_ERR_FORBIDDEN', 'route signature is not base64url');
  }
  const message = routeSigningMessage(headPeerId, expiresAt, routeText);
  let by: Uint8Array | undefined;
  for (const k of keys) {
    if (await verifyEd25519(k, message, sig)) {
      by = k;
      break;
    }
  }
  if (!by) throw new MeshError('MESH_ERR_FORBIDDEN', 'the route is not signed by the tracker for this head; a head accepts routes only from its tracker (or a tracker of its cluster)');
  let raw: unknown;
  try {
    raw = JSON.parse(routeText);
  } catch {
    throw new MeshError('MESH_ERR_BAD_REQUEST', 'the signed route is not JSON');
  }
  // A route whose head runs every layer itself lists no downstream hop: accept the empty list too.
  const p = (Array.isArray(raw) && raw.length === 0 ? routeSchema.or(z.array(z.never()).max(0)) : routeSchema).safeParse(raw);
  if (!p.success) throw new MeshError('MESH_ERR_BAD_REQUEST', `the signed route is not a hop list: ${p.error.issues[0]!.path.join('.')}: ${p.error.issues[0]!.message}`);
  return { hops: p.data, key: by };
}

/** A route the tracker's signature was checked on; one object per signature while it stays cached. */
export interface VerifiedRoute {
  readonly hops: readonly RouteHop[];
}

/**
 * Routes verified by signature (a head's /generate, a chain hop's steps): the
 * tracker hands the chats that start on one route within a few seconds the
 * same signed route (route-signer.ts), so the signature is checked once per
 * tracker key, head, text and expiry (an Ed25519 verification per chat or
 * step otherwise); the expiry on every call. A known route comes back synchronously (no promise,
 * no extra turn on a step's critical path).
 */
export class VerifiedRoutes {
  private readonly map = new Map<string, { key: Uint8Array; head: string; text: string; expires: number; route: VerifiedRoute }>();

  get(key: TrackerKeys, head: string, text: string, expires: number, signature: string, now: number): VerifiedRoute | Promise<VerifiedRoute> {
    const hit = this.map.get(signature);
    // Valid while the key that verified it is still one this node takes routes from.
    if (hit && hit.head === head && hit.text === text && hit.expires === expires && keyList(key).some((k) => sameBytes(hit.key, k))) {
      if (expires < now) throw new MeshError('MESH_ERR_FORBIDDEN', `the route expired ${now - expires} ms ago; ask the tracker for a fresh one`);
      return hit.route;
    }
    return this.verify(key, head, text, expires, signature, now);
  }

  private async verify(key: TrackerKeys, head: string, text: string, expires: number, signature: string, now: number): Promise<VerifiedRoute> {
    const { hops, key: by } = await verifyRouteWith(key, head, text, expires, signature, now);
    if (this.map.size >= 256) this.map.clear();
    const route: VerifiedRoute = { hops };
    this.map.set(signature, { key: by, head, text, expires, route });
    return route;
  }
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a === b) return true;
  if (a.byteLength !== b.byteLength) return false;
  for (let i = 0; i < a.byteLength; i++) if (a[i] !== b[i]) return false;
  return true;
}

/** True when `signature` is the tracker's over `replyText` as `headPeerId`'s reply address for a route expiring at `expiresAt` (chainReplySigningMessage). */
export async function verifyChainReply(trackerKey: TrackerKeys, headPeerId: string, expiresAt: number, replyText: string, signature: string): Promise<boolean> {
  const keys = keyList(trackerKey);
  if (keys.length === 0) return false;
  let sig: Uint8Array;
  try {
    sig = decodeBase64Url(signature);
  } catch {
    return false;
  }
  const message = chainReplySigningMessage(headPeerId, expiresAt, replyText);
  for (const k of keys) if (await verifyEd25519(k, message, sig)) return true;
  return false;
}

/**
 * The tracker keys a node takes routes from. A tracker alone: the key it
 * answers with. A cluster: every tracker's key its answers list, and, once
 * an operator key is known (configured, or pinned from the first answer
 * with a certificate), only those the operator certified. A key stays
 * usable for a while after its tracker stops being listed (routes it signed
 * live on for their TTL).
 */
export class TrackerTrust {
  private readonly keys = new Map<string, { key: Uint8Array; listedAt: number }>();
  private readonly certified = new Set<string>();
  private list: Uint8Array[] = [];
  operatorKey: string | undefined;

  constructor(
    operatorKey?: string,
    /** How long an unlisted key stays trusted, ms. */
    private readonly keepMs = 10 * 60_000,
  ) {
    this.operatorKey = operatorKey;
  }

  /** The keys to check a route against, the answering tracker's first. */
  get current(): readonly Uint8Array[] {
    return this.list;
  }

  /** Exactly this key (or none) from now on, until a tracker answers. */
  only(key: Uint8Array | undefined): void {
    this.keys.clear();
    this.list = key ? [key] : [];
    if (key) this.keys.set(encodeBase64Url(key), { key, listedAt: Date.now() });
  }

  /** What a tracker answered: its own key, and the cluster's list when it is in one. */
  async absorb(answering: string | undefined, listed: readonly TrackerKey[] | undefined, now = Date.now()): Promise<void> {
    const accepted: string[] = [];
    if (listed && listed.length > 0) {
      if (!this.operatorKey) this.operatorKey = listed.find((k) => k.cert)?.cert?.operator_key;
      for (const k of listed) if (!this.operatorKey || (await this.certifiedKey(k, now))) accepted.push(k.public_key);
      if (!this.operatorKey && answering) accepted.push(answering);
    } else if (answering && !this.operatorKey) accepted.push(answering);
    for (const k of accepted) {
      let key: Uint8Array;
      try {
        key = decodeBase64Url(k);
      } catch {
        continue;
      }
      if (key.byteLength === 32) this.keys.set(k, { key, listedAt: now });
    }
    for (const [k, v] of this.keys) if (now - v.listedAt > this.keepMs) this.keys.delete(k);
    const first = answering ? this.keys.get(answering) : undefined;
    this.list = [...(first ? [first.key] : []), ...[...this.keys.entries()].filter(([k]) => k !== answering).map(([, v]) => v.key)];
  }

  private async certifiedKey(k: TrackerKey, now: number): Promise<boolean> {
    const c = k.cert;
    if (!c || c.operator_key !== this.operatorKey || c.expires_at < now) return false;
    const id = `${k.public_key}:${c.expires_at}:${c.signature}`;
    if (this.certified.has(id)) return true;
    let op: Uint8Array;
    let sig: Uint8Array;
    try {
      op = decodeBase64Url(c.operator_key);
      sig = decodeBase64Url(c.signature);
    } catch {
      return false;
    }
    if (!(await verifyEd25519(op, trackerCertMessage(k.public_key, c.expires_at), sig))) return false;
    if (this.certified.size > 1024) this.certified.clear();
    this.certified.add(id);
    return true;
  }
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
  /**
   * Heartbeats sent over the relay socket / as signed HTTP requests; of the relay ones, those the relay batched (`beat`
   * messages); `skipped`: beats that went without the batched try, the relay having said it would refuse it.
   */
  readonly beats = { relay: 0, http: 0, batched: 0, skipped: 0 };
  /** A tracker peer the relay said takes no batched beats (not attached there, or older): its beats skip the batched try meanwhile. */
  private noBatch: NoBatch | undefined;
  private readonly random: () => number;

  constructor(private readonly init: TrackerClientInit) {
    this.base = init.trackerUrl.replace(/\/+$/, '');
    this.timeoutMs = init.requestTimeoutMs ?? 10_000;
    this.replaceDeadlineMs = init.replaceDeadlineMs ?? 30_000;
    this.trust = new TrackerTrust(init.operatorKey);
    this.random = init.random ?? Math.random;
  }

  /** The peer id of the tracker that answered last: heartbeats go to it over the relay. */
  get trackerPeerId(): string | undefined {
    return this.trackerPeer;
  }

  private setTrackerPeer(id: string | undefined): void {
    // Another tracker: what the relay said of the last one is not news of this one.
    if (id !== this.trackerPeer) this.noBatch = undefined;
    this.trackerPeer = id;
  }

  /** Why beats to the current tracker skip the batched try now (docs/protocol.md §9.1), or undefined: they try it. */
  get noBatchNow(): NoBatchReason | undefined {
    const relay = this.init.relay;
    const peer = this.trackerPeer;
    return relay !== undefined && peer !== undefined && this.skipsBatch(relay, peer) ? this.noBatch?.why : undefined;
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

  private async post(path: string, payload: unknown, signal?: AbortSignal): Promise<{ status: number; json: unknown }> {
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
    const { status, json } = await this.post('/api/nodes/register', await signBody(this.init.identity, msg));
    if (status !== 200 && status !== 201) this.fail('/api/nodes/register', status, json);
    const p = registerAnswerSchema.safeParse(json);
    if (!p.success) throw new MeshError('MESH_ERR_UPSTREAM', `tracker register answer: ${p.error.issues[0]!.path.join('.')}: ${p.error.issues[0]!.message}`);
    await this.trust.absorb(p.data.tracker_public_key, p.data.tracker_keys);
    this.setTrackerPeer(p.data.tracker_peer_id);
    if (p.data.distrust) this.init.onDistrust?.(p.data.distrust);
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
    const overRelay = await this.relayBeat(msg);
    if (overRelay) return overRelay;
    this.beats.http++;
    const { status, json } = await this.post('/api/nodes/heartbeat', await signBody(this.init.identity, msg));
    if (status === 404) throw new NotRegisteredError();
    if (status !== 200) this.fail('/api/nodes/heartbeat', status, json);
    return this.beatAnswer(json);
  }

  /** The beat over the relay; undefined when it could not be (no relay, no tracker peer, a relay or tracker error): send it signed. */
  private async relayBeat(msg: NodeMessage): Promise<HeartbeatAnswer | undefined> {
    const relay = this.init.relay;
    const peer = this.trackerPeerId;
    if (!relay || !peer || relay.state !== 'registered') return undefined;
    const batched = await this.batchedBeat(relay, peer, msg);
    if (batched !== undefined) return batched === 'timeout' ? undefined : batched;
    let reply: MeshReply;
    try {
      reply = await relay.request(peer, { method: 'POST', path: '/api/nodes/beat', headers: { 'content-type': 'application/json' }, body: utf8.encode(JSON.stringify(msg)) }, { timeoutMs: this.timeoutMs });
    } catch {
      return undefined;
    }
    let json: unknown;
    try {
      json = JSON.parse(new TextDecoder().decode(reply.body));
    } catch {
      return undefined;
    }
    return this.relayBeatAnswer(reply.status, json);
  }

  /**
   * The beat as a `beat` message the relay batches (docs/protocol.md §9.1):
   * the answer; 'timeout' when none came in time (the same relay and tracker
   * would be as slow on the request path: straight to HTTP); undefined when
   * it could not go batched (an older relay, a tracker not attached there or
   * not taking batches, a relay error): the request path then, as before.
   */
  private async batchedBeat(relay: TrackerRelay, peer: string, msg: NodeMessage): Promise<HeartbeatAnswer | 'timeout' | undefined> {
    if (this.skipsBatch(relay, peer)) {
      this.beats.skipped++;
      return undefined;
    }
    let reply: BeatReply | undefined;
    try {
      reply = await relay.beat?.(peer, msg, this.timeoutMs);
    } catch (e) {
      return (e as MeshError).code === 'MESH_ERR_TIMEOUT' ? 'timeout' : undefined;
    }
    if (reply === undefined) return undefined;
    const error = (reply.body as { error?: { code?: unknown; batch?: unknown } } | null)?.error;
    // The tracker is attached there but takes no batches (an older one), or is not attached there (on another relay of a
    // cluster, or not back yet after a restart): the request path, and for a while without asking first.
    if (error?.code === 'MESH_ERR_NO_SUCH_PEER') {
      this.refusesBatch(relay, peer, error.batch === 'unsupported' ? 'unsupported' : 'not-attached');
      return undefined;
    }
    const answer = await this.relayBeatAnswer(reply.status, reply.body);
    if (answer !== undefined) this.beats.batched++;
    return answer;
  }

  /** The relay said it would refuse `peer`'s batched beats, on the registration in force and within the bound. */
  private skipsBatch(relay: TrackerRelay, peer: string): boolean {
    const m = this.noBatch;
    if (m === undefined) return false;
    if (m.peer === peer && m.on === relay.currentRegistration && m.until > Date.now()) return true;
    // Over (the bound passed), or said on another connection (the node's relay reconnected: maybe to another relay).
    this.noBatch = undefined;
    return false;
  }

  /** The relay refuses `peer`'s batched beats (it takes none, or is not attached there): skip the try for a while. */
  private refusesBatch(relay: TrackerRelay, peer: string, why: NoBatchReason): void {
    const ms = why === 'unsupported' ? NO_BATCH_RETRY_MS : NOT_ATTACHED_RETRY_MS * (0.5 + this.random() / 2);
    this.noBatch = { peer, why, on: relay.currentRegistration, until: Date.now() + ms };
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
    return out;
  }

  /**
   * Watch for the tracker going away. A node with a relay that has
   * `peer-watch` asks that relay to say when the tracker's peer (the one its
   * beats go to) detaches, and holds no connection to the tracker: `gone`
   * when it did, `rearm` when no such news can come now (the tracker is not
   * attached to this relay, the relay connection dropped: see WatchEnd).
   * Otherwise (no relay, a relay without `peer-watch`, a tracker with no
   * peer id) the HTTP stream, as httpWatch().
   */
  async watch(signal: AbortSignal): Promise<WatchEnd> {
    const relay = this.init.relay;
    const peer = this.trackerPeerId;
    if (relay?.watchPeer !== undefined && relay.state !== 'none' && peer !== undefined) {
      // The relay's answer says whether the tracker is attached to it, so whether its beats may go batched.
      const end = await relay.watchPeer(peer, signal, () => {
        if (this.noBatch?.peer === peer && this.noBatch.why === 'not-attached') this.noBatch = undefined;
      });
      // Still not attached: renew what a batched beat was told (a relay that batches nothing told none).
      if (end === 'absent' && this.noBatch?.peer === peer && this.noBatch.why === 'not-attached') this.refusesBatch(relay, peer, 'not-attached');
      if (end === 'gone') return 'gone';
      if (end === 'cancelled') return 'ended';
      if (end !== 'unsupported' || relay.state !== 'registered') return 'rearm';
      // A relay without peer-watch: the HTTP stream, as before.
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
