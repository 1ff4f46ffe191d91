/**
 * Shared by the batching suites (onnxruntime-node and WASM here, WebGPU in
 * Node in test/gpu): sessions at different positions stepped together
 * through a chain of hops, every step checked against the float64 reference.
 */
import { expect } from 'vitest';
import type { WeightSource } from '../../src/model/graph.ts';
import { ReferenceModel, newRefCache, type RefKvCache } from '../../src/model/reference.ts';
import type { ForwardResult } from '../../src/shard/contract.ts';
import type { Runner } from './fused.ts';
import { maxAbsDiff, prompts, type Fixture } from './shard.ts';

/** Each hop's forward; the first takes token ids, the last answers a token. */
export type Hops = readonly Runner[];

async function through(hops: Hops, session: string, position: number, ids: number[]): Promise<Extract<ForwardResult, { kind: 'token' }>> {
  let r = await hops[0]!.forward({ session, position, tokenIds: ids });
  for (const hop of hops.slice(1)) {
    if (r.kind !== 'activation') throw new Error('expected an activation');
    r = await hop.forward({ session, position, activation: { data: r.data, shape: r.shape } });
  }
  if (r.kind !== 'token') throw new Error('expected a token');
  return r;
}

/**
 * Prompts of different lengths, prefilled one by one, then `steps` decode
 * steps where every session's step is submitted to a hop at once (all but
 * the first queue, and run as one batch when the hop frees). Every step's
 * logits are checked against the reference on `weights` (relative to their
 * scale); returns each session's greedy tokens. With `together` false every
 * step is awaited before the next is submitted: each session runs alone
 * (batches of one), the reference a batched run's tokens are compared with.
 */
export async function decodeTogether(f: Fixture, weights: WeightSource, hops: Hops, sessions: number, steps: number, tol: number, tag = 's', together = true): Promise<number[][]> {
  const V = f.cfg.vocabSize;
  const ps = prompts(V, sessions, 7);
  const ref = new ReferenceModel(f.cfg, weights);
  const caches: RefKvCache[] = ps.map(() => newRefCache(f.cfg));
  const close = (got: ArrayLike<number>, want: ArrayLike<number>, what: string) => {
    const { err, scale } = maxAbsDiff(got, want);
    expect(err, `${what}: max abs error ${err} vs scale ${scale}`).toBeLessThanOrEqual(tol * scale);
  };
  const tokens: number[][] = ps.map(() => []);
  const pos = ps.map((p) => p.length);
  for (let s = 0; s < sessions; s++) {
    const r = await through(hops, `${tag}${s}`, 0, ps[s]!);
    close(r.logits, ref.forward(ps[s]!, 0, caches[s]!).subarray((ps[s]!.length - 1) * V), `prefill ${s}`);
    tokens[s]!.push(r.tokenId);
  }
  for (let t = 0; t < steps; t++) {
    if (!together) {
      for (let s = 0; s < sessions; s++) {
        const o = await through(hops, `${tag}${s}`, pos[s]!, [tokens[s]!.at(-1)!]);
        close(o.logits, ref.forward([tokens[s]!.at(-1)!], pos[s]!, caches[s]!), `session ${s} step ${t} alone`);
        tokens[s]!.push(o.tokenId);
        pos[s]!++;
      }
      continue;
    }
    let outs: ForwardResult[] = await Promise.all(tokens.map((tk, s) => hops[0]!.forward({ session: `${tag}${s}`, position: pos[s]!, tokenIds: [tk.at(-1)!] })));
    for (const hop of hops.slice(1)) {
      outs = await Promise.all(
        outs.map((o, s) => {
          if (o.kind !== 'activation') throw new Error('expected an activation');
          return hop.forward({ session: `${tag}${s}`, position: pos[s]!, activation: { data: o.data, shape: o.shape } });
        }),
      );
    }
    outs.forEach((o, s) => {
      if (o.kind !== 'token') throw new Error('expected a token');
      close(o.logits, ref.forward([tokens[s]!.at(-1)!], pos[s]!, caches[s]!), `session ${s} step ${t}`);
      tokens[s]!.push(o.tokenId);
      pos[s]!++;
    });
  }
  return tokens;
}
