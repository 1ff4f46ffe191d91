import { describe, expect, it } from 'vitest';
import { MeshError } from '../../src/protocol/errors.ts';
import { sampleToken, type SamplingParams } from '../../src/shard/sampling.ts';
import { checkDraft, proposeFromLogits, speculativeUniform, targetDistribution, verifyDraft, type DraftProposal, type SparseDist } from '../../src/shard/speculative.ts';
import { chiSquareFit, chiSquareTwoSample, gammaQ } from '../helpers/chi-square.ts';

/**
 * A small-vocabulary "model pair" as pure functions of the context: the
 * target's logits and a draft's, different enough that acceptance is far
 * from certain (Σ min(p, q) ≈ 0.6 at T = 0.8), so the rule's rejections and
 * residual draws carry real weight in every distribution checked.
 */
const V = 12;
function mix(h: number, x: number): number {
  h = Math.imul(h ^ x, 0x9e3779b1);
  h ^= h >>> 15;
  h = Math.imul(h, 0x85ebca6b);
  return (h ^ (h >>> 13)) >>> 0;
}
function hashCtx(ctx: readonly number[]): number {
  let h = 0x811c9dc5;
  for (const t of ctx) h = mix(h, t + 1);
  return h;
}
function target(ctx: readonly number[]): Float32Array {
  const out = new Float32Array(V);
  let h = hashCtx(ctx);
  for (let i = 0; i < V; i++) {
    h = mix(h, i);
    out[i] = ((h % 1000) / 1000) * 4 - 2;
  }
  return out;
}
function draft(ctx: readonly number[]): Float32Array {
  const t = target(ctx);
  const out = new Float32Array(V);
  let h = mix(hashCtx(ctx), 77);
  for (let i = 0; i < V; i++) {
    h = mix(h, i);
    out[i] = 0.6 * t[i]! + ((h % 1000) / 1000) * 2.4 - 1.2;
  }
  return out;
}

const PROMPT = [3, 1, 4, 1, 5];

type Drafter = (ctx: number[], k: number, params: SamplingParams) => DraftProposal;

/** Stochastic drafts from `draft`, one proposal per row (k fed + one for the last row). */
const stochastic: Drafter = (ctx, k, params) => {
  const ids: number[] = [];
  const q: SparseDist[] = [];
  for (let r = 0; r <= k; r++) {
    const p = proposeFromLogits(draft([...ctx, ...ids]), params, ctx.length + r);
    ids.push(p.id);
    q.push(p.q);
  }
  return { ids: ids.slice(0, k), next: ids[k]!, q };
};
/** Point-mass drafts: the draft model's greedy tokens. */
const greedyDraft: Drafter = (ctx, k) => {
  const ids: number[] = [];
  for (let r = 0; r < k; r++) ids.push(sampleToken(draft([...ctx, ...ids]), {}, 0).tokenId);
  return { ids };
};

/** A generation of `n` tokens after the prompt, k drafts a trip (kOf: per trip). */
function generate(params: SamplingParams, n: number, kOf: (trip: number) => number, drafter: Drafter): { tokens: number[]; trips: number; drafted: number; accepted: number } {
  const ctx = [...PROMPT];
  let trips = 0;
  let drafted = 0;
  let accepted = 0;
  while (ctx.length - PROMPT.length < n) {
    const k = kOf(trips);
    const d = drafter(ctx, k, params);
    const fed = d.ids;
    expect(fed).toHaveLength(k);
    const v = verifyDraft((r) => target([...ctx, ...fed.slice(0, r)]), d, params, ctx.length, V);
    trips++;
    drafted += k;
    accepted += v.accepted;
    expect(v.tokenIds.length).toBe(v.accepted + 1);
    expect(v.tokenIds.slice(0, v.accepted)).toEqual(fed.slice(0, v.accepted));
    ctx.push(...v.tokenIds);
  }
  return { tokens: ctx.slice(PROMPT.length, PROMPT.length + n), trips, drafted, accepted };
}

function speculationOff(params: SamplingParams, n: number): number[] {
  const ctx = [...PROMPT];
  while (ctx.length - PROMPT.length < n) ctx.push(sampleToken(target(ctx), params, ctx.length).tokenId);
  return ctx.slice(PROMPT.length);
}

/** Exact p at T (f64, as sampling.ts weighs it). */
function exactP(logits: Float32Array, params: SamplingParams): number[] {
  const { order, weights, total } = targetDistribution(logits, params);
  const p = new Array<number>(V).fill(0);
  order.forEach((id, i) => (p[id] = weights[i]! / total));
  return p;
}

describe('verifyDraft: greedy and point-mass drafts are speculation off, token for token', () => {
  it('greedy: every k, the same tokens as plain greedy decoding', () => {
    const off = speculationOff({}, 24);
    for (const k of [1, 2, 4, 8, 16]) expect(generate({}, 24, () => k, greedyDraft).tokens).toEqual(off);
    // And with stochastic proposals (q is ignored at temperature 0).
    expect(generate({}, 24, () => 3, stochastic).tokens).toEqual(off);
  });

  it('temperature 0.8 with top-k/top-p: point-mass drafts give speculation off draw for draw, for every seed', () => {
    for (let seed = 0; seed < 300; seed++) {
      for (const params of [{ temperature: 0.8, seed }, { temperature: 1.3, topK: 5, topP: 0.9, seed }] as SamplingParams[]) {
        const off = speculationOff(params, 12);
        expect(generate(params, 12, (t) => 1 + ((t + seed) % 5), greedyDraft).tokens).toEqual(off);
      }
    }
  });

  it('a matching draft is accepted whole, and the bonus token follows it', () => {
    const off = speculationOff({}, 6);
    const v = verifyDraft((r) => target([...PROMPT, ...off.slice(0, r)]), { ids: off.slice(0, 5) }, {}, PROMPT.length, V);
    expect(v.accepted).toBe(5);
    expect(v.tokenIds).toEqual(off);
    expect(v.logprobs).toHaveLength(6);
    v.logprobs.forEach((lp) => expect(lp).toBeLessThan(0));
  });
});

describe('verifyDraft: stochastic drafts (Leviathan / Chen)', () => {
  const params: SamplingParams = { temperature: 0.8 };
  const N = 10_000;

  it('is reproducible whatever k: each position is a function of (seed, position, context)', () => {
    for (let seed = 0; seed < 200; seed++) {
      const p = { ...params, seed };
      const a = generate(p, 10, () => 1, stochastic).tokens;
      expect(generate(p, 10, () => 4, stochastic).tokens).toEqual(a);
      expect(generate(p, 10, (t) => [7, 2, 5, 1][t % 4]!, stochastic).tokens).toEqual(a);
    }
  });

  it('first step: 10,000 draws fit the target distribution (chi-square), and match speculation off', () => {
    const p0 = exactP(target(PROMPT), params);
    const q0 = exactP(draft(PROMPT), params);
    const overlap = p0.reduce((s, p, i) => s + Math.min(p, q0[i]!), 0);
    const spec = new Array<number>(V).fill(0);
    const off = new Array<number>(V).fill(0);
    let accepted = 0;
    for (let seed = 0; seed < N; seed++) {
      const g = generate({ ...params, seed }, 1, () => 3, stochastic);
      spec[g.tokens[0]!]!++;
      accepted += g.accepted > 0 ? 1 : 0;
      off[sampleToken(target(PROMPT), { ...params, seed: seed + N }, PROMPT.length).tokenId]!++;
    }
    const fit = chiSquareFit(spec, p0);
    expect(fit.df).toBeGreaterThanOrEqual(6);
    expect(fit.pValue).toBeGreaterThan(1e-3);
    expect(chiSquareTwoSample(spec, off).pValue).toBeGreaterThan(1e-3);
    // The first draft is accepted with probability Σ min(p, q) (binomial, 5 sigma).
    const sd = Math.sqrt((overlap * (1 - overlap)) / N);
    expect(Math.abs(accepted / N - overlap)).toBeLessThan(5 * sd);
    expect(overlap).toBeGreaterThan(0.3);
    expect(overlap).toBeLessThan(0.9);
  });

  it('the first two tokens jointly fit p(x1) p(x2 | x1) (accepted drafts and residuals alike)', () => {
    const p0 = exactP(target(PROMPT), params);
    const joint: number[] = [];
    for (let a = 0; a < V; a++) {
      const p1 = exactP(target([...PROMPT, a]), params);
      for (let b = 0; b < V; b++) joint.push(p0[a]! * p1[b]!);
    }
    const counts = new Array<number>(V * V).fill(0);
    for (let seed = 0; seed < N; seed++) {
      const [a, b] = generate({ ...params, seed }, 2, () => 2, stochastic).tokens;
      counts[a! * V + b!]!++;
    }
    expect(chiSquareFit(counts, joint).pValue).toBeGreaterThan(1e-3);
  });

  it('the test has power: taking every draft as it comes (no rule) is rejected', () => {
    const p0 = exactP(target(PROMPT), params);
    const drafts = new Array<number>(V).fill(0);
    for (let seed = 0; seed < N; seed++) drafts[stochastic([...PROMPT], 1, { ...params, seed }).ids[0]!]!++;
    expect(chiSquareFit(drafts, p0).pValue).toBeLessThan(1e-6);
  });

  it('top-k and top-p cut the target before the rule: the output never leaves the cut', () => {
    const cut: SamplingParams = { temperature: 0.8, topK: 4, topP: 0.8 };
    const p0 = exactP(target(PROMPT), cut);
    const counts = new Array<number>(V).fill(0);
    for (let seed = 0; seed < 4000; seed++) counts[generate({ ...cut, seed }, 1, () => 2, stochastic).tokens[0]!]!++;
    counts.forEach((c, i) => {
      if (p0[i] === 0) expect(c).toBe(0);
    });
    expect(chiSquareFit(counts, p0).pValue).toBeGreaterThan(1e-3);
  });
});

describe('speculativeUniform', () => {
  it('three streams apart from the plain sampler, each a function of (seed, position)', () => {
    const u = new Set<number>();
    for (const s of ['draft', 'accept', 'residual'] as const) {
      expect(speculativeUniform(9, s, 17)).toBe(speculativeUniform(9, s, 17));
      u.add(speculativeUniform(9, s, 17));
    }
    expect(u.size).toBe(3);
    // Uniform enough: 10 bins of 20,000 positions.
    const bins = new Array<number>(10).fill(0);
    for (let p = 0; p < 20_000; p++) bins[Math.floor(speculativeUniform(5, 'accept', p) * 10)]!++;
    expect(chiSquareFit(bins, new Array(10).fill(0.1)).pValue).toBeGreaterThan(1e-3);
  });
});

describe('checkDraft refuses bad drafts with 400', () => {
  const bad = (d: DraftProposal, rows: number) => {
    try {
      checkDraft(d, rows, V);
    } catch (e) {
      expect(e).toBeInstanceOf(MeshError);
      expect((e as MeshError).code).toBe('MESH_ERR_BAD_REQUEST');
      return (e as Error).message;
    }
    throw new Error('accepted a bad draft');
  };
  it('lengths, ids, q', () => {
    expect(bad({ ids: [1, 2, 3] }, 3)).toMatch(/needs 4 rows/);
    expect(bad({ ids: [1, V] }, 3)).toMatch(/outside/);
    expect(bad({ ids: [1], next: -1 }, 3)).toMatch(/outside/);
    expect(bad({ ids: [1.5, 2] }, 3)).toMatch(/outside/);
    expect(bad({ ids: new Array(17).fill(1) }, 18)).toMatch(/at most 16/);
    expect(bad({ ids: [1, 2], q: [{ ids: [1], probs: [1] }] }, 3)).toMatch(/one q per/);
    expect(bad({ ids: [1], q: [{ ids: [1, 2], probs: [0.5, 0.4] }] }, 2)).toMatch(/sums to/);
    expect(bad({ ids: [1], q: [{ ids: [2], probs: [1] }] }, 2)).toMatch(/not in the q/);
    expect(bad({ ids: [1], q: [{ ids: [1, 1], probs: [0.5, 0.5] }] }, 2)).toMatch(/twice/);
    expect(bad({ ids: [1], q: [{ ids: [1, 2], probs: [Number.NaN, 1] }] }, 2)).toMatch(/probability/);
    expect(() => checkDraft({ ids: [1], next: 2, q: [{ ids: [1, 3], probs: [0.25, 0.75] }, { ids: [2], probs: [1] }] }, 2, V)).not.toThrow();
    // A prompt chunk carrying drafts: only its last rows are judged.
    expect(() => checkDraft({ ids: [1, 2] }, 9, V)).not.toThrow();
  });
});

describe('chi-square helper', () => {
  it('Q matches known values', () => {
    // P(chi2_1 > 3.841) = 0.05; P(chi2_10 > 18.307) = 0.05; P(chi2_4 > 13.277) = 0.01.
    expect(gammaQ(0.5, 3.841459 / 2)).toBeCloseTo(0.05, 5);
    expect(gammaQ(5, 18.307038 / 2)).toBeCloseTo(0.05, 5);
    expect(gammaQ(2, 13.276704 / 2)).toBeCloseTo(0.01, 5);
  });
});
