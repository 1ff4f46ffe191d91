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

  /** Take choice `index`'s result of next(); after a text part, its next part is awaited. */
  add(index: number, r: IteratorResult<CompletionPart>): void {
    if (r.done) throw new MeshError('MESH_ERR_UPSTREAM', 'generation ended without a result');
    this.queue.push({ index, part: r.value });
    if (!('text' in r.value)) return;
    const pending = this.choices[index]!.next().then((next) => ({ index, r: next }));
    // Raced later; until then a failure must not count as unhandled.
    pending.catch(() => undefined);
    this.waiting.set(index, pending);
  }

  /** The next part of any choice, in the order they come; undefined once every choice has finished. */
  async next(): Promise<{ index: number; part: CompletionPart } | undefined> {
    if (this.queue.length === 0 && this.waiting.size > 0) {
      // One choice (every chat): its own promise, without a race's per-part wrapper.
      const { index, r } = this.waiting.size === 1 ? await this.waiting.values().next().value! : await Promise.race(this.waiting.values());
      this.waiting.delete(index);
      this.add(index, r);
    }
    return this.queue.shift();
  }
}
