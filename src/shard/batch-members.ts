/**
 * The shape every batched path shares (packed-batch.ts, fused-batch.ts):
 * each member passes its own checks and KV admission (a member that fails
 * answers with its error alone), then the admitted ones run as one batch,
 * and the answers go back in request order, one row each (a
 * verification's judged rows at the last hop).
 */
import type { ForwardRequest, ForwardResult } from './contract.ts';
import { judgedRows, tokenFromRows } from './speculative.ts';

export async function runMembers<I extends { index: number }>(
  count: number,
  admit: (index: number) => Promise<I>,
  run: (items: I[]) => Promise<ForwardResult[]>,
): Promise<Array<ForwardResult | Error>> {
  const answers: Array<ForwardResult | Error> = new Array(count);
  const items: I[] = [];
  for (let index = 0; index < count; index++) {
    try {
      items.push(await admit(index));
    } catch (e) {
      answers[index] = e instanceof Error ? e : new Error(String(e));
    }
  }
  if (items.length > 0) {
    const done = await run(items);
    items.forEach((it, i) => (answers[it.index] = done[i]!));
  }
  return answers;
}

/**
 * Each member's token from its rows of the batch's logits [rows, vocab]:
 * judgedRows(its draft) rows per member in order (its last row, or a
 * verification's last k + 1), sampled or verified at their positions.
 */
export function batchTokens(all: Float32Array, vocab: number, items: ReadonlyArray<{ req: ForwardRequest; input: { position: number; seq: number } }>): ForwardResult[] {
  let at = 0;
  return items.map((it) => {
    const rows = judgedRows(it.req.draft);
    const logits = all.slice(at * vocab, (at + rows) * vocab);
    at += rows;
    return { kind: 'token', ...tokenFromRows(logits, vocab, it.req.draft, it.req.sampling ?? {}, it.input.position + it.input.seq - rows + 1) };
  });
}

/** Each member's output row of the batch's activation [B, hidden], copied out. */
export function batchActivations(data: Float32Array, hidden: number, count: number): ForwardResult[] {
  return Array.from({ length: count }, (_, i) => ({ kind: 'activation', data: data.slice(i * hidden, (i + 1) * hidden), shape: [1, 1, hidden] }));
}
