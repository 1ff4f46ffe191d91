/**
 * The head's side of spot-checks (docs/verification.md): once a generation
 * is over, the hops its tracker's plan names are checked, off every
 * critical path — no token waits for this.
 *
 * For each planned hop: the hop's latest attestation says how many rows of
 * the session it vouches for; the head recomputes the hash chain of those
 * rows from what it holds (the hop's input history, its outputs: the next
 * hop's input history, or the tokens) and verifies the signature (a hop
 * that signs nothing or something else is reported as refusing, never as
 * honest). Then `POST /check` to the first planned checker that answers
 * (a timeout is not a verdict: the next is tried), verification of its
 * signed answer, and the distance per step. A mismatch goes to the next
 * checker of the plan (the arbiter) before anything is reported. The
 * evidence goes to the tracker, which decides (src/verify/evidence.ts).
 *
 * Bounded: `maxConcurrent` checks at a time, `maxQueued` waiting; a full
 * queue drops the newest generation's checks (they stay "not checked").
 */
import { decodeBase64 as decodeBase64Url, encodeBase64Url } from '../../protocol/base64.ts';
import { concatBytes } from '../../protocol/bytes.ts';
import type { MeshReply } from '../../protocol/envelopes.ts';
import { MeshError, remoteError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import type { RouteHop } from '../../protocol/tracker.ts';
import { decodeTensor, dtypeBytes, type Dtype } from '../../protocol/tensor.ts';
import { attestMessage, chainDigest, checkMessage, CHECK_ATTEST_HEADER, draftDigest, parseAttestations, readStepTokens, sha256, stepTokenBytes, type AttestScope, type StepDigest } from '../../verify/attest.ts';
import { CHECK_DRAFTS_HEADER, CHECK_PEER_HEADER, CHECK_STEPS_HEADER, CHECK_TOKENS_HEADER, formatStepDrafts, formatStepShapes, formatStepTokens, readTokenCheck, TOKEN_CHECK_BYTES } from '../../verify/check-wire.ts';
import type { DraftProposal } from '../../shard/speculative.ts';
import { rowDistances, worst } from '../../verify/distance.ts';
import { temperatureOf, type CheckReport, type SkippedCheck } from '../../verify/evidence.ts';
import { CHECK_PATH, CHECK_PLAN_HEADER, CHECK_PLAN_SIGNATURE_HEADER, type CheckPlan, type PlanCheck, type PlanPeer } from '../../verify/plan.ts';
import { thresholdsFor, tokenDistance, type Thresholds } from '../../verify/thresholds.ts';

/** The plan as the head received it with /generate. */
export interface SignedPlan {
  text: string;
  signature: string;
  plan: CheckPlan;
}

/** What one span of a finished generation computed, as the head holds it. */
export interface FinishedSpan {
  peer: string;
  start: number;
  end: number;
  /** Input bytes of every row, in order: wire rows, or token ids (u32 LE) for the head's own span. */
  input: Uint8Array;
  /** Bytes per input row. */
  inputRowBytes: number;
  output: { kind: 'rows'; bytes: Uint8Array; rowBytes: number } | { kind: 'tokens'; tokens: ReadonlyArray<{ tokenId: number; logprob: number }> };
  /** The span's latest attestation entry (X-Meshnet-Attest), if it gave one. */
  attestation?: string;
  /**
   * When steps were cut back (FinishedGeneration.kept): each step's input and output bytes as computed,
   * cut rows included — what the span signed. Absent there: the head does not hold them (uncheckable).
   */
  full?: { inputs: readonly Uint8Array[]; outputs: readonly Uint8Array[] };
  /** Why the head cannot check this span (its chain was rebuilt after a cut): its check is reported skipped. */
  uncheckable?: string;
}

export interface FinishedGeneration {
  plan: SignedPlan;
  session: string;
  /** Row counts of the steps as computed, in order (the prompt, then one a step; a verification's drafts included). */
  steps: readonly number[];
  /**
   * Rows each step kept, when any step was cut back (a speculative step's rejected draft rows): the
   * spans then give `full`, and a check compares the kept rows (or, at the last hop, every emitted token).
   */
  kept?: readonly number[];
  /** Tokens each step emitted (a verification's accepted drafts, then its token); absent: each step's one token (the last span's output). */
  stepTokens?: ReadonlyArray<ReadonlyArray<{ tokenId: number; logprob: number }>>;
  /**
   * Per step, the draft a sampling drafter's rule (Leviathan's, at T > 0) judged, where it drew the step's
   * tokens: the last hop signed its digest, and its check replays that rule against it.
   */
  drafts?: ReadonlyArray<DraftProposal | undefined>;
  spans: readonly FinishedSpan[];
  dtype: Dtype;
  hidden: number;
  /** The request's sampling, as X-Meshnet-Sampling carries it. */
  sampling: string;
  /**
   * Why the head cannot check this generation (rows the hops signed were cut back later, as after a
   * rejected speculative draft, and are no longer held): its planned checks are reported skipped.
   */
  uncheckable?: string;
}

export type CheckEvent =
  | { type: 'refused'; peer: string; why: string }
  | { type: 'no-checker'; peer: string; why: string }
  | { type: 'uncheckable'; peer: string; why: string }
  | { type: 'reported'; peer: string; local: number; threshold: number; answer: unknown }
  | { type: 'report-failed'; peer: string; why: string };

export interface VerifierInit {
  /** This head's peer id. */
  peerId: string;
  transport: { send(hop: RouteHop, req: { method: string; path: string; headers?: Record<string, string>; body?: Uint8Array }, timeoutMs: number, signal?: AbortSignal, opts?: { accept?: (reply: MeshReply) => boolean }): Promise<MeshReply> };
  verify(publicKey: Uint8Array, message: Uint8Array, signature: Uint8Array): Promise<boolean>;
  /** Sends the report (signed by the head) to the tracker; resolves with the tracker's answer. */
  report(report: CheckReport): Promise<unknown>;
  /** Tells the tracker a planned check could not run (signed by the head). */
  skipped?(s: SkippedCheck): Promise<unknown>;
  /** Checks at once. @defaultValue 2 */
  maxConcurrent?: number;
  /** Checks waiting. @defaultValue 32 */
  maxQueued?: number;
  /** Wait for one checker's answer, ms. @defaultValue 60000 */
  checkTimeoutMs?: number;
  /** Largest sample a report carries, bytes. @defaultValue 262144 */
  maxSampleBytes?: number;
  now?: () => number;
  onEvent?(e: CheckEvent): void;
}

interface Job {
  gen: FinishedGeneration;
  span: FinishedSpan;
  entry: PlanCheck;
}

export class Verifier {
  private readonly queue: Job[] = [];
  private running = 0;
  private idleWaiters: Array<() => void> = [];
  /** Checks dropped because the queue was full. */
  dropped = 0;
  /** Checks run (answered by a checker and reported). */
  ran = 0;

  constructor(private readonly init: VerifierInit) {}

  /** Queue the checks a finished generation's plan asks for. Returns at once. */
  finished(gen: FinishedGeneration): void {
    for (const entry of gen.plan.plan.checks) {
      const span = gen.spans.find((s) => s.peer === entry.peer.peer_id && s.start === entry.start_layer && s.end === entry.end_layer);
      if (!span) continue; // the hop was replaced, or the route changed: not checked this time
      const why = gen.uncheckable ?? span.uncheckable;
      if (why !== undefined) {
        void this.skip({ gen, span, entry }, 'uncheckable', why);
        continue;
      }
      if (this.queue.length >= (this.init.maxQueued ?? 32)) {
        this.dropped++;
        continue;
      }
      this.queue.push({ gen, span, entry });
    }
    this.pump();
  }

  /** Resolves when no check runs or waits (tests, shutdown). */
  idle(): Promise<void> {
    if (this.running === 0 && this.queue.length === 0) return Promise.resolve();
    return new Promise((r) => this.idleWaiters.push(r));
  }

  get pending(): number {
    return this.running + this.queue.length;
  }

  private pump(): void {
    while (this.running < (this.init.maxConcurrent ?? 2) && this.queue.length > 0) {
      const job = this.queue.shift()!;
      this.running++;
      void this.run(job)
        .catch((e: unknown) => this.init.onEvent?.({ type: 'report-failed', peer: job.entry.peer.peer_id, why: (e as Error).message }))
        .finally(() => {
          this.running--;
          this.pump();
          if (this.running === 0 && this.queue.length === 0) for (const w of this.idleWaiters.splice(0)) w();
        });
    }
  }

  private async run(job: Job): Promise<void> {
    const { gen, span, entry } = job;
    const peer = entry.peer.peer_id;
    const att = parseAttestations(span.attestation).find((a) => a.peer === peer);
    if (!att) return this.skip(job, 'refused', 'it gave no attestation');
    // The steps the attestation covers: a prefix of the generation's steps.
    let covered = 0;
    const steps: number[] = [];
    for (const n of gen.steps) {
      if (covered + n > att.rows) break;
      steps.push(n);
      covered += n;
    }
    if (covered !== att.rows || steps.length === 0) return this.skip(job, 'refused', `its attestation covers ${att.rows} rows, not a whole number of steps`);
    const last = span.output.kind === 'tokens';
    const scope: AttestScope = { model: gen.plan.plan.model, session: gen.session, startLayer: span.start, endLayer: span.end, dtype: gen.dtype, ...(last ? { sampling: gen.sampling } : {}) };
    /** Rows each step kept (all of them, unless the generation cut steps back), and each step's position in the chain. */
    const kept = steps.map((n, s) => gen.kept?.[s] ?? n);
    const positions: number[] = [];
    kept.reduce((p, k) => (positions.push(p), p + k), 0);
    /** Tokens each step emitted, as the last hop claims them. */
    const emitted = steps.map((_, s) => gen.stepTokens?.[s] ?? (span.output.kind === 'tokens' && span.output.tokens[s] ? [span.output.tokens[s]] : []));

    // The claim as the head saw it: per step, the input and output bytes.
    const inputs: Uint8Array[] = [];
    const outputs: Uint8Array[] = [];
    if (gen.kept) {
      // Steps were cut back: the hop signed each step's rows as computed, which the head kept aside.
      if (!span.full || span.full.inputs.length < steps.length || span.full.outputs.length < steps.length) return this.skip(job, 'uncheckable', 'the head does not hold the rows of the steps cut back');
      inputs.push(...span.full.inputs.slice(0, steps.length));
      outputs.push(...span.full.outputs.slice(0, steps.length));
      if (last && emitted.some((e, s) => e.length === 0 || e.length > kept[s]!)) return this.skip(job, 'uncheckable', 'the head does not hold the tokens of every step');
    } else {
      let row = 0;
      for (const [s, n] of steps.entries()) {
        inputs.push(span.input.subarray(row * span.inputRowBytes, (row + n) * span.inputRowBytes));
        if (span.output.kind === 'rows') outputs.push(span.output.bytes.subarray(row * span.output.rowBytes, (row + n) * span.output.rowBytes));
        else {
          const t = span.output.tokens[s];
          if (!t) return this.skip(job, 'refused', `no token for step ${s}`);
          const d = gen.drafts?.[s];
          outputs.push(stepTokenBytes(emitted[s]!.length > 0 ? emitted[s]! : [t], d ? draftDigest(d) : undefined));
        }
        row += n;
      }
    }
    if (inputs.some((b, s) => b.byteLength !== steps[s]! * span.inputRowBytes) || outputs.some((b) => b.byteLength === 0)) {
      // The head's own history falls short (not the hop's doing): no verdict either way.
      return this.skip(job, 'uncheckable', 'the head does not hold every row the attestation covers');
    }
    const inHashes = inputs.map(sha256);
    const outHashes = outputs.map(sha256);
    const digests = (outs: readonly Uint8Array[]): StepDigest[] => steps.map((n, s) => ({ position: positions[s]!, rows: n, input: inHashes[s]!, output: outs[s]! }));
    if (!(await this.init.verify(decodeBase64Url(entry.peer.public_key), attestMessage(gen.session, covered, chainDigest(scope, digests(outHashes))), att.signature))) {
      return this.skip(job, 'refused', 'its attestation does not verify over what it answered');
    }

    // A last hop's drafted steps: their drafts follow the rows.
    const drafted = steps.map((_, s) => (last ? gen.drafts?.[s] : undefined));
    const draftTail = drafted.some((d) => d !== undefined) ? formatStepDrafts(drafted) : undefined;
    const body = draftTail ? concatBytes([...inputs, draftTail]) : concatBytes(inputs);
    const headers: Record<string, string> = {
      [CHECK_PLAN_HEADER]: gen.plan.text,
      [CHECK_PLAN_SIGNATURE_HEADER]: gen.plan.signature,
      [CHECK_PEER_HEADER]: peer,
      [H.session]: gen.session,
      [H.startLayer]: String(span.start),
      [H.endLayer]: String(span.end),
      [H.dtype]: gen.dtype,
      [CHECK_STEPS_HEADER]: formatStepShapes({ rows: steps, kept }),
      'content-type': 'application/octet-stream',
    };
    if (span.start !== 0) headers[H.shape] = `1,${covered},${gen.hidden}`;
    if (last) {
      headers[H.sampling] = gen.sampling;
      headers[CHECK_TOKENS_HEADER] = formatStepTokens(emitted.map((e) => e.map((t) => t.tokenId)));
      if (draftTail) headers[CHECK_DRAFTS_HEADER] = String(draftTail.byteLength);
    }

    // Checker, then (on a mismatch) the arbiter: the first planned holders that answer.
    const answers: Array<{ peer: PlanPeer; outs: Uint8Array[]; outHashes: Uint8Array[]; attestation: string }> = [];
    const tried = new Set<string>();
    /** Checkers that said they were busy with another check: asked again, a little later. */
    const busy = new Set<string>();
    const ask = async (): Promise<boolean> => {
      for (let round = 0; round < 4; round++) {
        if (round > 0) {
          if (busy.size === 0) return false;
          await new Promise((r) => setTimeout(r, 400 * round));
          for (const b of busy) tried.delete(b);
          busy.clear();
        }
        for (const c of entry.checkers) {
          if (tried.has(c.peer_id) || answers.some((a) => a.peer.peer_id === c.peer_id)) continue;
          tried.add(c.peer_id);
          const got = await this.ask(c, headers, body, { steps, kept, positions, emitted: emitted.map((e) => e.length), drafted: drafted.map((d) => d !== undefined) }, scope, gen, peer, covered, inHashes, last).catch((e: unknown) => {
            if (e instanceof MeshError && e.code === 'MESH_ERR_BUSY') busy.add(c.peer_id);
            return undefined;
          });
          if (got) {
            answers.push(got);
            return true;
          }
        }
      }
      return false;
    };
    if (!(await ask())) return this.skip(job, 'no-checker', 'no planned checker answered');

    const temperature = temperatureOf(gen.sampling);
    const classOf = (p: PlanPeer) => ({ format: p.format, backend: p.backend });
    const limit = (t: Thresholds) => (last ? 1 : t.rowRel);
    const t0 = thresholdsFor(classOf(entry.peer), classOf(answers[0]!.peer));
    // The claim's step holds every row it computed; a check's, the rows that stayed: those are compared.
    const stepDistance = (claim: Uint8Array, check: Uint8Array, s: number): number => {
      if (!last) return worst(rowDistances(decodeTensor(claim, gen.dtype).subarray(0, kept[s]! * gen.hidden), decodeTensor(check, gen.dtype), gen.hidden).rel);
      return Math.max(...readStepTokens(claim).map((t, j) => tokenDistance(t0, temperature > 0, readTokenCheck(check, j * TOKEN_CHECK_BYTES), t.logprob)));
    };
    const perStep = (k: number) => outputs.map((o, s) => nanInf(stepDistance(o, answers[k]!.outs[s]!, s)));
    const d0 = perStep(0);
    const th0 = limit(t0);
    const local = Math.max(...d0);
    if (local > th0) await ask(); // a mismatch: a third holder before anyone is accused

    // Samples: every step when small, else the worst and a few at random.
    const sampleBytes = outputs.reduce((n, o) => n + o.byteLength, 0) * (1 + answers.length);
    let picks: number[];
    if (sampleBytes <= (this.init.maxSampleBytes ?? 262_144) && steps.length <= 64) picks = steps.map((_, s) => s);
    else {
      const order = d0.map((d, s) => [d, s] as const).sort((a, b) => b[0] - a[0]).slice(0, 8).map(([, s]) => s);
      while (order.length < Math.min(12, steps.length)) {
        const s = Math.floor(Math.random() * steps.length);
        if (!order.includes(s)) order.push(s);
      }
      picks = order.sort((a, b) => a - b);
    }
    const report: CheckReport = {
      head: this.init.peerId,
      timestamp: (this.init.now ?? Date.now)(),
      plan: gen.plan.text,
      plan_signature: gen.plan.signature,
      kind: last ? 'tokens' : 'rows',
      ...(last ? { sampling: gen.sampling } : { hidden: gen.hidden }),
      claim: {
        peer_id: peer,
        session: gen.session,
        start_layer: span.start,
        end_layer: span.end,
        dtype: gen.dtype,
        steps: formatStepShapes({ rows: steps, kept }),
        inputs: inHashes.map(encodeBase64Url),
        outputs: outHashes.map(encodeBase64Url),
        attestation: encodeBase64Url(att.signature),
      },
      checks: answers.map((a, k) => ({ role: k === 0 ? ('checker' as const) : ('arbiter' as const), peer_id: a.peer.peer_id, outputs: a.outHashes.map(encodeBase64Url), attestation: a.attestation })),
      samples: picks.map((s) => ({ step: s, claim: encodeBase64Url(outputs[s]!), checks: answers.map((a) => encodeBase64Url(a.outs[s]!)) })),
    };
    this.ran++;
    const answer = await this.init.report(report);
    this.init.onEvent?.({ type: 'reported', peer, local, threshold: th0, answer });
  }

  /** A planned check that could not run: said to the tracker (the generation's record shows it unchecked, a refusing hop stays unverified). */
  private async skip(job: Job, kind: 'refused' | 'no-checker' | 'uncheckable', why: string): Promise<void> {
    const peer = job.entry.peer.peer_id;
    this.init.onEvent?.({ type: kind, peer, why });
    await this.init.skipped?.({ head: this.init.peerId, timestamp: (this.init.now ?? Date.now)(), plan: job.gen.plan.text, plan_signature: job.gen.plan.signature, session: job.gen.session, peer_id: peer, start_layer: job.entry.start_layer, end_layer: job.entry.end_layer, reason: kind, why: why.slice(0, 500) }).catch(() => undefined);
  }

  /** One checker's answer, verified; undefined when it did not answer usably (a timeout is not a verdict). */
  private async ask(c: PlanPeer, headers: Record<string, string>, body: Uint8Array, shape: { steps: readonly number[]; kept: readonly number[]; positions: readonly number[]; emitted: readonly number[]; drafted: readonly boolean[] }, scope: AttestScope, gen: FinishedGeneration, checked: string, covered: number, inHashes: readonly Uint8Array[], last: boolean): Promise<{ peer: PlanPeer; outs: Uint8Array[]; outHashes: Uint8Array[]; attestation: string } | undefined> {
    const hop: RouteHop = { peer_id: c.peer_id, start_layer: scope.startLayer, end_layer: scope.endLayer, ...(c.endpoint ? { endpoint: c.endpoint } : {}), ...(c.relay_addr ? { relay_addr: c.relay_addr } : {}) };
    const reply = await this.init.transport.send(hop, { method: 'POST', path: CHECK_PATH, headers, body }, this.init.checkTimeoutMs ?? 60_000, undefined, { accept: () => true });
    if (reply.status !== 200) {
      const e = remoteError(reply.status, reply.body);
      throw new MeshError(e.code, `checker ${c.peer_id}: ${e.message}`);
    }
    const outs: Uint8Array[] = [];
    let o = 0;
    const rowBytes = gen.hidden * dtypeBytes(gen.dtype);
    // Per step: the kept rows, or one record per token the step emitted (then a drafted step's draft digest).
    for (const [s, k] of shape.kept.entries()) {
      const size = last ? TOKEN_CHECK_BYTES * shape.emitted[s]! + (shape.drafted[s] ? 32 : 0) : k * rowBytes;
      outs.push(reply.body.subarray(o, o + size));
      o += size;
    }
    if (o !== reply.body.byteLength) return undefined;
    const outHashes = outs.map(sha256);
    const att = parseAttestations(reply.headers[CHECK_ATTEST_HEADER]).find((a) => a.peer === c.peer_id && a.rows === covered);
    if (!att) return undefined;
    const digests = shape.steps.map((n, s) => ({ position: shape.positions[s]!, rows: n, input: inHashes[s]!, output: outHashes[s]! }));
    if (!(await this.init.verify(decodeBase64Url(c.public_key), checkMessage(checked, gen.session, covered, chainDigest(scope, digests)), att.signature))) return undefined;
    return { peer: c, outs, outHashes, attestation: encodeBase64Url(att.signature) };
  }
}

function nanInf(x: number): number {
  return Number.isNaN(x) ? Infinity : x;
}

