/**
 * The shard's contract: what a caller hands an executor, what it gets back,
 * and the executor a node serves its span with, whichever graphs run it —
 * the plain-operator ShardExecutor (executor.ts) or the fused-operator
 * FusedShardExecutor (fused-executor.ts); span-executor.ts builds either.
 * The node runtime, the forward handler and the head's pipeline see only
 * these types.
 */
import type { ModelConfig } from '../model/config.ts';
import type { GraphDtype, WeightSource } from '../model/graph.ts';
import type { BatchStats } from './batch-queue.ts';
import type { KvStats } from './kv-store.ts';
import type { SamplingParams } from './sampling.ts';
import type { DraftProposal, Verified } from './speculative.ts';

/** Supplies the tensors one graph needs, by HF name; called once per graph, so a host can fetch just those bytes. */
export type WeightLoader = (names: readonly string[]) => WeightSource | Promise<WeightSource>;

export interface ForwardRequest {
  /** KV session id; absent: a stateless forward over the whole sequence (position 0, nothing kept). */
  session?: string;
  /** Tokens the session's cache holds before this call. 0 restarts the session. */
  position?: number;
  /**
   * Positions the session will reach at most (prompt + max_tokens), given
   * when it opens (position 0): its KV room is reserved up front, or the
   * call fails at once with 503 MESH_ERR_BUSY. Absent: room grows by blocks.
   */
  sessionTokens?: number;
  startLayer?: number;
  endLayer?: number;
  /** Input activation [1, seq, hidden], row-major. */
  activation?: { data: Float32Array; shape: readonly number[] };
  /** Token ids, when this shard holds the embedding and starts at layer 0. */
  tokenIds?: readonly number[];
  sampling?: SamplingParams;
  /**
   * Speculative decoding: the session's cache may hold positions up to this
   * one from an earlier verification step; those past `position` are cut
   * before this call (SessionKv.reserve). Outside [position, rollbackFrom]: 409 as usual.
   */
  rollbackFrom?: number;
  /** A verification step (the call must end at the last layer): the drafts its last rows propose (speculative.ts). */
  draft?: DraftProposal;
  /**
   * A call that ends at the last layer answers the logits of these rows (0-based within the call's
   * rows, in order) instead of sampling a token: a spot-check of a last hop recomputes every step's
   * logits in one prefill (docs/verification.md).
   */
  logitRows?: readonly number[];
}

export type ForwardResult =
  | { kind: 'activation'; data: Float32Array; shape: [1, number, number] }
  | {
      kind: 'token';
      tokenId: number;
      logprob: number;
      /** Last position's logits [vocab]; empty when a GPU picked the token and kept them there. */
      logits: Float32Array;
      /** A verification step's outcome: the drafts accepted and the tokens emitted (tokenId is the last of them). */
      spec?: Verified;
    }
  /** `logitRows` asked: the rows' logits one after another, [rows.length, vocab]. */
  | { kind: 'logits'; rows: readonly number[]; data: Float32Array };

/** The executor of one span of layers, as the node runtime serves it. */
export interface SpanExecutor {
  readonly config: ModelConfig;
  readonly startLayer: number;
  /** Exclusive. */
  readonly endLayer: number;
  /** Holds layer 0's embedding: takes token ids. */
  readonly holdsEmbedding: boolean;
  /** Holds the final norm and LM head: answers tokens. */
  readonly holdsHead: boolean;
  /** Positions one session may reach. */
  readonly maxContext: number;
  /** Activation dtype of the graphs (what /info reports). */
  readonly dtype: GraphDtype;
  /** Bytes of weights held by this span's graphs. */
  readonly weightBytes: number;
  /** Runs (queues) one request; one-token steps of different sessions queued together may run as one batch. */
  forward(req: ForwardRequest): Promise<ForwardResult>;
  /** Tokens a session's cache holds at `layer` (default: the first held layer); 0 when unknown. */
  sessionLength(id: string, layer?: number): number;
  dropSession(id: string): boolean;
  /**
   * Cuts a session's cache back to `length` positions on every held layer
   * (speculative decoding's rollback; a forward's `rollbackFrom` does the
   * same in order with its queue). Call it between that session's forwards.
   * False when the session is unknown or the length is not a non-negative integer.
   */
  truncateSession(id: string, length: number): boolean;
  kvStats(): KvStats;
  /** The donor's budget changed: the KV caches get what the weights leave of it. Live sessions keep their room. */
  setMemoryBudget(bytes: number): void;
  /** Batch sizes run so far (the node's stats and /info). */
  batchStats(): BatchStats;
  /** The last batch this executor ran was full (speculative decoding backs off: X-Meshnet-Batch-Full). */
  batchFull(): boolean;
  /** Waits for the queued requests, then frees the graphs and caches. */
  release(): Promise<void>;
}
