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
 * the same reason). A 409 from a hop (its cache vanished after a real fault:
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
import type { ForwardRequest, ForwardResult } from '../../shard/executor.ts';
import { PositionMismatchError } from '../../shard/errors.ts';
import { StopMatcher, StreamDecoder } from '../../model/text-stream.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import { History, busyError, errorEvent, isRebuilding, parseTokenAnswer, sessionIdFor } from './pipeline-parts.ts';
import { ChainInbox, ChainState, ChainStepError, chainStep, type SignedRouteText } from './chain-driver.ts';
import { trace } from '../../protocol/trace.ts';

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

/** A replacement span; with `chain`, the head's whole route with it in place as the tracker re-signed it (chained hops resume on it). */
export interface Replacement {
  hops: RouteHop[];
  chain?: { hops: RouteHop[]; signed: SignedRouteText };
}

/** Asks the tracker for hops covering exactly [failed.start_layer, failed.end_layer); `route`: the hops the head runs now (the tracker then re-signs the whole route). */
export type ReplaceSpan = (failed: RouteHop, signal?: AbortSignal, route?: readonly RouteHop[]) => Promise<RouteHop[] | Replacement>;

export interface PipelineOptions {
  /** Wire dtype of activations between hops. @defaultValue 'bf16' */
  wireDtype: Dtype;
  /** Longest wait for one hop's answer to a one-token step, ms. @defaultValue 10000 */
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
}

export const PIPELINE_DEFAULTS: PipelineOptions = { wireDtype: 'bf16', decodeTimeoutMs: 10_000, prefillTimeoutMs: 60_000, maxRecoveries: 4, hopMode: 'chain' };

export interface PipelineInit extends Partial<PipelineOptions> {
  executor: HeadExecutor;
  tokenizer: HeadTokenizer;
  transport: HopTransport;
  /** Absent: a failed hop ends the generation with an error event (no tracker to ask). */
  replace?: ReplaceSpan;
  onLog?: (message: string) => void;
}

interface HopState {
  hop: RouteHop;
  history: History;
  /** False: its cache does not hold the history (new replacement, or a 409): the next send replays from position 0. */
  synced: boolean;
}

interface PendingRecovery {
  t0: number;
  failed: string;
  replacements: string[];
  /** Emit once the hop at this index answered. */
  untilIndex: number;
}

export interface GenerateOptions {
  signal?: AbortSignal;
  /** The route as the tracker signed it: hops check it before they push (absent: no chain, the star). */
  signed?: SignedRouteText;
}

export class PipelineDriver {
  readonly options: PipelineOptions;
  /** Where last hops hand back chained steps' tokens (POST /chain/token). */
  readonly chainInbox = new ChainInbox();
  private readonly rowBytes: number;

  constructor(private readonly init: PipelineInit) {
    const o = { ...PIPELINE_DEFAULTS };
    for (const k of Object.keys(PIPELINE_DEFAULTS) as Array<keyof PipelineOptions>) if (init[k] !== undefined) (o as Record<string, unknown>)[k] = init[k];
    this.options = o;
    this.rowBytes = init.executor.config.hiddenSize * dtypeBytes(o.wireDtype);
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
      if (promptIds.length + req.prefix_token_ids.length >= ex.maxContext) {
        throw new MeshError('MESH_ERR_TOO_LARGE', `prompt of ${promptIds.length} tokens (+${req.prefix_token_ids.length} already generated) does not fit the context of ${ex.maxContext}`);
      }
    } catch (e) {
      yield errorEvent(e);
      return;
    }
    const L = ex.config.numLayers;
    const session = sessionIdFor(req.session_id);
    // Positions this session reaches at most: max_tokens counts the prefix, and the last token is never fed back.
    const declared = Math.min(ex.maxContext, promptIds.length + req.max_tokens);
    const hops: HopState[] = plan.hops.map((hop) => ({ hop, history: new History(this.rowBytes, 64), synced: true }));
    const sampling = JSON.stringify({ temperature: req.temperature, top_p: req.top_p, top_k: req.top_k, ...(req.seed !== undefined ? { seed: req.seed } : {}) });
    const localSampling = { temperature: req.temperature, topP: req.top_p, topK: req.top_k, ...(req.seed !== undefined ? { seed: req.seed } : {}) };
    const detok = new StreamDecoder((ids) => tok.decode(ids, { skipSpecialTokens: true }));
    const stop = new StopMatcher(req.stop);
    const pending: GenerateEvent[] = [];
    let recoveries = 0;
    let position = 0;
    const chain = new ChainState(this.options.hopMode === 'chain', opts.signed, plan.hops);
    let index = req.prefix_token_ids.length;

    yield { type: 'start', prompt_tokens: promptIds.length, route: hops.map((h) => h.hop.peer_id) };
    // A restart after a head failed: both see the text so far as that head did, so the stop
    // matcher holds back exactly what it held (and never sent), and releases or drops it as it would have.
    for (const id of req.prefix_token_ids) stop.push(detok.push(id));

    /** One step: `tokens` enter at `position`; returns the sampled token. */
    const step = async (tokens: number[], allTokens: () => number[]): Promise<{ tokenId: number; logprob: number }> => {
      const seq = tokens.length;
      const total = position + seq;
      trace?.('step', session, position);
      let local: ForwardResult;
      const localReq = (ids: readonly number[], pos: number): ForwardRequest => ({
        session,
        position: pos,
        ...(pos === 0 ? { sessionTokens: declared } : {}),
        tokenIds: ids,
        startLayer: 0,
        endLayer: plan.localEnd,
        ...(plan.localEnd === L ? { sampling: localSampling } : {}),
      });
      try {
        try {
          local = await ex.forward(localReq(tokens, position));
        } catch (e) {
          // Our own cache was dropped after idling past its TTL: rebuild it from the token history.
          if (!(e instanceof PositionMismatchError)) throw e;
          local = await ex.forward(localReq(allTokens(), 0));
        }
      } catch (e) {
        if (e instanceof MeshError && (e.code === 'MESH_ERR_BUSY' || isRebuilding(e))) throw new MeshError('MESH_ERR_BUSY', `head ${headPeerId}: ${e.message}`, { ...e.details, peer_id: headPeerId });
        throw e;
      }
      trace?.('head-span', session, position);
      if (local.kind === 'token') return { tokenId: local.tokenId, logprob: local.logprob };
      // `input` holds this step's rows, or every row when the previous hop replayed (its history is then rebuilt whole).
      let input: Uint8Array = encodeTensor(local.data, this.options.wireDtype);
      if (chain.usable(hops)) {
        const got = await this.chainStepOrStar(chain, hops, input, { headPeerId, session, position, seq, total, sampling, declared, signal });
        trace?.('step-done', session, position);
        if (got) return got;
      }
      let recovery: PendingRecovery | undefined;
      /** Hops replayed after a 409 in this step: each gets one replay. */
      const replayed409 = new Set<HopState>();

      for (let i = 0; i < hops.length; ) {
        const hs = hops[i]!;
        hs.history.extendTo(total, input);
        const last = i === hops.length - 1;
        const t0 = performance.now();
        let replayed: Uint8Array[] | null = null;
        let reply;
        try {
          if (!hs.synced) replayed = await this.replayHop(hs, bounds(), session, last, sampling, declared, signal);
          reply = await this.sendRows(hs, input.subarray(input.byteLength - seq * this.rowBytes), position, seq, session, last, sampling, declared, signal);
        } catch (e) {
          if (signal?.aborted || (e instanceof MeshError && (e.code === 'MESH_ERR_CANCELLED' || e.code === 'MESH_ERR_BUSY'))) throw e;
          if (e instanceof ReplayMismatch) {
            if (replayed409.has(hs)) throw new MeshError('MESH_ERR_POSITION_MISMATCH', `hop ${hs.hop.peer_id} answered 409 again while being replayed`);
            replayed409.add(hs);
            continue;
          }
          recovery = await this.recover(hops, i, e, headPeerId, recovery, t0, signal, () => recoveries++, chain);
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
        if (recovery && i >= recovery.untilIndex) {
          pending.push({ type: 'recovered', failed_peer_id: recovery.failed, replacement_peer_id: recovery.replacements.join(','), recovery_ms: Math.round(performance.now() - recovery.t0) });
          recovery = undefined;
        }
        if (last) {
          const ans = parseTokenAnswer(reply.body, hs.hop);
          return { tokenId: ans.token_id, logprob: ans.logprob };
        }
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
    };

    let finish: 'stop' | 'length' = 'length';
    const history: number[] = [...promptIds, ...req.prefix_token_ids];
    // Where each step started: a replay resends the history in these same chunks.
    const stepStarts: number[] = [];
    const bounds = (): number[] => [...stepStarts, position];
    let completed = false;
    try {
      let next: number[] = history.slice();
      while (index < req.max_tokens && position + next.length <= ex.maxContext) {
        if (signal?.aborted) throw new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled');
        const { tokenId, logprob } = await step(next, () => history.slice(0, position + next.length));
        stepStarts.push(position);
        position += next.length;
        while (pending.length > 0) yield pending.shift()!;
        if (tok.isEos(tokenId)) {
          finish = 'stop';
          break;
        }
        history.push(tokenId);
        const pushed = stop.push(detok.push(tokenId));
        let text = pushed.text;
        // The last token of a length-limited run lets go of text held for a stop string that can no longer complete.
        if (!pushed.stopped && (index + 1 >= req.max_tokens || position + 1 > ex.maxContext)) text += stop.flush();
        yield { type: 'token', index, token_id: tokenId, text, logprob };
        index++;
        if (pushed.stopped) {
          finish = 'stop';
          break;
        }
        next = [tokenId];
      }
      completed = true;
      yield { type: 'done', finish_reason: finish, completion_tokens: index, prompt_tokens: promptIds.length };
    } catch (e) {
      if (!completed) {
        while (pending.length > 0) yield pending.shift()!;
        yield errorEvent(e);
      }
    } finally {
      ex.dropSession(session);
      for (const hs of hops) transport.bestEffort(hs.hop, { method: 'DELETE', path: `/sessions/${encodeURIComponent(session)}` });
    }
  }

  /**
   * The step down the chain; undefined when it failed and must run as a star
   * (hops may hold the step already: the star's 409 replay puts them right,
   * and leaves every hop in sync for the next chained step).
   */
  private async chainStepOrStar(chain: ChainState, hops: HopState[], input: Uint8Array, s: ChainStepArgs): Promise<{ tokenId: number; logprob: number } | undefined> {
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
        timeoutMs: chain.timeout(s.seq, s.seq > 1 ? this.options.prefillTimeoutMs : this.options.decodeTimeoutMs),
        ...(s.signal ? { signal: s.signal } : {}),
      });
      chain.observe(s.seq, performance.now() - t0);
      const ans = parseTokenAnswer(r.token, hops.at(-1)!.hop);
      // The rows came with the token; without them the hops after the first could not be replayed from history: replay all from the head's own rows.
      if (!chain.file(hops, r.rows, s.total, s.seq * this.rowBytes)) {
        this.init.onLog?.(`chain step at position ${s.position}: the last hop handed back ${r.rows.byteLength} bytes of rows, not ${(hops.length - 1) * s.seq * this.rowBytes}; the generation goes on as a star`);
        chain.off = true;
        for (const h of hops) h.synced = false;
      }
      return { tokenId: ans.token_id, logprob: ans.logprob };
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
  private sendRows(hs: HopState, body: Uint8Array, pos: number, rows: number, session: string, last: boolean, sampling: string, declared: number, signal: AbortSignal | undefined) {
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
    const timeout = rows > 1 ? this.options.prefillTimeoutMs : this.options.decodeTimeoutMs;
    return this.init.transport.send(hs.hop, { method: 'POST', path: '/forward', headers, body }, timeout, signal, { sample: rows === 1 });
  }

  /**
   * Rebuild a hop's cache from its input history, in the chunks the rows were
   * first computed in (the prompt, then one row per step): a kernel run on
   * [1, n] rows rounds differently from n runs on [1, 1], and replaying in
   * the original shapes keeps the cache, and so every later token, bit for
   * bit what it would have been. Returns the outputs (null for the last hop,
   * whose answers are tokens).
   */
  private async replayHop(hs: HopState, starts: number[], session: string, last: boolean, sampling: string, declared: number, signal: AbortSignal | undefined): Promise<Uint8Array[] | null> {
    const outs: Uint8Array[] = [];
    const hist = hs.history.view();
    for (let k = 0; k + 1 < starts.length; k++) {
      const a = starts[k]!;
      const b = starts[k + 1]!;
      const reply = await this.sendRows(hs, hist.subarray(a * this.rowBytes, b * this.rowBytes), a, b - a, session, last, sampling, declared, signal);
      if (reply.status === 409) throw new ReplayMismatch();
      if (reply.status === 503) throw busyError(hs.hop, reply);
      if (!last) {
        if (reply.body.byteLength !== (b - a) * this.rowBytes) throw new MeshError('MESH_ERR_UPSTREAM', `hop ${hs.hop.peer_id} answered ${reply.body.byteLength} bytes replaying ${b - a} rows`);
        outs.push(reply.body);
      }
    }
    hs.synced = true;
    return last ? null : outs;
  }

  /** Replace hops[i] by the tracker's answer; returns the recovery to report once the replacement answers. */
  private async recover(
    hops: HopState[],
    i: number,
    cause: unknown,
    headPeerId: string,
    current: PendingRecovery | undefined,
    t0: number,
    signal: AbortSignal | undefined,
    count: () => number,
    chain: ChainState,
  ): Promise<PendingRecovery> {
    const failed = hops[i]!;
    const reason = cause instanceof Error ? cause.message : String(cause);
    if (!this.init.replace) throw new MeshError('MESH_ERR_UPSTREAM', `${reason}; no tracker to ask for a replacement`);
    if (count() >= this.options.maxRecoveries) throw new MeshError('MESH_ERR_UPSTREAM', `${reason}; gave up after ${this.options.maxRecoveries} replacements`);
    this.init.onLog?.(`hop ${failed.hop.peer_id} [${failed.hop.start_layer}, ${failed.hop.end_layer}) failed (${reason}); asking the tracker for a replacement`);
    const answer = await this.init.replace(failed.hop, signal, hops.map((h) => h.hop));
    const got = Array.isArray(answer) ? answer : answer.hops;
    let at = failed.hop.start_layer;
    for (const h of got) {
      if (h.start_layer !== at || h.end_layer <= at || h.peer_id === headPeerId) {
        throw new MeshError('MESH_ERR_UPSTREAM', `the tracker's replacement does not chain over [${failed.hop.start_layer}, ${failed.hop.end_layer})`);
      }
      at = h.end_layer;
    }
    if (got.length === 0 || at !== failed.hop.end_layer) throw new MeshError('MESH_ERR_UPSTREAM', `the tracker's replacement does not cover [${failed.hop.start_layer}, ${failed.hop.end_layer})`);
    // The first replacement inherits the failed hop's input history; the others get theirs from the replay's outputs.
    const fresh: HopState[] = got.map((hop, k) => ({ hop, history: k === 0 ? failed.history : new History(this.rowBytes, failed.history.rows), synced: false }));
    hops.splice(i, 1, ...fresh);
    // The tracker re-signed the route with the replacement in place: once every hop is in sync again, steps chain again.
    if (!Array.isArray(answer) && answer.chain) chain.renew(answer.chain.signed, answer.chain.hops);
    const failedIds = current ? current.failed : failed.hop.peer_id;
    return {
      t0: current?.t0 ?? t0,
      failed: failedIds,
      replacements: got.map((h) => h.peer_id),
      untilIndex: i + got.length - 1,
    };
  }
}

interface ChainStepArgs {
  headPeerId: string;
  session: string;
  position: number;
  seq: number;
  total: number;
  sampling: string;
  declared: number;
  signal: AbortSignal | undefined;
}

/** A hop answered 409 in the middle of its replay (it lost the cache again): start its replay over. */
class ReplayMismatch extends Error {}
