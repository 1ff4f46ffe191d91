/**
 * A step's rows down the route, once the head has run its own layers: down
 * the chain while the hops are the signed ones, as a star otherwise (or when
 * the chain step fails), with a failed hop replaced and replayed and a 409
 * replayed once (hop-failover.ts), and each hop given the step budget. Kept
 * apart from the driver (pipeline.ts), which decides what a step feeds and
 * what its answer emits; this module only gets the answer back.
 */
import { MeshError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import type { Dtype } from '../../protocol/tensor.ts';
import { concatBytes } from '../../protocol/bytes.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import { trace } from '../../protocol/trace.ts';
import { ATTEST_HEADER } from '../../verify/attest.ts';
import type { HeadVerify } from '../verify/head-verify.ts';
import { ChainStepError, chainStep, type ChainInbox, type ChainState } from './chain-driver.ts';
import { isDecodeStep, specHeaderMap, stepAnswer, type Generation, type SpecHeaders, type StepAnswer } from './generation.ts';
import { HopFailover, ReplayMismatch, recoveredEvent, type HopState, type PendingRecovery, type ReplaceSpan, type SendRows } from './hop-failover.ts';
import { busyError, parseTokenAnswer } from './pipeline-parts.ts';

/** A hop's one-token step is given up on after this many times the recent step (the step budget)… */
export const STEP_BUDGET_FACTOR = 5;
/** …but never sooner than this, ms (a slow donor's step, a busy machine's stall). */
export const STEP_BUDGET_FLOOR_MS = 2_000;

/** What the hops' side needs of the driver's init (read as the step runs). */
export interface HopStepsInit {
  readonly executor: { readonly config: { readonly hiddenSize: number } };
  readonly transport: HopTransport;
  readonly replace?: ReplaceSpan | undefined;
  readonly verify?: HeadVerify | undefined;
  readonly onLog?: ((message: string) => void) | undefined;
}

/** The driver's options this side reads (PipelineOptions). */
export interface HopStepsOptions {
  readonly wireDtype: Dtype;
  readonly decodeTimeoutMs: number;
  readonly prefillTimeoutMs: number;
  readonly maxRecoveries: number;
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

export class HopSteps {
  /** A failed hop's replacement and a hop's replay (hop-failover.ts). */
  private readonly failover: HopFailover;
  /** Moving average of this head's one-token steps, ms, over its generations: sets the step budget. */
  private recentStepMs: number | undefined;

  constructor(
    private readonly init: HopStepsInit,
    private readonly options: HopStepsOptions,
    /** Where last hops hand back chained steps' tokens (the driver's, POST /chain/token). */
    private readonly chainInbox: ChainInbox,
    private readonly rowBytes: number,
  ) {
    this.failover = new HopFailover({ replace: init.replace, maxRecoveries: options.maxRecoveries, rowBytes, onLog: init.onLog });
  }

  /** The step's `input` rows (the head's output) through every hop: the last hop's token(s). */
  async run(run: Generation, input: Uint8Array, seq: number, total: number, spec: SpecHeaders): Promise<StepAnswer> {
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

  /** How long one hop may take to answer a one-token step (all its paths together) before it counts as failed. */
  stepBudgetMs(rows = 1): number {
    const max = this.options.decodeTimeoutMs;
    if (this.recentStepMs === undefined) return max;
    return Math.min(max, Math.max(STEP_BUDGET_FLOOR_MS, Math.round(STEP_BUDGET_FACTOR * this.recentStepMs * rows)));
  }

  /** A one-token step took `ms`: the step budget follows the recent ones. */
  observeStep(ms: number): void {
    this.recentStepMs = this.recentStepMs === undefined ? ms : this.recentStepMs + 0.2 * (ms - this.recentStepMs);
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
}
