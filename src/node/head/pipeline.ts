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
 * Host-agnostic: the executor, tokenizer, transports and tracker are injected.
 */
import { MeshError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import { encodeTensor, type Dtype, dtypeBytes } from '../../protocol/tensor.ts';
import type { GenerateEvent, GenerateRequest, RouteHop } from '../../protocol/tracker.ts';
import { concatBytes } from '../../protocol/bytes.ts';
import type { ForwardRequest, ForwardResult } from '../../shard/contract.ts';
import { PositionMismatchError } from '../../shard/errors.ts';
import type { SamplingParams } from '../../shard/sampling.ts';
import { StopMatcher, StreamDecoder } from '../../model/text-stream.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import type { RouteProof } from '../../net/rtc-signal.ts';
import { History, busyError, errorEvent, isRebuilding, parseTokenAnswer, sessionIdFor, type TokenAnswer } from './pipeline-parts.ts';
import { isStochasticDraft, MAX_DRAFT, type DraftProposal } from '../../shard/speculative.ts';
import { encodeDraft } from '../../protocol/draft.ts';
import { AdaptiveK, type CarriedPolicy } from './speculation/adaptive-k.ts';
import type { Drafter } from './speculation/drafter.ts';
import { promptLookupFor } from './speculation/prompt-lookup.ts';
import { Speculator, addCounters, emptyCounters, type SpeculationCounters, type StepOutcome, type StepPlan } from './speculation/speculator.ts';
import { ChainInbox, ChainState, ChainStepError, chainStep, type SignedRouteText } from './chain-driver.ts';
import { HopFailover, ReplayMismatch, recoveredEvent, type Chunk, type HopState, type PendingRecovery, type ReplaceSpan, type SendRows } from './hop-failover.ts';
import { trace } from '../../protocol/trace.ts';
import type { GenerationTrace, HeadVerify } from '../verify/head-verify.ts';
import { ATTEST_HEADER } from '../../verify/attest.ts';
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

/** A hop's one-token step is given up on after this many times the recent step (the step budget)… */
export const STEP_BUDGET_FACTOR = 5;
/** …but never sooner than this, ms (a slow donor's step, a busy machine's stall). */
export const STEP_BUDGET_FLOOR_MS = 2_000;

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

/** One generation's state, shared by its steps. */
interface Generation {
  headPeerId: string;
  /** The KV session id on every hop. */
  session: string;
  /** Positions the session reaches at most (sessionTokens, X-Meshnet-Session-Tokens). */
  declared: number;
  /** The head runs layers [0, localEnd) itself. */
  localEnd: number;
  /** The downstream hops, replacements spliced in. */
  hops: HopState[];
  /** X-Meshnet-Sampling for the last hop. */
  sampling: string;
  /** The same, for a head that runs the last layer itself. */
  localSampling: SamplingParams;
  chain: ChainState;
  /** Events to yield after the current step (recoveries). */
  pending: GenerateEvent[];
  /** Replacements so far (up to maxRecoveries). */
  recoveries: number;
  /** Resumes on a failed hop the tracker found answering again (up to MAX_SAME_NODE_RESUMES, hop-failover.ts). */
  sameNode: number;
  /** Tokens every hop's cache holds before the current step. */
  position: number;
  /** How each step was computed (start, rows fed): a replay resends the history in these same chunks. */
  steps: Chunk[];
  signal: AbortSignal | undefined;
  /** What the spot-checks need of this generation (attestations, steps, tokens); absent: no checks. */
  checks: GenerationTrace | undefined;
  /** Rows were cut back after a speculative step (the next step started before the previous one ended). */
  cut?: boolean;
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
  /** A failed hop's replacement and a hop's replay (hop-failover.ts). */
  private readonly failover: HopFailover;
  private readonly specTotals = emptyCounters();
  /** What each drafter's generations learnt (Drafter.memoryKey → the k policy's state): the next one starts from it. */
  private readonly carried = new Map<string, CarriedPolicy>();
  /** Moving average of this head's one-token steps, ms, over its generations: sets the step budget. */
  private recentStepMs: number | undefined;

  constructor(private readonly init: PipelineInit) {
    const o = { ...PIPELINE_DEFAULTS };
    for (const k of Object.keys(PIPELINE_DEFAULTS) as Array<keyof PipelineOptions>) if (init[k] !== undefined) (o as Record<string, unknown>)[k] = init[k];
    this.options = o;
    this.rowBytes = init.executor.config.hiddenSize * dtypeBytes(o.wireDtype);
    this.failover = new HopFailover({ replace: init.replace, maxRecoveries: o.maxRecoveries, rowBytes: this.rowBytes, onLog: init.onLog });
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
        if (sp.tokens.length === 1 && run.pending.length === 0) this.observeStep(performance.now() - t0);
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
    // A hop the tracker now distrusts (a check proved it wrong) is replaced before this step, by the star's replay.
    const verify = this.init.verify;
    const distrusted = verify !== undefined && run.hops.some((h) => verify.distrusted(h.hop.peer_id));
    if (!distrusted && run.chain.usable(run.hops)) {
      const { headPeerId, session, position, sampling, declared, signal } = run;
      const got = await this.chainStepOrStar(run.chain, run.hops, input, { headPeerId, session, position, seq, total, sampling, declared, signal, spec, decode: isDecodeStep(position, seq), onAttest: (h) => run.checks?.attest(h) });
      trace?.('step-done', run.session, run.position);
      if (got) return got;
    }
    return this.starStep(run, input, seq, total, spec);
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

  /**
   * The step as a star: the head sends `input` to each hop in turn and each
   * answers it; a failed hop is replaced and replayed, a 409 replayed once.
   */
  private async starStep(run: Generation, input: Uint8Array, seq: number, total: number, spec: SpecHeaders): Promise<StepAnswer> {
    const { hops, session, position, sampling, declared, signal } = run;
    let recovery: PendingRecovery | undefined;
    /** Hops replayed after a 409 in this step: each gets one replay. */
    const replayed409 = new Set<HopState>();

    for (let i = 0; i < hops.length; ) {
      const hs = hops[i]!;
      if (this.init.verify?.distrusted(hs.hop.peer_id)) {
        // Its caches and everything after it hold rows derived from its lies: replace it, and replay every later hop.
        this.init.onLog?.(`hop ${hs.hop.peer_id} is distrusted by the tracker (a check found it lying); replacing it`);
        recovery = await this.failover.replace(hops, i, new MeshError('MESH_ERR_FORBIDDEN', `hop ${hs.hop.peer_id} is quarantined`), { headPeerId: run.headPeerId, current: recovery, t0: performance.now(), signal, count: run, chain: run.chain });
        for (let k = i + 1; k < hops.length; k++) hops[k]!.synced = false;
        continue;
      }
      hs.history.extendTo(total, input);
      const last = i === hops.length - 1;
      const t0 = performance.now();
      let replayed: Uint8Array[] | null = null;
      let reply;
      try {
        // A replay after a cut sends padded rows in place of the rejected ones: this hop's new chain is not what the head kept.
        if (!hs.synced && run.cut) run.checks?.uncheckableHop(hs.hop.peer_id, 'it was rebuilt after rows were cut back (a replay pads the cut rows)');
        if (!hs.synced) {
          const send: SendRows = (body, pos, rows, rollbackFrom) => this.sendRows(hs, body, pos, rows, session, last, sampling, declared, signal, rollbackFrom !== undefined ? { rollbackFrom } : {});
          replayed = await this.failover.replay(hs, [...run.steps, { start: position, width: 0 }], last, send);
        }
        reply = await this.sendRows(hs, input.subarray(input.byteLength - seq * this.rowBytes), position, seq, session, last, sampling, declared, signal, { ...spec, draft: last ? spec.draft : undefined, decode: isDecodeStep(position, seq) });
      } catch (e) {
        if (signal?.aborted || (e instanceof MeshError && (e.code === 'MESH_ERR_CANCELLED' || e.code === 'MESH_ERR_BUSY'))) throw e;
        if (e instanceof ReplayMismatch) {
          if (replayed409.has(hs)) throw new MeshError('MESH_ERR_POSITION_MISMATCH', `hop ${hs.hop.peer_id} answered 409 again while being replayed`);
          replayed409.add(hs);
          continue;
        }
        recovery = await this.failover.replace(hops, i, e, { headPeerId: run.headPeerId, current: recovery, t0, signal, count: run, chain: run.chain });
        continue; // retry index i, now the first replacement hop
      }
      const rowsSent = seq;
      if (reply.status === 409) {
        // The hop lost the session's cache (it restarted, the session idled past its TTL, or the step ran twice): replay it, once.
        if (replayed409.has(hs)) throw new MeshError('MESH_ERR_POSITION_MISMATCH', `hop ${hs.hop.peer_id} answered 409 again after a replay`);
        replayed409.add(hs);
        this.init.onLog?.(`hop ${hs.hop.peer_id} answered 409 at position ${position}; replaying ${position} rows`);
        hs.synced = false;
        continue;
      }
      if (reply.status === 503) throw busyError(hs.hop, reply);
      hs.synced = true;
      run.checks?.attest(reply.headers);
      if (recovery && i >= recovery.untilIndex) {
        run.pending.push(recoveredEvent(recovery));
        recovery = undefined;
      }
      if (last) return stepAnswer(parseTokenAnswer(reply.body, hs.hop), spec, reply.headers[H.batchFull] === '1');
      const answered = reply.headers[H.dtype];
      if (answered !== undefined && answered !== this.options.wireDtype) {
        throw new MeshError('MESH_ERR_UPSTREAM', `hop ${hs.hop.peer_id} answered ${H.dtype} ${answered.slice(0, 16)} to a ${this.options.wireDtype} request`);
      }
      if (reply.body.byteLength !== rowsSent * this.rowBytes) {
        throw new MeshError('MESH_ERR_UPSTREAM', `hop ${hs.hop.peer_id} answered ${reply.body.byteLength} bytes for ${rowsSent} rows of ${this.rowBytes}`);
      }
      // Zero-copy: the hop's answer (same dtype) is the next hop's body. After a replay the next
      // hop may need every row (when it is a fresh replacement too): hand it the replay's outputs as well.
      input = replayed && !hops[i + 1]!.synced ? concatBytes([...replayed, reply.body]) : reply.body;
      i++;
    }
    throw new MeshError('MESH_ERR_INTERNAL', 'the route has no last hop');
  }

  /**
   * The step down the chain; undefined when it failed and must run as a star
   * (hops may hold the step already: the star's 409 replay puts them right,
   * and leaves every hop in sync for the next chained step).
   */
  private async chainStepOrStar(chain: ChainState, hops: HopState[], input: Uint8Array, s: ChainStepArgs): Promise<StepAnswer | undefined> {
    hops[0]!.history.extendTo(s.total, input);
    const t0 = performance.now();
    try {
      const r = await chainStep({
        transport: this.init.transport,
        inbox: this.chainInbox,
        headPeerId: s.headPeerId,
        signed: chain.signed!,
        hops: hops.map((h) => h.hop),
        body: input,
        dtype: this.options.wireDtype,
        hidden: this.init.executor.config.hiddenSize,
        seq: s.seq,
        position: s.position,
        session: s.session,
        sampling: s.sampling,
        declared: s.declared,
        // A verification (a few rows after the prompt) is timed as a decode step.
        timeoutMs: chain.timeout(s.decode ? 1 : s.seq, s.decode ? this.options.decodeTimeoutMs : this.options.prefillTimeoutMs, undefined, this.recentStepMs),
        extra: specHeaderMap(s.spec),
        ...(s.signal ? { signal: s.signal } : {}),
      });
      chain.observe(s.decode ? 1 : s.seq, performance.now() - t0);
      if (r.attest !== undefined) s.onAttest?.({ [ATTEST_HEADER]: r.attest });
      const ans = parseTokenAnswer(r.token, hops.at(-1)!.hop);
      // The rows came with the token; without them the hops after the first could not be replayed from history: replay all from the head's own rows.
      if (!chain.file(hops, r.rows, s.total, s.seq * this.rowBytes)) {
        this.init.onLog?.(`chain step at position ${s.position}: the last hop handed back ${r.rows.byteLength} bytes of rows, not ${(hops.length - 1) * s.seq * this.rowBytes}; the generation goes on as a star`);
        chain.off = true;
        for (const h of hops) h.synced = false;
      }
      return stepAnswer(ans, s.spec, r.batchFull === true);
    } catch (e) {
      if (s.signal?.aborted) throw new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled');
      if (!(e instanceof ChainStepError)) throw e;
      chain.failed();
      if (e.error.code === 'MESH_ERR_BUSY') {
        const hop = hops.find((h) => h.hop.peer_id === e.peer)?.hop ?? hops[0]!.hop;
        throw new MeshError('MESH_ERR_BUSY', `hop ${hop.peer_id} [${hop.start_layer}, ${hop.end_layer}): ${e.error.message}`, { peer_id: hop.peer_id, ...e.error.details });
      }
      this.init.onLog?.(`chain step at position ${s.position} failed at hop ${e.peer ?? '(unknown)'} (${e.error.code}: ${e.error.message}); running it as a star`);
      return undefined;
    }
  }

  /** One /forward of `rows` rows at `pos`; a 409 or a 503 MESH_ERR_BUSY comes back as the reply (the caller replays, or gives up). */
  private sendRows(hs: HopState, body: Uint8Array, pos: number, rows: number, session: string, last: boolean, sampling: string, declared: number, signal: AbortSignal | undefined, spec: SpecHeaders & { decode?: boolean } = {}) {
    const headers: Record<string, string> = {
      [H.shape]: `1,${rows},${this.init.executor.config.hiddenSize}`,
      [H.dtype]: this.options.wireDtype,
      [H.session]: session,
      [H.position]: String(pos),
      [H.startLayer]: String(hs.hop.start_layer),
      [H.endLayer]: String(hs.hop.end_layer),
      'content-type': 'application/octet-stream',
    };
    if (last) headers[H.sampling] = sampling;
    // Opening the session: the hop reserves KV room for all of it now, or refuses before computing anything.
    if (pos === 0) headers[H.sessionTokens] = String(declared);
    Object.assign(headers, specHeaderMap(spec));
    // A verification's rows each may cost up to a one-row step on a compute-bound hop: its budget counts them.
    const timeout = rows > 1 && !spec.decode ? this.options.prefillTimeoutMs : this.stepBudgetMs(rows);
    return this.init.transport.send(hs.hop, { method: 'POST', path: '/forward', headers, body }, timeout, signal, { sample: rows === 1, ...(hs.proof ? { proof: hs.proof } : {}) });
  }

  /** How long one hop may take to answer a one-token step (all its paths together) before it counts as failed. */
  stepBudgetMs(rows = 1): number {
    const max = this.options.decodeTimeoutMs;
    if (this.recentStepMs === undefined) return max;
    return Math.min(max, Math.max(STEP_BUDGET_FLOOR_MS, Math.round(STEP_BUDGET_FACTOR * this.recentStepMs * rows)));
  }

  private observeStep(ms: number): void {
    this.recentStepMs = this.recentStepMs === undefined ? ms : this.recentStepMs + 0.2 * (ms - this.recentStepMs);
  }

}

interface ChainStepArgs {
  /** The hops' attestations that came with the token (head-verify.ts). */
  onAttest?: (headers: Record<string, string>) => void;
  headPeerId: string;
  session: string;
  position: number;
  seq: number;
  total: number;
  sampling: string;
  declared: number;
  signal: AbortSignal | undefined;
  spec: SpecHeaders;
  /** A decode step (a verification's few rows included): timed as one. */
  decode: boolean;
}

/** What a step emits. */
interface StepAnswer extends StepOutcome {
  /** A hop said its batches run full. */
  batchFull: boolean;
}

/** A step's speculative-decoding headers: the drafts (to the hop with the LM head) and the rollback bound (to every hop). */
interface SpecHeaders {
  draft?: DraftProposal | undefined;
  rollbackFrom?: number | undefined;
}

function specHeaders(sp: StepPlan): SpecHeaders {
  return { ...(sp.draft ? { draft: sp.draft } : {}), ...(sp.rollbackFrom !== undefined ? { rollbackFrom: sp.rollbackFrom } : {}) };
}

function specHeaderMap(s: SpecHeaders): Record<string, string> {
  const out: Record<string, string> = {};
  if (s.draft) out[H.draft] = encodeDraft(s.draft);
  if (s.rollbackFrom !== undefined) out[H.rollback] = String(s.rollbackFrom);
  return out;
}

/** Steps after the prompt with at most a verification's rows are timed as decode steps. */
function isDecodeStep(position: number, seq: number): boolean {
  return seq === 1 || (position > 0 && seq <= MAX_DRAFT + 1);
}

/** The last hop's token JSON as what the step emits: its accepted drafts, then its token. */
function stepAnswer(ans: TokenAnswer, spec: SpecHeaders, batchFull: boolean): StepAnswer {
  const accepted = ans.accepted ?? 0;
  const ids = spec.draft?.ids ?? [];
  if (accepted > ids.length) throw new MeshError('MESH_ERR_UPSTREAM', `the last hop accepted ${accepted} drafted tokens of ${ids.length}`);
  const tokens = [...ids.slice(0, accepted), ans.token_id];
  const logprobs = ans.logprobs && ans.logprobs.length === tokens.length ? ans.logprobs : [...new Array<number>(accepted).fill(0), ans.logprob];
  return { tokens, logprobs, accepted, batchFull };
}
