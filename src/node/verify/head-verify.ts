/**
 * What a head's pipeline tells the verification side while it generates
 * (docs/verification.md), kept out of the pipeline itself: the hops'
 * attestations as they arrive with answers and tokens, the head's own
 * span's attestation, the steps and their tokens; at the end, the sessions
 * are dropped on every hop (the planned ones' answers carry their final
 * attestation) and the plan's checks go to the Verifier, off every critical
 * path. And which hops the tracker distrusts now: the pipeline replaces them
 * before its next step.
 */
import type { MeshReply } from '../../protocol/envelopes.ts';
import type { HeaderMap } from '../../protocol/headers.ts';
import type { RouteHop } from '../../protocol/tracker.ts';
import { dtypeBytes, type Dtype } from '../../protocol/tensor.ts';
import { concatBytes } from '../../protocol/bytes.ts';
import { ATTEST_HEADER, draftDigest, parseAttestations, stepTokenBytes, tokenBytes, tokenIdBytes, formatAttestation } from '../../verify/attest.ts';
import type { DraftProposal } from '../../shard/speculative.ts';
import type { Attestor } from '../../verify/attestor.ts';
import type { Distrust } from '../../verify/plan.ts';
import type { FinishedGeneration, FinishedSpan, SignedPlan, Verifier } from './verifier.ts';

/** Nodes the tracker distrusts now (quarantined after a check), until when. */
export class DistrustSet {
  private readonly until = new Map<string, number>();
  constructor(private readonly now: () => number = Date.now) {}

  /** The tracker's whole list (a heartbeat answer): replaces what was known. */
  replace(list: ReadonlyArray<{ peer_id: string; until: number }>): void {
    this.until.clear();
    for (const d of list) this.add(d);
  }

  add(d: Pick<Distrust, 'peer_id' | 'until'>): void {
    if (d.until > this.now()) this.until.set(d.peer_id, Math.max(d.until, this.until.get(d.peer_id) ?? 0));
  }

  has(peer: string): boolean {
    const u = this.until.get(peer);
    if (u === undefined) return false;
    if (u > this.now()) return true;
    this.until.delete(peer);
    return false;
  }

  get size(): number {
    return this.until.size;
  }
}

export interface HeadVerifyInit {
  peerId: string;
  /** Where finished generations are kept for walks; absent: not kept. */
  finished?: FinishedStore;
  model: string;
  attestor: Attestor;
  verifier: Verifier;
  distrust: DistrustSet;
  transport: {
    send(hop: RouteHop, req: { method: string; path: string; headers?: HeaderMap; body?: Uint8Array }, timeoutMs: number, signal?: AbortSignal, opts?: { accept?: (reply: MeshReply) => boolean }): Promise<MeshReply>;
    bestEffort(hop: RouteHop, req: { method: string; path: string }): void;
  };
}

export interface TraceStart {
  session: string;
  plan: SignedPlan | undefined;
  /** X-Meshnet-Sampling as the head sends it. */
  sampling: string;
  dtype: Dtype;
  hidden: number;
  numLayers: number;
  /** The head's own layers are [0, localEnd). */
  localEnd: number;
}

/** What the pipeline holds of a hop at the end. */
export interface TraceHop {
  hop: RouteHop;
  /** Its input rows kept (accepted), and the rows cut back at a row (History.truncate with keepCut). */
  history: { view(): Uint8Array; cutAt?(row: number): Uint8Array | undefined };
}

/** A finished generation as the checks need it, kept a while for a walk (a head audit contradicted it). */
export type Finished = Omit<FinishedGeneration, 'plan'> & { generation: string; at: number; bytes: number };

/** Finished generations kept for walks: at most this many bytes of rows, this long. */
const KEEP_BYTES = 64 << 20;
const KEEP_MS = 10 * 60_000;

/** A node's finished generations (as a head), kept a few minutes for the tracker's walks. */
export class FinishedStore {
  private readonly kept = new Map<string, Finished>();
  private keptBytes = 0;

  keep(f: Finished): void {
    const now = Date.now();
    for (const [k, v] of this.kept) {
      if (v.at > now - KEEP_MS && this.keptBytes + f.bytes <= KEEP_BYTES) break;
      this.kept.delete(k);
      this.keptBytes -= v.bytes;
    }
    if (f.bytes > KEEP_BYTES) return;
    this.kept.set(f.generation, f);
    this.keptBytes += f.bytes;
  }

  /** The tracker's walk (POST /verify/walk): check every span of a kept generation with its plan. False when it is not kept. */
  walk(plan: SignedPlan, verifier: Verifier): boolean {
    const f = this.kept.get(plan.plan.generation);
    if (!f) return false;
    verifier.finished({ ...f, plan });
    return true;
  }
}

export class HeadVerify {
  constructor(readonly init: HeadVerifyInit) {}

  distrusted(peer: string): boolean {
    return this.init.distrust.has(peer);
  }

  begin(s: TraceStart): GenerationTrace {
    return new GenerationTrace(this.init, s, (f) => this.init.finished?.keep(f));
  }
}

export class GenerationTrace {
  /** The latest attestation entry each peer sent (the newest chain: a hop restarted by a replay signs a new one). */
  private readonly latest = new Map<string, string>();
  private readonly steps: number[] = [];
  /** Rows each step kept (fewer than it computed when rejected draft rows were cut back after it). */
  private readonly kept: number[] = [];
  /** The token of each step's last row (what a plain step emits). */
  private readonly tokens: Array<{ tokenId: number; logprob: number }> = [];
  /** Every token each step emitted (a verification's accepted drafts, then its token). */
  private readonly stepTokens: Array<Array<{ tokenId: number; logprob: number }>> = [];
  /** Each step's draft when a sampling drafter's rule drew its tokens (the last hop signed its digest). */
  private readonly drafts: Array<DraftProposal | undefined> = [];
  /** Hops whose chain the head cannot rebuild, and why. */
  private readonly rebuilt = new Map<string, string>();
  /** The head's own span's steps as it signed them (restarted by a rebuild from position 0). */
  private own: Array<{ input: Uint8Array; output: Uint8Array }> = [];
  /** Set when rows the hops signed were cut back (a rejected speculative draft): the history no longer holds them. */
  private cut: string | undefined;

  constructor(
    private readonly init: HeadVerifyInit,
    private readonly s: TraceStart,
    private readonly onFinished: (f: Finished) => void,
  ) {}

  private get scope() {
    const last = this.s.localEnd === this.s.numLayers;
    return { model: this.init.model, session: this.s.session, startLayer: 0, endLayer: this.s.localEnd, dtype: this.s.dtype, ...(last ? { sampling: this.s.sampling } : {}) };
  }

  /**
   * The head's own span ran a step: token ids in, its wire rows (or, holding every layer, the tokens it
   * emitted) out; `sampledDraft`: the step's draft, when a sampling drafter's rule drew those tokens.
   */
  local(position: number, ids: readonly number[], out: Uint8Array | { tokenId: number; logprob: number; spec?: { tokenIds: readonly number[]; logprobs: readonly number[] } }, sampledDraft?: DraftProposal): void {
    const digest = sampledDraft ? draftDigest(sampledDraft) : undefined;
    const bytes = out instanceof Uint8Array ? out : out.spec ? stepTokenBytes(out.spec.tokenIds.map((tokenId, i) => ({ tokenId, logprob: out.spec!.logprobs[i] ?? 0 })), digest) : tokenBytes(out.tokenId, out.logprob);
    const input = tokenIdBytes(ids);
    this.init.attestor.record(this.scope, position, ids.length, input, bytes);
    if (position === 0) this.own = [];
    this.own.push({ input, output: bytes });
  }

  /** An answer's or a chained token's X-Meshnet-Attest entries, filed by the peer each names. */
  attest(headers: HeaderMap): void {
    const v = headers[ATTEST_HEADER];
    if (v === undefined) return;
    for (const a of parseAttestations(v)) this.latest.set(a.peer, formatAttestation(a));
  }

  /**
   * A step is done: the rows it computed, the tokens it emitted (a verification: its accepted drafts,
   * then the token after them), and the rows that stay (fewer when rejected draft rows are cut back:
   * the hops' histories keep the cut rows aside, so the check rebuilds each step as computed).
   * `sampledDraft`: the step's draft when a sampling drafter's rule drew its tokens (a check judges
   * them by that rule, against that draft).
   */
  step(rows: number, tokens: ReadonlyArray<{ tokenId: number; logprob: number }>, kept = rows, sampledDraft?: DraftProposal): void {
    this.steps.push(rows);
    this.kept.push(kept);
    this.tokens.push(tokens.at(-1)!);
    this.stepTokens.push([...tokens]);
    this.drafts.push(sampledDraft);
  }

  /**
   * Rows the hops computed and signed were cut back (rejected draft rows): the head's history keeps
   * accepted rows only, so its checks could not rebuild what the hops signed. Its planned checks are
   * then reported as skipped (`uncheckable`), never held against a hop.
   */
  uncheckable(why: string): void {
    this.cut ??= why;
  }

  /** One hop's signed chain is no longer what the head holds (it was rebuilt after a cut): its check is skipped, as `uncheckable`. */
  uncheckableHop(peer: string, why: string): void {
    if (!this.rebuilt.has(peer)) this.rebuilt.set(peer, why);
  }

  /**
   * The generation is over: drop the session on every hop, reading each hop's final attestation (hops
   * sign every few steps, so only the final one vouches for every step — a walk after a head audit
   * checks hops no plan named), and queue the checks. Returns at once; nothing waits for it.
   */
  end(hops: readonly TraceHop[], fed: readonly number[]): void {
    const drop = { method: 'DELETE', path: `/sessions/${encodeURIComponent(this.s.session)}` };
    const finals: Array<Promise<void>> = [];
    for (const h of hops) {
      finals.push(
        this.init.transport
          .send(h.hop, drop, 5_000, undefined, { accept: () => true })
          .then((r) => this.attest(r.headers))
          .catch(() => undefined),
      );
    }
    const own = this.init.attestor.finish(this.s.session).then((entry) => {
      if (entry) this.latest.set(this.init.peerId, entry);
    });
    void Promise.all([...finals, own]).then(() => this.dispatch(hops, fed));
  }

  private dispatch(hops: readonly TraceHop[], fed: readonly number[]): void {
    const { plan } = this.s;
    const rowBytes = this.s.hidden * dtypeBytes(this.s.dtype);
    const output = (k: number): FinishedSpan['output'] => {
      if (k >= hops.length) return { kind: 'tokens', tokens: this.tokens };
      return { kind: 'rows', bytes: hops[k]!.history.view(), rowBytes };
    };
    const spans: FinishedSpan[] = [];
    const att = (peer: string) => {
      const a = this.latest.get(peer);
      return a ? { attestation: a } : {};
    };
    spans.push({ peer: this.init.peerId, start: 0, end: this.s.localEnd, input: tokenIdBytes(fed), inputRowBytes: 4, output: output(0), ...att(this.init.peerId) });
    hops.forEach((h, k) => {
      const input = h.history.view();
      spans.push({ peer: h.hop.peer_id, start: h.hop.start_layer, end: h.hop.end_layer, input, inputRowBytes: rowBytes, output: output(k + 1), ...att(h.hop.peer_id) });
    });
    const cut = this.kept.some((k, i) => k < this.steps[i]!);
    if (cut) this.full(spans, hops);
    for (const sp of spans) {
      const why = this.rebuilt.get(sp.peer);
      if (why !== undefined) sp.uncheckable = why;
    }
    const generation = this.s.session.slice(0, Math.max(0, this.s.session.lastIndexOf('.')));
    const bytes = spans.reduce((n, sp) => n + sp.input.byteLength, 0);
    const finished: Finished = {
      session: this.s.session,
      steps: this.steps,
      stepTokens: this.stepTokens,
      ...(cut ? { kept: this.kept } : {}),
      ...(this.drafts.some((d) => d !== undefined) ? { drafts: this.drafts } : {}),
      spans,
      dtype: this.s.dtype,
      hidden: this.s.hidden,
      sampling: this.s.sampling,
      generation,
      at: Date.now(),
      bytes,
      ...(this.cut !== undefined ? { uncheckable: this.cut } : {}),
    };
    this.onFinished(finished);
    if (plan) this.init.verifier.finished({ ...finished, plan });
  }

  /**
   * Steps were cut back: give every span its steps as computed (what it signed) — the kept rows of each
   * step, then the rows cut after it (its history kept them aside). A span whose rows cannot be rebuilt
   * gets none (its check is then skipped as uncheckable, never held against it).
   */
  private full(spans: FinishedSpan[], hops: readonly TraceHop[]): void {
    const rowBytes = this.s.hidden * dtypeBytes(this.s.dtype);
    const at: number[] = [];
    this.kept.reduce((p, k) => (at.push(p), p + k), 0);
    const stepsOf = (h: TraceHop['history']): Uint8Array[] | undefined => {
      const view = h.view();
      const out: Uint8Array[] = [];
      for (const [s, n] of this.steps.entries()) {
        const k = this.kept[s]!;
        const keptRows = view.subarray(at[s]! * rowBytes, (at[s]! + k) * rowBytes);
        const cutRows = k < n ? h.cutAt?.(at[s]! + k) : new Uint8Array(0);
        if (keptRows.byteLength !== k * rowBytes || cutRows?.byteLength !== (n - k) * rowBytes) return undefined;
        out.push(k < n ? concatBytes([keptRows, cutRows]) : keptRows);
      }
      return out;
    };
    const inputs = hops.map((h) => stepsOf(h.history));
    const tokenOut = this.stepTokens.map((t, s) => stepTokenBytes(t, this.drafts[s] ? draftDigest(this.drafts[s]) : undefined));
    const outputsOf = (k: number): Uint8Array[] | undefined => (k >= hops.length ? tokenOut : inputs[k]);
    // The head's own span: what it signed, step by step.
    const own = this.own.length === this.steps.length ? this.own : undefined;
    if (own) spans[0]!.full = { inputs: own.map((x) => x.input), outputs: own.map((x) => x.output) };
    hops.forEach((_, k) => {
      const i = inputs[k];
      const o = outputsOf(k + 1);
      if (i && o) spans[k + 1]!.full = { inputs: i, outputs: o };
    });
  }
}
