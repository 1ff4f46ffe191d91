/**
 * `POST /generate` on a head node (the node holding layer 0, the embedding
 * and the tokenizer), composed in front of the forward handler: every other
 * path goes to the node's ordinary HTTP surface.
 *
 * A head accepts `X-Meshnet-Route` only from the tracker: the route text,
 * `X-Meshnet-Route-Expires` (ms since epoch) and this head's peer id must be
 * covered by `X-Meshnet-Route-Signature` (Ed25519, the tracker's key).
 * Unsigned, forged, expired or other-head routes get 403 before anything
 * runs, so no client can point a head at arbitrary endpoints.
 *
 * The answer is a stream of NDJSON lines, one GenerateEvent each, produced
 * as the consumer pulls (relay DATA frames, or chunked HTTP).
 *
 * A generation whose stream is lost with the connection (the relay
 * restarting, the tracker's or our own connection to it dropping — not a
 * CANCEL the tracker sent) is parked for `parkMs`: its pipeline pauses at its
 * next event (pull-driven: no step runs), keeps its sessions on the hops, and
 * the tracker may ask for it again (`X-Meshnet-Resume: 1` with the same
 * session_id and route): every event is sent again from the start (the
 * tracker keeps the indexes it lacks) and the generation goes on, nothing
 * recomputed. Not asked for within `parkMs`: it ends, its sessions dropped.
 */
import { z } from 'zod';
import { errorReply, jsonReply, type MeshRequest, type MeshResponse } from '../../protocol/envelopes.ts';
import { MeshError, remoteError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import { generateRequestSchema, type GenerateEvent, type RouteHop } from '../../protocol/tracker.ts';
import type { MeshHandler } from '../../net/contract.ts';
import type { PipelineDriver } from './pipeline.ts';
import { signedByAny, VerifiedRoutes, type TrackerKeys } from '../tracker-client.ts';
import { trace } from '../../protocol/trace.ts';
import { decodeBase64 as decodeBase64Url } from '../../protocol/base64.ts';
import { ATTEST_HEADER } from '../../verify/attest.ts';
import { CHECK_PLAN_HEADER, CHECK_PLAN_SIGNATURE_HEADER, checkPlanMessage, checkPlanSchema, DISTRUST_PATH, distrustMessage, distrustSchema, WALK_PATH, type Distrust } from '../../verify/plan.ts';
import { verifyEd25519 } from '../../net/identity.ts';
import type { SignedPlan } from '../verify/verifier.ts';
import { AUDIT_PATH, auditRequestSchema, recordsJson, runAudit } from '../verify/audit.ts';

export interface HeadHandlerInit {
  /** Everything but /generate. */
  forward: MeshHandler;
  /** This node's peer id: routes are signed for one head. */
  peerId: string;
  /** The tracker's route-signing key; undefined until known (then /generate answers 403). */
  /** The keys routes must be signed with (one tracker's, or every tracker's of its cluster). */
  trackerKey(): TrackerKeys;
  /** The driver while this node holds layer 0 and the tokenizer; undefined otherwise (then /generate answers 421). */
  pipeline(): PipelineDriver | undefined;
  /** Largest /generate body, bytes. @defaultValue 1048576 */
  maxBodyBytes?: number;
  now?: () => number;
  onLog?: (message: string) => void;
  /** Every event of every generation, as it is sent (the host logs recoveries and finishes). */
  onEvent?: (event: GenerateEvent, sessionId: string) => void;
  /** The tracker's verified notice that a node is quarantined (POST /verify/distrust). */
  onDistrust?: (notice: Distrust) => void;
  /** The tracker's verified walk: check every span of a finished generation with this plan; false when it is not kept. */
  onWalk?: (plan: SignedPlan) => boolean;
  /** How long a generation whose stream was lost with the connection waits to be asked for again, ms. @defaultValue 15000 */
  parkMs?: number;
}

/** Default HeadHandlerInit.parkMs: the tracker's relay outage budget (10 s) and some. */
export const PARK_MS = 15_000;

/** One generation this head runs, while it runs or waits (parked) for its tracker to ask for it again. */
interface Live {
  sessionId: string;
  /** The signed route text it runs on: a resume must name the same. */
  route: string;
  events: AsyncGenerator<GenerateEvent>;
  /** Its own signal: it outlives the request it came with while parked. */
  ctl: AbortController;
  /** Every event sent so far but the last (done/error): a resumed stream sends them again. */
  sent: GenerateEvent[];
  /** The stream that reads it now (a resume takes it over); undefined while parked. */
  owner: object | undefined;
  /** The pipeline's next event, while one is being made: a resume that takes over waits for the same one (one pull at a time). */
  pulling: Promise<IteratorResult<GenerateEvent>> | undefined;
  parkTimer: ReturnType<typeof setTimeout> | undefined;
}

/** The request's stream was cut with the connection (ours or the caller's to the relay), not stopped by its caller. */
function lostWithConnection(signal: AbortSignal | undefined): boolean {
  if (!signal?.aborted) return false;
  const r = signal.reason as { details?: { reason?: unknown } } | undefined;
  return r instanceof MeshError && r.details.reason === 'disconnected';
}

/** The tracker's check plan that came with /generate (the head passes it on to checkers, who verify it). */
function checkPlanOf(h: Record<string, string>): SignedPlan | undefined {
  const text = h[CHECK_PLAN_HEADER];
  const signature = h[CHECK_PLAN_SIGNATURE_HEADER]?.trim();
  if (text === undefined || !signature) return undefined;
  try {
    return { text, signature, plan: checkPlanSchema.parse(JSON.parse(text)) };
  } catch {
    // A plan this head cannot read: the generation runs unchecked (its hops stay "not checked").
    return undefined;
  }
}

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

/** 421 Misdirected Request: a route pointed at a node that is not (or no longer) a head. */
function notAHead(): MeshResponse {
  return errorReply(new MeshError('MESH_ERR_MISDIRECTED', 'this node does not hold layer 0 and the tokenizer now; ask the tracker for a fresh route'));
}

export function createHeadHandler(init: HeadHandlerInit): MeshHandler {
  const maxBody = init.maxBodyBytes ?? 1 << 20;
  const now = init.now ?? Date.now;
  const parkMs = init.parkMs ?? PARK_MS;
  const routes = new VerifiedRoutes();
  /** Generations running or parked, by session id. */
  const live = new Map<string, Live>();

  /** The generation's next event; one pull at a time, shared by whoever waits for it. */
  const pull = (g: Live): Promise<IteratorResult<GenerateEvent>> => {
    g.pulling ??= g.events.next().finally(() => {
      g.pulling = undefined;
    });
    return g.pulling;
  };

  /** End a generation for good: its pipeline's finally drops the sessions everywhere. */
  const end = (g: Live): void => {
    if (g.parkTimer !== undefined) clearTimeout(g.parkTimer);
    g.parkTimer = undefined;
    g.owner = undefined;
    if (live.get(g.sessionId) === g) live.delete(g.sessionId);
    g.ctl.abort(new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled'));
    void g.events.return(undefined).catch(() => undefined);
  };

  /**
   * The NDJSON of one reading of a generation: `replay` sends its events so
   * far first (a resume). Pull-driven: an event is made when the reader takes
   * the last one. Leaving early ends the generation, or parks it when the
   * connection took the stream with it.
   */
  async function* ndjson(g: Live, replay: boolean, signal: AbortSignal | undefined): AsyncGenerator<Uint8Array> {
    const me = {};
    g.owner = me;
    let over = false;
    // Stopped by whoever reads it (a caller that cancels, a node whose drain's grace ended): the pipeline
    // ends with an error event. A connection that went away parks it instead (below).
    const onAbort = (): void => {
      if (g.owner === me && !lostWithConnection(signal)) g.ctl.abort(signal!.reason);
    };
    if (signal?.aborted) onAbort();
    else signal?.addEventListener('abort', onAbort, { once: true });
    try {
      if (replay) for (const ev of [...g.sent]) yield utf8.encode(JSON.stringify(ev) + '\n');
      for (;;) {
        if (g.owner !== me) return;
        const r = await pull(g);
        // A resume took over while the event was being made: it has the same event, and sends it.
        if (g.owner !== me) return;
        if (r.done) {
          over = true;
          return;
        }
        const ev = r.value;
        const last = ev.type === 'done' || ev.type === 'error';
        if (last) over = true;
        else g.sent.push(ev);
        init.onEvent?.(ev, g.sessionId);
        const line = utf8.encode(JSON.stringify(ev) + '\n');
        trace?.('ndjson');
        yield line;
        trace?.('pulled');
        if (last) return;
      }
    } finally {
      signal?.removeEventListener('abort', onAbort);
      // A resume took it over: that reading owns it now.
      if (g.owner === me) {
        if (!over && lostWithConnection(signal)) {
          g.owner = undefined;
          init.onLog?.(`generation ${g.sessionId}: its stream was lost with the connection after ${g.sent.filter((e) => e.type === 'token').length} token(s); parked ${parkMs} ms for the tracker to ask for it again`);
          g.parkTimer = setTimeout(() => {
            init.onLog?.(`generation ${g.sessionId}: nobody asked for it within ${parkMs} ms (the client left, or the tracker restarted); ended`);
            end(g);
          }, parkMs);
        } else end(g);
      }
    }
  }

  /** The route of a /generate or /audit, as the tracker signed it for this head (403 otherwise). */
  async function signedRoute(h: Record<string, string>): Promise<{ route: RouteHop[]; routeText: string; expires: string; signature: string }> {
    const routeText = h[H.route];
    const expires = h[H.routeExpires];
    const signature = h[H.routeSignature];
    if (routeText === undefined || expires === undefined || signature === undefined) {
      throw new MeshError('MESH_ERR_FORBIDDEN', `${H.route}, ${H.routeExpires} and ${H.routeSignature} are required: a head accepts routes only from the tracker`);
    }
    if (!/^\d{1,16}$/.test(expires.trim())) throw new MeshError('MESH_ERR_FORBIDDEN', `${H.routeExpires} must be ms since epoch`);
    const known = routes.get(init.trackerKey(), init.peerId, routeText, Number(expires.trim()), signature.trim(), now());
    // Copies: the pipeline may change its hops (replacements), the cached route stays as signed.
    return { route: (known instanceof Promise ? await known : known).hops.map((hop) => ({ ...hop })), routeText, expires, signature };
  }

  /** A head audit (verify/audit.ts): the tracker's signed route, one prefill, one record per audited token. */
  async function audit(req: MeshRequest): Promise<MeshResponse> {
    const { route } = await signedRoute(req.headers);
    const driver = init.pipeline();
    if (!driver) return notAHead();
    if (req.body.byteLength > maxBody) throw new MeshError('MESH_ERR_TOO_LARGE', `the /audit body is ${req.body.byteLength} bytes, over ${maxBody}`);
    let raw: unknown;
    try {
      raw = JSON.parse(utf8d.decode(req.body));
    } catch {
      throw new MeshError('MESH_ERR_BAD_REQUEST', 'the /audit body is not JSON');
    }
    const p = auditRequestSchema.safeParse(raw);
    if (!p.success) throw new MeshError('MESH_ERR_BAD_REQUEST', `/audit body: ${p.error.issues[0]!.path.join('.') || 'value'}: ${p.error.issues[0]!.message}`);
    const records = await runAudit(driver, init.peerId, p.data, route);
    return jsonReply(200, { records: recordsJson(records) });
  }

  async function generate(req: MeshRequest): Promise<MeshResponse> {
    const h = req.headers;
    const { route, routeText, expires, signature } = await signedRoute(h);
    const driver = init.pipeline();
    if (!driver) return notAHead();
    if (req.body.byteLength > maxBody) throw new MeshError('MESH_ERR_TOO_LARGE', `the /generate body is ${req.body.byteLength} bytes, over ${maxBody}`);
    let raw: unknown;
    try {
      raw = JSON.parse(utf8d.decode(req.body));
    } catch {
      throw new MeshError('MESH_ERR_BAD_REQUEST', 'the /generate body is not JSON');
    }
    const p = generateRequestSchema.safeParse(raw);
    if (!p.success) {
      const i = p.error.issues[0]!;
      throw new MeshError('MESH_ERR_BAD_REQUEST', `/generate body: ${i.path.join('.') || 'value'}: ${i.message}`);
    }
    if ((!p.data.messages || p.data.messages.length === 0) && p.data.prompt === undefined && p.data.prompt_token_ids === undefined) throw new MeshError('MESH_ERR_BAD_REQUEST', '/generate body: give messages, prompt or prompt_token_ids');
    // Refuse a bad route now (400) rather than as the stream's first event.
    driver.planRoute(init.peerId, route);
    // The reply address is passed on as the tracker signed it (the hops check it); the head need not trust it itself.
    const replyText = h[H.chainReply];
    const replySig = h[H.chainReplySignature]?.trim();
    const reply = replyText !== undefined && replySig ? { reply: { text: replyText, signature: replySig } } : {};
    const headers = { 'content-type': 'application/x-ndjson', 'cache-control': 'no-store' };
    const sessionId = p.data.session_id;
    const prev = live.get(sessionId);
    if (prev && h[H.resume] === '1' && prev.route === routeText) {
      // The tracker lost this generation's stream and asks for it again: it goes on where it paused.
      if (prev.parkTimer !== undefined) clearTimeout(prev.parkTimer);
      prev.parkTimer = undefined;
      init.onLog?.(`generation ${sessionId}: resumed after its stream was lost (${prev.sent.filter((e) => e.type === 'token').length} token(s) sent again)`);
      return { status: 200, headers, body: ndjson(prev, true, req.signal) };
    }
    // The same id again without a resume (a tracker that restarted numbering): the old one is over.
    if (prev) end(prev);
    const ctl = new AbortController();
    const plan = checkPlanOf(h);
    const events = driver.generate(init.peerId, p.data, route, { signal: ctl.signal, signed: { text: routeText, expires: Number(expires.trim()), signature: signature.trim(), ...reply }, ...(plan ? { plan } : {}) });
    const g: Live = { sessionId, route: routeText, events, ctl, sent: [], owner: undefined, pulling: undefined, parkTimer: undefined };
    live.set(sessionId, g);
    return { status: 200, headers, body: ndjson(g, false, req.signal) };
  }

  /** A chained step's token from the route's last hop (src/node/hop/chain-hop.ts): the token JSON in a header, the rows for replays as the body. */
  function chainToken(req: MeshRequest): MeshResponse {
    const at = chainStepOf(req);
    if ('status' in at) return at;
    const token = req.headers[H.chainToken];
    if (token === undefined || token.length > 4096) return errorReply(new MeshError('MESH_ERR_BAD_REQUEST', `${H.chainToken} must hold the token's JSON`));
    // Only a step waiting for exactly this session and position takes it; the token and rows are checked by that step.
    trace?.('token-in', at.session, at.position);
    const attest = req.headers[ATTEST_HEADER];
    if (!init.pipeline()?.chainInbox.deliver(at.session, at.position, { token, rows: req.body, ...(req.headers[H.batchFull] === '1' ? { batchFull: true } : {}), ...(attest !== undefined ? { attest } : {}) })) return errorReply(new MeshError('MESH_ERR_NOT_FOUND', 'no chained step waits for this token'));
    return { status: 204, headers: {}, body: new Uint8Array(0) };
  }

  /** A hop's report that a chained step failed (the hop named in X-Meshnet-Chain-Failed; the body is the error). */
  function chainFailed(req: MeshRequest): MeshResponse {
    const at = chainStepOf(req);
    if ('status' in at) return at;
    const peer = req.headers[H.chainFailed]?.trim();
    const error = remoteError(undefined, req.body.subarray(0, 16_384), 'a hop reported a failed chain step');
    const named = peer && /^[0-9a-f]{32}$/.test(peer) ? peer : undefined;
    if (!init.pipeline()?.chainInbox.fail(at.session, at.position, named, error)) return errorReply(new MeshError('MESH_ERR_NOT_FOUND', 'no chained step waits at this position'));
    return { status: 204, headers: {}, body: new Uint8Array(0) };
  }

  function chainStepOf(req: MeshRequest): { session: string; position: number } | MeshResponse {
    if (req.method.toUpperCase() !== 'POST') return errorReply(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', `use POST ${req.path.split('?')[0]}`), { allow: 'POST' });
    const session = req.headers[H.session]?.trim() ?? '';
    const position = req.headers[H.position]?.trim() ?? '';
    if (!/^\d{1,9}$/.test(position)) return errorReply(new MeshError('MESH_ERR_BAD_REQUEST', `${H.position} must be a non-negative integer`));
    return { session, position: Number(position) };
  }

  /** The tracker's signed notice that a node is quarantined: this head stops using it before its next step. */
  async function distrustNotice(req: MeshRequest): Promise<MeshResponse> {
    if (req.method.toUpperCase() !== 'POST') return errorReply(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', `use POST ${DISTRUST_PATH}`), { allow: 'POST' });
    let raw: unknown;
    try {
      raw = JSON.parse(utf8d.decode(req.body.subarray(0, 4096)));
    } catch {
      return errorReply(new MeshError('MESH_ERR_BAD_REQUEST', 'a distrust notice is JSON {notice, signature}'));
    }
    const p = z.object({ notice: distrustSchema, signature: z.string().max(200) }).safeParse(raw);
    if (!p.success) return errorReply(new MeshError('MESH_ERR_BAD_REQUEST', 'a distrust notice is JSON {notice: {peer_id, until, offence?}, signature}'));
    const key = init.trackerKey();
    let sig: Uint8Array;
    try {
      sig = decodeBase64Url(p.data.signature);
    } catch {
      return errorReply(new MeshError('MESH_ERR_UNAUTHORIZED', 'the notice signature is not base64url'));
    }
    if (!(await signedByAny(key, distrustMessage(p.data.notice), sig, verifyEd25519))) return errorReply(new MeshError('MESH_ERR_UNAUTHORIZED', 'the notice is not signed by this node\'s tracker'));
    init.onDistrust?.(p.data.notice);
    return { status: 204, headers: {}, body: new Uint8Array(0) };
  }

  /** The tracker's walk after a head audit contradicted a generation: a plan (signed by the tracker) checking every span of it. */
  async function walk(req: MeshRequest): Promise<MeshResponse> {
    if (req.method.toUpperCase() !== 'POST') return errorReply(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', `use POST ${WALK_PATH}`), { allow: 'POST' });
    let raw: { plan?: unknown; signature?: unknown };
    try {
      raw = JSON.parse(utf8d.decode(req.body.subarray(0, 70_000))) as typeof raw;
    } catch {
      return errorReply(new MeshError('MESH_ERR_BAD_REQUEST', 'a walk is JSON {plan, signature}'));
    }
    if (typeof raw.plan !== 'string' || typeof raw.signature !== 'string') return errorReply(new MeshError('MESH_ERR_BAD_REQUEST', 'a walk is JSON {plan, signature}'));
    const plan = checkPlanOf({ [CHECK_PLAN_HEADER]: raw.plan, [CHECK_PLAN_SIGNATURE_HEADER]: raw.signature });
    const key = init.trackerKey();
    let sig: Uint8Array;
    try {
      sig = decodeBase64Url(raw.signature);
    } catch {
      return errorReply(new MeshError('MESH_ERR_UNAUTHORIZED', 'the walk\'s plan signature is not base64url'));
    }
    if (!plan || plan.plan.head !== init.peerId || !(await signedByAny(key, checkPlanMessage(init.peerId, raw.plan), sig, verifyEd25519))) return errorReply(new MeshError('MESH_ERR_UNAUTHORIZED', 'the walk\'s plan is not signed by this node\'s tracker for this head'));
    if (!init.onWalk?.(plan)) return errorReply(new MeshError('MESH_ERR_NOT_FOUND', `generation ${plan.plan.generation} is not kept here any more`));
    return { status: 202, headers: {}, body: new Uint8Array(0) };
  }

  return async function handle(req: MeshRequest): Promise<MeshResponse> {
    const path = req.path.split('?')[0]!;
    if (path === DISTRUST_PATH) return distrustNotice(req);
    if (path === WALK_PATH) return walk(req);
    if (path === '/chain/token') return chainToken(req);
    if (path === '/chain/failed') return chainFailed(req);
    if (path !== '/generate' && path !== AUDIT_PATH) return init.forward(req);
    if (req.method.toUpperCase() !== 'POST') return errorReply(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', `use POST ${path}`), { allow: 'POST' });
    try {
      return await (path === AUDIT_PATH ? audit(req) : generate(req));
    } catch (e) {
      if (e instanceof MeshError) {
        if (e.status === 403) init.onLog?.(`refused /generate: ${e.message}`);
        return errorReply(e);
      }
      if (e instanceof z.ZodError) return errorReply(new MeshError('MESH_ERR_BAD_REQUEST', e.message));
      init.onLog?.(`/generate failed: ${(e as Error).stack ?? String(e)}`);
      return errorReply(new MeshError('MESH_ERR_INTERNAL', 'the head failed to start this generation'));
    }
  };
}
