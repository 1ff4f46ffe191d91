/**
 * How the head reaches one downstream hop (docs/protocol.md §5): the relay fast
 * path over its own persistent `/ws` connection when the hop sits on the same
 * relay, a kept-open `/rpc/<peer_id>` socket (ADR-0014's path, for a hop on an
 * ADR-era or other relay), or direct HTTP to the hop's `endpoint`. When one
 * fails, the next is tried, and the one that answered is remembered per peer
 * so the next token goes straight to it.
 *
 * Host-agnostic: the host injects the relay client, a WebSocket constructor
 * for `/rpc` and a `fetch`; none is required.
 */
import type { MeshReply } from '../protocol/envelopes.ts';
import { MeshError, remoteError } from '../protocol/errors.ts';
import type { HeaderMap } from '../protocol/headers.ts';
import type { RouteHop } from '../protocol/tracker.ts';
import type { DirectRequest, FastPathClient, OutgoingRequest, PeerRequester, RequestOptions, RpcLike, TransportKind } from './contract.ts';
import { proofFromHeaders, type RouteProof } from './rtc-signal.ts';

/** Kinds that reach the hop without a relay in between. */
function isDirectKind(k: TransportKind): boolean {
  return k === 'link' || k === 'direct' || k === 'rtc';
}

/** Options of send() and push(). */
export interface SendOptions {
  /** Its round trip feeds the adaptive order (send only). */
  sample?: boolean;
  /** An answer the hop itself gave (a chain hop marks its refusals), passed up whatever its status. */
  accept?: (reply: MeshReply) => boolean;
  /**
   * The signed route that puts this node and the hop together: with it, a
   * hop with no data channel yet is dialled one in the background
   * (rtc-pool.ts). Absent: read from the request's chain headers, if any.
   */
  proof?: RouteProof;
}

export interface HopTransportInit {
  fast?: FastPathClient;
  /** Opens (lazily) a kept-open `/rpc` connection to `relayAddr`; one per address is cached. */
  rpc?: (relayAddr: string) => RpcLike;
  /**
   * A direct link (src/net/direct-link.ts) to a hop's endpoint when one is
   * up; undefined meanwhile (the first call may start dialling it). A link
   * that is up goes first in the 'relay' and 'direct' orders (it proved the
   * endpoint reachable, and costs the least); 'adaptive' measures it as a
   * direct path. Undefined too when the link ends at another peer than
   * `peerId` (an endpoint that is wrong, or names a local port on the caller's machine).
   */
  link?: (endpoint: string, peerId: string) => PeerRequester | undefined;
  /**
   * A WebRTC data channel to the hop's peer (rtc-pool.ts) when one is open;
   * undefined meanwhile (with a `proof`, the first call starts dialling).
   * An open channel leads every order: it is the shortest path there is.
   */
  rtc?: (peerId: string, proof?: RouteProof) => PeerRequester | undefined;
  /** Direct HTTP; wins over `fetch` when both are given. */
  direct?: DirectRequest;
  /** Direct HTTP through fetch, when no `direct` is given. */
  fetch?: typeof fetch;
  /**
   * Which path first when a hop has both a relay address and an endpoint:
   * 'relay' (ADR-0014: relay, then direct), 'direct', or 'adaptive' — the one
   * with the lower measured round trip to that peer, both measured on real
   * requests (the other path gets every 32nd request while it has fewer than
   * 3 samples, then every 256th, so a change of conditions is noticed).
   * Either way a failing path falls back to the other. @defaultValue 'relay'
   */
  order?: 'relay' | 'direct' | 'adaptive';
  onLog?: (message: string) => void;
}

/** Every transport of a hop failed; `errors` says how each did. */
export class HopUnreachableError extends MeshError {
  constructor(
    readonly hop: RouteHop,
    readonly errors: Array<{ kind: TransportKind; error: MeshError }>,
  ) {
    const last = errors.at(-1)?.error;
    super(
      last?.code === 'MESH_ERR_TIMEOUT' ? 'MESH_ERR_TIMEOUT' : 'MESH_ERR_PEER_GONE',
      `hop ${hop.peer_id} [${hop.start_layer}, ${hop.end_layer}) unreachable: ${errors.map((e) => `${e.kind}: ${e.error.message}`).join('; ') || 'it has neither relay_addr nor endpoint'}`,
      { peer_id: hop.peer_id },
    );
  }
}

/** After a request over a peer's link failed, this long before a link that is up leads that peer's order again, ms. */
const LINK_RETRY_MS = 10_000;
/** Between tries of a hop the relay does not know yet, after an outage of our relay: the first, and the most, ms. */
const PEER_BACK_POLL_MS = [100, 500] as const;
/**
 * The same for the data channel that failed a request (a frozen far side keeps its channel open); a new channel
 * to that peer (the failed one closed and was dialled again) leads at once.
 */
const RTC_RETRY_MS = 10_000;

/** Parsed once per address: plan() runs for every hop of every token, and a URL parse there showed up cold. */
const hostPortCache = new Map<string, string | undefined>();

function hostPort(url: string): string | undefined {
  if (hostPortCache.has(url)) return hostPortCache.get(url);
  if (hostPortCache.size >= 4096) hostPortCache.clear();
  const hp = parseHostPort(url);
  hostPortCache.set(url, hp);
  return hp;
}

function parseHostPort(url: string): string | undefined {
  try {
    const u = new URL(url);
    const port = u.port || (u.protocol === 'wss:' || u.protocol === 'https:' ? '443' : '80');
    return `${u.hostname}:${port}`;
  } catch {
    return undefined;
  }
}

/** Statuses of a reply that mean "this transport did not reach a working hop", as opposed to an answer from the hop. */
function isTransportFailure(reply: MeshReply): boolean {
  // Any 2xx is the hop's (a session dropped answers 204): taken for a failure, it sent the request again by every
  // other path and set the path that carried it back for LINK_RETRY_MS / RTC_RETRY_MS, after every generation.
  if ((reply.status >= 200 && reply.status < 300) || reply.status === 409) return false;
  // The hop itself has no KV room, or its GPU span is being rebuilt: another path would reach the same node.
  if (reply.status === 503 && (isBusyReply(reply) || isRebuildingReply(reply))) return false;
  return true;
}

/** A 503 MESH_ERR_UNAVAILABLE with retry_after_ms: the hop lost its GPU device and is building its span again (device-recovery.ts). */
function isRebuildingReply(reply: MeshReply): boolean {
  const e = remoteError(reply.status, reply.body);
  return e.code === 'MESH_ERR_UNAVAILABLE' && typeof e.details.retry_after_ms === 'number';
}

/** A 503 whose body is MESH_ERR_BUSY: the hop refused a session for lack of KV room (not a relay's 503). */
export function isBusyReply(reply: MeshReply): boolean {
  return reply.status === 503 && remoteError(reply.status, reply.body).code === 'MESH_ERR_BUSY';
}

function asMesh(e: unknown, fallback: string): MeshError {
  if (e instanceof MeshError) return e;
  const err = e as Error;
  if (err?.name === 'TimeoutError' || err?.name === 'AbortError') return new MeshError('MESH_ERR_TIMEOUT', `${fallback}: ${err.message}`);
  const cause = (err as { cause?: { code?: string; message?: string } })?.cause;
  return new MeshError('MESH_ERR_PEER_GONE', `${fallback}: ${cause?.code ?? cause?.message ?? err?.message ?? String(e)}`);
}

export class HopTransport {
  private readonly rpcConns = new Map<string, RpcLike>();
  /** The transport that last answered each peer: tried first next time. */
  private readonly preferred = new Map<string, TransportKind>();
  /** When a request over each peer's link last failed (ms since epoch): until LINK_RETRY_MS later, a link that is up does not jump the order. */
  private readonly linkFailedAt = new Map<string, number>();
  /** When a request over each peer's data channel last failed (ms since epoch), and that channel (its requester). */
  private readonly rtcFailed = new Map<string, { at: number; via: PeerRequester | undefined }>();
  /** Requests answered (or pushes sent) per path, and per peer the path that last carried one: /info's `hops_sent` and `paths`. */
  readonly sent: Record<TransportKind, number> = { rtc: 0, fast: 0, rpc: 0, link: 0, direct: 0 };
  private readonly lastPath = new Map<string, { kind: TransportKind; counts: Partial<Record<TransportKind, number>>; at: number }>();
  /** Adaptive order: per peer, round-trip EWMA (ms) and sample count per path, and requests sent. */
  private readonly rtt = new Map<string, { ms: Partial<Record<TransportKind, number>>; n: Partial<Record<TransportKind, number>>; sent: number }>();

  private readonly directRequest: DirectRequest | undefined;

  constructor(private readonly init: HopTransportInit) {
    this.directRequest = init.direct ?? (init.fetch ? fetchDirect(init.fetch) : undefined);
  }

  /** The transports to try for a hop, best first; `proof` lets a missing data channel be dialled. */
  plan(hop: RouteHop, proof?: RouteProof): TransportKind[] {
    const order = this.planWithoutRtc(hop);
    const channel = this.init.rtc?.(hop.peer_id, proof);
    if (channel !== undefined) {
      const failed = this.rtcFailed.get(hop.peer_id);
      if (failed === undefined || failed.via !== channel || Date.now() - failed.at > RTC_RETRY_MS) order.unshift('rtc');
      else order.push('rtc');
    }
    return order;
  }

  private planWithoutRtc(hop: RouteHop): TransportKind[] {
    const relay: TransportKind[] = [];
    /** Our relay connection is down and being waited out: the fast path holds the request until it is back. */
    let waiting = false;
    if (hop.relay_addr !== undefined) {
      const fast = this.init.fast;
      const ours = fast === undefined ? undefined : hostPort(fast.relayUrl);
      // In a cluster, our relay reaches a hop on any of its relays (a hop elsewhere: its 404 sends us to /rpc next).
      const onOurs = fast !== undefined && (fast.cluster === true || (ours !== undefined && hostPort(hop.relay_addr) === ours));
      if (onOurs && fast.isRegistered) relay.push('fast');
      else if (onOurs && (fast.outageLeftMs?.() ?? 0) > 0) waiting = true;
      // /rpc works for any relay, ours included: the fallback when our own connection is down (not while it is being waited out: the relay is the one down).
      if (this.init.rpc && !waiting) relay.push('rpc');
    }
    const linkUp = hop.endpoint !== undefined && this.init.link?.(hop.endpoint, hop.peer_id) !== undefined;
    const direct: TransportKind[] = hop.endpoint !== undefined && this.directRequest ? ['direct'] : [];
    const mode = this.init.order ?? 'relay';
    if (mode === 'adaptive' && linkUp) direct.unshift('link');
    // While our relay is down, a path that does not need it goes first, and the fast path waits last.
    if (waiting) return [...(linkUp && mode !== 'adaptive' ? (['link'] as TransportKind[]) : []), ...direct, 'fast'];
    const order = mode === 'direct' ? [...direct, ...relay] : [...relay, ...direct];
    // A link that is up has already proved the endpoint reachable (ADR-0014's reason to try the relay first), and skips the relay's two wakes: it leads.
    if (mode !== 'adaptive' && linkUp) {
      order.unshift('link');
      // Ahead of the path that answered while the link was still dialling, too (else a hop first reached by HTTP or the relay stays there).
      const failed = this.linkFailedAt.get(hop.peer_id);
      if (failed === undefined || Date.now() - failed > LINK_RETRY_MS) return order;
    }
    if (mode === 'adaptive' && relay.length > 0 && direct.length > 0) return this.adaptive(hop.peer_id, order);
    const pref = this.preferred.get(hop.peer_id);
    if (pref !== undefined && pref !== 'rtc' && order.includes(pref)) return [pref, ...order.filter((k) => k !== pref)];
    return order;
  }

  /**
   * Send one request to a hop; `sample`: its round trip feeds the adaptive order. Resolves with the hop's answer when it is 200,
   * 409 (the caller replays) or 503 MESH_ERR_BUSY (the hop has no KV room;
   * the caller decides); any other outcome on every transport rejects with
   * HopUnreachableError.
   */
  async send(hop: RouteHop, req: OutgoingRequest, timeoutMs: number, signal?: AbortSignal, opts: SendOptions = {}): Promise<MeshReply> {
    for (let tries = 0; ; tries++) {
      try {
        return await this.sendOnce(hop, req, timeoutMs, signal, opts);
      } catch (e) {
        // Our relay was lost a moment ago: the request went down with our connection, or the hop is not on the
        // relay yet (it may be reconnecting from the same outage). Send it again within the outage's window rather
        // than call the hop gone (a replacement would be asked for, and the failure counted against the hop).
        // A step that did run before the cut answers 409 the second time; the pipeline replays it.
        const left = this.init.fast?.outageWindowLeftMs?.() ?? 0;
        if (!(e instanceof HopUnreachableError) || left <= 0 || !e.errors.some((x) => x.kind === 'fast' && lostWithOurRelay(x.error))) throw e;
        await pause(Math.min(left, PEER_BACK_POLL_MS[1], PEER_BACK_POLL_MS[0] * 1.5 ** tries), signal);
        if (signal?.aborted) throw new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled');
      }
    }
  }

  /**
   * One try over every path in plan order. `timeoutMs` is the budget of the
   * whole try, not of each path: a hop that is silent on one path (a frozen
   * page, a stopped process) is given up on within it, not once per path.
   */
  private async sendOnce(hop: RouteHop, req: OutgoingRequest, timeoutMs: number, signal: AbortSignal | undefined, opts: SendOptions): Promise<MeshReply> {
    const errors: Array<{ kind: TransportKind; error: MeshError }> = [];
    const deadline = performance.now() + timeoutMs;
    for (const kind of this.plan(hop, this.init.rtc ? (opts.proof ?? proofFromHeaders(req.headers)) : undefined)) {
      if (signal?.aborted) throw new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled');
      // A path that timed out used the budget: the hop is silent, not the path.
      const left = Math.round(deadline - performance.now());
      if (errors.length > 0 && (left <= 0 || errors.some((x) => x.error.code === 'MESH_ERR_TIMEOUT'))) break;
      let reply: MeshReply;
      const t0 = performance.now();
      try {
        reply = await this.sendOn(kind, hop, req, errors.length === 0 ? timeoutMs : Math.max(1, left), signal);
      } catch (e) {
        if (signal?.aborted) throw new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled');
        errors.push({ kind, error: asMesh(e, kind) });
        this.pathFailed(kind, hop.peer_id);
        continue;
      }
      // `accept`: an answer the hop itself gave (a chain hop marks its refusals), passed up whatever its status.
      if (isTransportFailure(reply) && !opts.accept?.(reply)) {
        errors.push({ kind, error: remoteError(reply.status, reply.body, `HTTP ${reply.status}`) });
        this.pathFailed(kind, hop.peer_id);
        continue;
      }
      if (errors.length > 0 && !this.inOutageWindow()) this.init.onLog?.(`hop ${hop.peer_id}: ${errors.map((e) => `${e.kind} failed (${e.error.message})`).join(', ')}; ${kind} answered`);
      // Only like requests are compared (the pipeline samples one-token steps, not prompts or replays).
      if (opts.sample) this.observe(hop.peer_id, kind, performance.now() - t0);
      this.preferred.set(hop.peer_id, kind);
      this.count(hop.peer_id, kind);
      return reply;
    }
    this.preferred.delete(hop.peer_id);
    throw new HopUnreachableError(hop, errors);
  }

  /**
   * A request whose answer nobody waits on (a chained hop's push, a token
   * handed to the head). On the path send() would take first, when that is
   * the relay's fast path or a link whose far side forwards one-way frames,
   * it goes one-way: no answer, one message instead of two; the promise
   * resolves with 202 once `windowMs` passed without an error coming back,
   * or, when the relay answered an error (the hop is gone …), falls back to
   * send() over every path. Elsewhere (an ADR-era relay, /rpc, HTTP) it is
   * send() itself: resolves with the hop's answer, rejects with
   * HopUnreachableError.
   */
  async push(hop: RouteHop, req: OutgoingRequest, timeoutMs: number, windowMs: number, signal?: AbortSignal, opts: SendOptions = {}): Promise<MeshReply> {
    const proof = this.init.rtc ? (opts.proof ?? proofFromHeaders(req.headers)) : undefined;
    const first = this.plan(hop, proof)[0];
    const o: RequestOptions = { timeoutMs: Math.min(windowMs, timeoutMs), ...(signal ? { signal } : {}) };
    let oneWay: Promise<MeshReply> | undefined;
    if (first === 'rtc') oneWay = this.init.rtc!(hop.peer_id)?.push?.(hop.peer_id, req, o);
    else if (first === 'fast') oneWay = this.init.fast!.push?.(hop.peer_id, req, o);
    else if (first === 'link' && hop.endpoint !== undefined) oneWay = this.init.link?.(hop.endpoint, hop.peer_id)?.push?.(hop.peer_id, req, o);
    if (oneWay !== undefined) {
      // Counted as sent now: a one-way push is out once written; a failure below counts the path that carried it again.
      this.count(hop.peer_id, first!);
      try {
        const r = await oneWay;
        // 202: no news; a 2xx or the hop's own answer: a far side that answered anyway (it does not know one-way requests).
        if (r.status < 300 || opts.accept?.(r)) return r;
        if (!this.inOutageWindow()) this.init.onLog?.(`hop ${hop.peer_id}: one-way ${first} request refused (${remoteError(r.status, r.body).message}); trying every path`);
      } catch (e) {
        if (signal?.aborted) throw new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled');
        // During a relay outage the relay client logs the outage once; each push it cut is not news.
        if (!this.inOutageWindow()) this.init.onLog?.(`hop ${hop.peer_id}: one-way ${first} request failed (${(e as Error).message}); trying every path`);
      }
      this.pathFailed(first!, hop.peer_id);
      this.preferred.delete(hop.peer_id);
    }
    return this.send(hop, req, timeoutMs, signal, { ...opts, ...(proof ? { proof } : {}) });
  }

  /** Within the window of an outage of our relay (see FastPathClient.outageWindowLeftMs). */
  inOutageWindow(): boolean {
    return (this.init.fast?.outageWindowLeftMs?.() ?? 0) > 0;
  }

  private pathFailed(kind: TransportKind, peer: string): void {
    if (kind === 'rtc') {
      if (this.rtcFailed.size >= 4096) this.rtcFailed.clear();
      // The channel open now (undefined when the failure closed it): only this one is held back.
      this.rtcFailed.set(peer, { at: Date.now(), via: this.init.rtc?.(peer) });
    } else if (kind === 'link') {
      if (this.linkFailedAt.size >= 4096) this.linkFailedAt.clear();
      this.linkFailedAt.set(peer, Date.now());
    }
  }

  private count(peer: string, kind: TransportKind): void {
    this.sent[kind]++;
    let p = this.lastPath.get(peer);
    if (p === undefined) {
      if (this.lastPath.size >= 1024) this.lastPath.clear();
      p = { kind, counts: {}, at: 0 };
      this.lastPath.set(peer, p);
    }
    p.kind = kind;
    p.at = Date.now();
    p.counts[kind] = (p.counts[kind] ?? 0) + 1;
  }

  /** Per peer this node sent hops to: the path the last one took, and how many each path carried (/info `paths`). */
  paths(): Array<{ peer_id: string; path: TransportKind; sent: Partial<Record<TransportKind, number>>; last_ms_ago: number }> {
    const t = Date.now();
    return [...this.lastPath].map(([peer, p]) => ({ peer_id: peer, path: p.kind, sent: { ...p.counts }, last_ms_ago: t - p.at }));
  }

  /** Faster measured path first; explores the other one now and then (see HopTransportInit.order). */
  private adaptive(peer: string, order: TransportKind[]): TransportKind[] {
    let r = this.rtt.get(peer);
    if (!r) {
      if (this.rtt.size >= 4096) this.rtt.clear();
      r = { ms: {}, n: {}, sent: 0 };
      this.rtt.set(peer, r);
    }
    r.sent++;
    // Compare the best relay path with direct; unmeasured paths count as slowest.
    const best = [...order].sort((a, b) => (r.ms[a] ?? Infinity) - (r.ms[b] ?? Infinity) || order.indexOf(a) - order.indexOf(b));
    const other = best.find((k) => isDirectKind(k) !== isDirectKind(best[0]!));
    const needs = other !== undefined && (r.n[other] ?? 0) < 3;
    if (other !== undefined && r.sent % (needs ? 32 : 256) === 0) return [other, ...best.filter((k) => k !== other)];
    // Until both are measured, alternate so the comparison starts early.
    if (other !== undefined && (r.n[best[0]!] ?? 0) >= 1 && (r.n[other] ?? 0) === 0) return [other, ...best.filter((k) => k !== other)];
    return best;
  }

  private observe(peer: string, kind: TransportKind, ms: number): void {
    const r = this.rtt.get(peer);
    if (!r) return;
    const prev = r.ms[kind];
    r.ms[kind] = prev === undefined ? ms : prev + 0.2 * (ms - prev);
    r.n[kind] = (r.n[kind] ?? 0) + 1;
  }

  private sendOn(kind: TransportKind, hop: RouteHop, req: OutgoingRequest, timeoutMs: number, signal: AbortSignal | undefined): Promise<MeshReply> {
    const opts: RequestOptions = { timeoutMs, ...(signal ? { signal } : {}) };
    if (kind === 'rtc') {
      const request = this.init.rtc?.(hop.peer_id);
      if (request === undefined) return Promise.reject(new MeshError('MESH_ERR_UNAVAILABLE', `the data channel to ${hop.peer_id} closed`));
      return request(hop.peer_id, req, opts);
    }
    if (kind === 'fast') return this.init.fast!.request(hop.peer_id, req, opts);
    if (kind === 'link') {
      const request = this.init.link?.(hop.endpoint!, hop.peer_id);
      if (request === undefined) return Promise.reject(new MeshError('MESH_ERR_UNAVAILABLE', `the link to ${hop.endpoint} went down`));
      return request(hop.peer_id, req, opts);
    }
    if (kind === 'rpc') {
      const addr = hop.relay_addr!;
      let conn = this.rpcConns.get(addr);
      if (!conn) {
        conn = this.init.rpc!(addr);
        this.rpcConns.set(addr, conn);
      }
      return conn.request(req, opts);
    }
    return this.directRequest!(hop.endpoint!.replace(/\/+$/, '') + req.path, req, timeoutMs, signal);
  }

  /** Fire-and-forget (errors ignored): dropping a session on a hop that may be gone. */
  bestEffort(hop: RouteHop, req: OutgoingRequest, timeoutMs = 5_000): void {
    // The hop's own 404 (it holds no such session) is an answer too: no other path would do better.
    this.send(hop, req, timeoutMs, undefined, { accept: (r) => r.status === 404 && remoteError(r.status, r.body).code === 'MESH_ERR_NOT_FOUND' }).catch(() => undefined);
  }

  /** Close the kept-open `/rpc` sockets. */
  close(): void {
    for (const c of this.rpcConns.values()) c.close();
    this.rpcConns.clear();
  }
}

/** A fast-path failure that says our relay lost the hop or us, not that the hop failed: it is not on the relay (yet), or our connection dropped under the request. */
function lostWithOurRelay(e: MeshError): boolean {
  return e.code === 'MESH_ERR_NO_SUCH_PEER' || (e.code === 'MESH_ERR_PEER_GONE' && e.details.reason === 'disconnected');
}

/** Sleep `ms`, or less when `signal` aborts. */
function pause(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise<void>((resolve) => {
    const done = (): void => {
      clearTimeout(t);
      signal?.removeEventListener('abort', done);
      resolve();
    };
    const t = setTimeout(done, ms);
    signal?.addEventListener('abort', done, { once: true });
  });
}

/** DirectRequest over fetch (browsers, and any host without something leaner). */
export function fetchDirect(fetchFn: typeof fetch): DirectRequest {
  return async (url, req, timeoutMs, signal) => {
    const signals: AbortSignal[] = [];
    if (timeoutMs > 0) signals.push(AbortSignal.timeout(timeoutMs));
    if (signal) signals.push(signal);
    const res = await fetchFn(url, {
      method: req.method,
      headers: req.headers ?? {},
      ...(req.body && req.body.byteLength > 0 ? { body: req.body as Uint8Array<ArrayBuffer> } : {}),
      ...(signals.length > 0 ? { signal: signals.length === 1 ? signals[0]! : AbortSignal.any(signals) } : {}),
    });
    const body = new Uint8Array(await res.arrayBuffer());
    const headers: HeaderMap = {};
    res.headers.forEach((v, k) => (headers[k] = v));
    return { status: res.status, headers, body };
  };
}
