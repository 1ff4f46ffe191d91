/**
 * Proxying a generation to a head node, with head failover.
 *
 *   client ──/v1/chat──▶ tracker ──POST /generate + signed route──▶ head ──/forward──▶ hops …
 *                               ◀── NDJSON GenerateEvent lines ───
 *
 * The tracker never sees an activation: it picks the route, signs it, and
 * turns the head's token events into the client's stream. When the head's
 * stream breaks (an error event, a dropped connection, the peer gone, silence
 * past the idle timeout), the generation restarts on another head — or the
 * same one when nothing else holds layer 0 — with `prefix_token_ids` = the
 * tokens so far: the client's stream just goes on.
 *
 * Every generation holds an admission lease (admission.ts): KV room on each
 * node of its route, as the tracker counts it. A node that answers
 * MESH_ERR_BUSY (no room after all) is not a failure: it is marked busy and
 * the chat is routed again, ahead of the queue; the client sees nothing of
 * it but a later first token.
 */
import type { Logger } from 'pino';
import { MeshError, remoteError } from '../protocol/errors.ts';
import type { HeadTransport } from './head-transport.ts';
import { H } from '../protocol/headers.ts';
import { randomHex } from '../protocol/ids.ts';
import { generateEventSchema, type GenerateRequest, type RouteHop } from '../protocol/tracker.ts';
import type { Identity } from '../net/identity.ts';
import type { Admission, Lease } from './admission.ts';
import type { TrackerMetrics } from './metrics.ts';
import type { TrackerOptions } from './options.ts';
import type { NodeRecord, NodeRegistry } from './registry.ts';
import type { RoutePlan } from './routing.ts';
import { RouteSigner } from './route-signer.ts';

const utf8 = new TextEncoder();

export { createHeadTransport, type HeadTarget, type HeadTransport, type OpenOptions } from './head-transport.ts';

/** Split a byte stream into NDJSON lines. */
export async function* ndjsonLines(chunks: AsyncIterable<Uint8Array>): AsyncGenerator<string> {
  const decoder = new TextDecoder();
  let buf = '';
  for await (const c of chunks) {
    buf += decoder.decode(c, { stream: true });
    let i: number;
    while ((i = buf.indexOf('\n')) >= 0) {
      const line = buf.slice(0, i).trim();
      buf = buf.slice(i + 1);
      if (line) yield line;
    }
    if (buf.length > 1 << 20) throw new MeshError('MESH_ERR_UPSTREAM', 'head sent a line over 1 MiB');
  }
  buf += decoder.decode();
  if (buf.trim()) yield buf.trim();
}

// ---------------------------------------------------------------- generation with failover

export type GenerationEvent =
  | { type: 'start'; promptTokens: number }
  | { type: 'token'; tokenId: number; text: string }
  | { type: 'done'; finish: 'stop' | 'length'; promptTokens: number; completionTokens: number };

export interface GenerationDeps {
  registry: NodeRegistry;
  admission: Admission;
  /** Prompt lengths by model, learned from the heads' start events. */
  sizer: PromptSizer;
  transport: HeadTransport;
  identity: Identity;
  options: Pick<TrackerOptions, 'routeTtlMs' | 'generateIdleTimeoutMs' | 'maxHeadFailovers' | 'maxBusyReroutes' | 'now'>;
  logger: Logger;
  metrics: TrackerMetrics;
  /** Signs the routes handed to heads, one signature per route for a few seconds (route-signer.ts); one per call to runGeneration when absent. */
  signer?: RouteSigner;
  /** Called for each route handed to a head (dashboard): the first, after a failed head, after a MESH_ERR_BUSY answer. */
  onRoute?(kind: 'generate' | 'failover' | 'rerouted', model: string, plan: RoutePlan): void;
}

export type GenerationInput = Omit<GenerateRequest, 'prefix_token_ids' | 'session_id'>;

/**
 * Positions a chat may reach, as the tracker can tell before the head
 * tokenizes it: prompt bytes × the model's tokens per byte (learned from the
 * heads' `start` events, 1/3 until the first: English BPE averages nearer
 * 1/4), 10 % over, plus max_tokens. The head's `start` event gives the exact
 * count one round trip later, and a node that finds the estimate short
 * answers MESH_ERR_BUSY, so a miss costs a re-route, never a failed chat.
 */
export class PromptSizer {
  private readonly perByte = new Map<string, number>();

  /** Bytes of what the chat template will render, roles included. */
  static bytes(input: GenerationInput): number {
    if (input.messages) return input.messages.reduce((n, m) => n + utf8.encode(m.content).byteLength + m.role.length + 8, 0);
    return input.prompt !== undefined ? utf8.encode(input.prompt).byteLength : 0;
  }

  estimate(model: string, input: GenerationInput, contextTokens: number): number {
    // A prompt given as token ids (/v1/completions) is its own count.
    if (input.prompt_token_ids) return Math.min(contextTokens, input.prompt_token_ids.length + input.max_tokens);
    const ratio = this.perByte.get(model) ?? 1 / 3;
    return Math.min(contextTokens, Math.ceil(PromptSizer.bytes(input) * ratio * 1.1) + 4 + input.max_tokens);
  }

  /** The head counted `promptTokens` for this input. */
  learn(model: string, input: GenerationInput, promptTokens: number): void {
    const bytes = PromptSizer.bytes(input);
    if (input.prompt_token_ids || bytes < 16 || promptTokens <= 0) return;
    const r = Math.min(2, Math.max(0.05, promptTokens / bytes));
    const prev = this.perByte.get(model);
    // The larger of the new sample and a slowly decaying average: over-estimating only queues a chat a little early.
    this.perByte.set(model, prev === undefined ? r : Math.max(r, prev + 0.1 * (r - prev)));
  }
}

/** Why an attempt's controller is aborted when the attempt is over: one object, not a fresh DOMException (and its stack) per chat. */
const ATTEMPT_OVER = new MeshError('MESH_ERR_CANCELLED', 'the generation attempt is over');

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** Errors a head gives for the request itself: another head would say the same. */
const CLIENT_ERRORS = new Set<string>(['MESH_ERR_BAD_REQUEST', 'MESH_ERR_TOO_LARGE', 'MESH_ERR_BAD_SHAPE']);

export function routeHops(registry: NodeRegistry, plan: RoutePlan, skipFirst: boolean): RouteHop[] {
  return plan.hops.slice(skipFirst ? 1 : 0).map((h) => {
    const n = registry.nodes.get(h.id);
    const hop: RouteHop = { peer_id: h.id, start_layer: h.start, end_layer: h.end };
    if (n?.endpoint) hop.endpoint = n.endpoint;
    if (n?.relayAddr) hop.relay_addr = n.relayAddr;
    return hop;
  });
}

/**
 * Run one generation: yields token events, then one done event. Throws
 * MeshError when it cannot go on: 429 when no route had KV room in time,
 * 503 when layers are missing, the head's own error for a bad request, 502
 * when failovers are exhausted.
 *
 * Lifetime: everything an attempt holds (its admission lease of KV room,
 * the route's in-flight counts, the abort listener, the head's stream) is
 * released *before* the done event is yielded, so a caller that stops
 * pulling after `done` leaks nothing. A caller that stops earlier must call
 * `return()` (for-await does). `first`: a lease the caller already holds
 * (completion.ts admits before streaming), used for the first attempt; the
 * generator owns it from then on, so the caller must start iterating it.
 */
export async function* runGeneration(deps: GenerationDeps, model: string, input: GenerationInput, signal: AbortSignal, first?: Lease): AsyncGenerator<GenerationEvent> {
  let given = first;
  const requestId = randomHex(8);
  const tokens: number[] = [];
  let promptTokens = 0;
  const failedHeads = new Set<string>();
  let lastError: MeshError | undefined;
  let failovers = 0;
  let reroutes = 0;
  let why: 'generate' | 'failover' | 'rerouted' = 'generate';
  const log = deps.logger.child({ request_id: requestId, model });
  const context = deps.registry.model(model).contextTokens;
  const estimate = deps.sizer.estimate(model, input, context);
  const signer = deps.signer ?? new RouteSigner(deps.identity, deps.options.routeTtlMs, deps.options.now);

  for (let attempt = 0; ; attempt++) {
    if (signal.aborted) {
      given?.release();
      throw new MeshError('MESH_ERR_CANCELLED', 'the client went away');
    }
    const need = promptTokens > 0 ? Math.min(context, promptTokens + input.max_tokens) : estimate;
    let lease: Lease;
    if (given) {
      lease = given;
      given = undefined;
    } else if (why === 'failover') {
      try {
        lease = await deps.admission.acquire(model, need, { signal, exclude: failedHeads, front: true });
      } catch (e) {
        if (!(e instanceof MeshError && e.code === 'MESH_ERR_UNAVAILABLE')) throw e;
        // Nothing else holds layer 0: the failed head itself may have recovered (or been reassigned).
        await sleep(250);
        lease = await deps.admission.acquire(model, need, { signal, front: true });
      }
      deps.metrics.failovers.inc();
    } else lease = await deps.admission.acquire(model, need, { signal, front: why === 'rerouted' });
    const plan = lease.plan;
    deps.onRoute?.(why, model, plan);
    const headId = plan.hops[0]!.id;
    const head = deps.registry.nodes.get(headId);
    const hops = routeHops(deps.registry, plan, true);
    const routeNodes = plan.hops.map((h) => deps.registry.nodes.get(h.id)).filter((n): n is NodeRecord => n !== undefined);
    for (const n of routeNodes) deps.registry.addInFlight(n, 1);
    const ctl = new AbortController();
    const onAbort = () => ctl.abort();
    signal.addEventListener('abort', onAbort, { once: true });
    // Set when the head finished; yielded after the finally below has released this attempt.
    let finished: GenerationEvent | undefined;
    try {
      if (!head) throw new MeshError('MESH_ERR_PEER_GONE', `head ${headId} left before the request started`);
      const { route: signed, reply } = await signer.sign(headId, hops, head);
      const req: GenerateRequest = { ...input, prefix_token_ids: [...tokens], session_id: `${requestId}-${attempt}` };
      const headers: Record<string, string> = {
        'content-type': 'application/json',
        accept: 'application/x-ndjson',
        [H.route]: signed.header,
        [H.routeExpires]: String(signed.expiresAt),
        [H.routeSignature]: signed.signature,
        [H.requestId]: requestId,
      };
      // The head's reply address, signed: chain hops hand the token only to an address the tracker vouches for.
      if (reply) {
        headers[H.chainReply] = reply.text;
        headers[H.chainReplySignature] = reply.signature;
      }
      const body = await deps.transport.open({ peerId: headId, endpoint: head.endpoint, relayAddr: head.relayAddr }, headers, utf8.encode(JSON.stringify(req)), { signal: ctl.signal, idleTimeoutMs: deps.options.generateIdleTimeoutMs });
      for await (const line of ndjsonLines(body)) {
        let parsed;
        try {
          parsed = generateEventSchema.safeParse(JSON.parse(line));
        } catch {
          parsed = undefined;
        }
        if (!parsed?.success) throw new MeshError('MESH_ERR_UPSTREAM', `head ${headId} sent a line that is not a GenerateEvent: ${line.slice(0, 200)}`);
        const ev = parsed.data;
        if (ev.type === 'start') {
          if (promptTokens === 0) {
            promptTokens = ev.prompt_tokens;
            deps.sizer.learn(model, input, promptTokens);
            yield { type: 'start', promptTokens };
          }
          // The exact length now: hold what the head declares to its hops, no more.
          lease.resize(Math.min(context, ev.prompt_tokens + input.max_tokens));
        } else if (ev.type === 'token') {
          // A head restarted with a prefix numbers its first new token prefix.length; anything earlier we already have.
          if (ev.index < tokens.length) continue;
          tokens.push(ev.token_id);
          deps.metrics.tokens.inc();
          yield { type: 'token', tokenId: ev.token_id, text: ev.text };
          if (tokens.length >= input.max_tokens) {
            finished = { type: 'done', finish: 'length', promptTokens, completionTokens: tokens.length };
            break;
          }
        } else if (ev.type === 'recovered') {
          log.info({ failed: ev.failed_peer_id, replacement: ev.replacement_peer_id, recovery_ms: ev.recovery_ms }, 'head recovered a hop');
          deps.metrics.hopRecoveries.inc();
        } else if (ev.type === 'done') {
          finished = { type: 'done', finish: ev.finish_reason, promptTokens: promptTokens || ev.prompt_tokens, completionTokens: tokens.length };
          break;
        } else {
          // The error names the node that refused (MESH_ERR_BUSY: which one to route around) and when to come back.
          const err = remoteError(undefined, { error: ev }, `head ${headId}`);
          throw ev.peer_id !== undefined ? new MeshError(err.code, err.message, { ...err.details, peer_id: ev.peer_id }) : err;
        }
      }
      if (!finished) throw new MeshError('MESH_ERR_PEER_GONE', `head ${headId} ended its stream without a done event`);
    } catch (e) {
      const err = e instanceof MeshError ? e : new MeshError('MESH_ERR_UPSTREAM', (e as Error).message);
      if (signal.aborted) throw new MeshError('MESH_ERR_CANCELLED', 'the client went away');
      if (err.code === 'MESH_ERR_BUSY') {
        // A node had no KV room after all: not a failure. Keep new chats off it for its Retry-After, and route this one again.
        const busy = typeof err.details.peer_id === 'string' ? err.details.peer_id : headId;
        const retry = typeof err.details.retry_after_ms === 'number' ? err.details.retry_after_ms : 1_000;
        deps.registry.markBusy(busy, retry);
        deps.metrics.busyAnswers.inc();
        if (++reroutes > deps.options.maxBusyReroutes) {
          throw new MeshError('MESH_ERR_TOO_MANY_REQUESTS', `nodes kept answering that they have no KV room (${reroutes - 1} re-routes); retry later`, { retry_after_ms: deps.admission.retryAfterMs(), reason: 'busy' });
        }
        log.info({ busy, retry_after_ms: retry, tokens: tokens.length }, 'a node had no KV room; routing the chat again');
        why = 'rerouted';
        continue;
      }
      if (CLIENT_ERRORS.has(err.code) && tokens.length === 0) throw err;
      lastError = err;
      failedHeads.add(headId);
      if (head) head.failures++;
      log.warn({ head: headId, attempt, code: err.code, err: err.message, tokens: tokens.length }, 'head failed; restarting on another head');
      if (++failovers > deps.options.maxHeadFailovers) break;
      why = 'failover';
    } finally {
      signal.removeEventListener('abort', onAbort);
      ctl.abort(ATTEMPT_OVER);
      lease.release();
      for (const n of routeNodes) deps.registry.addInFlight(n, -1);
    }
    if (finished) {
      yield finished;
      return;
    }
  }
  throw new MeshError('MESH_ERR_UPSTREAM', `generation failed after ${deps.options.maxHeadFailovers + 1} head(s): ${lastError?.message ?? 'unknown error'}`, { last_code: lastError?.code });
}
