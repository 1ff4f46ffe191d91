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
 */
import { z } from 'zod';
import { errorReply, type MeshRequest, type MeshResponse } from '../../protocol/envelopes.ts';
import { MeshError, remoteError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import { generateRequestSchema, type GenerateEvent } from '../../protocol/tracker.ts';
import type { MeshHandler } from '../../net/contract.ts';
import type { PipelineDriver } from './pipeline.ts';
import { VerifiedRoutes, type TrackerKeys } from '../tracker-client.ts';
import { trace } from '../../protocol/trace.ts';

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
}

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

/** 421 Misdirected Request: a route pointed at a node that is not (or no longer) a head. */
function notAHead(): MeshResponse {
  return errorReply(new MeshError('MESH_ERR_MISDIRECTED', 'this node does not hold layer 0 and the tokenizer now; ask the tracker for a fresh route'));
}

async function* ndjson(events: AsyncGenerator<GenerateEvent>, onEvent: ((e: GenerateEvent) => void) | undefined): AsyncGenerator<Uint8Array> {
  try {
    for await (const ev of events) {
      onEvent?.(ev);
      const line = utf8.encode(JSON.stringify(ev) + '\n');
      trace?.('ndjson');
      yield line;
      trace?.('pulled');
    }
  } finally {
    // Runs on completion and when the consumer stops early (client gone): the generator's finally drops the sessions.
    await events.return(undefined);
  }
}

export function createHeadHandler(init: HeadHandlerInit): MeshHandler {
  const maxBody = init.maxBodyBytes ?? 1 << 20;
  const now = init.now ?? Date.now;
  const routes = new VerifiedRoutes();

  async function generate(req: MeshRequest): Promise<MeshResponse> {
    const h = req.headers;
    const routeText = h[H.route];
    const expires = h[H.routeExpires];
    const signature = h[H.routeSignature];
    if (routeText === undefined || expires === undefined || signature === undefined) {
      throw new MeshError('MESH_ERR_FORBIDDEN', `${H.route}, ${H.routeExpires} and ${H.routeSignature} are required: a head accepts routes only from the tracker`);
    }
    if (!/^\d{1,16}$/.test(expires.trim())) throw new MeshError('MESH_ERR_FORBIDDEN', `${H.routeExpires} must be ms since epoch`);
    const known = routes.get(init.trackerKey(), init.peerId, routeText, Number(expires.trim()), signature.trim(), now());
    // Copies: the pipeline may change its hops (replacements), the cached route stays as signed.
    const route = (known instanceof Promise ? await known : known).hops.map((hop) => ({ ...hop }));
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
    const events = driver.generate(init.peerId, p.data, route, { ...(req.signal ? { signal: req.signal } : {}), signed: { text: routeText, expires: Number(expires.trim()), signature: signature.trim(), ...reply } });
    return {
      status: 200,
      headers: { 'content-type': 'application/x-ndjson', 'cache-control': 'no-store' },
      body: ndjson(events, init.onEvent ? (e) => init.onEvent!(e, p.data.session_id) : undefined),
    };
  }

  /** A chained step's token from the route's last hop (src/node/hop/chain-hop.ts): the token JSON in a header, the rows for replays as the body. */
  function chainToken(req: MeshRequest): MeshResponse {
    const at = chainStepOf(req);
    if ('status' in at) return at;
    const token = req.headers[H.chainToken];
    if (token === undefined || token.length > 4096) return errorReply(new MeshError('MESH_ERR_BAD_REQUEST', `${H.chainToken} must hold the token's JSON`));
    // Only a step waiting for exactly this session and position takes it; the token and rows are checked by that step.
    trace?.('token-in', at.session, at.position);
    if (!init.pipeline()?.chainInbox.deliver(at.session, at.position, { token, rows: req.body })) return errorReply(new MeshError('MESH_ERR_NOT_FOUND', 'no chained step waits for this token'));
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

  return async function handle(req: MeshRequest): Promise<MeshResponse> {
    const path = req.path.split('?')[0]!;
    if (path === '/chain/token') return chainToken(req);
    if (path === '/chain/failed') return chainFailed(req);
    if (path !== '/generate') return init.forward(req);
    if (req.method.toUpperCase() !== 'POST') return errorReply(new MeshError('MESH_ERR_METHOD_NOT_ALLOWED', 'use POST /generate'), { allow: 'POST' });
    try {
      return await generate(req);
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
