/**
 * Several choices' parts as one stream, each part as soon as it comes: a
 * streamed /v1/completions request with several prompts (completion.ts's
 * CompletionPart). A part with `text` is never a choice's last.
 */
import { MeshError } from '../protocol/errors.ts';

export class MergedChoices<CompletionPart extends object> {
  private readonly queue: Array<{ index: number; part: CompletionPart }> = [];
  private readonly waiting = new Map<number, Promise<{ index: number; r: IteratorResult<CompletionPart> }>>();

  constructor(private readonly choices: ReadonlyArray<AsyncGenerator<CompletionPart>>) {}

  /** Take choice `index`'s result of next(); until its finish, its next part is awaited. */
  add(index: number, r: IteratorResult<CompletionPart>): void {
    if (r.done) throw new MeshError('MESH_ERR_UPSTREAM', 'generation ended without a result');
    // The head's acceptance is no output: the stream's headers have gone already.
    if (!('started' in r.value)) this.queue.push({ index, part: r.value });
    if ('finish' in r.value) return;
    this.await(index, this.choices[index]!.next());
  }

  /** Choice `index`'s next() already called (its result not in yet). */
  await(index: number, next: Promise<IteratorResult<CompletionPart>>): void {
    const pending = next.then((r) => ({ index, r }));
    // Raced later; until then a failure must not count as unhandled.
    pending.catch(() => undefined);
    this.waiting.set(index, pending);
  }

  /** The next part of any choice, in the order they come; undefined once every choice has finished. */
  async next(): Promise<{ index: number; part: CompletionPart } | undefined> {
    while (this.queue.length === 0 && this.waiting.size > 0) {
      // One choice (every chat): its own promise, without a race's per-part wrapper.
      const { index, r } = this.waiting.size === 1 ? await this.waiting.values().next().value! : await Promise.race(this.waiting.values());
      this.waiting.delete(index);
      this.add(index, r);
    }
    return this.queue.shift();
  }
}
