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
import { generateEventSchema, type GenerateRequest } from '../protocol/tracker.ts';
import type { Identity } from '../net/identity.ts';
import type { Admission, Lease } from './admission.ts';
import type { TrackerMetrics } from './metrics.ts';
import type { TrackerOptions } from './options.ts';
import type { NodeRecord, NodeRegistry } from './registry.ts';
import type { RoutePlan } from './routing.ts';
import { RouteSigner } from './route-signer.ts';
import { routeHops, type GenerationInput } from './route-hops.ts';
import type { VerificationService } from './verify/service.ts';
import { CHECK_PLAN_HEADER, CHECK_PLAN_SIGNATURE_HEADER } from '../verify/plan.ts';

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
  | { type: 'start'; promptTokens: number; /** The generation's verification record (verify/log.ts), when checks are on. */ verification?: string }
  | { type: 'token'; tokenId: number; text: string; /** On a speculative trip's first token: what it drafted and accepted. */ drafted?: number; accepted?: number }
  | { type: 'done'; finish: 'stop' | 'length'; promptTokens: number; completionTokens: number; /** The generation's verification record (verify/log.ts), when checks are on. */ verification?: string };

export interface GenerationDeps {
  registry: NodeRegistry;
  admission: Admission;
  /** Prompt lengths by model, learned from the heads' start events. */
  sizer: PromptSizer;
  transport: HeadTransport;
  identity: Identity;
  options: Pick<TrackerOptions, 'routeTtlMs' | 'generateIdleTimeoutMs' | 'maxHeadFailovers' | 'maxBusyReroutes' | 'now'> & Partial<Pick<TrackerOptions, 'relayOutageBudgetMs'>>;
  logger: Logger;
  metrics: TrackerMetrics;
  /** Signs the routes handed to heads, one signature per route for a few seconds (route-signer.ts); one per call to runGeneration when absent. */
  signer?: RouteSigner;
  /** Called for each route handed to a head (dashboard): the first, after a failed head, after a MESH_ERR_BUSY answer. */
  onRoute?(kind: 'generate' | 'failover' | 'rerouted', model: string, plan: RoutePlan): void;
  /** Spot-checks: a check plan with each route, a verification record per generation (verify/service.ts). */
  verification?: VerificationService;
}

export interface GenerationOptions {
  /** 'checked': every node of the route is checked, whatever its odds (the caller asked to know). */
  verification?: 'default' | 'checked';
  /** Nodes never to route this generation through (strict mode keeps its two routes disjoint). */
  exclude?: ReadonlySet<string>;
  /** Tokens already agreed on: the generation continues after them (heads get them as prefix_token_ids; they are not yielded again). */
  prefix?: readonly number[];
  /** Each attempt's route, as it starts (strict mode keeps its routes apart). */
  onAttempt?(nodes: readonly string[]): void;
  /** Offer the finished generation for a head audit (verify/audit.ts). @defaultValue true */
  audit?: boolean;
}

export type { GenerationInput };
export { routeHops };

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
/** Why an attempt is ended when its head was found lying: the generation fails over to another head. */
const HEAD_QUARANTINED = new MeshError('MESH_ERR_UPSTREAM', 'the head was found lying by a check and is quarantined');

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** Sleep `ms`, or less when `signal` aborts. */
function pause(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise<void>((resolve) => {
    const done = (): void => {
      clearTimeout(t);
      signal.removeEventListener('abort', done);
      resolve();
    };
    const t = setTimeout(done, ms);
    signal.addEventListener('abort', done, { once: true });
  });
}

/** Errors a head gives for the request itself: another head would say the same. */
const CLIENT_ERRORS = new Set<string>(['MESH_ERR_BAD_REQUEST', 'MESH_ERR_TOO_LARGE', 'MESH_ERR_BAD_SHAPE']);

/**
 * How a head reached over the relay is lost when the relay restarts or the
 * head's own connection drops: the relay's "no such peer", a stream cut
 * with the connection, or our relay client unreachable. Not a failure of the
 * head: the chat waits for both to be back and resumes there (head-handler's
 * parked generations), within relayOutageBudgetMs.
 */
const UNREACHABLE = new Set<string>(['MESH_ERR_PEER_GONE', 'MESH_ERR_NO_SUCH_PEER', 'MESH_ERR_UNAVAILABLE']);

/** Default of TrackerOptions.relayOutageBudgetMs. */
const RELAY_OUTAGE_BUDGET_MS = 10_000;

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
export async function* runGeneration(deps: GenerationDeps, model: string, input: GenerationInput, signal: AbortSignal, first?: Lease, opts: GenerationOptions = {}): AsyncGenerator<GenerationEvent> {
  let given = first;
  const requestId = randomHex(8);
  const tokens: number[] = [...(opts.prefix ?? [])];
  /** The log-probability the head reported for each token (a head audit compares them). */
  const logprobs: number[] = [];
  /** A sampling draft model drafted some of the tokens: Leviathan's rule drew them from drafts only the head holds. */
  let draftsSampled = false;
  let promptTokens = 0;
  const failedHeads = new Set<string>(opts.exclude ?? []);
  let lastError: MeshError | undefined;
  let failovers = 0;
  let reroutes = 0;
  let why: 'generate' | 'failover' | 'rerouted' = 'generate';
  const log = deps.logger.child({ request_id: requestId, model });
  const context = deps.registry.model(model).contextTokens;
  const estimate = deps.sizer.estimate(model, input, context);
  const signer = deps.signer ?? new RouteSigner(deps.identity, deps.options.routeTtlMs, deps.options.now);
  const outageBudgetMs = deps.options.relayOutageBudgetMs ?? RELAY_OUTAGE_BUDGET_MS;
  /** Since when (performance.now) the head has been unreachable over the relay; undefined while it is not. */
  let unreachableSince: number | undefined;
  /** The next attempt asks the same head, on the same route and session, to go on with the generation. */
  let resume = false;
  /** The generation's id at its head: a new one per head restart, the same while it is resumed. */
  let sessionId = `${requestId}-0`;
  /** Ends the running attempt because its head was found lying (a check's verdict); a resume moves it to the new attempt. */
  let quarantine: (() => void) | undefined;
  const verify = deps.verification?.enabled ? deps.verification : undefined;
  const record = verify?.log.open(requestId, model);

  for (let attempt = 0; ; attempt++) {
    if (signal.aborted) {
      given?.release();
      throw new MeshError('MESH_ERR_CANCELLED', 'the client went away');
    }
    const resuming = resume;
    resume = false;
    if (!resuming) sessionId = `${requestId}-${attempt}`;
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
        lease = await deps.admission.acquire(model, need, { signal, front: true, ...(opts.exclude ? { exclude: opts.exclude } : {}) });
      }
      deps.metrics.failovers.inc();
    } else lease = await deps.admission.acquire(model, need, { signal, front: why === 'rerouted', ...(opts.exclude ? { exclude: opts.exclude } : {}) });
    const plan = lease.plan;
    if (!resuming) {
      deps.onRoute?.(why, model, plan);
      opts.onAttempt?.(plan.hops.map((h) => h.id));
    }
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
    /** The head itself said what went wrong (an error event), as opposed to the way to it breaking. */
    let headSaid = false;
    const generation = sessionId;
    try {
      if (!head) throw new MeshError('MESH_ERR_PEER_GONE', `head ${headId} left before the request started`);
      const { route: signed, reply } = await signer.sign(headId, hops, head);
      const req: GenerateRequest = { ...input, prefix_token_ids: [...tokens], session_id: generation };
      const headers: Record<string, string> = {
        'content-type': 'application/json',
        accept: 'application/x-ndjson',
        [H.route]: signed.header,
        [H.routeExpires]: String(signed.expiresAt),
        [H.routeSignature]: signed.signature,
        [H.requestId]: requestId,
        // Every retry on the same head may find the generation parked there (or start it with the prefix).
        ...(resuming ? { [H.resume]: '1' } : {}),
      };
      // The head's reply address, signed: chain hops hand the token only to an address the tracker vouches for.
      if (reply) {
        headers[H.chainReply] = reply.text;
        headers[H.chainReplySignature] = reply.signature;
      }
      quarantine = () => ctl.abort(HEAD_QUARANTINED);
      if (verify && record && !resuming) {
        // The check plan: which of this route's spans the head has checked once the generation is over (docs/verification.md).
        const spans = plan.hops.map((h) => ({ peer: h.id, start: h.start, end: h.end }));
        const checks = await verify.plan(model, generation, headId, spans, opts.verification === 'checked');
        if (checks) {
          headers[CHECK_PLAN_HEADER] = checks.text;
          headers[CHECK_PLAN_SIGNATURE_HEADER] = checks.signature;
        }
        const planned = new Set((checks?.plan.checks ?? []).map((c) => `${c.peer.peer_id}:${c.start_layer}:${c.end_layer}`));
        record.attempt(generation, headId, spans, planned, checks?.plan.expires_at ?? 0, () => quarantine?.());
        verify.log.link(generation, record);
      }
      const body = await deps.transport.open({ peerId: headId, endpoint: head.endpoint, relayAddr: head.relayAddr }, headers, utf8.encode(JSON.stringify(req)), { signal: ctl.signal, idleTimeoutMs: deps.options.generateIdleTimeoutMs });
      deps.registry.markReachable(headId);
      if (unreachableSince !== undefined) {
        log.info({ head: headId, waited_ms: Math.round(performance.now() - unreachableSince), tokens: tokens.length }, 'head reachable again; the chat goes on there');
        unreachableSince = undefined;
      }
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
            yield { type: 'start', promptTokens, ...(record ? { verification: record.id } : {}) };
          }
          // The exact length now: hold what the head declares to its hops, no more.
          lease.resize(Math.min(context, ev.prompt_tokens + input.max_tokens));
        } else if (ev.type === 'token') {
          // A head restarted with a prefix numbers its first new token prefix.length; anything earlier we already have.
          if (ev.index < tokens.length) continue;
          tokens.push(ev.token_id);
          logprobs.push(ev.logprob);
          if (ev.drafts_sampled) draftsSampled = true;
          deps.metrics.tokens.inc();
          yield { type: 'token', tokenId: ev.token_id, text: ev.text, ...(ev.drafted !== undefined ? { drafted: ev.drafted, accepted: ev.accepted ?? 0 } : {}) };
          if (tokens.length >= input.max_tokens) {
            finished = { type: 'done', finish: 'length', promptTokens, completionTokens: tokens.length, ...(record ? { verification: record.id } : {}) };
            break;
          }
        } else if (ev.type === 'recovered') {
          record?.replacement(generation, ev.replacement_peer_id.split(','));
          log.info({ failed: ev.failed_peer_id, replacement: ev.replacement_peer_id, recovery_ms: ev.recovery_ms }, 'head recovered a hop');
          deps.metrics.hopRecoveries.inc();
        } else if (ev.type === 'done') {
          finished = { type: 'done', finish: ev.finish_reason, promptTokens: promptTokens || ev.prompt_tokens, completionTokens: tokens.length, ...(record ? { verification: record.id } : {}) };
          break;
        } else {
          // The error names the node that refused (MESH_ERR_BUSY: which one to route around) and when to come back.
          const err = remoteError(undefined, { error: ev }, `head ${headId}`);
          headSaid = true;
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
      const outage = !headSaid && head !== undefined && !head.endpoint && UNREACHABLE.has(err.code);
      if (outage) {
        // Over the relay, the head (or our way to it) went away: a relay restarting, the head reconnecting.
        // Not its failure: wait for both (our relay client holds requests while it reconnects) and resume there.
        const now = performance.now();
        deps.registry.markUnreachable(headId, err.message);
        if (unreachableSince === undefined) {
          unreachableSince = now;
          log.warn({ head: headId, code: err.code, err: err.message, tokens: tokens.length, budget_ms: outageBudgetMs }, 'head unreachable over the relay; waiting to resume the chat there');
        }
        const waited = now - unreachableSince;
        if (waited < outageBudgetMs) {
          resume = true;
          await pause(Math.min(500, 100 * 1.5 ** Math.min(10, attempt)), signal);
          continue;
        }
        // The budget is spent (for this chat, whichever head it tries next): fail over, or fail, now.
        lastError = new MeshError('MESH_ERR_UNAVAILABLE', `head ${headId} unreachable over the relay for ${Math.round(waited)} ms (the relay or the head is down): ${err.message}`);
      } else lastError = err;
      if (CLIENT_ERRORS.has(err.code) && tokens.length === 0) throw err;
      failedHeads.add(headId);
      // Out of reach past the budget is not proof the head failed (our own relay may be the one down).
      if (!outage) deps.registry.countFailure(headId);
      log.warn({ head: headId, attempt, code: err.code, err: lastError.message, tokens: tokens.length }, 'head failed; restarting on another head');
      if (++failovers > deps.options.maxHeadFailovers) break;
      why = 'failover';
    } finally {
      // A resumed attempt is the same generation at the same head: its record stays open.
      if (!resume) record?.ended(generation);
      signal.removeEventListener('abort', onAbort);
      ctl.abort(ATTEMPT_OVER);
      // A resume keeps the route, and its lease of KV room, for the next attempt.
      if (resume) given = lease;
      else lease.release();
      for (const n of routeNodes) deps.registry.addInFlight(n, -1);
    }
    if (finished) {
      // One head, one route from start to end: a head audit can judge it (verify/audit.ts) — unless a sampling
      // draft model drafted: a replay has no drafts to judge the rule's tokens by (the last hop's checks do).
      if (verify && failovers === 0 && opts.audit !== false && !opts.prefix?.length && !draftsSampled) {
        verify.audit({ model, input, tokens: [...tokens], logprobs, head: headId, route: plan.hops.map((h) => h.id), generation, record });
      }
      yield finished;
      return;
    }
  }
  throw new MeshError('MESH_ERR_UPSTREAM', `generation failed after ${deps.options.maxHeadFailovers + 1} head(s): ${lastError?.message ?? 'unknown error'}`, { last_code: lastError?.code });
}
