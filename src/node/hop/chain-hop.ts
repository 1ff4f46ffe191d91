/**
 * A hop's side of chained hops (push): a `/forward` that carries the signed
 * route and `X-Meshnet-Chain-Index` runs this node's span and pushes the
 * output on to the next hop itself; the last hop samples and hands the token
 * to the head (`POST /chain/token`). Per token that is N messages:
 *
 *   head ─▶ hop 1 ─▶ hop 2 ─▶ … ─▶ last hop ─▶ head (/chain/token)
 *
 * and nothing else: each push is a one-way request where the relay (or the
 * link) forwards them (FLAG_ONE_WAY: no answer, docs/protocol.md §10), and
 * no hop holds its caller's request open for the rest of the chain. The rows
 * the head needs for replays (every non-first hop's input) travel down the
 * chain with the activation — hop k (k ≥ 1) receives X_1 ‖ … ‖ X_k and runs
 * its span on X_k — and come back in the last hop's /chain/token body.
 *
 * A hop that fails a step (it cannot reach the next hop, its span failed,
 * it refused the route) tells the head itself (`POST /chain/failed`, naming
 * the hop that failed) and, where the request was two-way (ADR-era relay,
 * /rpc, HTTP), answers its caller with the same error. Every hop checks the
 * tracker's signature on the route (403 naming itself when it is bad or
 * expired) and on the head's reply address, refuses a route that visits a
 * node twice or returns to the head (a loop), and one whose hop `index` is
 * not itself. The time left travels with the chain
 * (`X-Meshnet-Chain-Budget-Ms`); each hop gives the next a little less.
 */
import { concatBytes } from '../../protocol/bytes.ts';
import { collectBody, errorReply, type MeshReply, type MeshRequest, type MeshResponse } from '../../protocol/envelopes.ts';
import { MeshError, remoteError } from '../../protocol/errors.ts';
import { H, type HeaderMap } from '../../protocol/headers.ts';
import type { RouteHop } from '../../protocol/tracker.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import type { MeshHandler } from '../../net/contract.ts';
import { VerifiedRoutes, verifyChainReply, type VerifiedRoute, type TrackerKeys } from '../tracker-client.ts';
import { dtypeBytes, isDtype } from '../../protocol/tensor.ts';
import { z } from 'zod';
import { trace } from '../../protocol/trace.ts';
import { appendAttestation, ATTEST_HEADER } from '../../verify/attest.ts';

export interface ChainHopInit {
  peerId: string;
  /** The keys routes must be signed with (one tracker's, or every tracker's of its cluster). */
  trackerKey(): TrackerKeys;
  transport: Pick<HopTransport, 'send' | 'push'> & Partial<Pick<HopTransport, 'inOutageWindow'>>;
  /** This node's own /forward (runs the span). */
  local: MeshHandler;
  now?: () => number;
  onLog?: (message: string) => void;
  /** Steps the head no longer waits for (late, or of an ended session): dropped before they run. */
  stale?: StaleSteps;
}

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

/** Heads whose clock offsets are kept, and ended sessions remembered. */
const STALE_MEMORY = 1024;
/** A head's smallest (receive − sent) is forgotten after this long, ms: it follows clock adjustments and path changes. */
const OFFSET_WINDOW_MS = 60_000;

/**
 * Which chained steps are dead on arrival, without any clock agreement:
 *
 * - late: per head, the smallest (receive − sent) seen lately is its clock
 *   offset plus the quickest delivery; a step whose (receive − sent) exceeds
 *   it by more than the step's budget (X-Meshnet-Chain-Budget-Ms) arrived
 *   after the head stopped waiting for it (a frozen page resumed, its socket's
 *   queue delivered at once). The head has run that step again by then.
 * - ended: its session was dropped (DELETE /sessions/<id>: the generation is
 *   over), so steps still queued for it have nobody to go to.
 *
 * Such a step is not run, pushed on, or reported.
 */
export class StaleSteps {
  private readonly offsets = new Map<string, { min: number; at: number }>();
  private readonly ended = new Set<string>();

  /** The head dropped this session (its generation is over). */
  end(session: string): void {
    this.ended.delete(session);
    if (this.ended.size >= STALE_MEMORY) this.ended.delete(this.ended.values().next().value!);
    this.ended.add(session);
  }

  /** Why this step is dead on arrival, or undefined to run it. `sentAt`, `budgetMs`: the head's (X-Meshnet-Chain-Sent-At); `now`: this node's clock, ms since epoch. */
  check(head: string, session: string, sentAt: number | undefined, budgetMs: number, now: number): string | undefined {
    if (this.ended.has(session)) return `its session ${session} was ended by the head`;
    if (sentAt === undefined) return undefined;
    const offset = now - sentAt;
    let o = this.offsets.get(head);
    if (o === undefined || offset < o.min || now - o.at > OFFSET_WINDOW_MS) {
      if (o === undefined && this.offsets.size >= STALE_MEMORY) this.offsets.delete(this.offsets.keys().next().value!);
      o = { min: offset, at: now };
      this.offsets.set(head, o);
      return undefined;
    }
    const late = offset - o.min;
    return late > budgetMs ? `it arrived ${Math.round(late)} ms later than this head's steps do, past its budget of ${budgetMs} ms` : undefined;
  }
}

/** Budget a chain starts with when the head sends none, ms; and the most a caller may ask for. */
const DEFAULT_BUDGET_MS = 10_000;
const MAX_BUDGET_MS = 600_000;
/** What each hop keeps back from the budget it hands on: its failure report must still reach the head in time. */
const HOP_MARGIN_MS = 250;
/** How long a one-way push waits for an error the relay may send back (no such peer …) before it counts as delivered. */
const PUSH_WINDOW_MS = 2_000;

const replySchema = z.object({ relay_addr: z.string().max(512).optional(), endpoint: z.string().max(512).optional() }).strict();
type ReplyAddress = z.infer<typeof replySchema>;

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

/**
 * Why checkChainRoute refuses a verified route (a loop, a gap), worked out
 * once per route; null: it does not.
 */
class RouteChecks {
  private readonly refused = new WeakMap<VerifiedRoute, MeshError | null>();
  of(head: string, route: VerifiedRoute): MeshError | null {
    let r = this.refused.get(route);
    if (r === undefined) {
      try {
        checkChainRoute(head, route.hops);
        r = null;
      } catch (e) {
        if (!(e instanceof MeshError)) throw e;
        r = e;
      }
      this.refused.set(route, r);
    }
    return r;
  }
}

/**
 * Reply addresses the tracker signed, by signature. Checked before the route,
 * so a hop that refuses a forged or expired route can still tell the head
 * which hop refused: on a one-way path nobody else hears the refusal.
 */
class VerifiedReplies {
  /** By signature: what it was checked for, and the address it parses to (a generation's every step carries the same one). */
  private readonly map = new Map<string, { head: string; expires: number; text: string; address: ReplyAddress }>();
  /** The address (synchronously when known), or false when the tracker did not sign it for this head; 400 when it is signed but not an address. */
  check(key: TrackerKeys, head: string, expires: number, text: string, sig: string): ReplyAddress | Promise<ReplyAddress | false> {
    const hit = this.map.get(sig);
    if (hit && hit.head === head && hit.expires === expires && hit.text === text) return hit.address;
    return this.verify(key, head, expires, text, sig);
  }

  private async verify(key: TrackerKeys, head: string, expires: number, text: string, sig: string): Promise<ReplyAddress | false> {
    if (!(await verifyChainReply(key, head, expires, text, sig))) return false;
    const reply = replySchema.safeParse(safeJson(text));
    if (!reply.success) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.chainReply} must be JSON {relay_addr?, endpoint?}`);
    if (this.map.size >= 256) this.map.clear();
    this.map.set(sig, { head, expires, text, address: reply.data });
    return reply.data;
  }
}

function budgetOf(h: HeaderMap): number {
  const v = h[H.chainBudget];
  if (v === undefined) return DEFAULT_BUDGET_MS;
  if (!/^\d{1,9}$/.test(v.trim())) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.chainBudget} must be a whole number of ms`);
  return Math.min(MAX_BUDGET_MS, Number(v.trim()));
}

/** Bytes of one block of rows (the activation of this step): product of the shape × the dtype's size. */
function blockBytes(h: HeaderMap): number {
  const dtype = h[H.dtype]?.trim() ?? 'f32';
  const dims = (h[H.shape] ?? '').split(',').map((d) => Number(d.trim()));
  if (!isDtype(dtype) || dims.length !== 3 || dims.some((d) => !Number.isSafeInteger(d) || d <= 0)) {
    throw new MeshError('MESH_ERR_BAD_REQUEST', `a chained /forward needs ${H.shape} "1,seq,hidden" and a known ${H.dtype}`);
  }
  return dims[0]! * dims[1]! * dims[2]! * dtypeBytes(dtype);
}

/** The handler for chain /forward requests (route the others to `local`). */
export function createChainHop(init: ChainHopInit): MeshHandler {
  const now = init.now ?? Date.now;
  const routes = new VerifiedRoutes();
  const checks = new RouteChecks();
  const replies = new VerifiedReplies();
  const me = init.peerId;
  /** A push that failed is news, except while our relay is lost or just back: the relay client says that once. */
  const pushLog = (message: string): void => {
    if (!init.transport.inOutageWindow?.()) init.onLog?.(message);
  };
  /** Stale steps dropped since the last line about them (one line per spell, not per step). */
  let staleDropped = 0;
  let staleLoggedAt = 0;

  /** The error naming the hop it concerns (this one unless given). */
  const named = (e: MeshError, peer = me): MeshError =>
    e.details.peer_id === undefined ? new MeshError(e.code, e.message.startsWith('hop ') ? e.message : `hop ${me}: ${e.message}`, { ...e.details, peer_id: peer }) : e;

  /** Tell the head a step failed (POST /chain/failed, one-way where possible), at the reply address the tracker signed. */
  const report = (to: RouteHop, h: HeaderMap, err: MeshError, left: number): void => {
    const headers: HeaderMap = { [H.session]: h[H.session] ?? '', [H.position]: h[H.position] ?? '0', [H.chainFailed]: String(err.details.peer_id ?? me), 'content-type': 'application/json' };
    const body = utf8.encode(JSON.stringify(err.toBody()));
    init.transport.push(to, { method: 'POST', path: '/chain/failed', headers, body }, Math.max(1, left), PUSH_WINDOW_MS).catch((e: unknown) => {
      pushLog(`chain: could not tell the head ${to.peer_id} that a step failed: ${(e as Error).message}`);
    });
  };

  /** The error answer (for a two-way caller), after telling the head. */
  const fail = (to: RouteHop | undefined, h: HeaderMap, e: MeshError, left: number, peer = me): MeshResponse => {
    const err = named(e, peer);
    if (to) report(to, h, err, left);
    return errorReply(err, { [H.chainFailed]: String(err.details.peer_id ?? peer), ...(to ? { [H.chainReported]: '1' } : {}) });
  };

  async function run(req: MeshRequest): Promise<MeshResponse> {
    const t0 = now();
    const h = req.headers;
    trace?.('hop', h[H.session], h[H.position]);
    const indexText = h[H.chainIndex]!.trim();
    const head = h[H.chainHead]?.trim();
    const text = h[H.route];
    const expires = h[H.routeExpires]?.trim();
    const sig = h[H.routeSignature]?.trim();
    // Until the reply address verifies, nobody is told but the caller (no report to an address of a stranger's choosing).
    let to: RouteHop | undefined;
    let budget = DEFAULT_BUDGET_MS;
    const left = () => Math.max(1, budget - (now() - t0) - HOP_MARGIN_MS);
    try {
      if (!/^\d{1,3}$/.test(indexText)) throw new MeshError('MESH_ERR_BAD_REQUEST', `${H.chainIndex} must be a small whole number`);
      if (!head || text === undefined || expires === undefined || sig === undefined) {
        throw new MeshError('MESH_ERR_FORBIDDEN', `a chained /forward needs ${H.chainHead}, ${H.route}, ${H.routeExpires} and ${H.routeSignature}: hops forward only routes the tracker signed`);
      }
      if (!/^\d{1,16}$/.test(expires)) throw new MeshError('MESH_ERR_FORBIDDEN', `${H.routeExpires} must be ms since epoch`);
      budget = budgetOf(h);
      // The reply address first: where the tracker signed it for this head, even a refused route can be reported there.
      const replyText = h[H.chainReply];
      let replyError: MeshError | undefined;
      if (replyText !== undefined) {
        const checked = replies.check(init.trackerKey(), head, Number(expires), replyText, h[H.chainReplySignature]?.trim() ?? '');
        const address = checked instanceof Promise ? await checked : checked;
        if (address === false) {
          replyError = new MeshError('MESH_ERR_FORBIDDEN', `the head's reply address (${H.chainReply}) is not signed by the tracker for this head and route: refused`);
        } else {
          // Layers of the head's own span are not known yet (the route is not); a report needs only the address.
          to = { peer_id: head, start_layer: 0, end_layer: 0, ...address };
        }
      }
      const known = routes.get(init.trackerKey(), head, text, Number(expires), sig, now());
      const route = known instanceof Promise ? await known : known;
      if (replyError) throw replyError;
      if (to) to.end_layer = route.hops[0]?.start_layer ?? 0;
      const refused = checks.of(head, route);
      if (refused) throw refused;
      const hops = route.hops;
      const index = Number(indexText);
      const hop = hops[index];
      if (!hop || hop.peer_id !== me) throw new MeshError('MESH_ERR_MISDIRECTED', `route hop ${index} is ${hop?.peer_id ?? 'missing'}, not this node`);
      const last = index === hops.length - 1;
      if (to === undefined) throw new MeshError('MESH_ERR_FORBIDDEN', `a chained /forward needs the head's reply address (${H.chainReply}) as the tracker signed it`);
      const headTo: RouteHop = to;

      const sent = /^(\d{1,16});(\d{1,9})$/.exec(h[H.chainSentAt]?.trim() ?? '');
      const dead = init.stale?.check(head, h[H.session] ?? '', sent ? Number(sent[1]) : undefined, sent ? Number(sent[2]) : budget, now());
      if (dead !== undefined) {
        // Checked once the route is the tracker's (a stranger cannot skew the offsets). The head has moved on (it ran this step again, or ended the generation): nothing to run, push or report.
        staleDropped++;
        if (staleDropped === 1 || now() - staleLoggedAt > 10_000) {
          init.onLog?.(`chain: dropped ${staleDropped === 1 ? 'a step' : `${staleDropped} steps`} the head no longer waits for (${dead})`);
          staleLoggedAt = now();
          staleDropped = 0;
        }
        return errorReply(new MeshError('MESH_ERR_CANCELLED', `hop ${me}: step dropped: ${dead}`), { [H.chainFailed]: me, [H.chainReported]: '1' });
      }
      // The body: the rows carried for the head (inputs of hops 1..index−1), then this hop's input.
      const block = blockBytes(h);
      const blocks = Math.max(1, index);
      if (req.body.byteLength !== blocks * block) {
        throw new MeshError('MESH_ERR_BAD_REQUEST', `chain hop ${index} expects ${blocks} block(s) of ${block} bytes (the carried rows, then its input); got ${req.body.byteLength} bytes`);
      }
      const input = req.body.subarray(req.body.byteLength - block);

      // This node's span, on the layers the signed route gives it (not whatever the caller wrote).
      const localHeaders: HeaderMap = { ...h, [H.startLayer]: String(hop.start_layer), [H.endLayer]: String(hop.end_layer) };
      if (!last) delete localHeaders[H.sampling];
      trace?.('hop-checked', h[H.session], h[H.position]);
      const res = await init.local({ ...req, headers: localHeaders, body: input });
      // A span's answer is bytes: no await (one microtask turn less on every step's critical path).
      const out = res.body instanceof Uint8Array ? res.body : await collectBody(res.body);
      trace?.('hop-span', h[H.session], h[H.position]);
      if (res.status !== 200) return fail(headTo, h, remoteError(res.status, out), left());

      // Full batches anywhere on the way reach the head with the token (it stops drafting for a while).
      const batchFull = h[H.batchFull] === '1' || res.headers[H.batchFull] === '1';
      // The hops' attestations travel with the step: each adds its latest to what it received (docs/protocol.md §11).
      const attest = res.headers[ATTEST_HEADER] !== undefined ? appendAttestation(h[ATTEST_HEADER], res.headers[ATTEST_HEADER]) : h[ATTEST_HEADER];
      if (last) {
        // The token in a header, and the carried rows (X_1 … X_n−1, all but hop 1's input) as the body.
        const tokenText = utf8d.decode(out);
        const headers: HeaderMap = { [H.session]: h[H.session] ?? '', [H.position]: h[H.position] ?? '0', [H.chainToken]: tokenText, [H.dtype]: h[H.dtype] ?? '', 'content-type': 'application/octet-stream' };
        if (batchFull) headers[H.batchFull] = '1';
        if (attest !== undefined) headers[ATTEST_HEADER] = attest;
        // The token push carries no route headers: the signed route goes along as the proof a data channel to the head needs.
        const proof = { head, route: text, expires: Number(expires), signature: sig };
        init.transport.push(headTo, { method: 'POST', path: '/chain/token', headers, body: req.body }, left(), PUSH_WINDOW_MS, undefined, { accept: (r) => r.status === 204 || r.status === 404, proof }).then(
          (got) => {
            if (got.status === 404) pushLog(`chain: the head ${head} waits for no token at position ${h[H.position]} (late, or it gave up on the step)`);
          },
          (e: unknown) => pushLog(`chain: hop ${me} could not hand its token to the head ${head}: ${(e as Error).message}`),
        );
        trace?.('hop-pushed', h[H.session], h[H.position]);
        return accepted();
      }

      const next = hops[index + 1]!;
      const fwd: HeaderMap = {};
      for (const k of [H.dtype, H.session, H.position, H.sessionTokens, H.sampling, H.route, H.routeExpires, H.routeSignature, H.chainHead, H.chainReply, H.chainReplySignature, H.chainSentAt, H.draft, H.rollback]) {
        const v = h[k];
        if (v !== undefined) fwd[k] = v;
      }
      if (batchFull) fwd[H.batchFull] = '1';
      fwd[H.shape] = res.headers[H.shape] ?? h[H.shape] ?? '';
      fwd[H.startLayer] = String(next.start_layer);
      fwd[H.endLayer] = String(next.end_layer);
      fwd[H.chainIndex] = String(index + 1);
      fwd[H.chainBudget] = String(Math.max(1, left() - HOP_MARGIN_MS));
      fwd['content-type'] = 'application/octet-stream';
      if (attest !== undefined) fwd[ATTEST_HEADER] = attest;
      if (out.byteLength !== block) return fail(headTo, h, new MeshError('MESH_ERR_INTERNAL', `the span answered ${out.byteLength} bytes for a ${block}-byte block`), left());
      // Hop 1's output is X_1, the first row block the head needs back; every later hop adds its own.
      const body = index === 0 ? out : concatBytes([req.body, out]);
      // Not awaited: the step goes on from the next hop; what comes back is only ever a failure to report.
      init.transport.push(next, { method: 'POST', path: '/forward', headers: fwd, body }, left(), PUSH_WINDOW_MS, undefined, { accept: isChainAnswer }).then(
        (down) => {
          if (down.status < 300) return;
          // A two-way next hop's refusal: it told the head itself when it could.
          if (down.headers[H.chainReported] === '1') return;
          const f = chainFailure(down);
          report(headTo, h, named(f.error, f.peer ?? next.peer_id), left());
        },
        (e: unknown) => {
          const why = e instanceof MeshError ? e.message : String(e);
          pushLog(`chain: the next hop ${next.peer_id} is unreachable: ${why}`);
          const code = e instanceof MeshError && e.code === 'MESH_ERR_TIMEOUT' ? 'MESH_ERR_TIMEOUT' : 'MESH_ERR_PEER_GONE';
          report(headTo, h, new MeshError(code, `hop ${me} could not reach the next hop ${next.peer_id}: ${why}`, { peer_id: next.peer_id }), left());
        },
      );
      trace?.('hop-pushed', h[H.session], h[H.position]);
      return accepted();
    } catch (e) {
      if (e instanceof MeshError) {
        if (e.status === 403) init.onLog?.(`chain: refused a route: ${e.message}`);
        return fail(to, h, e, left());
      }
      init.onLog?.(`chain: ${(e as Error).stack ?? String(e)}`);
      return fail(to, h, new MeshError('MESH_ERR_INTERNAL', 'the node failed to run this chained step; it keeps serving'), left());
    }
  }

  return run;
}

/** A hop's answer once it ran its span and handed the step on (a two-way caller's only news; one-way callers get none). */
function accepted(): MeshResponse {
  return { status: 202, headers: { [H.chain]: '1' }, body: new Uint8Array(0) };
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
