/**
 * X-Meshnet-Draft (docs/protocol.md §5): the drafts a verification step's
 * last rows propose, as JSON `{"ids":[…],"next"?:n,"q"?:[{"ids":[…],"probs":[…]}…]}`.
 * Bounded before use; the checks that need the model (vocabulary, rows)
 * are the executor's (src/shard/speculative.ts checkDraft).
 */
import { z } from 'zod';
import { MeshError } from './errors.ts';

const id = z.number().int().nonnegative().max(2 ** 31);
const draftSchema = z
  .object({
    ids: z.array(id).max(16),
    next: id.optional(),
    q: z.array(z.object({ ids: z.array(id).min(1).max(64), probs: z.array(z.number()).min(1).max(64) }).strict()).max(17).optional(),
  })
  .strict();

export type DraftJson = z.infer<typeof draftSchema>;

/** Longest X-Meshnet-Draft accepted (17 distributions of 64 entries fit well below it). */
const MAX_DRAFT_HEADER = 48 * 1024;

export function encodeDraft(d: { ids: readonly number[]; next?: number | undefined; q?: ReadonlyArray<{ ids: readonly number[]; probs: readonly number[] }> | undefined }): string {
  return JSON.stringify({ ids: d.ids, ...(d.next !== undefined ? { next: d.next } : {}), ...(d.q ? { q: d.q.map((x) => ({ ids: x.ids, probs: x.probs })) } : {}) });
}

/** The header's draft, or a 400 saying what is wrong with it. */
export function parseDraft(text: string): DraftJson {
  if (text.length > MAX_DRAFT_HEADER) throw new MeshError('MESH_ERR_BAD_REQUEST', `X-Meshnet-Draft is ${text.length} bytes, over ${MAX_DRAFT_HEADER}`);
  let raw: unknown;
  try {
    raw = JSON.parse(text);
  } catch {
    throw new MeshError('MESH_ERR_BAD_REQUEST', 'X-Meshnet-Draft is not JSON');
  }
  return draftFromJson(raw);
}

/** A draft already parsed from JSON (e.g. an entry of a check's drafts), or a 400 saying what is wrong with it. */
export function draftFromJson(raw: unknown): DraftJson {
  const p = draftSchema.safeParse(raw);
  if (!p.success) {
    const issue = p.error.issues[0]!;
    throw new MeshError('MESH_ERR_BAD_REQUEST', `X-Meshnet-Draft: ${issue.path.join('.') || 'value'}: ${issue.message}`);
  }
  return p.data;
}
