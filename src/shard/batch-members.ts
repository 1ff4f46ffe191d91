/**
 * The shape every batched path shares: each member passes its own checks and
 * KV admission (a member that fails answers with its error alone), then the
 * admitted ones run as one batch, and the answers go back in request order.
 */
import type { ForwardResult } from './executor.ts';

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
