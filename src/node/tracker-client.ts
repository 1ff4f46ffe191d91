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
  type NodeMessage,
  type RegisterAnswer,
  type ReplaceRequest,
  type ReplaceAnswer,
  type RouteHop,
  type Assignment,
} from '../protocol/tracker.ts';
import { verifyEd25519, type Identity } from '../net/identity.ts';
import { z } from 'zod';

export interface TrackerClientInit {
  /** Base URL, e.g. http://127.0.0.1:8080 */
  trackerUrl: string;
  fetch: typeof fetch;
  identity: Identity;
  /** Per request. @defaultValue 10000 */
  requestTimeoutMs?: number;
  /** How long a head keeps asking for a replacement span while the tracker answers 503 (no node covers it yet). @defaultValue 30000 */
  replaceDeadlineMs?: number;
  /** The tracker's list of quarantined nodes, with each register and heartbeat answer that carries one (docs/verification.md). */
  onDistrust?: (list: ReadonlyArray<{ peer_id: string; until: number }>) => void;
}

/** Answer to a heartbeat: a new assignment when the tracker moved the node, else nothing new. Unknown fields are ignored. */
const heartbeatAnswerSchema = z
  .object({
    assignment: assignmentSchema.nullable().optional(),
    heartbeat_interval_ms: z.number().int().positive().optional(),
    tracker_public_key: z.string().optional(),
    distrust: z.array(z.object({ peer_id: z.string(), until: z.number() })).max(10_000).optional(),
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

/** Longest pause between two asks for a replacement while the tracker has none, ms. */
const REPLACE_POLL_MAX_MS = 500;

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
export async function verifySignedRoute(trackerKey: Uint8Array | undefined, headPeerId: string, routeText: string, expiresAt: number, signature: string, now: number): Promise<RouteHop[]> {
  if (!trackerKey) throw new MeshError('MESH_ERR_FORBIDDEN', 'this head has no tracker key yet (not registered with a tracker, and none configured): it accepts no route');
  if (!Number.isSafeInteger(expiresAt)) throw new MeshError('MESH_ERR_FORBIDDEN', 'route expiry is not an integer (ms since epoch)');
  if (expiresAt < now) throw new MeshError('MESH_ERR_FORBIDDEN', `the route expired ${now - expiresAt} ms ago; ask the tracker for a fresh one`);
  let sig: Uint8Array;
  try {
    sig = decodeBase64Url(signature);
  } catch {
    throw new MeshError('MESH_ERR_FORBIDDEN', 'route signature is not base64url');
  }
  if (!(await verifyEd25519(trackerKey, routeSigningMessage(headPeerId, expiresAt, routeText), sig))) {
    throw new MeshError('MESH_ERR_FORBIDDEN', 'the route is not signed by the tracker for this head; a head accepts routes only from its tracker');
  }
  let raw: unknown;
  try {
    raw = JSON.parse(routeText);
  } catch {
    throw new MeshError('MESH_ERR_BAD_REQUEST', 'the signed route is not JSON');
  }
  // A route whose head runs every layer itself lists no downstream hop: accept the empty list too.
  const p = (Array.isArray(raw) && raw.length === 0 ? routeSchema.or(z.array(z.never()).max(0)) : routeSchema).safeParse(raw);
  if (!p.success) throw new MeshError('MESH_ERR_BAD_REQUEST', `the signed route is not a hop list: ${p.error.issues[0]!.path.join('.')}: ${p.error.issues[0]!.message}`);
  return p.data;
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

  get(key: Uint8Array | undefined, head: string, text: string, expires: number, signature: string, now: number): VerifiedRoute | Promise<VerifiedRoute> {
    const hit = this.map.get(signature);
    if (key && hit && hit.head === head && hit.text === text && hit.expires === expires && sameBytes(hit.key, key)) {
      if (expires < now) throw new MeshError('MESH_ERR_FORBIDDEN', `the route expired ${now - expires} ms ago; ask the tracker for a fresh one`);
      return hit.route;
    }
    return this.verify(key, head, text, expires, signature, now);
  }

  private async verify(key: Uint8Array | undefined, head: string, text: string, expires: number, signature: string, now: number): Promise<VerifiedRoute> {
    const hops = await verifySignedRoute(key, head, text, expires, signature, now);
    if (this.map.size >= 256) this.map.clear();
    const route: VerifiedRoute = { hops };
    this.map.set(signature, { key: key!, head, text, expires, route });
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
export async function verifyChainReply(trackerKey: Uint8Array | undefined, headPeerId: string, expiresAt: number, replyText: string, signature: string): Promise<boolean> {
  if (!trackerKey) return false;
  let sig: Uint8Array;
  try {
    sig = decodeBase64Url(signature);
  } catch {
    return false;
  }
  return verifyEd25519(trackerKey, chainReplySigningMessage(headPeerId, expiresAt, replyText), sig);
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
  /** Raw Ed25519 key the tracker signs routes with (from the last registration, or configured). */
  trackerKey: Uint8Array | undefined;

  constructor(private readonly init: TrackerClientInit) {
    this.base = init.trackerUrl.replace(/\/+$/, '');
    this.timeoutMs = init.requestTimeoutMs ?? 10_000;
    this.replaceDeadlineMs = init.replaceDeadlineMs ?? 30_000;
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
      throw new MeshError('MESH_ERR_UNAVAILABLE', `tracker ${this.base} unreachable for ${path}: ${(e as { cause?: { code?: string } }).cause?.code ?? (e as Error).message}`);
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
    this.trackerKey = decodeBase64Url(p.data.tracker_public_key);
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

  /** Throws NotRegisteredError on 404 (the tracker restarted and forgot us). */
  async heartbeat(msg: NodeMessage): Promise<HeartbeatAnswer> {
    const { status, json } = await this.post('/api/nodes/heartbeat', await signBody(this.init.identity, msg));
    if (status === 404) throw new NotRegisteredError();
    if (status !== 200) this.fail('/api/nodes/heartbeat', status, json);
    const p = heartbeatAnswerSchema.safeParse(json ?? {});
    if (!p.success) return {};
    if (p.data.tracker_public_key) this.trackerKey = decodeBase64Url(p.data.tracker_public_key);
    if (p.data.distrust) this.init.onDistrust?.(p.data.distrust);
    const out: HeartbeatAnswer = {};
    if (p.data.assignment !== undefined) out.assignment = p.data.assignment;
    if (p.data.heartbeat_interval_ms !== undefined) out.heartbeatIntervalMs = p.data.heartbeat_interval_ms;
    return out;
  }

  /**
   * Hold `GET /api/nodes/watch` open: resolves when the stream ends (the
   * tracker went away, or `signal` aborted), rejects when it cannot be
   * opened (unreachable), and with WatchUnsupportedError when the tracker
   * has no such route (an older one: heartbeats alone tell then).
   */
  async watch(signal: AbortSignal): Promise<void> {
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
