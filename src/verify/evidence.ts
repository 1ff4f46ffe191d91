/**
 * A check's evidence and the verdict on it (docs/protocol.md §11,
 * docs/verification.md). The head that ran a check sends the tracker
 * `POST /api/checks/report`, signed with its key: the plan the tracker
 * signed for it, the checked hop's per-step input and output hashes and its
 * attestation, each checker's output hashes and signed answer, and the rows
 * (or last-hop records) of a few steps. The tracker believes none of it on
 * the head's word: it verifies its own signature on the plan, recomputes
 * every hash chain and verifies every attestation against the keys the
 * plan names, hashes every sample against the listed hashes, and computes
 * the distances itself. A head can therefore neither frame an honest node
 * (it cannot sign for it, nor for its checkers) nor alter what they said.
 *
 * The verdict (two independent holders against one):
 *   claim ≈ checker                        → pass
 *   claim ≠ checker, claim ≠ arbiter, checker ≈ arbiter → the checked node lied (offence)
 *   claim ≠ checker, claim ≈ arbiter, checker ≠ arbiter → the checker lied (offence of the checker)
 *   anything else (no arbiter, three-way disagreement)  → inconclusive: nobody is punished
 */
import { z } from 'zod';
import { decodeBase64 as decodeBase64Url } from '../protocol/base64.ts';
import { MeshError } from '../protocol/errors.ts';
import { decodeTensor, isDtype } from '../protocol/tensor.ts';
import { attestMessage, chainDigest, checkMessage, readStepClaim, sha256, type AttestScope, type StepDigest } from './attest.ts';
import { parseStepShapes, readTokenCheck, TOKEN_CHECK_BYTES } from './check-wire.ts';
import { rowDistances, worst } from './distance.ts';
import { checkPlanMessage, checkPlanSchema, sessionOfGeneration, type CheckPlan, type PlanPeer } from './plan.ts';
import { checkToken } from './token-check.ts';
import { pairClass, recordsDistance, thresholdsFor, tokenDistance, type NodeClass, type PairClass, type Thresholds } from './thresholds.ts';

const peerId = z.string().regex(/^[0-9a-f]{32}$/);
const b64 = z.string().max(12_000_000);
const hash = z.string().regex(/^[A-Za-z0-9_-]{43}$/);

export const checkReportSchema = z.object({
  head: peerId,
  timestamp: z.number().int(),
  /** The plan's text and the tracker's signature over it, as the head received them. */
  plan: z.string().min(2).max(64_000),
  plan_signature: z.string().min(40).max(200),
  kind: z.enum(['rows', 'tokens']),
  /** Values per row (rows kind). */
  hidden: z.number().int().positive().max(1 << 16).optional(),
  /** The last hop's X-Meshnet-Sampling text (tokens kind): bound into its attestation, so a head cannot judge it by other sampling. */
  sampling: z.string().max(1000).optional(),
  claim: z.object({
    peer_id: peerId,
    session: z.string().min(1).max(128),
    start_layer: z.number().int().nonnegative(),
    end_layer: z.number().int().positive(),
    dtype: z.string().max(8),
    /** Row counts of the steps covered, and the rows each kept when cut back (check-wire.ts formatStepShapes). */
    steps: z.string().max(65_536),
    inputs: z.array(hash).max(65_536),
    outputs: z.array(hash).max(65_536),
    attestation: z.string().min(80).max(100),
  }),
  checks: z
    .array(
      z.object({
        role: z.enum(['checker', 'arbiter']),
        peer_id: peerId,
        outputs: z.array(hash).max(65_536),
        attestation: z.string().min(80).max(100),
      }),
    )
    .min(1)
    .max(2),
  /** The bytes of some steps (base64url): the claim's output and each check's, in the order of `checks`. */
  samples: z.array(z.object({ step: z.number().int().nonnegative(), claim: b64, checks: z.array(b64).max(2) })).max(64),
});
export type CheckReport = z.infer<typeof checkReportSchema>;

/**
 * POST /api/checks/skipped: a planned check the head could not run: the hop gave no valid attestation
 * (`refused`, held against it), no checker answered, or the head no longer holds the rows the hop signed
 * (`uncheckable`: rows cut back after a speculative step; nobody's fault).
 */
export const skippedCheckSchema = z.object({
  head: peerId,
  timestamp: z.number().int(),
  plan: z.string().min(2).max(64_000),
  plan_signature: z.string().min(40).max(200),
  session: z.string().min(1).max(128),
  peer_id: peerId,
  start_layer: z.number().int().nonnegative(),
  end_layer: z.number().int().positive(),
  reason: z.enum(['refused', 'no-checker', 'uncheckable']),
  why: z.string().max(500),
});
export type SkippedCheck = z.infer<typeof skippedCheckSchema>;

export type Outcome = 'pass' | 'offence' | 'checker-offence' | 'inconclusive';

export interface Verdict {
  outcome: Outcome;
  /** The node found lying (offence: the checked hop; checker-offence: that checker). */
  guilty?: string;
  kind: 'rows' | 'tokens';
  checked: string;
  session: string;
  startLayer: number;
  endLayer: number;
  rows: number;
  steps: number;
  /** Worst step distance of the claim from each check, and of the two checks from each other (rows: relative L2; tokens: in units of the pair's thresholds, thresholds.ts tokenDistance). */
  distance: { checker: number; arbiter?: number; between?: number };
  threshold: number;
  /** Steps whose bytes the tracker compared, and the rows (or tokens) in them. */
  compared: number;
  comparedRows: number;
  /** The pair of weight formats the checked node and its checker form (thresholds.ts). */
  pair: PairClass;
  plan: CheckPlan;
}

export interface JudgeDeps {
  /** Keys the check plan may be signed with: the judging tracker's, and its cluster's other trackers'. */
  trackerKeys: readonly Uint8Array[];
  now: number;
  verify(publicKey: Uint8Array, message: Uint8Array, signature: Uint8Array): Promise<boolean>;
  /** Largest age of a report past its plan's expiry, ms. @defaultValue 10 minutes */
  graceMs?: number;
}

function bytesOf(text: string, what: string): Uint8Array {
  try {
    return decodeBase64Url(text);
  } catch {
    throw new MeshError('MESH_ERR_BAD_REQUEST', `${what} is not base64url`);
  }
}

function forbidden(message: string): MeshError {
  return new MeshError('MESH_ERR_FORBIDDEN', message);
}

/** Verify a report's plan, chains, attestations and samples; then judge it. Throws 400/401/403 for evidence that does not hold up. */
export async function judgeReport(r: CheckReport, deps: JudgeDeps): Promise<Verdict> {
  // The plan: signed by this tracker (or another of its cluster), for this head, still (nearly) fresh.
  const planMessage = checkPlanMessage(r.head, r.plan);
  const planSignature = bytesOf(r.plan_signature, 'plan_signature');
  let signed = false;
  for (const key of deps.trackerKeys) if (!signed && (await deps.verify(key, planMessage, planSignature))) signed = true;
  if (!signed) throw forbidden('the check plan is not signed by a tracker of this cluster for this head');
  let plan: CheckPlan;
  try {
    plan = checkPlanSchema.parse(JSON.parse(r.plan));
  } catch {
    throw new MeshError('MESH_ERR_BAD_REQUEST', 'the check plan is not a CheckPlan');
  }
  if (plan.head !== r.head) throw forbidden('the plan was made for another head');
  if (deps.now > plan.expires_at + (deps.graceMs ?? 600_000)) throw forbidden('the plan expired long ago');
  const c = r.claim;
  if (!sessionOfGeneration(c.session, plan.generation)) throw forbidden(`session ${c.session} is not of generation ${plan.generation}`);
  const entry = plan.checks.find((e) => e.peer.peer_id === c.peer_id && e.start_layer === c.start_layer && e.end_layer === c.end_layer);
  if (!entry) throw forbidden(`the plan has no check of ${c.peer_id} on [${c.start_layer}, ${c.end_layer})`);
  const checkers: PlanPeer[] = r.checks.map((k) => {
    const p = entry.checkers.find((x) => x.peer_id === k.peer_id);
    if (!p) throw forbidden(`${k.peer_id} is not a checker of this plan`);
    return p;
  });
  if (r.checks.length === 2 && r.checks[0]!.peer_id === r.checks[1]!.peer_id) throw forbidden('the arbiter must be another node than the checker');
  if (!isDtype(c.dtype)) throw new MeshError('MESH_ERR_BAD_REQUEST', `dtype ${c.dtype} is not a wire dtype`);

  // The chains: the claim's and every check's, over the same inputs.
  const shapes = parseStepShapes(c.steps);
  const steps = shapes.rows;
  const n = steps.length;
  if (c.inputs.length !== n || c.outputs.length !== n || r.checks.some((k) => k.outputs.length !== n)) throw new MeshError('MESH_ERR_BAD_REQUEST', `every hash list must have one hash per step (${n})`);
  const rows = steps.reduce((a, b) => a + b, 0);
  if (r.kind === 'tokens' && r.sampling === undefined) throw new MeshError('MESH_ERR_BAD_REQUEST', 'a tokens report gives the sampling');
  const scope: AttestScope = { model: plan.model, session: c.session, startLayer: c.start_layer, endLayer: c.end_layer, dtype: c.dtype, ...(r.kind === 'tokens' ? { sampling: r.sampling! } : {}) };
  const temperature = r.kind === 'tokens' ? temperatureOf(r.sampling!) : 0;
  const inputs = c.inputs.map((h) => bytesOf(h, 'a hash'));
  // A step's position in the chain: the rows kept before it (a step cut back kept only its first rows).
  const digests = (outs: readonly string[]): StepDigest[] => {
    let pos = 0;
    return steps.map((rowsOf, i) => {
      const d = { position: pos, rows: rowsOf, input: inputs[i]!, output: bytesOf(outs[i]!, 'a hash') };
      pos += shapes.kept[i]!;
      return d;
    });
  };
  const claimAcc = chainDigest(scope, digests(c.outputs));
  if (!(await deps.verify(bytesOf(entry.peer.public_key, 'public_key'), attestMessage(c.session, rows, claimAcc), bytesOf(c.attestation, 'attestation')))) {
    throw new MeshError('MESH_ERR_UNAUTHORIZED', `the checked hop's attestation does not verify over these hashes`);
  }
  for (const [i, k] of r.checks.entries()) {
    const acc = chainDigest(scope, digests(k.outputs));
    if (!(await deps.verify(bytesOf(checkers[i]!.public_key, 'public_key'), checkMessage(c.peer_id, c.session, rows, acc), bytesOf(k.attestation, 'attestation')))) {
      throw new MeshError('MESH_ERR_UNAUTHORIZED', `the answer of ${k.role} ${k.peer_id} does not verify over these hashes`);
    }
  }

  // The samples: each hashes to what its signer listed for that step.
  const checked: NodeClass = { format: entry.peer.format, backend: entry.peer.backend };
  const th = checkers.map((k) => thresholdsFor(checked, { format: k.format, backend: k.backend }));
  const between = checkers.length === 2 ? thresholdsFor(checkers[0]!, checkers[1]!) : undefined;
  const seen = new Set<number>();
  const dist = { checker: 0, arbiter: 0, between: 0 };
  const kind = r.kind;
  if (kind === 'rows' && r.hidden === undefined) throw new MeshError('MESH_ERR_BAD_REQUEST', 'a rows report gives hidden');
  for (const s of r.samples) {
    if (s.step >= n || seen.has(s.step)) throw new MeshError('MESH_ERR_BAD_REQUEST', `sample step ${s.step} is outside the steps or repeated`);
    seen.add(s.step);
    if (s.checks.length !== r.checks.length) throw new MeshError('MESH_ERR_BAD_REQUEST', 'a sample gives the bytes of every check');
    const claimBytes = bytesOf(s.claim, 'a sample');
    if (!equal(sha256(claimBytes), bytesOf(c.outputs[s.step]!, 'a hash'))) throw forbidden(`the claim's sample of step ${s.step} does not hash to its listed output`);
    const checkBytes: Uint8Array[] = [];
    for (const [i, b] of s.checks.entries()) {
      const bytes = bytesOf(b, 'a sample');
      if (!equal(sha256(bytes), bytesOf(r.checks[i]!.outputs[s.step]!, 'a hash'))) throw forbidden(`the ${r.checks[i]!.role}'s sample of step ${s.step} does not hash to its listed output`);
      checkBytes.push(bytes);
    }
    if (kind === 'rows') {
      // The claim holds every row the step computed; a check, the rows that stayed: those are compared.
      const hidden = r.hidden!;
      const keptRows = shapes.kept[s.step]!;
      const decode = (b: Uint8Array, rowsOf: number, who: string) => {
        const d = decodeTensor(b, c.dtype as 'bf16');
        if (d.length !== rowsOf * hidden) throw new MeshError('MESH_ERR_BAD_REQUEST', `${who}'s sample of step ${s.step} is not ${rowsOf} rows of ${hidden}`);
        return d.subarray(0, keptRows * hidden);
      };
      const claimRows = decode(claimBytes, steps[s.step]!, 'the claim');
      const checkRows = checkBytes.map((b, i) => decode(b, keptRows, r.checks[i]!.role));
      const d = (a: Float32Array, b: Float32Array) => worst(rowDistances(a, b, hidden).rel);
      dist.checker = Math.max(dist.checker, d(claimRows, checkRows[0]!));
      if (checkRows[1]) {
        dist.arbiter = Math.max(dist.arbiter, d(claimRows, checkRows[1]));
        dist.between = Math.max(dist.between, d(checkRows[0]!, checkRows[1]));
      }
    } else {
      // Every token the step emitted (a verification's accepted drafts, then its token), one record each.
      let claim: Array<{ tokenId: number; logprob: number }>;
      let draft: Uint8Array | undefined;
      try {
        ({ tokens: claim, draft } = readStepClaim(claimBytes));
      } catch (e) {
        throw new MeshError('MESH_ERR_BAD_REQUEST', `the claim's sample of step ${s.step}: ${(e as Error).message}`);
      }
      if (claim.length > shapes.kept[s.step]!) throw new MeshError('MESH_ERR_BAD_REQUEST', `step ${s.step} emitted ${claim.length} tokens from ${shapes.kept[s.step]} kept rows`);
      const recs = checkBytes.map((b, i) => {
        if (b.byteLength !== TOKEN_CHECK_BYTES * claim.length + (draft ? 32 : 0)) throw new MeshError('MESH_ERR_BAD_REQUEST', `a token check record is ${TOKEN_CHECK_BYTES} bytes, one per token the step emitted (then the digest of a sampled draft the hop signed)`);
        // A sampling drafter's step: the check must have judged the very draft the hop signed (the head cannot swap it).
        if (draft && !equal(b.subarray(TOKEN_CHECK_BYTES * claim.length), draft)) throw forbidden(`the ${r.checks[i]!.role} judged step ${s.step} against another draft than the hop signed`);
        return claim.map((t, j) => {
          const rec = readTokenCheck(b, j * TOKEN_CHECK_BYTES);
          if (rec.claimed !== t.tokenId) throw forbidden(`a checker judged token ${rec.claimed} at step ${s.step}, but the hop claimed ${t.tokenId}`);
          return rec;
        });
      });
      const sampled = temperature > 0;
      claim.forEach((t, j) => {
        dist.checker = Math.max(dist.checker, tokenDistance(th[0]!, sampled, recs[0]![j]!, t.logprob));
        if (recs[1]) {
          dist.arbiter = Math.max(dist.arbiter, tokenDistance(th[1]!, sampled, recs[1][j]!, t.logprob));
          dist.between = Math.max(dist.between, recordsDistance(between!, recs[0]![j]!, recs[1][j]!));
        }
      });
    }
  }
  // Rows: relative L2 against the pair's threshold; tokens: already in units of the thresholds (tokenDistance).
  const pick = (t: Thresholds) => (kind === 'rows' ? t.rowRel : 1);
  const okChecker = dist.checker <= pick(th[0]!);
  const okArbiter = th[1] ? dist.arbiter <= pick(th[1]) : undefined;
  const okBetween = between ? dist.between <= pick(between) : undefined;
  let outcome: Outcome;
  let guilty: string | undefined;
  if (seen.size === 0) outcome = 'inconclusive';
  else if (okChecker) outcome = 'pass';
  else if (okArbiter === false && okBetween === true) {
    outcome = 'offence';
    guilty = c.peer_id;
  } else if (okArbiter === true && okBetween === false) {
    outcome = 'checker-offence';
    guilty = r.checks[0]!.peer_id;
  } else outcome = 'inconclusive';
  return {
    outcome,
    ...(guilty ? { guilty } : {}),
    kind,
    checked: c.peer_id,
    session: c.session,
    startLayer: c.start_layer,
    endLayer: c.end_layer,
    rows,
    steps: n,
    distance: { checker: dist.checker, ...(r.checks.length === 2 ? { arbiter: dist.arbiter, between: dist.between } : {}) },
    threshold: pick(th[0]!),
    compared: seen.size,
    comparedRows: kind === 'rows' ? [...seen].reduce((n, i) => n + shapes.kept[i]!, 0) : seen.size,
    pair: pairClass(checked, { format: checkers[0]!.format, backend: checkers[0]!.backend }),
    plan,
  };
}

/** The temperature of an X-Meshnet-Sampling text (0: greedy). */
export function temperatureOf(sampling: string): number {
  try {
    const t = (JSON.parse(sampling) as { temperature?: unknown }).temperature;
    return typeof t === 'number' && t > 0 ? t : 0;
  } catch {
    throw new MeshError('MESH_ERR_BAD_REQUEST', 'sampling is not JSON');
  }
}

function equal(a: Uint8Array, b: Uint8Array): boolean {
  if (a.byteLength !== b.byteLength) return false;
  for (let i = 0; i < a.byteLength; i++) if (a[i] !== b[i]) return false;
  return true;
}

/** Re-exported for the checker (check-handler) and the head (verifier): the local judgement uses the same numbers. */
export { checkToken };
