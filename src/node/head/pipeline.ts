/**
 * The head's pipeline driver: ADR-0014's `_run_downstream_pipeline`, plus
 * what the ADR left as "prototype" (a lost hop skipped the token).
 *
 *   tracker ── POST /generate (signed route) ──▶ head
 *   head: tokens ─▶ embed + own layers ─▶ bf16 ─▶ hop 1 ─▶ hop 2 … ─▶ last hop samples
 *                                         ◀──────────── {token_id,text,logprob}
 *
 * Each hop keeps the session's KV cache, so after the prompt every step sends
 * one token's activation per hop. The head keeps, per hop, the activations it
 * sent (the hop's input history, bf16 as on the wire, grown by doubling): when
 * a hop fails it asks the tracker for a replacement span and sends that
 * history to the replacement at position 0 together with the current step,
 * which rebuilds the replacement's cache in one request without re-running a
 * single upstream layer (petals' inference_session keeps the same history for
 * the same reason; hop-failover.ts). A 409 from a hop (its cache vanished after a real fault:
 * a restart, an idle TTL, or a transport retry ran the step twice) is
 * repaired the same way on the same hop, once per step. The
 * sampled token of the step does not change, so greedy output is the same
 * with or without failures, and no token is skipped.
 *
 * Every session declares its length when it opens (prompt + max_tokens, as
 * `sessionTokens` locally and X-Meshnet-Session-Tokens to each hop), so each
 * node reserves its KV room up front. A node without room answers 503
 * MESH_ERR_BUSY at once; the generation then ends with an error event naming
 * that node, and the tracker routes it elsewhere or queues it.
 *
 * This module plans each step (the prompt, drafts, the head's own layers)
 * and turns its answer into token events (stop strings, EOS, max_tokens); a
 * step's rows travel the hops in hop-steps.ts (chain or star, replacement,
 * replay, the step budget), and generation.ts holds the state both share.
 *
 * Host-agnostic: the executor, tokenizer, transports and tracker are injected.
 */
import { MeshError } from '../../protocol/errors.ts';
import { encodeTensor, type Dtype, dtypeBytes } from '../../protocol/tensor.ts';
import type { GenerateEvent, GenerateRequest, RouteHop } from '../../protocol/tracker.ts';
import type { ForwardRequest, ForwardResult } from '../../shard/contract.ts';
import { PositionMismatchError } from '../../shard/errors.ts';
import { StopMatcher, StreamDecoder } from '../../model/text-stream.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import type { RouteProof } from '../../net/rtc-signal.ts';
import { History, errorEvent, isRebuilding, sessionIdFor } from './pipeline-parts.ts';
import { isStochasticDraft } from '../../shard/speculative.ts';
import { AdaptiveK, type CarriedPolicy } from './speculation/adaptive-k.ts';
import type { Drafter } from './speculation/drafter.ts';
import { promptLookupFor } from './speculation/prompt-lookup.ts';
import { Speculator, addCounters, emptyCounters, type SpeculationCounters, type StepPlan } from './speculation/speculator.ts';
import { ChainInbox, ChainState, type SignedRouteText } from './chain-driver.ts';
import type { HopState, ReplaceSpan } from './hop-failover.ts';
import { specHeaders, type Generation, type StepAnswer } from './generation.ts';
import { HopSteps } from './hop-steps.ts';
import { trace } from '../../protocol/trace.ts';
import type { HeadVerify } from '../verify/head-verify.ts';
import type { SignedPlan } from '../verify/verifier.ts';

/** What the driver needs of the head's ShardExecutor. */
export interface HeadExecutor {
  readonly config: { readonly numLayers: number; readonly hiddenSize: number; readonly vocabSize: number };
  readonly startLayer: number;
  readonly endLayer: number;
  readonly maxContext: number;
  forward(req: ForwardRequest): Promise<ForwardResult>;
  dropSession(id: string): boolean;
}

/** What the driver needs of ModelTokenizer. */
export interface HeadTokenizer {
  encode(text: string, opts?: { addSpecialTokens?: boolean }): number[];
  encodeChat(messages: ReadonlyArray<{ role: string; content: string }>, opts?: { extra?: Record<string, unknown> }): number[];
  decode(ids: readonly number[], opts?: { skipSpecialTokens?: boolean }): string;
  isEos(id: number): boolean;
}

export type { ReplaceSpan, Replacement } from './hop-failover.ts';
export { STEP_BUDGET_FACTOR, STEP_BUDGET_FLOOR_MS } from './hop-steps.ts';

export interface PipelineOptions {
  /** Wire dtype of activations between hops. @defaultValue 'bf16' */
  wireDtype: Dtype;
  /**
   * Longest wait for one hop's answer to a one-token step, ms, over all its
   * paths together. Once the head has timed a few steps, a silent hop is given
   * up on sooner: after STEP_BUDGET_FACTOR × the recent one-token step (at
   * least STEP_BUDGET_FLOOR_MS). @defaultValue 10000
   */
  decodeTimeoutMs: number;
  /** Longest wait for a hop's answer to a prompt or replay, ms (long prompts on slow donors). @defaultValue 60000 */
  prefillTimeoutMs: number;
  /** Hop replacements one generation may go through before it gives up with an error event. @defaultValue 4 */
  maxRecoveries: number;
  /**
   * 'chain': each hop pushes its output to the next and the last answers the head (N legs a token);
   * 'star': every hop answers the head (2(N−1) legs; ADR-era peers). A chain step that fails runs
   * again as a star; the next step chains again while the hops are the signed ones (ChainState). @defaultValue 'chain'
   */
  hopMode: 'chain' | 'star';
  /**
   * Speculative decoding (head/speculation/): steps carry drafts where the drafter has them and the
   * k policy finds they pay; a request may still turn it off. @defaultValue true
   */
  speculation: boolean;
}

export const PIPELINE_DEFAULTS: PipelineOptions = { wireDtype: 'bf16', decodeTimeoutMs: 10_000, prefillTimeoutMs: 60_000, maxRecoveries: 4, hopMode: 'chain', speculation: true };

/** What a drafter is made from: the generation's KV session id (a draft model's own session derives from it), its declared length, its prompt's length. */
export interface DraftContext {
  session: string;
  declared: number;
  promptTokens: number;
}

/** A generation's drafter (undefined: none for this request, e.g. a draft model it names that is not here). */
export type DrafterFactory = (req: GenerateRequest, ctx: DraftContext) => Drafter | undefined;

export interface PipelineInit extends Partial<PipelineOptions> {
  executor: HeadExecutor;
  tokenizer: HeadTokenizer;
  transport: HopTransport;
  /** Absent: a failed hop ends the generation with an error event (no tracker to ask). */
  replace?: ReplaceSpan;
  /** Spot-checks (docs/verification.md): attestations, the plan's checks, distrusted hops. Absent: none. */
  verify?: HeadVerify;
  onLog?: (message: string) => void;
  /** The drafter of each generation (absent: prompt lookup, with the request's prediction). */
  drafter?: DrafterFactory;
}

export interface GenerateOptions {
  signal?: AbortSignal;
  /** The route as the tracker signed it: hops check it before they push (absent: no chain, the star). */
  signed?: SignedRouteText;
  /** The tracker's check plan for this generation (docs/verification.md); absent: nothing is checked. */
  plan?: SignedPlan;
}

export class PipelineDriver {
  readonly options: PipelineOptions;
  /** Where last hops hand back chained steps' tokens (POST /chain/token). */
  readonly chainInbox = new ChainInbox();
  private readonly rowBytes: number;
  /** How a step's rows travel the hops: chain or star, replacement and replay, the step budget (hop-steps.ts). */
  private readonly hopSteps: HopSteps;
  private readonly specTotals = emptyCounters();
  /** What each drafter's generations learnt (Drafter.memoryKey → the k policy's state): the next one starts from it. */
  private readonly carried = new Map<string, CarriedPolicy>();

  constructor(private readonly init: PipelineInit) {
    const o = { ...PIPELINE_DEFAULTS };
    for (const k of Object.keys(PIPELINE_DEFAULTS) as Array<keyof PipelineOptions>) if (init[k] !== undefined) (o as Record<string, unknown>)[k] = init[k];
    this.options = o;
    this.rowBytes = init.executor.config.hiddenSize * dtypeBytes(o.wireDtype);
    this.hopSteps = new HopSteps(init, o, this.chainInbox, this.rowBytes);
  }

  /** What a head audit (verify/audit.ts) runs on: this head's executor, tokenizer, transport and wire dtype. */
  get parts(): { executor: HeadExecutor; tokenizer: HeadTokenizer; transport: HopTransport; wireDtype: Dtype } {
    return { executor: this.init.executor, tokenizer: this.init.tokenizer, transport: this.init.transport, wireDtype: this.options.wireDtype };
  }

  /**
   * The layers the head runs itself and the hops after it, checked to chain
   * without a gap up to the last layer. A leading hop naming the head itself
   * (a tracker may list the head as hop 0) becomes the local range.
   */
  planRoute(headPeerId: string, route: readonly RouteHop[]): { localEnd: number; hops: RouteHop[] } {
    const ex = this.init.executor;
    const L = ex.config.numLayers;
    const hops = [...route];
    let localEnd = ex.endLayer;
    if (hops[0]?.peer_id === headPeerId) {
      const own = hops.shift()!;
      if (own.start_layer !== 0 || own.end_layer > ex.endLayer) {
        throw new MeshError('MESH_ERR_LAYER_RANGE', `the route gives this head layers [${own.start_layer}, ${own.end_layer}); it holds [${ex.startLayer}, ${ex.endLayer})`);
      }
      localEnd = own.end_layer;
    }
    if (ex.startLayer !== 0) throw new MeshError('MESH_ERR_LAYER_RANGE', `this node holds [${ex.startLayer}, ${ex.endLayer}), not layer 0: it cannot head a pipeline`);
    // ADR-0012 overlap: the first hop may start before our end; then we stop where it starts.
    if (hops.length > 0) localEnd = Math.min(localEnd, hops[0]!.start_layer);
    if (localEnd < 1) throw new MeshError('MESH_ERR_LAYER_RANGE', 'the route leaves the head no layer to run');
    let at = localEnd;
    for (const h of hops) {
      if (h.start_layer !== at || h.end_layer <= h.start_layer) {
        throw new MeshError('MESH_ERR_BAD_REQUEST', `route hop ${h.peer_id} runs [${h.start_layer}, ${h.end_layer}) but the previous one ends at ${at}`);
      }
      if (h.peer_id === headPeerId) throw new MeshError('MESH_ERR_BAD_REQUEST', 'the route sends the activation back to the head');
      at = h.end_layer;
    }
    if (at !== L) throw new MeshError('MESH_ERR_BAD_REQUEST', `the route ends at layer ${at}; the model has ${L}`);
    return { localEnd, hops };
  }

  /**
   * Run one generation; yields GenerateEvents (start, token…, recovered…,
   * done | error). Pull-driven: a step runs when the consumer asks for the
   * next event, so a slow reader never lets the pipeline run ahead. Leaving
   * the loop early cancels and drops the session everywhere.
   */
  async *generate(headPeerId: string, req: GenerateRequest, route: readonly RouteHop[], opts: GenerateOptions = {}): AsyncGenerator<GenerateEvent> {
    const { executor: ex, tokenizer: tok, transport } = this.init;
    const signal = opts.signal;
    let plan: { localEnd: number; hops: RouteHop[] };
    let promptIds: number[];
    try {
      plan = this.planRoute(headPeerId, route);
      if (req.messages && req.messages.length > 0) promptIds = tok.encodeChat(req.messages, req.chat_template_kwargs ? { extra: req.chat_template_kwargs } : {});
      else if (req.prompt_token_ids !== undefined) {
        promptIds = [...req.prompt_token_ids];
        const vocab = ex.config.vocabSize;
        const outside = promptIds.find((id) => id >= vocab);
        if (outside !== undefined) throw new MeshError('MESH_ERR_BAD_REQUEST', `prompt token id ${outside} is outside the vocabulary (0..${vocab - 1})`);
      } else if (req.prompt !== undefined) promptIds = tok.encode(req.prompt);
      else throw new MeshError('MESH_ERR_BAD_REQUEST', 'give messages, prompt or prompt_token_ids');
      if (promptIds.length === 0) throw new MeshError('MESH_ERR_BAD_REQUEST', 'the prompt encodes to no tokens');
      const predicted = req.prediction_token_ids?.find((id) => id >= ex.config.vocabSize);
      if (predicted !== undefined) throw new MeshError('MESH_ERR_BAD_REQUEST', `prediction token id ${predicted} is outside the vocabulary (0..${ex.config.vocabSize - 1})`);
      if (promptIds.length + req.prefix_token_ids.length >= ex.maxContext) {
        throw new MeshError('MESH_ERR_TOO_LARGE', `prompt of ${promptIds.length} tokens (+${req.prefix_token_ids.length} already generated) does not fit the context of ${ex.maxContext}`);
      }
    } catch (e) {
      yield errorEvent(e);
      return;
    }
    const session = sessionIdFor(req.session_id);
    const proof: RouteProof | undefined = opts.signed && { head: headPeerId, route: opts.signed.text, expires: opts.signed.expires, signature: opts.signed.signature };
    const hops: HopState[] = plan.hops.map((hop) => ({ hop, history: new History(this.rowBytes, 64), synced: true, ...(proof ? { proof } : {}) }));
    const run: Generation = {
      headPeerId,
      session,
      // Positions this session reaches at most: max_tokens counts the prefix, and the last token is never fed back.
      declared: Math.min(ex.maxContext, promptIds.length + req.max_tokens),
      localEnd: plan.localEnd,
      hops,
      sampling: JSON.stringify({ temperature: req.temperature, top_p: req.top_p, top_k: req.top_k, ...(req.seed !== undefined ? { seed: req.seed } : {}) }),
      localSampling: { temperature: req.temperature, topP: req.top_p, topK: req.top_k, ...(req.seed !== undefined ? { seed: req.seed } : {}) },
      chain: new ChainState(this.options.hopMode === 'chain', opts.signed, plan.hops),
      pending: [],
      recoveries: 0,
      sameNode: 0,
      position: 0,
      steps: [],
      signal,
      checks: undefined,
    };
    run.checks = this.init.verify?.begin({ session, plan: opts.plan, sampling: run.sampling, dtype: this.options.wireDtype, hidden: ex.config.hiddenSize, numLayers: ex.config.numLayers, localEnd: plan.localEnd });
    const detok = new StreamDecoder((ids) => tok.decode(ids, { skipSpecialTokens: true }));
    const stop = new StopMatcher(req.stop);
    let index = req.prefix_token_ids.length;

    yield { type: 'start', prompt_tokens: promptIds.length, route: hops.map((h) => h.hop.peer_id) };
    // A restart after a head failed: both see the text so far as that head did, so the stop
    // matcher holds back exactly what it held (and never sent), and releases or drops it as it would have.
    for (const id of req.prefix_token_ids) stop.push(detok.push(id));

    let finish: 'stop' | 'length' = 'length';
    const history: number[] = [...promptIds, ...req.prefix_token_ids];
    // Drafts and checks go together: the hops' histories keep rows cut back aside, and a check rebuilds each step as computed.
    const speculator = this.speculatorFor(req, session, run.declared, promptIds.length);
    let completed = false;
    try {
      let next: number[] = history.slice();
      gen: while (index < req.max_tokens && run.position + next.length <= ex.maxContext) {
        if (signal?.aborted) throw new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled');
        const sp: StepPlan = speculator ? await speculator.plan(history, next, run.position, index) : { tokens: next, draftMs: 0 };
        const t0 = performance.now();
        const answer = await this.step(run, sp, () => [...history.slice(0, run.position), ...sp.tokens]);
        // A one-row step sets the step budget; one that recovered a hop is no measure of the usual one.
        if (sp.tokens.length === 1 && run.pending.length === 0) this.hopSteps.observeStep(performance.now() - t0);
        speculator?.settle(sp, answer, { batchFull: answer.batchFull });
        // The checks judge every token the step emitted, each from its row, over the rows that stay.
        // A sampling drafter's step: the acceptance rule drew its tokens, and a check replays that rule against its draft.
        const sampledDraft = isStochasticDraft(sp.draft, run.localSampling) ? sp.draft : undefined;
        run.checks?.step(sp.tokens.length, answer.tokens.map((tokenId, i) => ({ tokenId, logprob: answer.logprobs[i] ?? 0 })), next.length + answer.accepted, sampledDraft);
        // How each step was computed: a replay resends the history in these same chunks (a verification's
        // kept rows padded back to its width, so the rebuilt cache is bit for bit the same).
        run.steps.push({ start: run.position, width: sp.tokens.length });
        // The rows that stay: the unfed tokens and the accepted drafts; the hops cut the rest at the next step.
        run.position += next.length + answer.accepted;
        if (answer.accepted < sp.tokens.length - next.length) {
          // The cut rows are kept aside while checks may need them: the hops signed them.
          for (const hs of run.hops) hs.history.truncate(run.position, run.checks !== undefined);
          run.cut = true;
        }
        while (run.pending.length > 0) yield run.pending.shift()!;
        const drafted = sp.draft?.ids.length ?? 0;
        for (let t = 0; t < answer.tokens.length; t++) {
          const tokenId = answer.tokens[t]!;
          if (tok.isEos(tokenId)) {
            finish = 'stop';
            break gen;
          }
          history.push(tokenId);
          const pushed = stop.push(detok.push(tokenId));
          let text = pushed.text;
          // The last token of a length-limited run lets go of text held for a stop string that can no longer complete.
          if (!pushed.stopped && (index + 1 >= req.max_tokens || history.length > ex.maxContext)) text += stop.flush();
          const counts = t === 0 && drafted > 0 ? { drafted, accepted: answer.accepted, ...(sampledDraft ? { drafts_sampled: true } : {}) } : {};
          yield { type: 'token', index, token_id: tokenId, text, logprob: answer.logprobs[t] ?? 0, ...counts };
          index++;
          if (pushed.stopped) {
            finish = 'stop';
            break gen;
          }
          if (index >= req.max_tokens) break gen;
        }
        next = [answer.tokens.at(-1)!];
      }
      completed = true;
      const c = speculator?.counters;
      yield { type: 'done', finish_reason: finish, completion_tokens: index, prompt_tokens: promptIds.length, ...(c && c.drafted > 0 ? { drafted: c.drafted, accepted: c.accepted, trips: c.trips } : {}) };
    } catch (e) {
      if (!completed) {
        while (run.pending.length > 0) yield run.pending.shift()!;
        yield errorEvent(e);
      }
    } finally {
      ex.dropSession(session);
      // With checks, the planned hops' answers to DELETE carry their final attestation (head-verify.ts); the checks run after.
      if (run.checks) run.checks.end(hops, history.slice(0, run.position));
      else for (const hs of hops) transport.bestEffort(hs.hop, { method: 'DELETE', path: `/sessions/${encodeURIComponent(session)}` });
      if (speculator) {
        addCounters(this.specTotals, speculator.counters);
        const learnt = speculator.carry();
        // Generations running at once each start from the same state; the last to end is kept (a fixed k keeps the probe back-off it did not use).
        if (learnt) {
          const probe = learnt.policy.probe ?? this.carried.get(learnt.key)?.probe;
          this.carried.set(learnt.key, probe ? { ...learnt.policy, probe } : learnt.policy);
        }
        await speculator.release();
      }
    }
  }

  /** Speculative decoding over every generation this driver ran (GET /info, heartbeats). */
  speculationStats(): SpeculationCounters {
    return { ...this.specTotals };
  }

  /** The generation's speculator, or none: turned off (by the request or the node), or nothing to draft with. */
  private speculatorFor(req: GenerateRequest, session: string, declared: number, promptTokens: number): Speculator | undefined {
    if (!this.options.speculation || req.speculative === false || req.speculative_k === 0) return undefined;
    const drafter: Drafter | undefined = (this.init.drafter ?? promptLookupFor(this.init.tokenizer))(req, { session, declared, promptTokens });
    if (!drafter) return undefined;
    const prior = drafter.memoryKey === undefined ? undefined : this.carried.get(drafter.memoryKey);
    // A draft model this head knows nothing of yet probes before it drafts: each of its drafts costs a forward.
    const probeFirst = drafter.kind === 'model' || drafter.kind === 'self';
    const policy = new AdaptiveK({ ...(req.speculative_k !== undefined ? { fixedK: req.speculative_k } : {}), ...(prior ? { prior } : {}), probeFirst });
    return new Speculator({ drafter, policy, maxTokens: req.max_tokens, declared });
  }

  /** One step: `sp.tokens` enter at `run.position` (with drafts, a verification); returns the token(s) it emits. */
  private async step(run: Generation, sp: StepPlan, allTokens: () => number[]): Promise<StepAnswer> {
    const seq = sp.tokens.length;
    const total = run.position + seq;
    const spec = specHeaders(sp);
    trace?.('step', run.session, run.position);
    const local = await this.headSpan(run, sp, allTokens);
    trace?.('head-span', run.session, run.position);
    // What the head's own span computed, for its attestation: this step's tokens, or every token when its cache was rebuilt.
    const fed = local.kind === 'token' || local.data.length / this.init.executor.config.hiddenSize === seq ? { at: run.position, ids: sp.tokens } : { at: 0, ids: allTokens() };
    if (local.kind === 'token') {
      run.checks?.local(fed.at, fed.ids, local, isStochasticDraft(sp.draft, run.localSampling) ? sp.draft : undefined);
      const v = local.spec;
      return v ? { tokens: v.tokenIds, logprobs: v.logprobs, accepted: v.accepted, batchFull: false } : { tokens: [local.tokenId], logprobs: [local.logprob], accepted: 0, batchFull: false };
    }
    // `input` holds this step's rows, or every row when the previous hop replayed (its history is then rebuilt whole).
    const input: Uint8Array = encodeTensor(local.data, this.options.wireDtype);
    run.checks?.local(fed.at, fed.ids, input);
    return this.hopSteps.run(run, input, seq, total, spec);
  }

  /** The head's own layers for a step (its cache rebuilt from the token history when it was dropped); a busy head is MESH_ERR_BUSY naming it. */
  private async headSpan(run: Generation, sp: StepPlan, allTokens: () => number[]): Promise<ForwardResult> {
    const ex = this.init.executor;
    const last = run.localEnd === ex.config.numLayers;
    const localReq = (ids: readonly number[], pos: number): ForwardRequest => ({
      session: run.session,
      position: pos,
      ...(pos === 0 ? { sessionTokens: run.declared } : {}),
      ...(pos > 0 && sp.rollbackFrom !== undefined ? { rollbackFrom: sp.rollbackFrom } : {}),
      tokenIds: ids,
      startLayer: 0,
      endLayer: run.localEnd,
      ...(last ? { sampling: run.localSampling, ...(sp.draft ? { draft: sp.draft } : {}) } : {}),
    });
    try {
      try {
        return await ex.forward(localReq(sp.tokens, run.position));
      } catch (e) {
        // Our own cache was dropped after idling past its TTL: rebuild it from the token history.
        if (!(e instanceof PositionMismatchError)) throw e;
        return await ex.forward(localReq(allTokens(), 0));
      }
    } catch (e) {
      if (e instanceof MeshError && (e.code === 'MESH_ERR_BUSY' || isRebuilding(e))) throw new MeshError('MESH_ERR_BUSY', `head ${run.headPeerId}: ${e.message}`, { ...e.details, peer_id: run.headPeerId });
      throw e;
    }
  }

  /** How long one hop may take to answer a one-token step (all its paths together) before it counts as failed. */
  stepBudgetMs(rows = 1): number {
    return this.hopSteps.stepBudgetMs(rows);
  }
}
