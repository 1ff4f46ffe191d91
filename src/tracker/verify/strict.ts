/**
 * Strict mode (`verification: "strict"`, docs/verification.md): every step
 * of a generation is computed on two routes that share no node, and a token
 * is released only when both produced it. A disagreement goes to a third
 * route, disjoint from both, which computes that one step from the agreed
 * tokens (one prefill); its answer is the majority, and the route that lost
 * goes on from the agreed tokens on a route without its nodes (the tracker
 * also checks every node of both routes at their next session). No third
 * route: the generation ends with an error rather than an unverified token.
 *
 * The cost: twice the compute of the mesh for the generation, each token as
 * late as the slower route, plus one prefill per disagreement (greedy
 * decoding on honest nodes never disagrees with f32 on the wire; bf16 may at
 * a near-tie). Sampling is kept reproducible across routes by a seed (one is
 * chosen when the request gave none).
 */
import type { Logger } from 'pino';
import { MeshError } from '../../protocol/errors.ts';
import type { Lease } from '../admission.ts';
import { runGeneration, type GenerationDeps, type GenerationEvent, type GenerationInput } from '../head-proxy.ts';

type Symbol = { kind: 'token'; tokenId: number; text: string } | { kind: 'end'; finish: 'stop' | 'length'; promptTokens: number };

/** One route's stream as symbols: tokens, then its end. */
class Side {
  promptTokens = 0;
  verification: string | undefined;
  /** The nodes of the route this side runs on now (a failover moves it). */
  nodes = new Set<string>();
  gen!: AsyncGenerator<GenerationEvent>;
  constructor(readonly name: string) {}

  async next(): Promise<Symbol> {
    for (;;) {
      const r = await this.gen.next();
      if (r.done) throw new MeshError('MESH_ERR_UPSTREAM', `route ${this.name} ended without a result`);
      const ev = r.value;
      if (ev.type === 'start') {
        this.promptTokens = ev.promptTokens;
        if (ev.verification) this.verification = ev.verification;
        continue;
      }
      if (ev.type === 'token') return { kind: 'token', tokenId: ev.tokenId, text: ev.text };
      if (ev.verification) this.verification = ev.verification;
      return { kind: 'end', finish: ev.finish, promptTokens: ev.promptTokens };
    }
  }

  async close(): Promise<void> {
    await this.gen.return(undefined);
  }
}

function same(a: Symbol, b: Symbol): boolean {
  return a.kind === b.kind && (a.kind === 'token' ? a.tokenId === (b as { tokenId: number }).tokenId : a.finish === (b as { finish: string }).finish);
}

export interface StrictStats {
  /** Tokens released with both routes agreeing. */
  agreed: number;
  /** Steps where the routes disagreed and a third route decided. */
  disputes: number;
  /** The verification records of every route that took part. */
  records: string[];
}

/**
 * The generation, strictly: GenerationEvents as runGeneration yields them,
 * each token agreed by two disjoint routes. `leases`: one per route (the
 * second's route shares no node with the first's).
 */
export async function* runStrict(deps: GenerationDeps & { logger: Logger }, model: string, input: GenerationInput, signal: AbortSignal, leases: [Lease, Lease], stats: StrictStats): AsyncGenerator<GenerationEvent> {
  const seeded: GenerationInput = input.temperature > 0 && input.seed === undefined ? { ...input, seed: Math.floor(Math.random() * 2 ** 31) } : input;
  const nodesOf = (l: Lease) => new Set(l.plan.hops.map((h) => h.id));
  const open = (name: string, lease: Lease | undefined, exclude: ReadonlySet<string>, prefix: readonly number[]) => {
    const side = new Side(name);
    if (lease) side.nodes = nodesOf(lease);
    side.gen = runGeneration(deps, model, seeded, signal, lease, { exclude, prefix, audit: false, onAttempt: (n) => (side.nodes = new Set(n)) });
    return side;
  };
  let a = open('A', leases[0], nodesOf(leases[1]), []);
  let b = open('B', leases[1], nodesOf(leases[0]), []);
  const tokens: number[] = [];
  let started = false;
  const log = deps.logger.child({ model, strict: true });
  const record = (s: Side) => {
    if (s.verification && !stats.records.includes(s.verification)) stats.records.push(s.verification);
  };
  try {
    for (;;) {
      const [sa, sb] = await Promise.all([a.next(), b.next()]);
      record(a);
      record(b);
      if (!started) {
        started = true;
        yield { type: 'start', promptTokens: a.promptTokens || b.promptTokens };
      }
      let agreed: Symbol;
      if (same(sa, sb)) {
        agreed = sa;
        stats.agreed += sa.kind === 'token' ? 1 : 0;
      } else {
        // A third route, sharing no node with either, computes this one step from the agreed tokens.
        stats.disputes++;
        log.warn({ index: tokens.length, a: sa, b: sb }, 'strict mode: the two routes disagree; a third route decides');
        const both = new Set([...a.nodes, ...b.nodes]);
        const third = open('C', undefined, both, tokens);
        let sc: Symbol;
        try {
          sc = await third.next();
          record(third);
        } catch (e) {
          throw new MeshError('MESH_ERR_UPSTREAM', `strict mode: the two routes disagree at token ${tokens.length} and no third route could decide (${(e as Error).message})`);
        } finally {
          await third.close();
        }
        if (same(sc, sa)) agreed = sa;
        else if (same(sc, sb)) agreed = sb;
        else throw new MeshError('MESH_ERR_UPSTREAM', `strict mode: three routes disagree at token ${tokens.length}; no token is released`);
        // Every node of both routes is checked at its next session (the tracker's trust book), and the route that lost goes on from the agreed tokens without its nodes.
        deps.verification?.forceChecks([...both]);
        const prefix = agreed.kind === 'token' ? [...tokens, agreed.tokenId] : tokens;
        if (!same(sa, agreed)) {
          await a.close();
          if (agreed.kind === 'token') a = open('A', undefined, both, prefix);
        } else {
          await b.close();
          if (agreed.kind === 'token') b = open('B', undefined, both, prefix);
        }
      }
      if (agreed.kind === 'end') {
        yield { type: 'done', finish: agreed.finish, promptTokens: agreed.promptTokens, completionTokens: tokens.length };
        return;
      }
      tokens.push(agreed.tokenId);
      yield { type: 'token', tokenId: agreed.tokenId, text: agreed.text };
    }
  } finally {
    await Promise.allSettled([a.close(), b.close()]);
  }
}
