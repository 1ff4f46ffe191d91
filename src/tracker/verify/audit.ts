/**
 * Head audits (docs/verification.md): the head is the one node whose work
 * no spot-check covers on its own word — it runs the checks, and it is the
 * one that streams the tokens. So for a sample of finished generations (the
 * head's BOINC odds) the tracker has a route that shares no node with the
 * generation's re-run the prompt plus the produced tokens in one prefill
 * (`POST /audit` on that route's head) and confirms each token.
 *
 * A token that fails is not yet a verdict: a second disjoint route audits
 * too. When both say the generation is wrong, the generation's record says
 * so, every node of its route is checked at its next session, and the
 * tracker walks the hops: it sends the generation's head a plan checking
 * every span of that generation (`POST /verify/walk`; heads keep a finished
 * generation's rows a few minutes), so the hop that lied is named by the
 * ordinary evidence. If the walk names nobody within a minute (every hop
 * checks clean, or the head does not answer), the lie was the head's own:
 * two disjoint routes contradict the tokens it streamed, and it is
 * quarantined. When the two audits disagree with each other, the audit
 * routes' nodes are checked next instead, and nobody is punished.
 */
import type { Logger } from 'pino';
import { MeshError, remoteError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import { tokenDistance, thresholdsFor, type NodeClass, type WeightFormat } from '../../verify/thresholds.ts';
import type { HeadTransport } from '../head-transport.ts';
import { routeHops, type GenerationInput } from '../route-hops.ts';
import type { NodeRegistry } from '../registry.ts';
import type { RouteSigner } from '../route-signer.ts';
import type { GenerationRecord } from './log.ts';
import type { TrustBook } from './trust.ts';

export interface AuditSubject {
  model: string;
  input: GenerationInput;
  /** The tokens the client got, and the log-probability the head reported for each. */
  tokens: readonly number[];
  logprobs: readonly number[];
  head: string;
  /** Every node of the generation's route, the head first; the last one sampled the tokens. */
  route: readonly string[];
  /** The attempt's generation id (its sessions' prefix). */
  generation: string;
  record: GenerationRecord | undefined;
}

export interface AuditResult {
  /** Index of the first token the audit route contradicts; undefined: every token confirmed. */
  failedAt: number | undefined;
  auditHead: string;
  auditRoute: string[];
  worst: number;
}

export interface AuditorDeps {
  registry: NodeRegistry;
  transport: HeadTransport;
  signer: RouteSigner;
  trust: TrustBook;
  logger: Logger;
  now(): number;
  /** Ask the generation's head to check every span of it (the walk); resolves once asked. */
  walk(subject: AuditSubject): Promise<void>;
  /** The head is proven to have streamed tokens its route did not give (two audits agree, the walk named nobody). */
  convict(subject: AuditSubject, audits: AuditResult[]): void;
  /** Force checks of these nodes at their next session. */
  force(peers: readonly string[]): void;
  /**
   * Whether the head reported the generation's checks as uncheckable (rows its hops signed were cut back by
   * speculative decoding): the walk cannot name a hop then, so silence convicts nobody.
   */
  uncheckable?(generation: string): boolean;
  /** How long the walk may take to name a hop, ms. @defaultValue 60000 */
  walkMs?: number;
}

export class HeadAuditor {
  /** Audits run, and by outcome (tests, /api/verification). */
  readonly counts = { audits: 0, confirmed: 0, contradicted: 0, convicted: 0, unwalkable: 0, skipped: 0 };
  private running = 0;

  constructor(private readonly d: AuditorDeps) {}

  classOf(peer: string): NodeClass {
    const n = this.d.registry.nodes.get(peer);
    return { format: (n?.info.weight_format ?? 'f32') as WeightFormat, backend: n?.info.backend ?? 'unknown' };
  }

  /** Audit `s` if the head's odds say so; never throws, never delays the caller. */
  maybe(s: AuditSubject): void {
    if (s.tokens.length === 0 || !this.d.trust.draw(s.head)) return;
    if (this.running >= 2) {
      this.counts.skipped++;
      return;
    }
    this.running++;
    void this.audit(s)
      .catch((e: unknown) => this.d.logger.info({ head: s.head, err: (e as Error).message }, 'head audit did not run'))
      .finally(() => this.running--);
  }

  async audit(s: AuditSubject): Promise<'confirmed' | 'contradicted' | 'convicted' | 'unwalkable' | 'inconclusive' | 'skipped'> {
    const first = await this.runOn(s, new Set(s.route));
    if (!first) {
      this.counts.skipped++;
      return 'skipped';
    }
    this.counts.audits++;
    if (first.failedAt === undefined) {
      this.counts.confirmed++;
      this.d.trust.pass(s.head);
      s.record?.audited('clean', `every token confirmed by a disjoint route (head ${first.auditHead})`);
      return 'confirmed';
    }
    this.d.logger.warn({ head: s.head, generation: s.generation, token: first.failedAt, audit_head: first.auditHead }, 'head audit: a disjoint route contradicts a token; a second route audits');
    const second = await this.runOn(s, new Set([...s.route, ...first.auditRoute]));
    if (!second || second.failedAt === undefined) {
      // The two audits disagree (or no second route): nobody is punished, everyone involved is checked next.
      this.d.force([...s.route, ...first.auditRoute, ...(second?.auditRoute ?? [])]);
      return 'inconclusive';
    }
    this.counts.contradicted++;
    s.record?.audited('wrong', `two disjoint routes (heads ${first.auditHead}, ${second.auditHead}) contradict token ${Math.min(first.failedAt, second.failedAt)}`);
    this.d.force(s.route);
    // The walk: the head checks every span of the generation; a lying hop is named by the ordinary evidence.
    const offencesBefore = this.d.trust.offenceLog.length;
    await this.d.walk(s).catch(() => undefined);
    // Real time, not the tracker's clock: the walk is checks running on nodes.
    const deadline = performance.now() + (this.d.walkMs ?? 60_000);
    while (performance.now() < deadline) {
      if (this.d.trust.offenceLog.slice(offencesBefore).some((o) => s.route.includes(o.peer) && o.generation === s.generation)) return 'contradicted';
      if (this.d.uncheckable?.(s.generation)) {
        // The hops' signed rows are gone (cut back after speculative steps): head and hops cannot be told apart.
        // The generation stays "wrong"; nobody is punished; every node of the route is checked next.
        this.counts.unwalkable++;
        this.d.logger.warn({ head: s.head, generation: s.generation }, 'head audit: the walk cannot check this generation (speculative rows cut back); nobody is convicted');
        this.d.force(s.route);
        return 'unwalkable';
      }
      await new Promise((r) => setTimeout(r, 250));
    }
    this.counts.convicted++;
    this.d.convict(s, [first, second]);
    return 'convicted';
  }

  /** One audit on a route that avoids `exclude`; undefined when no such route exists or it did not answer. */
  private async runOn(s: AuditSubject, exclude: ReadonlySet<string>): Promise<AuditResult | undefined> {
    let plan;
    try {
      plan = this.d.registry.pick(s.model, exclude);
    } catch {
      return undefined;
    }
    const headId = plan.hops[0]!.id;
    const head = this.d.registry.nodes.get(headId);
    if (!head) return undefined;
    const hops = routeHops(this.d.registry, plan, true);
    const { route } = await this.d.signer.sign(headId, hops, head);
    const headers: Record<string, string> = { 'content-type': 'application/json', [H.route]: route.header, [H.routeExpires]: String(route.expiresAt), [H.routeSignature]: route.signature };
    const i = s.input;
    const body = {
      ...(i.messages ? { messages: i.messages } : {}),
      ...(i.chat_template_kwargs ? { chat_template_kwargs: i.chat_template_kwargs } : {}),
      ...(i.prompt !== undefined ? { prompt: i.prompt } : {}),
      ...(i.prompt_token_ids ? { prompt_token_ids: i.prompt_token_ids } : {}),
      token_ids: s.tokens,
      temperature: i.temperature,
      top_p: i.top_p,
      top_k: i.top_k,
      ...(i.seed !== undefined ? { seed: i.seed } : {}),
    };
    const ctl = new AbortController();
    const chunks: Uint8Array[] = [];
    try {
      const stream = await this.d.transport.open({ peerId: headId, ...(head.endpoint ? { endpoint: head.endpoint } : {}), ...(head.relayAddr ? { relayAddr: head.relayAddr } : {}) }, headers, new TextEncoder().encode(JSON.stringify(body)), { signal: ctl.signal, idleTimeoutMs: 60_000, path: '/audit' });
      for await (const c of stream) chunks.push(c);
    } catch (e) {
      this.d.logger.info({ audit_head: headId, err: (e as Error).message }, 'head audit route did not answer');
      return undefined;
    }
    let records: Array<{ claimed: number; sampled: number; deficit: number; gap: number; logprob: number }>;
    try {
      records = (JSON.parse(new TextDecoder().decode(concat(chunks))) as { records: typeof records }).records;
    } catch {
      throw remoteError(502, undefined, `audit head ${headId} answered no records`);
    }
    if (!Array.isArray(records) || records.length !== s.tokens.length) throw new MeshError('MESH_ERR_UPSTREAM', `audit head ${headId} answered ${records?.length} records for ${s.tokens.length} tokens`);
    const th = thresholdsFor(this.classOf(s.route.at(-1)!), this.classOf(plan.hops.at(-1)!.id));
    const sampled = (i.temperature ?? 0) > 0;
    let failedAt: number | undefined;
    let worst = 0;
    records.forEach((r, k) => {
      const d = r.claimed !== s.tokens[k] ? Infinity : tokenDistance(th, sampled, r, s.logprobs[k] ?? NaN);
      worst = Math.max(worst, d);
      if (d > 1 && failedAt === undefined) failedAt = k;
    });
    return { failedAt, auditHead: headId, auditRoute: plan.hops.map((h) => h.id), worst };
  }
}

function concat(parts: readonly Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.byteLength, 0));
  let o = 0;
  for (const p of parts) {
    out.set(p, o);
    o += p.byteLength;
  }
  return out;
}
