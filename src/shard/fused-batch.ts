/**
 * One-row decode steps of several sessions through the fused layer graphs
 * (fused-graph.ts) as ONE batch: GroupQueryAttention takes a batch natively,
 * each row with its own `seqlens_k` (its position), so every session keeps
 * its own rotary position and attends to its own past only.
 *
 * GQA wants the batch's caches as one tensor [B, kvh, capacity, hd], while
 * each session owns its buffers (sized by the KV ledger, kv-ledger.ts). So a
 * batch gathers: per layer, each session's filled rows are copied into a
 * batch buffer (on the device with a device backend: copyBufferToBuffer,
 * never through the CPU), GQA writes the new row of every session in place,
 * and that one row per session is copied back. The gather is ΣP rows per
 * layer — what attention reads anyway — and the projections and MLP read
 * the weights once for B rows, which is where the time goes.
 *
 * Fidelity: rows never mix (GQA bounds each row's attention by its
 * seqlens_k); a wider GEMM may round differently in the last f32 ulps, not
 * enough to change a greedy token (test/shard/fused-batch.test.ts).
 */
import { IO } from '../model/graph.ts';
import { FUSED_IO, HEAD_IO } from '../model/fused-graph.ts';
import type { ModelConfig } from '../model/config.ts';
import { hostData, isDeviceTensor, type BackendTensor, type DeviceMemory, type DeviceTensor, type OnnxSession, type RunValue } from './backend.ts';
import type { ForwardRequest, ForwardResult } from './executor.ts';
import { checkForwardInput, type ForwardInput } from './forward-input.ts';
import type { KvSession } from './kv-store.ts';
import type { KvBuffer, LayerKv } from './layer-kv.ts';
import { runMembers } from './batch-members.ts';
import type { BatchScratch } from './batch-scratch.ts';
import { sampleToken } from './sampling.ts';
import { layerRangeError } from './errors.ts';

export interface FusedBatchContext {
  config: ModelConfig;
  startLayer: number;
  endLayer: number;
  maxContext: number;
  segments: ReadonlyArray<{ start: number; end: number; session: OnnxSession }>;
  embed: OnnxSession | null;
  head: OnnxSession | null;
  device: DeviceMemory | undefined;
  /** Reused gather buffers on a CPU backend (absent: fresh arrays every step). */
  scratch?: BatchScratch;
  /** The executor's admission and position checks for one session step (FusedShardExecutor.reservation). */
  reserve(session: string, start: number, end: number, position: number, seq: number, declared: number | undefined): Promise<KvSession<LayerKv>>;
}

/**
 * Requests that may share a fused batch: a session's one-row step past its
 * first token (a prompt runs alone), same layers, same input kind.
 */
export function fusedBatchKey(req: ForwardRequest, held: { startLayer: number; endLayer: number }): string | undefined {
  if (req.session === undefined || !((req.position ?? 0) > 0)) return undefined;
  const rows = req.tokenIds !== undefined ? req.tokenIds.length : req.activation?.shape[1];
  if (rows !== 1) return undefined;
  return `${req.startLayer ?? held.startLayer}-${req.endLayer ?? held.endLayer}-${req.tokenIds !== undefined ? 'tokens' : 'activation'}`;
}

interface Item {
  index: number;
  req: ForwardRequest;
  input: ForwardInput;
  kv: KvSession<LayerKv>;
}

export function runFusedBatch(ctx: FusedBatchContext, reqs: readonly ForwardRequest[]): Promise<Array<ForwardResult | Error>> {
  const held = { startLayer: ctx.startLayer, endLayer: ctx.endLayer };
  const admit = async (index: number): Promise<Item> => {
    const req = reqs[index]!;
    const input = checkForwardInput(ctx.config, { ...held, holdsEmbedding: ctx.embed !== null, maxContext: ctx.maxContext }, req);
    if (input.seq !== 1 || req.session === undefined) throw new RangeError('a fused batch takes one-row session steps only');
    if (ctx.segments.findIndex((s) => s.start === input.start) < 0 || ctx.segments.findIndex((s) => s.end === input.end) < 0) {
      throw layerRangeError(`layers [${input.start}, ${input.end}) do not start and end on this shard's graph boundaries`, held);
    }
    const kv = await ctx.reserve(req.session, input.start, input.end, input.position, 1, req.sessionTokens);
    return { index, req, input, kv };
  };
  return runMembers(reqs.length, admit, (items) => runItems(ctx, items));
}

async function runItems(ctx: FusedBatchContext, items: Item[]): Promise<ForwardResult[]> {
  const cfg = ctx.config;
  const { numKvHeads: KV, headDim: D, hiddenSize: h } = cfg;
  const B = items.length;
  const { start, end } = items[0]!.input;
  const first = ctx.segments.findIndex((s) => s.start === start);
  const last = ctx.segments.findIndex((s) => s.end === end);
  const positions = items.map((it) => it.input.position);
  const cap = Math.max(...positions) + 1;
  const owned: RunValue[] = [];
  const gathered: KvBuffer[] = [];
  try {
    let hidden: RunValue;
    if (items[0]!.input.kind === 'tokens') {
      const ids = new BigInt64Array(B);
      items.forEach((it, i) => (ids[i] = (it.input as Extract<ForwardInput, { kind: 'tokens' }>).ids[0]!));
      const out = await ctx.embed!.runWith({ [IO.inputIds]: { type: 'int64', data: ids, dims: [B, 1] } });
      hidden = out[IO.hiddenOut]!;
      owned.push(hidden);
    } else {
      const data = new Float32Array(B * h);
      items.forEach((it, i) => data.set((it.input as Extract<ForwardInput, { kind: 'activation' }>).data, i * h));
      hidden = { type: 'float32', data, dims: [B, 1, h] };
    }
    const counters: Record<string, BackendTensor> = {
      [FUSED_IO.seqlensK]: { type: 'int32', data: Int32Array.from(positions), dims: [B] },
      [FUSED_IO.totalSeqLen]: { type: 'int32', data: Int32Array.of(cap), dims: [1] },
    };
    // Per held layer of the call: the batch's key and value buffers, gathered from the sessions'.
    const batchKv = new Map<number, { k: KvBuffer; v: KvBuffer }>();
    for (let l = start; l < end; l++) {
      const i = l - ctx.startLayer;
      const k = await gather(ctx, `k${l}`, items, (s) => s.keys[i]!, positions, cap, KV, D);
      gathered.push(k);
      const v = await gather(ctx, `v${l}`, items, (s) => s.values[i]!, positions, cap, KV, D);
      gathered.push(v);
      batchKv.set(l, { k, v });
    }
    const asValue = (b: KvBuffer): RunValue => (b instanceof Float32Array ? { type: 'float32', data: b, dims: [B, KV, cap, D] } : b);
    for (let si = first; si <= last; si++) {
      const seg = ctx.segments[si]!;
      const feeds: Record<string, RunValue> = { ...counters, [FUSED_IO.hidden]: hidden };
      const outputs: Record<string, RunValue> = {};
      for (let l = seg.start; l < seg.end; l++) {
        const { k, v } = batchKv.get(l)!;
        feeds[FUSED_IO.pastKey(l)] = asValue(k);
        feeds[FUSED_IO.pastValue(l)] = asValue(v);
        outputs[FUSED_IO.presentKey(l)] = asValue(k);
        outputs[FUSED_IO.presentValue(l)] = asValue(v);
      }
      const out = await seg.session.runWith(feeds, outputs);
      hidden = out[FUSED_IO.hiddenOut]!;
      owned.push(hidden);
    }
    // The new row of each session back into its own buffers; lengths move once every layer has it.
    for (let l = start; l < end; l++) {
      const i = l - ctx.startLayer;
      const { k, v } = batchKv.get(l)!;
      scatterRow(ctx, items, k, (s) => s.keys[i]!, positions, cap, KV, D);
      scatterRow(ctx, items, v, (s) => s.values[i]!, positions, cap, KV, D);
    }
    for (const it of items) for (let l = start; l < end; l++) it.kv.lengths[l - ctx.startLayer] = it.input.position + 1;

    if (end === cfg.numLayers && ctx.head) {
      const out = await ctx.head.runWith({ [HEAD_IO.hidden]: hidden });
      owned.push(out[HEAD_IO.logits]!); // on the device (the head keeps them there): freed below
      const all = (await hostData(out[HEAD_IO.logits]!)) as Float32Array;
      const V = cfg.vocabSize;
      return items.map((it, i) => {
        const logits = all.slice(i * V, (i + 1) * V);
        const { tokenId, logprob } = sampleToken(logits, it.req.sampling ?? {}, it.input.position + 1);
        return { kind: 'token', tokenId, logprob, logits };
      });
    }
    const data = (await hostData(hidden)) as Float32Array;
    return items.map((_, i) => ({ kind: 'activation', data: data.slice(i * h, (i + 1) * h), shape: [1, 1, h] }));
  } finally {
    for (const t of owned) if (isDeviceTensor(t)) t.dispose();
    for (const b of gathered) if (!(b instanceof Float32Array)) b.dispose();
  }
}

/**
 * [B, kvh, cap, hd] holding each session's first P_i rows of every head.
 * On a CPU backend the buffer may be a reused one (`key`: one per layer, all
 * alive during the step) whose rows past P_i hold an earlier step's data:
 * GQA reads row i only up to its seqlens_k, so they are never read.
 */
async function gather(ctx: FusedBatchContext, key: string, items: Item[], pick: (c: LayerKv) => KvBuffer, positions: number[], cap: number, KV: number, D: number): Promise<KvBuffer> {
  const B = items.length;
  if (!ctx.device) {
    const n = B * KV * cap * D;
    const out = ctx.scratch ? (ctx.scratch.take(key, n, false) as Float32Array) : new Float32Array(n);
    items.forEach((it, b) => {
      const src = pick(it.kv.cache) as Float32Array;
      const c = it.kv.cache.capacity;
      for (let hh = 0; hh < KV; hh++) out.set(src.subarray(hh * c * D, (hh * c + positions[b]!) * D), (b * KV + hh) * cap * D);
    });
    return out;
  }
  const out = await ctx.device.alloc('float32', [B, KV, cap, D]);
  const ops: Array<{ src: DeviceTensor; srcByte: number; dst: DeviceTensor; dstByte: number; bytes: number }> = [];
  items.forEach((it, b) => {
    const c = it.kv.cache.capacity;
    if (positions[b]! === 0) return;
    for (let hh = 0; hh < KV; hh++) ops.push({ src: pick(it.kv.cache) as DeviceTensor, srcByte: hh * c * D * 4, dst: out, dstByte: (b * KV + hh) * cap * D * 4, bytes: positions[b]! * D * 4 });
  });
  if (ops.length > 0) ctx.device.copy(ops);
  return out;
}

/** Row P_i of every head of batch entry i back into session i's buffer. */
function scatterRow(ctx: FusedBatchContext, items: Item[], from: KvBuffer, pick: (c: LayerKv) => KvBuffer, positions: number[], cap: number, KV: number, D: number): void {
  if (from instanceof Float32Array) {
    items.forEach((it, b) => {
      const dst = pick(it.kv.cache) as Float32Array;
      const c = it.kv.cache.capacity;
      const p = positions[b]!;
      for (let hh = 0; hh < KV; hh++) dst.set(from.subarray(((b * KV + hh) * cap + p) * D, ((b * KV + hh) * cap + p + 1) * D), (hh * c + p) * D);
    });
    return;
  }
  const ops: Array<{ src: DeviceTensor; srcByte: number; dst: DeviceTensor; dstByte: number; bytes: number }> = [];
  items.forEach((it, b) => {
    const c = it.kv.cache.capacity;
    const p = positions[b]!;
    for (let hh = 0; hh < KV; hh++) ops.push({ src: from, srcByte: ((b * KV + hh) * cap + p) * D * 4, dst: pick(it.kv.cache) as DeviceTensor, dstByte: (hh * c + p) * D * 4, bytes: D * 4 });
  });
  ctx.device!.copy(ops);
}

