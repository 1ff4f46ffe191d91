/**
 * One spot-check from end to end in one process, on real executors
 * (fortunes-tiny, onnxruntime-node): a hop runs a session step by step and
 * attests it, the head's Verifier asks a planned checker (`POST /check`, the
 * real handler) to recompute it in one prefill, asks the arbiter on a
 * mismatch, and the tracker's judge decides from the signed evidence alone.
 * Honest hops pass; a hop adding 1 % noise is found lying; a checker adding
 * noise is itself found lying and the honest hop is not accused; evidence a
 * head altered is refused.
 */
import { beforeAll, describe, expect, it } from 'vitest';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { Identity, verifyEd25519 } from '../../src/net/identity.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import { collectBody, type MeshReply, type MeshRequest } from '../../src/protocol/envelopes.ts';
import { decodeTensor, encodeTensor } from '../../src/protocol/tensor.ts';
import { ShardExecutor } from '../../src/shard/executor.ts';
import { Attestor } from '../../src/verify/attestor.ts';
import { tokenBytes } from '../../src/verify/attest.ts';
import { judgeReport, type CheckReport, type Verdict } from '../../src/verify/evidence.ts';
import type { CheckPlan, PlanPeer } from '../../src/verify/plan.ts';
import { signPlan } from '../../src/tracker/verify/planner.ts';
import { createCheckHandler, type CheckExecutor } from '../../src/node/verify/check-handler.ts';
import { Verifier, type FinishedGeneration, type FinishedSpan } from '../../src/node/verify/verifier.ts';
import { fortunesTiny, FORTUNES_DIR } from '../helpers/fortunes-tiny.ts';
import { weightsFromFiles } from '../helpers/weights.ts';
import { nodeBackend } from '../helpers/shard.ts';

const { cfg, tok } = fortunesTiny();
const weights = weightsFromFiles(new Map([['model.safetensors', new Uint8Array(readFileSync(join(FORTUNES_DIR, 'model.safetensors')))]]));
const H = cfg.hiddenSize;
const L = cfg.numLayers;
const MODEL = 'fortunes-tiny';

/** A checker's span executor (its forward answers the logits of chosen rows at the last layer). */
function checkExecutor(start: number, end: number): Promise<CheckExecutor> {
  return ShardExecutor.create({ config: cfg, backend: nodeBackend, weights: () => weights, startLayer: start, endLayer: end, maxContext: 512 });
}

let tracker: Identity;
let head: Identity;
let hop: Identity;
const checkers: Identity[] = [];
const peerOf = (id: Identity, format: 'f32' | 'q4' = 'f32'): PlanPeer => ({ peer_id: id.peerId, public_key: encodeBase64Url(id.publicKey), format, backend: 'onnxruntime-node' });

beforeAll(async () => {
  tracker = await Identity.generate();
  head = await Identity.generate();
  hop = await Identity.generate();
  for (let i = 0; i < 3; i++) checkers.push(await Identity.generate());
}, 60_000);

type Lie = (rows: Float32Array) => Float32Array;
const noise: Lie = (rows) => {
  const out = Float32Array.from(rows);
  let seed = 1;
  for (let r = 0; r < rows.length / H; r++) {
    let ss = 0;
    for (let i = 0; i < H; i++) ss += rows[r * H + i]! ** 2;
    const rms = Math.sqrt(ss / H);
    for (let i = 0; i < H; i++) {
      seed = (seed * 1103515245 + 12345) >>> 0;
      out[r * H + i] = rows[r * H + i]! + 0.01 * rms * ((seed / 4294967296) * 2 - 1) * Math.sqrt(3);
    }
  }
  return out;
};

interface Run {
  verdicts: Verdict[];
  events: unknown[];
  report?: CheckReport;
}

/**
 * A generation of `steps` (the prompt, then one row a step) through a hop on [start, end), checked
 * by `checkerIds` in order; `hopLie` alters the hop's answers, `checkerLie` the first checker's.
 */
async function run(start: number, end: number, opts: { hopLie?: Lie; checkerLie?: Lie; secondBest?: boolean; temperature?: number; prompt?: string } = {}): Promise<Run> {
  const last = end === L;
  const session = `gen-1.${Math.random().toString(36).slice(2)}`;
  const sampling = JSON.stringify({ temperature: opts.temperature ?? 0, top_p: 1, top_k: 0, ...(opts.temperature ? { seed: 3 } : {}) });
  const prompt = tok.encodeChat([{ role: 'user', content: opts.prompt ?? 'Tell me a fortune about checks.' }]);
  const upstream = await ShardExecutor.create({ config: cfg, backend: nodeBackend, weights: () => weights, startLayer: 0, endLayer: start, maxContext: 512 });
  const span = await ShardExecutor.create({ config: cfg, backend: nodeBackend, weights: () => weights, startLayer: start, endLayer: end, maxContext: 512 });
  const attestor = new Attestor({ peerId: hop.peerId, sign: (b) => hop.sign(b) });
  const scope = { model: MODEL, session, startLayer: start, endLayer: end, dtype: 'bf16', ...(last ? { sampling } : {}) };
  const steps: number[] = [];
  const ins: Uint8Array[] = [];
  const outs: Uint8Array[] = [];
  const tokens: Array<{ tokenId: number; logprob: number }> = [];
  let ids = prompt;
  let pos = 0;
  const follow = [17, 230, 9, 400, 55, 71, 8, 1000];
  for (let s = 0; s <= follow.length; s++) {
    const up = await upstream.forward({ session, position: pos, tokenIds: ids, ...(pos === 0 ? { sessionTokens: prompt.length + 16 } : {}) });
    if (up.kind !== 'activation') throw new Error('upstream answered a token');
    const input = encodeTensor(up.data, 'bf16');
    const r = await span.forward({ session, position: pos, activation: { data: decodeTensor(input, 'bf16'), shape: [1, ids.length, H] }, ...(last ? { sampling: JSON.parse(sampling.replace('top_p', 'topP').replace('top_k', 'topK')) } : {}) });
    let output: Uint8Array;
    if (r.kind === 'token') {
      let id = r.tokenId;
      if (opts.secondBest) {
        const l = Float32Array.from(r.logits);
        l[id] = -Infinity;
        id = l.indexOf(Math.max(...l));
      }
      tokens.push({ tokenId: id, logprob: r.logprob });
      output = tokenBytes(id, r.logprob);
    } else output = encodeTensor(opts.hopLie ? opts.hopLie(r.data) : r.data, 'bf16');
    attestor.record(scope, pos, ids.length, input, output);
    steps.push(ids.length);
    ins.push(input);
    outs.push(output);
    pos += ids.length;
    ids = [follow[s] ?? 1];
  }
  await upstream.release();
  await span.release();
  const attestation = await attestor.finish(session);

  const plan: CheckPlan = { head: head.peerId, model: MODEL, generation: 'gen-1', expires_at: Date.now() + 60_000, checks: [{ peer: peerOf(hop), start_layer: start, end_layer: end, checkers: checkers.map((c) => peerOf(c)) }] };
  const signed = await signPlan(tracker, plan);
  const handlers = new Map<string, (req: MeshRequest) => Promise<{ status: number; headers: Record<string, string>; body: Uint8Array | AsyncIterable<Uint8Array> }>>();
  for (const [i, c] of checkers.entries()) {
    const ex = await checkExecutor(start, end);
    const lie = i === 0 ? opts.checkerLie : undefined;
    const lying: CheckExecutor = lie
      ? { ...ex, config: ex.config, startLayer: ex.startLayer, endLayer: ex.endLayer, forward: async (req) => { const r = await ex.forward(req); return r.kind === 'activation' ? { ...r, data: lie(r.data) } : r; } }
      : ex;
    handlers.set(c.peerId, createCheckHandler({ peerId: c.peerId, model: MODEL, executor: () => lying, trackerKey: () => tracker.publicKey, sign: (b) => c.sign(b), verify: verifyEd25519 }));
  }
  const out: Run = { verdicts: [], events: [] };
  const verifier = new Verifier({
    peerId: head.peerId,
    transport: {
      async send(h, req): Promise<MeshReply> {
        const res = await handlers.get(h.peer_id)!({ method: req.method, path: req.path, headers: req.headers ?? {}, body: req.body ?? new Uint8Array(0) });
        return { status: res.status, headers: res.headers, body: await collectBody(res.body) };
      },
    },
    verify: verifyEd25519,
    async report(r) {
      out.report = r;
      const v = await judgeReport(r, { trackerKeys: [tracker.publicKey], now: Date.now(), verify: verifyEd25519 });
      out.verdicts.push(v);
      return v;
    },
    onEvent: (e) => out.events.push(e),
  });
  const all = (parts: Uint8Array[]) => {
    const b = new Uint8Array(parts.reduce((n, p) => n + p.byteLength, 0));
    let o = 0;
    for (const p of parts) {
      b.set(p, o);
      o += p.byteLength;
    }
    return b;
  };
  const fin: FinishedSpan = {
    peer: hop.peerId,
    start,
    end,
    input: all(ins),
    inputRowBytes: H * 2,
    output: last ? { kind: 'tokens', tokens } : { kind: 'rows', bytes: all(outs), rowBytes: H * 2 },
    ...(attestation ? { attestation } : {}),
  };
  const gen: FinishedGeneration = { plan: { ...signed, plan }, session, steps, spans: [fin], dtype: 'bf16', hidden: H, sampling };
  verifier.finished(gen);
  await verifier.idle();
  return out;
}

describe('a spot-check, end to end in one process', () => {
  it('an honest middle hop passes: the tracker recomputes the distance from the signed rows', async () => {
    const r = await run(1, 3);
    expect(r.events).toHaveLength(1);
    expect(r.verdicts).toHaveLength(1);
    expect(r.verdicts[0]).toMatchObject({ outcome: 'pass', checked: hop.peerId, kind: 'rows', steps: 9 });
    expect(r.verdicts[0]!.distance.checker).toBeLessThan(r.verdicts[0]!.threshold / 10);
    expect(r.verdicts[0]!.compared).toBe(9);
    expect(r.report!.checks).toHaveLength(1); // no mismatch, no arbiter
  }, 60_000);

  it('a hop adding 1 % noise is found lying by checker and arbiter', async () => {
    const r = await run(1, 3, { hopLie: noise });
    const v = r.verdicts[0]!;
    expect(v.outcome).toBe('offence');
    expect(v.guilty).toBe(hop.peerId);
    expect(v.distance.checker).toBeGreaterThan(v.threshold);
    expect(v.distance.arbiter).toBeGreaterThan(v.threshold);
    expect(v.distance.between).toBeLessThan(v.threshold);
  }, 60_000);

  it('a lying checker does not get an honest hop accused: the arbiter sides with the hop, the checker is found lying', async () => {
    const r = await run(1, 3, { checkerLie: noise });
    const v = r.verdicts[0]!;
    expect(v.outcome).toBe('checker-offence');
    expect(v.guilty).toBe(checkers[0]!.peerId);
  }, 60_000);

  it('an honest last hop passes at temperature 0 and at 0.8; one that picks the second-best token is found lying', async () => {
    expect((await run(3, L)).verdicts[0]).toMatchObject({ outcome: 'pass', kind: 'tokens' });
    expect((await run(3, L, { temperature: 0.8 })).verdicts[0]).toMatchObject({ outcome: 'pass', kind: 'tokens' });
    const lie = (await run(3, L, { secondBest: true })).verdicts[0]!;
    expect(lie).toMatchObject({ outcome: 'offence', guilty: hop.peerId });
  }, 120_000);

  it('a check longer than one run is computed in chunks on a temporary session, and still agrees to the rounding (rows and tokens)', async () => {
    const long = Array.from({ length: 40 }, (_, i) => `Fortune number ${i} says the checks are long.`).join(' ');
    const mid = await run(1, 3, { prompt: long });
    expect(mid.verdicts[0]).toMatchObject({ outcome: 'pass' });
    expect(mid.verdicts[0]!.rows).toBeGreaterThan(256);
    expect(mid.verdicts[0]!.distance.checker).toBeLessThan(mid.verdicts[0]!.threshold / 3);
    expect((await run(3, L, { prompt: long })).verdicts[0]).toMatchObject({ outcome: 'pass', kind: 'tokens' });
    expect((await run(1, 3, { prompt: long, hopLie: noise })).verdicts[0]).toMatchObject({ outcome: 'offence' });
  }, 120_000);

  it('refuses evidence a head altered: a sample that is not what the hop signed, a hash list changed, a replayed plan for another head', async () => {
    const r = await run(1, 3, { hopLie: noise });
    const judge = (edit: (x: CheckReport) => void) => {
      const copy = structuredClone(r.report!);
      edit(copy);
      return judgeReport(copy, { trackerKeys: [tracker.publicKey], now: Date.now(), verify: verifyEd25519 });
    };
    await expect(judge(() => undefined)).resolves.toMatchObject({ outcome: 'offence' });
    await expect(judge((x) => (x.samples[0]!.claim = x.samples[0]!.checks[0]!))).rejects.toMatchObject({ code: 'MESH_ERR_FORBIDDEN' });
    await expect(judge((x) => (x.claim.outputs[0] = x.checks[0]!.outputs[0]!))).rejects.toMatchObject({ code: 'MESH_ERR_UNAUTHORIZED' });
    await expect(judge((x) => (x.head = checkers[2]!.peerId))).rejects.toMatchObject({ code: 'MESH_ERR_FORBIDDEN' });
    await expect(judge((x) => (x.checks[1]!.peer_id = x.checks[0]!.peer_id))).rejects.toMatchObject({ code: 'MESH_ERR_FORBIDDEN' });
  }, 60_000);
});
