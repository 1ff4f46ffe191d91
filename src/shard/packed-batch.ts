/**
 * One-row decode steps of several sessions through the plain layer graphs
 * (graph.ts) in ONE session.run per segment. Two layouts of the same graphs,
 * chosen per batch (batchLayout):
 *
 * padded — B along the graphs' batch axis, every past padded to the longest:
 *   hidden   [B, 1, hidden]        row i = session i's token
 *   past     [B, Pmax, kvh, hd]    session i's P_i rows, then zero rows
 *   rotary   [B, 1, 1, hd]         row i at position P_i
 *   mask     [B, 1, groups, Pmax+1] row i open on its P_i rows and column Pmax (its new row)
 * Each query attends over Pmax+1 columns: B·Pmax dot products per head.
 *
 * packed — B along the sequence axis, the pasts one after another:
 *   hidden   [1, B, hidden]
 *   past     [1, ΣP, kvh, hd]      P_i rows at off_i
 *   rotary   [1, B, 1, hd]
 *   mask     [1, 1, groups·B, ΣP + B]  row i open on columns off_i … off_i+P_i-1 and ΣP+i
 * Each query attends over every session's columns: B·ΣP dot products, but
 * no padding rows — cheaper only when one past is much longer than the rest.
 *
 * In both, present row i is session i's new KV row, written back at P_i.
 * Masked columns are exactly zero after softmax (exp(-1e9 - max) underflows
 * to 0 in f32) and padding rows are zeros, so each row's attention is the
 * same sum as alone; the projections and the MLP are row-wise. What can
 * differ from a lone run is the rounding of a wider GEMM and of the softmax
 * reduction (f32 ulps), never the token a greedy step picks
 * (test/shard/batch.test.ts checks both layouts against float64).
 *
 * Cost: the projections and MLP read the weights once for B rows (the win).
 * The pasts are copied into one tensor per layer; the graph's Concat and
 * Transposes copy them again (bench/ort-ops.ts breaks a step down by op).
 */
import type { ModelConfig } from '../model/config.ts';
import { IO, maskValue, type GraphDtype } from '../model/graph.ts';
import { ropeTables } from '../model/rope.ts';
import type { BackendTensor, OnnxSession } from './backend.ts';
import { PositionMismatchError, layerRangeError } from './errors.ts';
import type { ForwardRequest, ForwardResult } from './executor.ts';
import { checkForwardInput, type ForwardInput } from './forward-input.ts';
import type { KvSession, KvStore } from './kv-store.ts';
import { runMembers } from './batch-members.ts';
import type { BatchScratch } from './batch-scratch.ts';
import type { JoinQueued, Joiner } from './batch-queue.ts';
import { sampleToken } from './sampling.ts';

export interface PackedSegment {
  start: number;
  end: number;
  session: OnnxSession;
}

/** What a packed batch needs of the plain executor. */
export interface PackedContext {
  config: ModelConfig;
  dtype: GraphDtype;
  startLayer: number;
  endLayer: number;
  maxContext: number;
  invFreq: Float64Array;
  segments: readonly PackedSegment[];
  embed: OnnxSession | null;
  head: OnnxSession | null;
  kv: KvStore;
  /** Reused input buffers (absent: fresh arrays every step). */
  scratch?: BatchScratch;
  /** 'auto' (absent): batchLayout() per batch; benchmarks and tests force one. */
  layout?: BatchLayoutChoice;
}

export type BatchLayoutChoice = 'auto' | 'padded' | 'packed';

/** Requests that may share a packed batch: one row, a KV session, same layers and input kind. */
export function packedBatchKey(req: ForwardRequest, held: { startLayer: number; endLayer: number }): string | undefined {
  if (req.session === undefined) return undefined;
  const rows = req.tokenIds !== undefined ? req.tokenIds.length : req.activation?.shape[1];
  if (rows !== 1) return undefined;
  const kind = req.tokenIds !== undefined ? 'tokens' : 'activation';
  return `${req.startLayer ?? held.startLayer}-${req.endLayer ?? held.endLayer}-${kind}`;
}

interface Item {
  index: number;
  req: ForwardRequest;
  input: ForwardInput;
  kv: KvSession;
}

type Join = JoinQueued<ForwardRequest, ForwardResult>;

/**
 * Runs `reqs` (equal batch keys) as one packed batch; a request that fails its checks or admission fails alone.
 * With `join`, requests queued meanwhile join between segments (batch-queue.ts): they run the segments they
 * missed first, then the rest with the batch.
 */
export function runPackedBatch(ctx: PackedContext, reqs: readonly ForwardRequest[], join?: Join): Promise<Array<ForwardResult | Error>> {
  return runMembers(reqs.length, (index) => admit(ctx, index, reqs[index]!), (items) => runItems(ctx, items, join));
}

/** The per-request checks and KV admission of ShardExecutor.forwardNow, for one batch member. */
async function admit(ctx: PackedContext, index: number, req: ForwardRequest): Promise<Item> {
  const held = { startLayer: ctx.startLayer, endLayer: ctx.endLayer };
  const input = checkForwardInput(ctx.config, { ...held, holdsEmbedding: ctx.embed !== null, maxContext: ctx.maxContext }, req);
  const { start, end, seq, position } = input;
  if (seq !== 1 || req.session === undefined) throw new RangeError('a packed batch takes one-row session steps only');
  if (ctx.segments.findIndex((s) => s.start === start) < 0 || ctx.segments.findIndex((s) => s.end === end) < 0) {
    throw layerRangeError(`layers [${start}, ${end}) do not start and end on this shard's graph boundaries`, held);
  }
  const kv = position === 0 ? await ctx.kv.open(req.session, Math.min(ctx.maxContext, Math.max(seq, req.sessionTokens ?? 0))) : ctx.kv.get(req.session);
  if (!kv) throw new PositionMismatchError(req.session, position, 0);
  if (position === 0) for (let l = start; l < end; l++) kv.lengths[l - ctx.startLayer] = 0;
  let actual = Infinity;
  for (let l = start; l < end; l++) actual = Math.min(actual, kv.lengths[l - ctx.startLayer]!);
  for (let l = start; l < end; l++) if (kv.lengths[l - ctx.startLayer] !== position) throw new PositionMismatchError(req.session, position, actual);
  await ctx.kv.ensure(kv, position + seq, Math.max(0, ...kv.lengths));
  return { index, req, input, kv };
}

/**
 * Which layout a batch at `positions` runs in. Per KV row, packed does B
 * queries' dot products and the copies; padded one query's and the copies,
 * over B·(Pmax+1) rows. Padded wins unless the pasts are very uneven.
 */
export function batchLayout(positions: readonly number[]): 'padded' | 'packed' {
  const B = positions.length;
  let total = 0;
  let longest = 0;
  for (const p of positions) {
    total += p;
    longest = Math.max(longest, p);
  }
  return 2 * B * (longest + 1) <= (total + B) * (B + 1) ? 'padded' : 'packed';
}

/** What one segment run feeds besides the hidden rows and the pasts, for a set of items. */
interface Layout {
  positions: number[];
  padded: boolean;
  /** Where item i's past starts, in rows of the fed past tensor. */
  offsets: number[];
  /** Rows of the fed past tensor. */
  total: number;
  /** The batch's leading dims: [B, 1] along the batch axis, or [1, B] along the sequence. */
  lead: number[];
  pastDims: number[];
  shared: Record<string, BackendTensor>;
}

function layoutFor(ctx: PackedContext, items: Item[]): Layout {
  const cfg = ctx.config;
  const { numKvHeads: KV, headDim: D } = cfg;
  const B = items.length;
  const positions = items.map((it) => it.input.position);
  const padded = (ctx.layout === undefined || ctx.layout === 'auto' ? batchLayout(positions) : ctx.layout) === 'padded';
  const offsets: number[] = [];
  let total = 0;
  if (padded) {
    const longest = Math.max(...positions);
    positions.forEach((_, i) => offsets.push(i * longest));
    total = B * longest;
  } else {
    for (const p of positions) {
      offsets.push(total);
      total += p;
    }
  }
  const lead = padded ? [B, 1] : [1, B];
  const cos = new Float32Array(B * D);
  const sin = new Float32Array(B * D);
  positions.forEach((p, i) => {
    const t = ropeTables(ctx.invFreq, p, 1);
    cos.set(t.cos, i * D);
    sin.set(t.sin, i * D);
  });
  const groups = cfg.numHeads / KV;
  const mask = padded ? paddedMask(cfg, ctx.dtype, positions, ctx.scratch) : packedMask(cfg, ctx.dtype, positions, offsets, total, ctx.scratch);
  const shared: Record<string, BackendTensor> = {
    [IO.ropeCos]: { type: 'float32', data: cos, dims: [...lead, 1, D] },
    [IO.ropeSin]: { type: 'float32', data: sin, dims: [...lead, 1, D] },
    [IO.mask]: { type: 'float32', data: mask, dims: padded ? [B, 1, groups, total / B + 1] : [1, 1, groups * B, total + B] },
  };
  return { positions, padded, offsets, total, lead, pastDims: padded ? [B, total / B, KV, D] : [1, total, KV, D], shared };
}

/** The items' input rows [B·hidden]: their token ids through the embedding, or their activations. */
async function inputRows(ctx: PackedContext, items: Item[]): Promise<Float32Array> {
  const B = items.length;
  const h = ctx.config.hiddenSize;
  if (items[0]!.input.kind === 'tokens') {
    const ids = new BigInt64Array(B);
    items.forEach((it, i) => (ids[i] = (it.input as Extract<ForwardInput, { kind: 'tokens' }>).ids[0]!));
    const out = await ctx.embed!.run({ [IO.inputIds]: { type: 'int64', data: ids, dims: [1, B] } });
    return out[IO.hiddenOut]!.data as Float32Array;
  }
  const hidden = new Float32Array(B * h);
  items.forEach((it, i) => hidden.set((it.input as Extract<ForwardInput, { kind: 'activation' }>).data, i * h));
  return hidden;
}

/** Segment `si` for `items` laid out as `lay`: their new KV rows written back, the output rows returned. */
async function runSegment(ctx: PackedContext, items: Item[], lay: Layout, hidden: Float32Array, si: number): Promise<Float32Array> {
  const { numKvHeads: KV, headDim: D, hiddenSize: h } = ctx.config;
  const rowElems = KV * D;
  const { positions, offsets, total, padded } = lay;
  const B = items.length;
  const kvType = ctx.dtype === 'f16' ? 'float16' : 'float32';
  const f16 = ctx.dtype === 'f16';
  // Reused buffers (batch-scratch.ts) hold stale rows: every row is written here, the pasts' and (padded) the zeros after them.
  const pastTensor = (key: string, arrays: Array<Float32Array | Uint16Array>): Float32Array | Uint16Array => {
    const out = ctx.scratch ? ctx.scratch.take(key, total * rowElems, f16) : f16 ? new Uint16Array(total * rowElems) : new Float32Array(total * rowElems);
    arrays.forEach((a, i) => {
      const rows = positions[i]!;
      (out as Float32Array).set((a as Float32Array).subarray(0, rows * rowElems), offsets[i]! * rowElems);
      if (padded) out.fill(0, (offsets[i]! + rows) * rowElems, (offsets[i]! + total / B) * rowElems);
    });
    return out;
  };
  const seg = ctx.segments[si]!;
  const feeds: Record<string, BackendTensor> = { ...lay.shared, [IO.hidden]: { type: 'float32', data: hidden, dims: [...lay.lead, h] } };
  for (let l = seg.start; l < seg.end; l++) {
    const li = l - ctx.startLayer;
    // Keyed by the layer's place in its segment: segments run one after another, so the next reuses these.
    feeds[IO.pastKey(l)] = { type: kvType, data: pastTensor(`k${l - seg.start}`, items.map((it) => it.kv.cache.keys[li]!)), dims: lay.pastDims };
    feeds[IO.pastValue(l)] = { type: kvType, data: pastTensor(`v${l - seg.start}`, items.map((it) => it.kv.cache.values[li]!)), dims: lay.pastDims };
  }
  const out = await seg.session.run(feeds);
  // Present [B,1,kvh,hd] or [1,B,kvh,hd]: row i is item i's either way, as are the hidden rows.
  for (let l = seg.start; l < seg.end; l++) {
    const li = l - ctx.startLayer;
    const k = out[IO.presentKey(l)]!.data as Float32Array;
    const v = out[IO.presentValue(l)]!.data as Float32Array;
    items.forEach((it, i) => {
      (it.kv.cache.keys[li] as Float32Array).set(k.subarray(i * rowElems, (i + 1) * rowElems), positions[i]! * rowElems);
      (it.kv.cache.values[li] as Float32Array).set(v.subarray(i * rowElems, (i + 1) * rowElems), positions[i]! * rowElems);
    });
  }
  return out[IO.hiddenOut]!.data as Float32Array;
}

/**
 * Requests queued since the batch started, admitted to it before segment `si`: each passes the
 * same checks and KV admission as a member (or fails alone), then the admitted ones run segments
 * first…si-1 together, so that they stand where the batch stands.
 */
async function catchUp(ctx: PackedContext, join: Join, items: Item[], first: number, si: number): Promise<{ items: Item[]; joiners: Joiner<ForwardRequest, ForwardResult>[]; hidden: Float32Array } | null> {
  const queued = join(new Set(items.map((it) => it.req.session!)));
  const joiners: Joiner<ForwardRequest, ForwardResult>[] = [];
  const more: Item[] = [];
  for (const j of queued) {
    try {
      more.push(await admit(ctx, -1, j.req));
      joiners.push(j);
    } catch (e) {
      j.reject(e);
    }
  }
  if (more.length === 0) return null;
  try {
    const lay = layoutFor(ctx, more);
    let hidden = await inputRows(ctx, more);
    for (let sj = first; sj < si; sj++) hidden = await runSegment(ctx, more, lay, hidden, sj);
    return { items: more, joiners, hidden };
  } catch (e) {
    for (const j of joiners) j.reject(e);
    throw e;
  }
}

async function runItems(ctx: PackedContext, members: Item[], join?: Join): Promise<ForwardResult[]> {
  const cfg = ctx.config;
  const h = cfg.hiddenSize;
  const { start, end } = members[0]!.input;
  const first = ctx.segments.findIndex((s) => s.start === start);
  const last = ctx.segments.findIndex((s) => s.end === end);
  let items = members;
  const joiners: Joiner<ForwardRequest, ForwardResult>[] = [];
  let hidden: Float32Array;
  try {
    let lay = layoutFor(ctx, items);
    hidden = await inputRows(ctx, items);
    for (let si = first; si <= last; si++) {
      if (join && si > first) {
        const c = await catchUp(ctx, join, items, first, si);
        if (c) {
          items = [...items, ...c.items];
          joiners.push(...c.joiners);
          const merged = new Float32Array(items.length * h);
          merged.set(hidden);
          merged.set(c.hidden, hidden.length);
          hidden = merged;
          // Also a fresh mask: the catch-up's took the scratch buffer this batch's mask was in.
          lay = layoutFor(ctx, items);
        }
      }
      hidden = await runSegment(ctx, items, lay, hidden, si);
    }
  } catch (e) {
    for (const j of joiners) j.reject(e);
    throw e;
  }
  for (const it of items) for (let l = start; l < end; l++) it.kv.lengths[l - ctx.startLayer] = it.input.position + 1;

  let results: ForwardResult[];
  try {
    results = await finish(ctx, items, hidden);
  } catch (e) {
    for (const j of joiners) j.reject(e);
    throw e;
  }
  joiners.forEach((j, i) => j.resolve(results[members.length + i]!));
  return results.slice(0, members.length);
}

/** The batch's answers: tokens through the head when it ends at the last layer, else each item's activation row. */
async function finish(ctx: PackedContext, items: Item[], hidden: Float32Array): Promise<ForwardResult[]> {
  const cfg = ctx.config;
  const h = cfg.hiddenSize;
  const B = items.length;
  if (items[0]!.input.end === cfg.numLayers && ctx.head) {
    const out = await ctx.head.run({ [IO.hidden]: { type: 'float32', data: hidden, dims: [1, B, h] } });
    const all = out[IO.logits]!.data as Float32Array;
    const V = cfg.vocabSize;
    return items.map((it, i) => {
      const logits = all.slice(i * V, (i + 1) * V);
      const { tokenId, logprob } = sampleToken(logits, it.req.sampling ?? {}, it.input.position + 1);
      return { kind: 'token', tokenId, logprob, logits };
    });
  }
  return items.map((_, i) => ({ kind: 'activation', data: hidden.slice(i * h, (i + 1) * h), shape: [1, 1, h] }));
}

/**
 * Additive mask [B, 1, groups, Pmax + 1]: batch row i is open on its first P_i
 * columns (its past, within a sliding window) and on column Pmax (its new row).
 */
function paddedMask(cfg: ModelConfig, dtype: GraphDtype, positions: number[], scratch?: BatchScratch): Float32Array {
  const groups = cfg.numHeads / cfg.numKvHeads;
  const B = positions.length;
  const longest = Math.max(...positions);
  const cols = longest + 1;
  const elems = B * groups * cols;
  const mask = (scratch ? (scratch.take('mask', elems, false) as Float32Array) : new Float32Array(elems)).fill(maskValue(dtype));
  for (let i = 0; i < B; i++) {
    const base = i * groups * cols;
    const row = mask.subarray(base, base + cols);
    const first = cfg.slidingWindow === null ? 0 : Math.max(0, positions[i]! + 1 - cfg.slidingWindow);
    row.fill(0, first, positions[i]!);
    row[longest] = 0;
    for (let g = 1; g < groups; g++) mask.copyWithin(base + g * cols, base, base + cols);
  }
  return mask;
}

/** Additive mask [groups·B, ΣP + B]: row g·B + i is open on session i's past and on its own new column. */
function packedMask(cfg: ModelConfig, dtype: GraphDtype, positions: number[], offsets: number[], total: number, scratch?: BatchScratch): Float32Array {
  const groups = cfg.numHeads / cfg.numKvHeads;
  const B = positions.length;
  const cols = total + B;
  const elems = groups * B * cols;
  const mask = (scratch ? (scratch.take('mask', elems, false) as Float32Array) : new Float32Array(elems)).fill(maskValue(dtype));
  for (let i = 0; i < B; i++) {
    const row = mask.subarray(i * cols, (i + 1) * cols);
    // Sliding window (Mistral, Phi-3): the query at position p sees past keys t > p - window.
    const first = cfg.slidingWindow === null ? 0 : Math.max(0, positions[i]! + 1 - cfg.slidingWindow);
    row.fill(0, offsets[i]! + first, offsets[i]! + positions[i]!);
    row[total + i] = 0;
  }
  for (let g = 1; g < groups; g++) mask.copyWithin(g * B * cols, 0, B * cols);
  return mask;
}
