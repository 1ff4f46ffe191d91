/**
 * The shape every batched path shares (packed-batch.ts, fused-batch.ts):
 * each member passes its own checks and KV admission (a member that fails
 * answers with its error alone), then the admitted ones run as one batch,
 * and the answers go back in request order, one row each.
 */
import type { ForwardRequest, ForwardResult } from './contract.ts';
import { sampleToken } from './sampling.ts';

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

/** Each member's token, sampled from its row of the batch's logits [B, vocab] at its next position. */
export function batchTokens(all: Float32Array, vocab: number, items: ReadonlyArray<{ req: ForwardRequest; input: { position: number } }>): ForwardResult[] {
  return items.map((it, i) => {
    const logits = all.slice(i * vocab, (i + 1) * vocab);
    const { tokenId, logprob } = sampleToken(logits, it.req.sampling ?? {}, it.input.position + 1);
    return { kind: 'token', tokenId, logprob, logits };
  });
}

/** Each member's output row of the batch's activation [B, hidden], copied out. */
export function batchActivations(data: Float32Array, hidden: number, count: number): ForwardResult[] {
  return Array.from({ length: count }, (_, i) => ({ kind: 'activation', data: data.slice(i * hidden, (i + 1) * hidden), shape: [1, 1, hidden] }));
}
