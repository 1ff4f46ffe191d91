/**
 * Lying modes for tests (docs/verification.md): a span executor or weight
 * loader wrapped to answer wrong. Test code only — nothing in src/ imports
 * this, the CLI cannot reach it (test/cli/fault-hooks.test.ts proves both);
 * a test starts a lying node through test/helpers/lying-node.ts.
 *
 *   noise         every output row + Gaussian noise of σ = 1 % of the row's RMS (a last hop: of its logits)
 *   zero          every output row zeroed (a last hop: samples from zero logits)
 *   wrong-layers  layer l computed with layer l+1's weights (the right computation on the wrong layers)
 *   tampered      every weight of the span with 1 % relative noise (a corrupted download, a tampered file)
 *   q4-as-f32     4-bit weights (quantized, dequantized) while the node announces f32
 *   one-in-20     noise on 1 step in 20 (of every session)
 *   honest-then-noise  honest for the first `honestSessions` sessions, then noise on every step
 *   second-best   a last hop answers the second-best token
 */
import type { WeightSource } from '../../src/model/graph.ts';
import { dequantizeQ4, quantizeQ4 } from '../../src/model/quantize.ts';
import { FUSED_Q4_SCHEME } from '../../src/model/fused-graph.ts';
import type { ForwardRequest, ForwardResult } from '../../src/shard/contract.ts';
import { logSoftmaxAt, sampleToken } from '../../src/shard/sampling.ts';
import { mulberry32 } from '../../src/model/fixture.ts';

export const LYING_MODES = ['noise', 'zero', 'wrong-layers', 'tampered', 'q4-as-f32', 'one-in-20', 'honest-then-noise', 'second-best'] as const;
export type LyingMode = (typeof LYING_MODES)[number];

export interface FaultOptions {
  mode: LyingMode;
  /** honest-then-noise: sessions served honestly first. @defaultValue 12 */
  honestSessions?: number;
  /** The model's layer count (wrong-layers keeps the last layer in range). */
  numLayers: number;
  seed?: number;
  /** Called at the first lie an output mode tells (weight modes lie from the start). */
  onFirstLie?: () => void;
}


function gaussian(r: () => number): number {
  return Math.sqrt(-2 * Math.log(1 - r())) * Math.cos(2 * Math.PI * r());
}

export function addNoise(rows: Float32Array, hidden: number, rel: number, r: () => number): Float32Array {
  const out = new Float32Array(rows.length);
  for (let i = 0; i + hidden <= rows.length; i += hidden) {
    let ss = 0;
    for (let k = 0; k < hidden; k++) ss += rows[i + k]! ** 2;
    const sigma = rel * Math.sqrt(ss / hidden);
    for (let k = 0; k < hidden; k++) out[i + k] = rows[i + k]! + sigma * gaussian(r);
  }
  return out;
}

/** The weight loader a lying node loads its span through (wrong layers, tampered, 4-bit). */
export function lyingWeights(src: WeightSource, o: FaultOptions): WeightSource {
  if (o.mode === 'wrong-layers') {
    return (name) => {
      const m = /^model\.layers\.(\d+)\.(.*)$/.exec(name);
      if (!m) return src(name);
      return src(`model.layers.${Math.min(o.numLayers - 1, Number(m[1]) + 1)}.${m[2]}`);
    };
  }
  if (o.mode === 'tampered' || o.mode === 'q4-as-f32') {
    const cache = new Map<string, { shape: readonly number[]; data: Float32Array }>();
    return (name) => {
      const w = src(name);
      const layerWeight = /^model\.layers\.\d+\./.test(name);
      if (!layerWeight || w.shape.length !== 2) return w;
      let t = cache.get(name);
      if (!t) {
        if (o.mode === 'q4-as-f32') {
          if (!/_proj\.weight$/.test(name)) return w;
          t = { shape: w.shape, data: dequantizeQ4(quantizeQ4(w.data, w.shape[0]!, w.shape[1]!, FUSED_Q4_SCHEME)) };
        } else {
          const r = mulberry32(name.length * 7919 + (o.seed ?? 1));
          t = { shape: w.shape, data: Float32Array.from(w.data, (x) => x * (1 + 0.01 * gaussian(r))) };
        }
        cache.set(name, t);
      }
      return t;
    };
  }
  return src;
}

/** The span executor's forward wrapped to lie on its answers (output modes). */
export function lyingForward<E extends { forward(req: ForwardRequest): Promise<ForwardResult>; config: { hiddenSize: number } }>(ex: E, o: FaultOptions): (req: ForwardRequest) => Promise<ForwardResult> {
  const r = mulberry32(o.seed ?? 7);
  const hidden = ex.config.hiddenSize;
  const sessions = new Set<string>();
  let steps = 0;
  let lied = false;
  return async (req) => {
    const res = await ex.forward(req);
    if (req.session && req.position === 0) sessions.add(req.session);
    // Only calls that carry a session (a real step): a stateless call is someone checking, and an honest liar answers those right.
    if (!req.session) return res;
    let lie: boolean;
    switch (o.mode) {
      case 'noise':
      case 'zero':
      case 'second-best':
        lie = true;
        break;
      case 'one-in-20':
        lie = ++steps % 20 === 0;
        break;
      case 'honest-then-noise':
        lie = sessions.size > (o.honestSessions ?? 12);
        break;
      default:
        lie = false;
    }
    if (!lie) return res;
    if (!lied) {
      lied = true;
      o.onFirstLie?.();
    }
    if (res.kind === 'activation') {
      if (o.mode === 'zero') return { ...res, data: new Float32Array(res.data.length) };
      if (o.mode === 'second-best') return res;
      return { ...res, data: addNoise(res.data, hidden, 0.01, r) };
    }
    if (res.kind !== 'token') return res;
    // A last hop answers a token: its lies are in the logits it samples from (noise, zeros) or in the pick (second-best).
    if (res.logits.length === 0) return res;
    const position = (req.position ?? 0) + (req.activation?.shape[1] ?? req.tokenIds?.length ?? 1);
    if (o.mode === 'second-best') {
      let best = 0;
      let second = -1;
      for (let i = 1; i < res.logits.length; i++) if (res.logits[i]! > res.logits[best]!) best = i;
      for (let i = 0; i < res.logits.length; i++) if (i !== best && (second < 0 || res.logits[i]! > res.logits[second]!)) second = i;
      return { ...res, tokenId: second, logprob: logSoftmaxAt(res.logits, second) };
    }
    const logits = o.mode === 'zero' ? new Float32Array(res.logits.length) : addNoise(res.logits, res.logits.length, 0.01, r);
    const picked = sampleToken(logits, req.sampling ?? {}, position);
    return { ...res, tokenId: picked.tokenId, logprob: picked.logprob, logits };
  };
}
