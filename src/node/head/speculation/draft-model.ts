/**
 * Drafting with a draft model: a smaller checkpoint of the same vocabulary,
 * run by the head on its own backend (the same engine as the target's, so
 * their numerics agree as far as the models do). Its KV session follows the
 * generation: each call feeds what was accepted since the last one (cutting
 * back the rejected drafts with the same rollback every hop does), then
 * proposes one token at a time.
 *
 * Greedy requests get point-mass drafts (the draft's argmax). At T > 0 it
 * samples from its own distribution at the request's temperature, top_k and
 * top_p (cut to its 64 likeliest tokens) and sends that q with each
 * proposal, one proposal more than it feeds, for the verifier's
 * Leviathan/Chen rule (src/shard/speculative.ts). At T > 0 one token per
 * forward, always: the q of a position then never depends on how the drafts
 * were chunked, so a seeded generation draws the same tokens whatever k was.
 * Greedy drafts only ever change the speed, never a token, so there the
 * tokens accepted since the last call are caught up in one forward: a
 * policy that drafts only now and then (adaptive k probing a poor draft
 * model) would otherwise pay a whole-model step per generated token.
 */
import { MeshError } from '../../../protocol/errors.ts';
import type { ForwardRequest, ForwardResult } from '../../../shard/contract.ts';
import type { SamplingParams } from '../../../shard/sampling.ts';
import { proposeFromLogits, type SparseDist } from '../../../shard/speculative.ts';
import type { Draft, Drafter } from './drafter.ts';

/** What the drafter needs of a whole-model executor (ShardExecutor, FusedShardExecutor). */
export interface DraftExecutor {
  readonly config: { readonly vocabSize: number; readonly numLayers: number };
  readonly maxContext: number;
  forward(req: ForwardRequest): Promise<ForwardResult>;
  dropSession(id: string): boolean;
}

/** What a model says about its vocabulary, to compare a draft's with the target's. */
export interface VocabularyOf {
  /** The config's vocab_size. */
  vocabSize: number;
  /** The tokenizer's token text of an id (absent: only the sizes are compared). */
  idToToken?(id: number): string | undefined;
}

/**
 * Refuses a draft model whose vocabulary is not the target's: its ids would
 * mean other tokens, and every draft would be rejected (or worse, accepted
 * by chance). Thrown at start, naming both.
 */
export function checkDraftVocabulary(draftName: string, draft: VocabularyOf, target: VocabularyOf): void {
  if (draft.vocabSize !== target.vocabSize) {
    throw new MeshError('MESH_ERR_BAD_REQUEST', `draft model ${draftName} has a vocabulary of ${draft.vocabSize} tokens, the target ${target.vocabSize}: a draft model must share the target's tokenizer`);
  }
  if (!draft.idToToken || !target.idToToken) return;
  for (let id = 0; id < target.vocabSize; id++) {
    const a = draft.idToToken(id);
    const b = target.idToToken(id);
    if (a !== b) throw new MeshError('MESH_ERR_BAD_REQUEST', `draft model ${draftName}'s tokenizer maps id ${id} to ${JSON.stringify(a)?.slice(0, 40) ?? 'nothing'}, the target's to ${JSON.stringify(b)?.slice(0, 40) ?? 'nothing'}: not the same vocabulary`);
  }
}

export interface DraftModelOptions {
  /** The draft model's KV session id (the generation's own id + a suffix). */
  session: string;
  sampling: SamplingParams;
  /** Positions the generation reaches at most (the drafter reserves that plus the drafts). */
  declared: number;
  /** The draft model's name: a head carries its acceptance from one generation to the next under it (Drafter.memoryKey). */
  name?: string;
  /** 'self': the draft is the target's own first layers with its head (self-speculation). @defaultValue 'model' */
  kind?: 'model' | 'self';
}

export class DraftModelDrafter implements Drafter {
  readonly kind: 'model' | 'self';
  readonly memoryKey: string | undefined;
  /** Tokens the draft cache holds, position by position. */
  private fed: number[] = [];
  /** Furthest position the cache was written to (rollback bound). */
  private written = 0;
  /** Row logits (T > 0) or the greedy pick after the last fed token. */
  private after: { tokenId: number; logits: Float32Array } | null = null;
  private msPerToken = 0;
  private readonly stochastic: boolean;

  constructor(
    private readonly ex: DraftExecutor,
    private readonly o: DraftModelOptions,
  ) {
    this.stochastic = (o.sampling.temperature ?? 0) > 0;
    this.kind = o.kind ?? 'model';
    // Greedy and sampled drafts are judged by different rules: their acceptance is kept apart.
    this.memoryKey = o.name === undefined ? undefined : `model:${o.name}:${this.stochastic ? 'sampled' : 'greedy'}`;
  }

  costPerToken(): number {
    return this.msPerToken;
  }

  /** One forward of `tokens` at `position`, timed; leaves what follows them in `after`. */
  private async feed(tokens: readonly number[], position: number): Promise<void> {
    const t0 = performance.now();
    const req: ForwardRequest = {
      session: this.o.session,
      position,
      tokenIds: tokens,
      startLayer: 0,
      endLayer: this.ex.config.numLayers,
      sampling: {},
    };
    if (position === 0) req.sessionTokens = Math.min(this.ex.maxContext, this.o.declared + 17);
    if (this.written > position) req.rollbackFrom = this.written;
    const r = await this.ex.forward(req);
    if (r.kind !== 'token') throw new MeshError('MESH_ERR_INTERNAL', 'the draft model does not end at its LM head');
    if (this.stochastic && r.logits.length !== this.ex.config.vocabSize) throw new MeshError('MESH_ERR_INTERNAL', 'the draft model keeps its logits on the device; sampled drafts need them (returnLogits)');
    this.fed.length = position;
    this.fed.push(...tokens);
    this.written = Math.max(this.written, this.fed.length);
    this.after = { tokenId: r.tokenId, logits: r.logits };
    // What a draft costs: one-token forwards only (a catch-up's rows are cheaper each).
    if (tokens.length === 1) {
      const ms = performance.now() - t0;
      this.msPerToken = this.msPerToken === 0 ? ms : this.msPerToken + 0.2 * (ms - this.msPerToken);
    }
  }

  /** Feeds what was accepted since the last call, ahead of the next `propose` (greedy: one forward; sampled: nothing, see above). */
  async prepare(accepted: readonly number[]): Promise<void> {
    if (this.stochastic || accepted.length < 2) return;
    const acc = accepted.slice(); // the caller's array grows while this runs
    let common = 0;
    const n = Math.min(this.fed.length, acc.length);
    while (common < n && this.fed[common] === acc[common]) common++;
    if (common >= acc.length - 1) return;
    await this.feed(acc.slice(common), common);
  }

  async propose(accepted: readonly number[], k: number): Promise<Draft> {
    if (k <= 0 || accepted.length === 0) return { ids: [] };
    // Room in the draft model's context for the drafts (and one more).
    k = Math.min(k, this.ex.maxContext - accepted.length - 1);
    if (k <= 0) return { ids: [] };
    let common = 0;
    const n = Math.min(this.fed.length, accepted.length);
    while (common < n && this.fed[common] === accepted[common]) common++;
    if (common === accepted.length) common--; // the logits after the last accepted token are not kept: feed it again
    if (common === 0) await this.feed(accepted, 0);
    else if (!this.stochastic) await this.feed(accepted.slice(common), common);
    else for (let p = common; p < accepted.length; p++) await this.feed([accepted[p]!], p);

    const ids: number[] = [];
    const q: SparseDist[] = [];
    const want = this.stochastic ? k + 1 : k;
    for (let r = 0; r < want; r++) {
      const position = accepted.length + r;
      let id: number;
      if (this.stochastic) {
        const p = proposeFromLogits(this.after!.logits, this.o.sampling, position);
        id = p.id;
        q.push(p.q);
      } else id = this.after!.tokenId;
      ids.push(id);
      // The last proposal is not fed: the verifier judges it by the last row (or it is the k-th draft).
      if (r + 1 < want) await this.feed([id], position);
    }
    if (!this.stochastic) return { ids };
    return { ids: ids.slice(0, k), next: ids[k]!, q };
  }

  release(): void {
    this.ex.dropSession(this.o.session);
    this.fed = [];
    this.written = 0;
    this.after = null;
  }
}
