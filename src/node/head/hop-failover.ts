/**
 * What the head's pipeline (pipeline.ts) does when a hop fails: it asks the
 * tracker for hops that cover the failed span, splices them into the
 * generation's route, and rebuilds a hop's KV cache by replaying its input
 * history in the chunks the rows were first computed in. The sampled token
 * of the step does not change, so greedy output is the same with or
 * without failures, and no token is skipped.
 *
 * The first replacement inherits the failed hop's input history; the hops
 * after it in the replacement get theirs from the replay's outputs. A node
 * the tracker hands back for its own span (nobody else holds it, and it
 * answers again) most likely holds the session still: it is sent the step
 * as it is, and a 409 replays it.
 */
import type { MeshReply } from '../../protocol/envelopes.ts';
import { MeshError } from '../../protocol/errors.ts';
import type { GenerateEvent, RouteHop } from '../../protocol/tracker.ts';
import type { RouteProof } from '../../net/rtc-signal.ts';
import type { ChainState, SignedRouteText } from './chain-driver.ts';
import { History, busyError } from './pipeline-parts.ts';

/** A replacement span; with `chain`, the head's whole route with it in place as the tracker re-signed it (chained hops resume on it). */
export interface Replacement {
  hops: RouteHop[];
  chain?: { hops: RouteHop[]; signed: SignedRouteText };
}

/** Asks the tracker for hops covering exactly [failed.start_layer, failed.end_layer); `route`: the hops the head runs now (the tracker then re-signs the whole route). */
export type ReplaceSpan = (failed: RouteHop, signal?: AbortSignal, route?: readonly RouteHop[]) => Promise<RouteHop[] | Replacement>;

/** A downstream hop of one generation, as the head drives it. */
export interface HopState {
  hop: RouteHop;
  history: History;
  /** False: its cache does not hold the history (new replacement, or a 409): the next send replays from position 0. */
  synced: boolean;
  /** The signed route with this hop on it: lets the transport open a data channel to it (net/rtc-pool.ts). */
  proof?: RouteProof;
}

/** How a step was first computed: where it started and how many rows it fed (a verification's drafts included). */
export interface Chunk {
  start: number;
  width: number;
}

/** A replacement under way: reported (a `recovered` event) once the hop at `untilIndex` answered. */
export interface PendingRecovery {
  t0: number;
  failed: string;
  replacements: string[];
  /** Emit once the hop at this index answered. */
  untilIndex: number;
}

/** What one generation has spent on failures so far (the pipeline's Generation holds it). */
export interface RecoveryCount {
  /** Replacements (up to maxRecoveries). */
  recoveries: number;
  /** Resumes on a failed hop the tracker found answering again (up to MAX_SAME_NODE_RESUMES). */
  sameNode: number;
}

/** Times one generation resumes on a failed hop that the tracker finds answering again (no spare holds its layers). */
export const MAX_SAME_NODE_RESUMES = 8;

/** A hop answered 409 in the middle of its replay (it lost the cache again): start its replay over. */
export class ReplayMismatch extends Error {}

/** One /forward of `rows` rows at `pos` to the hop being replayed (`rollbackFrom`: it may hold rows past `pos` up to there: cut them first). */
export type SendRows = (body: Uint8Array, pos: number, rows: number, rollbackFrom: number | undefined) => Promise<MeshReply>;

export interface HopFailoverInit {
  /** Absent: a failed hop ends the generation (no tracker to ask). */
  replace: ReplaceSpan | undefined;
  /** Hop replacements one generation may go through. */
  maxRecoveries: number;
  /** Bytes of one activation row on the wire. */
  rowBytes: number;
  onLog?: ((message: string) => void) | undefined;
}

export class HopFailover {
  constructor(private readonly init: HopFailoverInit) {}

  /**
   * Replace hops[i] by the tracker's answer (spliced into `hops` in place);
   * returns the recovery to report once the replacement answers. Throws
   * MESH_ERR_UPSTREAM when there is no tracker, the generation ran out of
   * replacements, or the answer does not cover the failed span.
   */
  async replace(
    hops: HopState[],
    i: number,
    cause: unknown,
    ctx: { headPeerId: string; current: PendingRecovery | undefined; t0: number; signal: AbortSignal | undefined; count: RecoveryCount; chain: ChainState },
  ): Promise<PendingRecovery> {
    const { headPeerId, current, t0, signal, count, chain } = ctx;
    const failed = hops[i]!;
    const reason = cause instanceof Error ? cause.message : String(cause);
    if (!this.init.replace) throw new MeshError('MESH_ERR_UPSTREAM', `${reason}; no tracker to ask for a replacement`);
    if (count.recoveries >= this.init.maxRecoveries) throw new MeshError('MESH_ERR_UPSTREAM', `${reason}; gave up after ${this.init.maxRecoveries} replacements`);
    this.init.onLog?.(`hop ${failed.hop.peer_id} [${failed.hop.start_layer}, ${failed.hop.end_layer}) failed (${reason}); asking the tracker for a replacement`);
    const answer = await this.init.replace(failed.hop, signal, hops.map((h) => h.hop));
    const got = Array.isArray(answer) ? answer : answer.hops;
    // The failed node itself (the tracker found nobody else, and it answers again: back from a relay restart, a
    // freeze): its cache most likely holds the session still, so it is sent the step as is; a 409 replays it.
    const same = got.length === 1 && got[0]!.peer_id === failed.hop.peer_id && got[0]!.start_layer === failed.hop.start_layer && got[0]!.end_layer === failed.hop.end_layer;
    if (same) {
      if (++count.sameNode > MAX_SAME_NODE_RESUMES) throw new MeshError('MESH_ERR_UPSTREAM', `${reason}; hop ${failed.hop.peer_id} keeps failing after answering the tracker (${MAX_SAME_NODE_RESUMES} times)`);
    } else count.recoveries++;
    let at = failed.hop.start_layer;
    for (const h of got) {
      if (h.start_layer !== at || h.end_layer <= at || h.peer_id === headPeerId) {
        throw new MeshError('MESH_ERR_UPSTREAM', `the tracker's replacement does not chain over [${failed.hop.start_layer}, ${failed.hop.end_layer})`);
      }
      at = h.end_layer;
    }
    if (got.length === 0 || at !== failed.hop.end_layer) throw new MeshError('MESH_ERR_UPSTREAM', `the tracker's replacement does not cover [${failed.hop.start_layer}, ${failed.hop.end_layer})`);
    // The first replacement inherits the failed hop's input history; the others get theirs from the replay's outputs.
    const fresh: HopState[] = got.map((hop, k) => ({ hop, history: k === 0 ? failed.history : new History(this.init.rowBytes, failed.history.rows), synced: same && failed.synced }));
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

  /**
   * Rebuild a hop's cache from its input history, in the chunks the rows were
   * first computed in (the prompt, then one row per step): a kernel run on
   * [1, n] rows rounds differently from n runs on [1, 1], and replaying in
   * the original shapes keeps the cache, and so every later token, bit for
   * bit what it would have been. `chunks` ends with the step about to run
   * (its start; its width is not used). Returns the outputs (null for the
   * last hop, whose answers are tokens); a 409 throws ReplayMismatch, a 503
   * MESH_ERR_BUSY naming the hop.
   */
  async replay(hs: HopState, chunks: readonly Chunk[], last: boolean, send: SendRows): Promise<Uint8Array[] | null> {
    const outs: Uint8Array[] = [];
    const hist = hs.history.view();
    const rb = this.init.rowBytes;
    let written = 0;
    for (let k = 0; k + 1 < chunks.length; k++) {
      const a = chunks[k]!.start;
      const b = chunks[k + 1]!.start;
      // A verification kept b − a of its rows: the kept ones, padded back to its width with copies of
      // the last (a row never changes an earlier one: causal attention, row-wise projections).
      const width = Math.max(b - a, chunks[k]!.width);
      let rows = hist.subarray(a * rb, b * rb);
      if (width > b - a) {
        const padded = new Uint8Array(width * rb);
        padded.set(rows);
        for (let r = b - a; r < width; r++) padded.set(hist.subarray((b - 1) * rb, b * rb), r * rb);
        rows = padded;
      }
      const reply = await send(rows, a, width, written > a ? written : undefined);
      written = Math.max(written, a + width);
      if (reply.status === 409) throw new ReplayMismatch();
      if (reply.status === 503) throw busyError(hs.hop, reply);
      if (!last) {
        if (reply.body.byteLength !== width * rb) throw new MeshError('MESH_ERR_UPSTREAM', `hop ${hs.hop.peer_id} answered ${reply.body.byteLength} bytes replaying ${width} rows`);
        outs.push(reply.body.subarray(0, (b - a) * rb));
      }
    }
    hs.synced = true;
    return last ? null : outs;
  }
}

/** The event a finished replacement reports. */
export function recoveredEvent(r: PendingRecovery): GenerateEvent {
  return { type: 'recovered', failed_peer_id: r.failed, replacement_peer_id: r.replacements.join(','), recovery_ms: Math.round(performance.now() - r.t0) };
}
