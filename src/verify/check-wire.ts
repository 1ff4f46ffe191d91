/**
 * `POST /check` on the wire (docs/protocol.md §11): the head sends a
 * checker one hop's input rows of one session and how they were cut into
 * steps; the checker answers its own outputs, signed.
 *
 * Request headers: the plan and its signature (the ticket), `x-meshnet-check-peer`
 * (the checked hop), `x-meshnet-session`, the layers, `x-meshnet-dtype`,
 * `x-meshnet-shape` (1, rows, hidden), `x-meshnet-check-steps` (row counts per
 * step, run-length: `37,1x120`), and for a last hop `x-meshnet-sampling` and
 * `x-meshnet-check-tokens` (the claimed token per step, comma-separated).
 * Body: the input rows in the wire dtype, exactly as the hop received them;
 * for a last hop whose steps a sampling drafter drafted, followed by
 * `x-meshnet-check-drafts` bytes of JSON: one entry per step, the draft the
 * step carried (X-Meshnet-Draft's value) where Leviathan's rule drew its
 * tokens, else null.
 *
 * Answer 200: a span's output rows in the wire dtype (as the hop would have
 * answered), or for a last hop one record per token each step emitted
 * (tokenCheckBytes; after a drafted step's records, its draft's digest), with
 * `x-meshnet-check-attest` (check-v1 signature over the chain of the same
 * input hashes and its own output hashes).
 */
import { draftFromJson, encodeDraft, type DraftJson } from '../protocol/draft.ts';
import { MeshError } from '../protocol/errors.ts';

export const CHECK_PEER_HEADER = 'x-meshnet-check-peer';
export const CHECK_STEPS_HEADER = 'x-meshnet-check-steps';
export const CHECK_TOKENS_HEADER = 'x-meshnet-check-tokens';
/** Bytes of per-step drafts after a last hop's check rows (formatStepDrafts). */
export const CHECK_DRAFTS_HEADER = 'x-meshnet-check-drafts';
/** A head audit's last hop: the first row (0-based) whose next token is judged; the rest of the rows follow. */
export const CHECK_FROM_HEADER = 'x-meshnet-check-from';
/** On a last hop's audit answer: how many records the body holds. */
export const CHECK_RECORDS_HEADER = 'x-meshnet-check-records';

/** Rows one check may cover at most (a session's context). */
export const MAX_CHECK_ROWS = 65_536;

export function formatSteps(steps: readonly number[]): string {
  const parts: string[] = [];
  for (let i = 0; i < steps.length; ) {
    let j = i;
    while (j < steps.length && steps[j] === steps[i]) j++;
    parts.push(j - i > 1 ? `${steps[i]}x${j - i}` : String(steps[i]));
    i = j;
  }
  return parts.join(',');
}

/** Row counts of steps that all kept every row (a step cut back is refused here: see parseStepShapes). */
export function parseSteps(text: string | undefined): number[] {
  if (!text || text.length > 65_536) throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_STEPS_HEADER} must list the row count of every step (run-length: 37,1x120)`);
  const out: number[] = [];
  let total = 0;
  for (const part of text.split(',')) {
    const m = /^\s*(\d{1,6})(?:x(\d{1,6}))?\s*$/.exec(part);
    if (!m) throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_STEPS_HEADER}: "${part.slice(0, 20)}" is not ROWS or ROWSxCOUNT`);
    const rows = Number(m[1]);
    const count = m[2] === undefined ? 1 : Number(m[2]);
    if (rows < 1 || count < 1) throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_STEPS_HEADER}: steps have at least one row`);
    total += rows * count;
    if (total > MAX_CHECK_ROWS) throw new MeshError('MESH_ERR_TOO_LARGE', `a check covers at most ${MAX_CHECK_ROWS} rows`);
    for (let k = 0; k < count; k++) out.push(rows);
  }
  return out;
}

/**
 * A session's steps as a check sees them: the rows each computed, and the rows of it that stayed (a
 * speculative step's rejected draft rows were cut back after it: the next step started at its
 * position + kept). Wire: `ROWS` for a step that kept every row (run-length `ROWSxCOUNT`), `ROWS:KEPT`
 * for one cut back. The chain's position of a step is the sum of the kept rows before it.
 */
export interface StepShapes {
  rows: number[];
  kept: number[];
}

export function formatStepShapes(s: StepShapes): string {
  if (s.kept.every((k, i) => k === s.rows[i])) return formatSteps(s.rows);
  return s.rows.map((n, i) => (s.kept[i] === n ? String(n) : `${n}:${s.kept[i]}`)).join(',');
}

export function parseStepShapes(text: string | undefined): StepShapes {
  if (!text || text.length > 65_536) throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_STEPS_HEADER} must list the row count of every step (run-length: 37,1x120; a step cut back: 5:2)`);
  const rows: number[] = [];
  const kept: number[] = [];
  let total = 0;
  for (const part of text.split(',')) {
    const m = /^\s*(\d{1,6})(?:x(\d{1,6})|:(\d{1,6}))?\s*$/.exec(part);
    if (!m) throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_STEPS_HEADER}: "${part.slice(0, 20)}" is not ROWS, ROWSxCOUNT or ROWS:KEPT`);
    const n = Number(m[1]);
    const count = m[2] === undefined ? 1 : Number(m[2]);
    const k = m[3] === undefined ? n : Number(m[3]);
    if (n < 1 || count < 1) throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_STEPS_HEADER}: steps have at least one row`);
    if (k < 1 || k > n) throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_STEPS_HEADER}: a step keeps 1..${n} of its ${n} rows, not ${k}`);
    total += n * count;
    if (total > MAX_CHECK_ROWS) throw new MeshError('MESH_ERR_TOO_LARGE', `a check covers at most ${MAX_CHECK_ROWS} rows`);
    for (let j = 0; j < count; j++) {
      rows.push(n);
      kept.push(k);
    }
  }
  return { rows, kept };
}

/** The tokens a last hop emitted per step, in order (a verification's accepted drafts, then its token): `a+b+c` per step, steps comma-separated. */
export function formatStepTokens(groups: ReadonlyArray<readonly number[]>): string {
  return groups.map((g) => g.join('+')).join(',');
}

/** formatStepTokens read back: `steps` groups of 1..kept[s] token ids below `vocab` each. */
export function parseStepTokens(text: string | undefined, kept: readonly number[], vocab: number): number[][] {
  const groups = (text ?? '').split(',').map((g) => g.split('+').map((t) => (/^\d{1,9}$/.test(t.trim()) ? Number(t.trim()) : NaN)));
  if (groups.length !== kept.length || groups.some((g, s) => g.length > kept[s]! || g.some((x) => !(x >= 0 && x < vocab)))) {
    throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_TOKENS_HEADER} must give, for each of ${kept.length} steps, the token ids it emitted (below ${vocab}, at most its kept rows), a+b per step`);
  }
  return groups;
}

/** Per step, the draft a sampling drafter's rule judged (null for the other steps): a check body's tail. */
export function formatStepDrafts(drafts: ReadonlyArray<Parameters<typeof encodeDraft>[0] | undefined>): Uint8Array {
  return new TextEncoder().encode(`[${drafts.map((d) => (d ? encodeDraft(d) : 'null')).join(',')}]`);
}

/** formatStepDrafts read back: one entry per step, each a valid draft or undefined. */
export function parseStepDrafts(bytes: Uint8Array, steps: number): Array<DraftJson | undefined> {
  let raw: unknown;
  try {
    raw = JSON.parse(new TextDecoder().decode(bytes));
  } catch {
    throw new MeshError('MESH_ERR_BAD_REQUEST', `the drafts after the rows (${CHECK_DRAFTS_HEADER}) are not JSON`);
  }
  if (!Array.isArray(raw) || raw.length !== steps) throw new MeshError('MESH_ERR_BAD_REQUEST', `the drafts after the rows must list one entry per step (${steps})`);
  return raw.map((d) => (d === null ? undefined : draftFromJson(d)));
}

export function formatTokens(ids: readonly number[]): string {
  return ids.join(',');
}

export function parseTokens(text: string | undefined, steps: number, vocab: number): number[] {
  const ids = (text ?? '').split(',').map((t) => (/^\d{1,9}$/.test(t.trim()) ? Number(t.trim()) : NaN));
  if (ids.length !== steps || ids.some((x) => !(x >= 0 && x < vocab))) {
    throw new MeshError('MESH_ERR_BAD_REQUEST', `${CHECK_TOKENS_HEADER} must give ${steps} token ids below ${vocab}, one per step`);
  }
  return ids;
}

/** One step of a last-hop check: the claimed token, what the checker samples, its top token, and how far the claim is from being sampled. */
export interface TokenCheckRecord {
  claimed: number;
  sampled: number;
  argmax: number;
  deficit: number;
  gap: number;
  /** The claimed token's log-probability under the checker's logits (a last hop signs the one it computed). */
  logprob: number;
}

export const TOKEN_CHECK_BYTES = 36;

export function tokenCheckBytes(r: TokenCheckRecord): Uint8Array {
  const b = new Uint8Array(TOKEN_CHECK_BYTES);
  const dv = new DataView(b.buffer);
  dv.setUint32(0, r.claimed >>> 0, true);
  dv.setUint32(4, r.sampled >>> 0, true);
  dv.setUint32(8, r.argmax >>> 0, true);
  dv.setFloat64(12, r.deficit, true);
  dv.setFloat64(20, r.gap, true);
  dv.setFloat64(28, r.logprob, true);
  return b;
}

export function readTokenCheck(b: Uint8Array, offset = 0): TokenCheckRecord {
  const dv = new DataView(b.buffer, b.byteOffset + offset, TOKEN_CHECK_BYTES);
  return { claimed: dv.getUint32(0, true), sampled: dv.getUint32(4, true), argmax: dv.getUint32(8, true), deficit: dv.getFloat64(12, true), gap: dv.getFloat64(20, true), logprob: dv.getFloat64(28, true) };
}

/** A last hop's claimed output bytes (attest.ts tokenBytes) read back. */
export function readTokenBytes(b: Uint8Array): { tokenId: number; logprob: number } {
  if (b.byteLength !== 12) throw new RangeError('a token claim is 12 bytes');
  const dv = new DataView(b.buffer, b.byteOffset, 12);
  return { tokenId: dv.getUint32(0, true), logprob: dv.getFloat64(4, true) };
}
