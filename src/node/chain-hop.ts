/**
 * A hop's side of chained hops (push): a `/forward` that carries the signed
 * route and `X-Meshnet-Chain-Index` runs this node's span and pushes the
 * output on to the next hop itself; the last hop samples and POSTs the token
 * to the head's `/chain/token`. Per token that is N legs instead of the
 * star's 2(N−1):
 *
 *   head ─▶ hop 1 ─▶ hop 2 ─▶ … ─▶ last hop ─▶ head (/chain/token)
 *
 * Off the critical path every hop answers its caller once the rest of the
 * chain has answered it: a non-last hop's answer is its own output followed
 * by the downstream hops' outputs, so the head ends up holding every hop's
 * input rows (what it replays into a replacement), and a hop that cannot
 * reach the next one answers with an error naming that hop
 * (`X-Meshnet-Chain-Failed` and the body's `peer_id`).
 *
 * Every hop checks the tracker's signature on the route before it runs or
 * forwards anything (403 naming itself when it is bad or expired), refuses a
 * route that visits a node twice or returns to the head (a loop), and
 * refuses a route whose hop `index` is not itself. The time left for the
 * chain travels with it (`X-Meshnet-Chain-Budget-Ms`) and each hop gives the
 * next a little less, so the hop next to a gone one reports before the head's
 * own step timeout fires.
 */
import { concatBytes } from '../protocol/bytes.ts';
import { collectBody, errorReply, type MeshReply, type MeshRequest, type MeshResponse } from '../protocol/envelopes.ts';
import { MeshError, remoteError } from '../protocol/errors.ts';
import { H, type HeaderMap } from '../protocol/headers.ts';
import type { RouteHop } from '../protocol/tracker.ts';
import type { HopTransport } from './hop-transport.ts';
import type { MeshHandler } from './mesh-types.ts';
import { verifySignedRoute } from './tracker-client.ts';
import { z } from 'zod';

export interface ChainHopInit {
  peerId: string;
  trackerKey(): Uint8Array | undefined;
  transport: Pick<HopTransport, 'send'>;
  /** This node's own /forward (runs the span). */
  local: MeshHandler;
  now?: () => number;
  onLog?: (message: string) => void;
}

/** Budget a chain starts with when the head sends none, ms; and the most a caller may ask for. */
const DEFAULT_BUDGET_MS = 10_000;
const MAX_BUDGET_MS = 600_000;
/** What each hop keeps back from the budget it hands on: its own answer must still reach its caller in time. */
const HOP_MARGIN_MS = 250;

const replySchema = z.object({ relay_addr: z.string().max(512).optional(), endpoint: z.string().max(512).optional() }).strict();

/** True when a /forward asks this node to take part in a chain. */
export function isChainRequest(req: MeshRequest): boolean {
  return req.headers[H.chainIndex] !== undefined;
}

/** An answer a chain hop gave (as opposed to a relay's or a transport's): the caller passes it up whatever its status. */
export function isChainAnswer(reply: MeshReply): boolean {
  return reply.headers[H.chain] !== undefined || reply.headers[H.chainFailed] !== undefined;
}

/**
 * A route is refused when it visits a node twice or returns to the head: a
 * loop would make a hop push to itself, or a signed route replayed in a
 * circle keep nodes busy.
 */
export function checkChainRoute(head: string, hops: readonly RouteHop[]): void {
  const seen = new Set<string>([head]);
  let at = hops[0]?.start_layer ?? 0;
  for (const h of hops) {
    if (seen.has(h.peer_id)) throw new MeshError('MESH_ERR_BAD_REQUEST', `the route visits ${h.peer_id} twice (a loop): refused`);
    seen.add(h.peer_id);
    if (h.start_layer !== at || h.end_layer <= h.start_layer) throw new MeshError('MESH_ERR_BAD_REQUEST', `route hop ${h.peer_id} runs [${h.start_layer}, ${h.end_layer}) but the previous one ends at ${at}`);
    at = h.end_layer;
  }
}

/** Verified routes by signature: a generation's route is checked by the signature once, its expiry on every step. */
class VerifiedRoutes {
  private readonly map = new Map<string, { head: string; text: string; expires: number; hops: RouteHop[] }>();
  async get(key: Uint8Array | undefined, head: string, text: string, expires: number, sig: string, now: number): Promise<RouteHop[]> {
    const hit = this.map.get(sig);
    if (hit && hit.head === head && hit.text === text && hit.expires === expires) {
      if (expires < now) throw new MeshError('MESH_ERR_FORBIDDEN', `the route expired ${now - expires} ms ago; ask the tracker for a fresh one`);
      return hit.hops;
    }
    const hops = await verifySignedRoute(key, head, text, expires, sig, now);
    if (this.map.size >= 256) this.map.clear();
    this.map.set(sig, { head, text, expires, hops });
    return hops;
  }
}

function budgetOf(h: HeaderMap): number {
  const v = h[H.chainBudget];
  if (v === undefined) return DEFAULT_BUDGET_MS;
  if (!/^\d{1,9}$/.test(v.trim())) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.chainBudget} must be a whole number of ms`);
  return Math.min(MAX_BUDGET_MS, Number(v.trim()));
}

/** The handler for chain /forward requests (route the others to `local`). */
export function createChainHop(init: ChainHopInit): MeshHandler {
  const now = init.now ?? Date.now;
  const routes = new VerifiedRoutes();
  const me = init.peerId;

  /** An error this hop answers with, naming the hop it concerns (itself unless given). */
  const fail = (e: MeshError, peer = me): MeshResponse => {
    const err = e.details.peer_id === undefined ? new MeshError(e.code, e.message.startsWith('hop ') ? e.message : `hop ${me}: ${e.message}`, { ...e.details, peer_id: peer }) : e;
    return errorReply(err, { [H.chainFailed]: String(err.details.peer_id ?? peer) });
  };

  async function run(req: MeshRequest): Promise<MeshResponse> {
    const t0 = now();
    const h = req.headers;
    const indexText = h[H.chainIndex]!.trim();
    const head = h[H.chainHead]?.trim();
    const text = h[H.route];
    const expires = h[H.routeExpires]?.trim();
    const sig = h[H.routeSignature]?.trim();
    if (!/^\d{1,3}$/.test(indexText)) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.chainIndex} must be a small whole number`);
    if (!head || text === undefined || expires === undefined || sig === undefined) {
      throw new MeshError('MESH_ERR_FORBIDDEN', `a chained /forward needs ${H.chainHead}, ${H.route}, ${H.routeExpires} and ${H.routeSignature}: hops forward only routes the tracker signed`);
    }
    if (!/^\d{1,16}$/.test(expires)) throw new MeshError('MESH_ERR_FORBIDDEN', `${H.routeExpires} must be ms since epoch`);
    const hops = await routes.get(init.trackerKey(), head, text, Number(expires), sig, now());
    checkChainRoute(head, hops);
    const index = Number(indexText);
    const hop = hops[index];
    if (!hop || hop.peer_id !== me) throw new MeshError('MESH_ERR_MISDIRECTED', `route hop ${index} is ${hop?.peer_id ?? 'missing'}, not this node`);
    const last = index === hops.length - 1;
    const budget = budgetOf(h);

    // This node's span, on the layers the signed route gives it (not whatever the caller wrote).
    const localHeaders: HeaderMap = { ...h, [H.startLayer]: String(hop.start_layer), [H.endLayer]: String(hop.end_layer) };
    if (!last) delete localHeaders[H.sampling];
    const res = await init.local({ ...req, headers: localHeaders });
    const out = await collectBody(res.body);
    if (res.status !== 200) return { status: res.status, headers: { ...res.headers, [H.chainFailed]: me }, body: out };
    const left = () => Math.max(1, budget - (now() - t0) - HOP_MARGIN_MS);

    if (last) {
      let reply = h[H.chainReply] !== undefined ? replySchema.safeParse(safeJson(h[H.chainReply])) : undefined;
      if (reply && !reply.success) reply = undefined;
      const addr = { ...(reply?.data ?? {}) };
      // The reply address is not signed: a relay address must at least name the signed head (a /rpc/<peer> URL), or it is not used.
      if (addr.relay_addr !== undefined && !addr.relay_addr.includes(head)) delete addr.relay_addr;
      const to: RouteHop = { peer_id: head, start_layer: 0, end_layer: hops[0]!.start_layer, ...addr };
      const headers: HeaderMap = { [H.session]: h[H.session] ?? '', [H.position]: h[H.position] ?? '0', 'content-type': 'application/json' };
      let got: MeshReply;
      try {
        got = await init.transport.send(to, { method: 'POST', path: '/chain/token', headers, body: out }, left(), req.signal, { accept: (r) => r.status === 204 || r.status === 404 });
      } catch (e) {
        throw new MeshError('MESH_ERR_PEER_GONE', `hop ${me} could not hand its token to the head ${head}: ${(e as Error).message}`, { peer_id: head });
      }
      if (got.status !== 204) throw new MeshError('MESH_ERR_NOT_FOUND', `the head ${head} waits for no token of this step (${got.status})`, { peer_id: head });
      return { status: 200, headers: { [H.chain]: '1', 'content-type': 'application/octet-stream' }, body: new Uint8Array(0) };
    }

    const next = hops[index + 1]!;
    const fwd: HeaderMap = {};
    for (const k of [H.dtype, H.session, H.position, H.sessionTokens, H.sampling, H.route, H.routeExpires, H.routeSignature, H.chainHead, H.chainReply]) {
      const v = h[k];
      if (v !== undefined) fwd[k] = v;
    }
    fwd[H.shape] = res.headers[H.shape] ?? h[H.shape] ?? '';
    fwd[H.startLayer] = String(next.start_layer);
    fwd[H.endLayer] = String(next.end_layer);
    fwd[H.chainIndex] = String(index + 1);
    fwd[H.chainBudget] = String(Math.max(1, left() - HOP_MARGIN_MS));
    fwd['content-type'] = 'application/octet-stream';
    let down: MeshReply;
    try {
      down = await init.transport.send(next, { method: 'POST', path: '/forward', headers: fwd, body: out }, left(), req.signal, { accept: isChainAnswer });
    } catch (e) {
      const why = e instanceof MeshError ? e.message : String(e);
      init.onLog?.(`chain: the next hop ${next.peer_id} is unreachable: ${why}`);
      return fail(new MeshError(e instanceof MeshError && e.code === 'MESH_ERR_TIMEOUT' ? 'MESH_ERR_TIMEOUT' : 'MESH_ERR_PEER_GONE', `hop ${me} could not reach the next hop ${next.peer_id}: ${why}`, { peer_id: next.peer_id }), next.peer_id);
    }
    if (down.status !== 200) {
      // The failure happened further on: pass it up as it is, still naming the hop that failed.
      const failed = down.headers[H.chainFailed] ?? next.peer_id;
      return { status: down.status, headers: { ...down.headers, [H.chainFailed]: failed }, body: down.body };
    }
    if (down.headers[H.chain] === undefined) {
      return fail(new MeshError('MESH_ERR_UPSTREAM', `the next hop ${next.peer_id} does not chain (an ADR-era node?); use the star`, { peer_id: next.peer_id }), next.peer_id);
    }
    return { status: 200, headers: { [H.chain]: '1', 'content-type': 'application/octet-stream' }, body: down.body.byteLength > 0 ? concatBytes([out, down.body]) : out };
  }

  return async (req) => {
    try {
      return await run(req);
    } catch (e) {
      if (e instanceof MeshError) {
        if (e.status === 403) init.onLog?.(`chain: refused a route: ${e.message}`);
        return fail(e);
      }
      init.onLog?.(`chain: ${(e as Error).stack ?? String(e)}`);
      return fail(new MeshError('MESH_ERR_INTERNAL', 'the node failed to run this chained step; it keeps serving'));
    }
  };
}

function safeJson(text: string | undefined): unknown {
  try {
    return JSON.parse(text ?? '');
  } catch {
    return undefined;
  }
}

/** The error a chain hop answered with, and the hop it names. */
export function chainFailure(reply: MeshReply): { peer: string | undefined; error: MeshError } {
  const error = remoteError(reply.status, reply.body);
  const named = error.details.peer_id;
  return { peer: reply.headers[H.chainFailed] ?? (typeof named === 'string' ? named : undefined), error };
}
