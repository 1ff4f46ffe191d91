/**
 * Prompt lookup (n-gram) drafting: the text a model writes often repeats
 * its input — a summary quotes the document, an edit copies the code, a
 * chat repeats names — so the tokens that followed the last time the
 * current n-gram appeared are a free guess at what comes next.
 *
 * The drafter indexes every n-gram (n = minN..maxN) of the accepted
 * sequence (prompt + generated) by where it last ended, incrementally as
 * tokens arrive; a proposal is the continuation after the most recent
 * earlier occurrence of the longest suffix that has one (a loop is
 * followed round to k tokens). An optional
 * prediction (OpenAI's Predicted Outputs: text the answer is expected to
 * resemble) is used first: while the output still follows it from its
 * start, its next tokens are the proposal; after a divergence its n-grams
 * are looked up like the context's, before them.
 */
import type { Draft, Drafter, DrafterKind } from './drafter.ts';

export interface PromptLookupOptions {
  /** Longest suffix matched. @defaultValue 4 */
  maxN?: number;
  /** Shortest suffix matched (1 drafts on any repeated token: cheap, but often wrong). @defaultValue 2 */
  minN?: number;
  /** Tokens the answer is expected to resemble (a prediction). */
  prediction?: readonly number[];
}

/** Where each n-gram of a growing sequence last ended (and the time before), by n. */
class NgramIndex {
  readonly tokens: number[] = [];
  /** n → key → [end of the latest occurrence, end of the one before] (exclusive ends). */
  private readonly last: Array<Map<string, [number, number]>>;
  constructor(
    private readonly minN: number,
    private readonly maxN: number,
  ) {
    this.last = Array.from({ length: maxN + 1 }, () => new Map());
  }

  push(t: number): void {
    this.tokens.push(t);
    const end = this.tokens.length;
    for (let n = this.minN; n <= this.maxN && n <= end; n++) {
      const key = this.tokens.slice(end - n, end).join(',');
      const m = this.last[n]!;
      const had = m.get(key);
      m.set(key, [end, had ? had[0] : -1]);
    }
  }

  /** End of the most recent occurrence of `gram` ending before `before` (exclusive), or -1. */
  find(gram: readonly number[], before: number): number {
    const hit = this.last[gram.length]?.get(gram.join(','));
    if (!hit) return -1;
    if (hit[0] < before) return hit[0];
    return hit[1] < before ? hit[1] : -1;
  }
}

export class PromptLookupDrafter implements Drafter {
  readonly kind: DrafterKind;
  private readonly minN: number;
  private readonly maxN: number;
  private readonly ctx: NgramIndex;
  private readonly prediction: NgramIndex | null;
  /** Tokens of the accepted sequence that are generated (past the prompt) and still follow the prediction from its start; -1 once they diverged. */
  private aligned = 0;
  private promptLength = -1;

  constructor(o: PromptLookupOptions = {}) {
    this.maxN = o.maxN ?? 4;
    this.minN = o.minN ?? 2;
    if (!(Number.isInteger(this.minN) && this.minN >= 1 && Number.isInteger(this.maxN) && this.maxN >= this.minN && this.maxN <= 16)) {
      throw new RangeError(`prompt lookup n-grams ${this.minN}..${this.maxN}: need 1 <= min <= max <= 16`);
    }
    this.ctx = new NgramIndex(this.minN, this.maxN);
    if (o.prediction && o.prediction.length > 0) {
      this.prediction = new NgramIndex(this.minN, this.maxN);
      for (const t of o.prediction) this.prediction.push(t);
      this.kind = 'prediction';
    } else {
      this.prediction = null;
      this.kind = 'prompt-lookup';
    }
  }

  /**
   * Tell the drafter where the prompt ends (the first call's sequence is
   * the prompt, plus any prefix a restarted generation carries): the
   * prediction is followed from there.
   */
  private sync(accepted: readonly number[]): void {
    if (this.promptLength < 0) this.promptLength = accepted.length;
    const have = this.ctx.tokens.length;
    if (accepted.length < have) throw new RangeError(`the accepted sequence shrank from ${have} to ${accepted.length} tokens`);
    for (let i = have; i < accepted.length; i++) {
      const t = accepted[i]!;
      if (i >= this.promptLength && this.prediction && this.aligned >= 0) {
        const g = i - this.promptLength;
        this.aligned = this.prediction.tokens[g] === t ? g + 1 : -1;
      }
      this.ctx.push(t);
    }
  }

  propose(accepted: readonly number[], k: number): Draft {
    this.sync(accepted);
    if (k <= 0) return { ids: [] };
    const p = this.prediction;
    if (p && this.aligned >= 0 && this.aligned < p.tokens.length) return { ids: p.tokens.slice(this.aligned, this.aligned + k) };
    const seq = this.ctx.tokens;
    for (let n = Math.min(this.maxN, seq.length); n >= this.minN; n--) {
      const gram = seq.slice(seq.length - n);
      if (p) {
        const end = p.find(gram, p.tokens.length + 1);
        if (end >= 0 && end < p.tokens.length) return { ids: p.tokens.slice(end, end + k) };
      }
      // An earlier occurrence in the context: one that ends before the suffix itself does.
      const end = this.ctx.find(gram, seq.length);
      if (end >= 0) {
        // The continuation may run into the proposal itself (a loop of period seq.length − end): follow it round.
        const ids: number[] = [];
        for (let j = end; ids.length < k; j++) ids.push(j < seq.length ? seq[j]! : ids[j - seq.length]!);
        return { ids };
      }
    }
    return { ids: [] };
  }

  costPerToken(): number {
    return 0;
  }

  release(): void {}
}

/**
 * The default drafter factory of a head: prompt lookup over the prompt and
 * the text so far, following the request's prediction (text tokenized by
 * the head's tokenizer, or token ids) first.
 */
export function promptLookupFor(tok: { encode(text: string, opts?: { addSpecialTokens?: boolean }): number[] }): (req: { prediction?: string | undefined; prediction_token_ids?: number[] | undefined }) => PromptLookupDrafter {
  return (req) => {
    const prediction = req.prediction_token_ids ?? (req.prediction !== undefined && req.prediction.length > 0 ? tok.encode(req.prediction, { addSpecialTokens: false }) : undefined);
    return new PromptLookupDrafter(prediction ? { prediction } : {});
  };
}
