/**
 * The tracker's verification service (docs/verification.md): plans checks
 * for each generation (planner.ts), judges the evidence heads report
 * (src/verify/evidence.ts), keeps the BOINC counters and quarantines
 * (trust.ts), and keeps each generation's verification record (log.ts).
 *
 * A quarantine acts at once: the node leaves routing (the registry asks
 * `excluded`), every head running a generation through it is told by a
 * signed notice (`POST /verify/distrust`; the head replaces the hop by its
 * usual replay), and an attempt the node heads is ended so the generation
 * fails over to another head with the tokens so far.
 */
import type { Logger } from 'pino';
import { decodeBase64 as decodeBase64Url, encodeBase64Url } from '../../protocol/base64.ts';
import { MeshError } from '../../protocol/errors.ts';
import { canonicalJson } from '../../protocol/tracker.ts';
import type { Identity } from '../../net/identity.ts';
import { verifyEd25519 } from '../../net/identity.ts';
import { checkReportSchema, judgeReport, skippedCheckSchema, type Verdict } from '../../verify/evidence.ts';
import { checkPlanMessage, checkPlanSchema, DISTRUST_PATH, distrustMessage, sessionOfGeneration, WALK_PATH, type CheckPlan, type Distrust } from '../../verify/plan.ts';
import type { WeightFormat } from '../../verify/thresholds.ts';
import type { HeadTransport } from '../head-transport.ts';
import type { NodeRegistry } from '../registry.ts';
import { VerificationLog, type GenerationRecord } from './log.ts';
import { planChecks, signPlan, type PlannerNode } from './planner.ts';
import { HeadAuditor, type AuditResult, type AuditSubject } from './audit.ts';
import type { RouteSigner } from '../route-signer.ts';
import { TrustBook, type OffenceRecord, type TrustCounters, type TrustOutcome } from './trust.ts';

export interface VerificationOptions {
  /** Plan checks at all (`meshnet tracker --no-checks` turns spot-checks off). @defaultValue true */
  enabled: boolean;
  /** p_min of the BOINC rule. @defaultValue 0.02 */
  minRate: number;
  /** First quarantine, ms (doubling per offence). @defaultValue 900000 */
  quarantineMs: number;
  /** How long a walk after a contradicted head audit may take to name a hop before the head is convicted, ms. @defaultValue 60000 */
  auditWalkMs?: number;
  now(): number;
  random(): number;
}

export interface VerificationDeps {
  registry: NodeRegistry;
  identity: Identity;
  transport: HeadTransport;
  /** Signs the routes of head audits. */
  signer: RouteSigner;
  logger: Logger;
  options: VerificationOptions;
  /** Checks judged, by outcome (metrics). */
  onVerdict?(v: Verdict): void;
  /**
   * The route-signing keys of the cluster's other trackers (`--nats`): a head's check plan may come from any
   * of them (its report reaches whichever tracker haproxy picks). Alone: none.
   */
  peerTrackerKeys?(): readonly Uint8Array[];
  /** A judgement changed a node's trust counters (`--nats`: the cluster's store shares them). */
  onTrustOutcome?(peer: string, outcome: TrustOutcome, now: TrustCounters): void;
}

export interface ReportAnswer {
  outcome: Verdict['outcome'];
  guilty?: string;
  distance: Verdict['distance'];
  threshold: number;
  /** Nodes under quarantine now: the head stops using them at once. */
  distrust: Distrust[];
}

const SEEN_MAX = 50_000;

export class VerificationService {
  readonly trust: TrustBook;
  readonly log: VerificationLog;
  /** Head audits of finished generations (audit.ts). */
  readonly audits: HeadAuditor;
  /** Generations whose head reported their checks uncheckable (speculative rows cut back), for head audits' walks. */
  private readonly uncheckable = new Set<string>();
  /** Rows (or last-hop tokens) the tracker compared in checks that passed, by pair of weight formats: the honest pairs' record. */
  readonly comparedRows: Record<string, number> = {};
  /** The largest distance of a passing check, by the same key (how close honest pairs come to their thresholds). */
  readonly passDistanceMax: Record<string, number> = {};
  /** Reports already judged, by the claim's and checks' signatures (a replayed report is refused). */
  private readonly seen = new Set<string>();

  constructor(private readonly d: VerificationDeps) {
    this.trust = new TrustBook({
      minRate: d.options.minRate,
      quarantineMs: d.options.quarantineMs,
      now: d.options.now,
      random: d.options.random,
      onQuarantine: (peer, until) => d.registry.quarantine(peer, until),
      onOutcome: (peer, outcome, now) => d.onTrustOutcome?.(peer, outcome, now),
    });
    this.log = new VerificationLog({ now: d.options.now });
    this.audits = new HeadAuditor({
      registry: d.registry,
      transport: d.transport,
      signer: d.signer,
      trust: this.trust,
      logger: d.logger,
      now: d.options.now,
      walk: (s) => this.walk(s),
      convict: (s, audits) => this.convictHead(s, audits),
      force: (peers) => this.forceChecks(peers),
      uncheckable: (generation) => this.uncheckable.has(generation),
      ...(d.options.auditWalkMs !== undefined ? { walkMs: d.options.auditWalkMs } : {}),
    });
  }

  /** A finished generation, for a head audit at the head's odds (never delays the caller). */
  audit(s: AuditSubject): void {
    if (this.enabled) this.audits.maybe(s);
  }

  /** The walk of a contradicted generation: its head checks every span of it with a plan that names them all. */
  private async walk(s: AuditSubject): Promise<void> {
    const attempt = s.record?.attempts.find((a) => a.generation === s.generation);
    const spans = attempt?.spans.filter((x) => x.start !== undefined).map((x) => ({ peer: x.peer, start: x.start!, end: x.end! })) ?? [];
    const plan = await this.plan(this.d.registry.nodes.get(s.head)?.info.model ?? '', s.generation, s.head, spans, true);
    const head = this.d.registry.nodes.get(s.head);
    if (!plan || !head) return;
    for (const c of plan.plan.checks) s.record?.expect(s.generation, c.peer.peer_id, c.start_layer, c.end_layer, plan.plan.expires_at);
    const ctl = new AbortController();
    const body = await this.d.transport.open(
      { peerId: s.head, ...(head.endpoint ? { endpoint: head.endpoint } : {}), ...(head.relayAddr ? { relayAddr: head.relayAddr } : {}) },
      { 'content-type': 'application/json' },
      new TextEncoder().encode(JSON.stringify({ plan: plan.text, signature: plan.signature })),
      { signal: ctl.signal, idleTimeoutMs: 10_000, path: WALK_PATH },
    );
    for await (const _ of body) void _;
  }

  private convictHead(s: AuditSubject, audits: AuditResult[]): void {
    const [a, b] = audits as [AuditResult, AuditResult];
    const off = this.trust.offence({
      peer: s.head,
      role: 'head',
      model: s.model,
      start_layer: 0,
      end_layer: 0,
      generation: s.generation,
      session: s.generation,
      kind: 'tokens',
      rows: s.tokens.length,
      steps: s.tokens.length,
      threshold: 1,
      claim: { peer: s.head, attestation: '' },
      checker: { peer: a.auditHead, attestation: '', distance: a.worst },
      arbiter: { peer: b.auditHead, attestation: '', distance: b.worst },
      reported_by: 'tracker audit',
    });
    this.d.logger.warn({ head: s.head, generation: s.generation, until: new Date(off.until).toISOString() }, 'head audit: two disjoint routes contradict the tokens the head streamed and no hop was found lying; the head is quarantined');
    this.quarantined(off);
  }

  get enabled(): boolean {
    return this.d.options.enabled;
  }

  /** Turn spot-checks on or off while running (a bench compares both in one run); trust counters are kept. */
  setEnabled(on: boolean): void {
    this.d.options.enabled = on;
  }

  /** Routing leaves these out: quarantined here, or by another tracker of the cluster. */
  excluded(peer: string): boolean {
    return this.trust.quarantined(peer) || this.d.registry.isQuarantined(peer);
  }

  /** May `excluded` say yes to anyone now? False: nobody is quarantined, here or by another tracker. */
  anyExcluded(): boolean {
    return this.trust.anyQuarantined() || this.d.registry.anyQuarantined();
  }

  /** The latest end of any quarantine `excluded` counts (here or by another tracker), ms since epoch; 0: none. */
  exclusionsEnd(): number {
    return Math.max(this.trust.latestQuarantineEnd, this.d.registry.latestQuarantineEnd());
  }

  /** Keys a check plan may be signed with: this tracker's, and in a cluster every other tracker's. */
  private planKeys(): Uint8Array[] {
    return [this.d.identity.publicKey, ...(this.d.peerTrackerKeys?.() ?? [])];
  }

  private plannerNode(peer: string): PlannerNode | undefined {
    const n = this.d.registry.nodes.get(peer);
    if (!n) return undefined;
    return {
      peerId: n.peerId,
      publicKey: n.publicKey,
      model: n.info.model,
      format: (n.info.weight_format ?? 'f32') as WeightFormat,
      backend: n.info.backend,
      serving: n.serving,
      ...(n.endpoint ? { endpoint: n.endpoint } : {}),
      ...(n.relayAddr ? { relayAddr: n.relayAddr } : {}),
    };
  }

  /** The signed plan for one attempt (undefined: nothing drawn, or checks are off). */
  async plan(model: string, generation: string, head: string, spans: ReadonlyArray<{ peer: string; start: number; end: number }>, force = false): Promise<{ plan: CheckPlan; text: string; signature: string } | undefined> {
    if (!this.enabled) return undefined;
    const reg = this.d.registry;
    const plan = planChecks(
      {
        nodes: (m) => [...(reg.models.has(m) ? reg.placement(m).nodes : [])].map((n) => this.plannerNode(n.peerId)!).filter(Boolean),
        node: (p) => this.plannerNode(p),
        trust: this.trust,
        random: this.d.options.random,
        now: this.d.options.now,
      },
      { model, generation, head, spans, force },
    );
    if (!plan) return undefined;
    return { plan, ...(await signPlan(this.d.identity, plan)) };
  }

  /** POST /api/checks/report: a head's signed evidence; the verdict, and who is distrusted now. */
  async report(raw: unknown): Promise<ReportAnswer> {
    if (typeof raw !== 'object' || raw === null) throw new MeshError('MESH_ERR_BAD_REQUEST', 'expected {body: CheckReport, signature}');
    const { body, signature } = raw as { body?: unknown; signature?: unknown };
    const parsed = checkReportSchema.safeParse(body);
    if (!parsed.success || typeof signature !== 'string') {
      const issue = parsed.success ? undefined : parsed.error.issues[0];
      throw new MeshError('MESH_ERR_BAD_REQUEST', `check report: ${issue ? `${issue.path.join('.') || '(root)'}: ${issue.message}` : 'signature missing'}`);
    }
    const r = parsed.data;
    const head = this.d.registry.nodes.get(r.head);
    if (!head) throw new MeshError('MESH_ERR_NOT_FOUND', `head ${r.head} is not registered here`);
    let sig: Uint8Array;
    try {
      sig = decodeBase64Url(signature);
    } catch {
      throw new MeshError('MESH_ERR_UNAUTHORIZED', 'the report signature is not base64url');
    }
    if (!(await verifyEd25519(decodeBase64Url(head.publicKey), new TextEncoder().encode(canonicalJson(body)), sig))) throw new MeshError('MESH_ERR_UNAUTHORIZED', 'the report is not signed by its head');
    const key = `${r.claim.attestation}:${r.checks.map((c) => c.attestation).join(':')}`;
    if (this.seen.has(key)) throw new MeshError('MESH_ERR_BAD_REQUEST', 'this evidence was reported already');
    const v = await judgeReport(r, { trackerKeys: this.planKeys(), now: this.d.options.now(), verify: verifyEd25519 });
    if (this.seen.size >= SEEN_MAX) this.seen.clear();
    this.seen.add(key);
    this.apply(v, r.head, r.claim.attestation, r.checks);
    this.d.onVerdict?.(v);
    return { outcome: v.outcome, ...(v.guilty ? { guilty: v.guilty } : {}), distance: v.distance, threshold: v.threshold, distrust: this.distrusted() };
  }

  /** POST /api/checks/skipped: a planned check the head could not run. A refusing hop stays unverified (and is checked next time); nobody is punished. */
  async skipped(raw: unknown): Promise<{ recorded: boolean }> {
    if (typeof raw !== 'object' || raw === null) throw new MeshError('MESH_ERR_BAD_REQUEST', 'expected {body: SkippedCheck, signature}');
    const { body, signature } = raw as { body?: unknown; signature?: unknown };
    const p = skippedCheckSchema.safeParse(body);
    if (!p.success || typeof signature !== 'string') throw new MeshError('MESH_ERR_BAD_REQUEST', `skipped check: ${p.success ? 'signature missing' : p.error.issues[0]!.message}`);
    const s = p.data;
    const head = this.d.registry.nodes.get(s.head);
    if (!head) throw new MeshError('MESH_ERR_NOT_FOUND', `head ${s.head} is not registered here`);
    const ok = (await verifyEd25519(decodeBase64Url(head.publicKey), new TextEncoder().encode(canonicalJson(body)), bytes(signature))) && (await signedByAny(this.planKeys(), checkPlanMessage(s.head, s.plan), bytes(s.plan_signature)));
    if (!ok) throw new MeshError('MESH_ERR_UNAUTHORIZED', 'the skipped check is not signed by its head, or its plan not by a tracker of this cluster');
    let plan: CheckPlan;
    try {
      plan = checkPlanSchema.parse(JSON.parse(s.plan));
    } catch {
      throw new MeshError('MESH_ERR_BAD_REQUEST', 'the plan is not a CheckPlan');
    }
    if (plan.head !== s.head || !sessionOfGeneration(s.session, plan.generation) || !plan.checks.some((c) => c.peer.peer_id === s.peer_id && c.start_layer === s.start_layer && c.end_layer === s.end_layer)) {
      throw new MeshError('MESH_ERR_FORBIDDEN', 'the plan has no such check for this head and session');
    }
    if (s.reason === 'refused') this.trust.refused(s.peer_id);
    if (s.reason === 'uncheckable') {
      // Remembered a while for a head audit's walk of this generation (audit.ts); oldest first out.
      this.uncheckable.add(plan.generation);
      if (this.uncheckable.size > 4096) this.uncheckable.delete(this.uncheckable.values().next().value!);
    }
    this.log.ofGeneration(plan.generation)?.result(plan.generation, s.peer_id, s.start_layer, s.end_layer, s.reason === 'refused' ? 'refused' : 'skipped', s.why);
    this.d.logger.info({ head: s.head, peer: s.peer_id, reason: s.reason, why: s.why }, 'a planned check did not run');
    return { recorded: true };
  }

  /** Check these nodes at their next session whatever their odds (strict mode saw their routes disagree). */
  forceChecks(peers: readonly string[]): void {
    for (const p of peers) this.trust.force(p);
  }

  /** Nodes under quarantine now: judged here, or by another tracker of the cluster. */
  distrusted(): Distrust[] {
    const out = new Map<string, number>();
    for (const d of [...this.trust.distrusted(), ...this.d.registry.quarantines()]) out.set(d.peer_id, Math.max(out.get(d.peer_id) ?? 0, d.until));
    return [...out].map(([peer_id, until]) => ({ peer_id, until }));
  }

  private apply(v: Verdict, reporter: string, claimAttestation: string, checks: ReadonlyArray<{ role: string; peer_id: string; attestation: string }>): void {
    const record = this.log.ofGeneration(v.plan.generation);
    const mark = (outcome: 'clean' | 'wrong' | 'inconclusive', detail?: string) => record?.result(v.plan.generation, v.checked, v.startLayer, v.endLayer, outcome, detail);
    const log = this.d.logger.child({ checked: v.checked, layers: [v.startLayer, v.endLayer], session: v.session, distance: v.distance, threshold: v.threshold });
    if (v.outcome === 'pass') {
      const key = `${v.pair}:${v.kind}`;
      this.comparedRows[key] = (this.comparedRows[key] ?? 0) + v.comparedRows;
      this.passDistanceMax[key] = Math.max(this.passDistanceMax[key] ?? 0, v.distance.checker);
      this.trust.pass(v.checked);
      mark('clean');
      log.debug('check passed');
      return;
    }
    if (v.outcome === 'inconclusive') {
      this.trust.inconclusive(v.checked);
      for (const c of checks) this.trust.inconclusive(c.peer_id);
      mark('inconclusive');
      log.warn('check inconclusive: the checked node and its checker disagree and no arbiter settled it');
      return;
    }
    const guilty = v.guilty!;
    const checker = checks[0]!;
    const arbiter = checks[1];
    const off = this.trust.offence({
      peer: guilty,
      role: v.outcome === 'offence' ? 'hop' : 'checker',
      model: v.plan.model,
      start_layer: v.startLayer,
      end_layer: v.endLayer,
      generation: v.plan.generation,
      session: v.session,
      kind: v.kind,
      rows: v.rows,
      steps: v.steps,
      threshold: v.threshold,
      claim: { peer: v.checked, attestation: claimAttestation },
      checker: { peer: checker.peer_id, attestation: checker.attestation, distance: v.distance.checker },
      ...(arbiter ? { arbiter: { peer: arbiter.peer_id, attestation: arbiter.attestation, distance: v.distance.arbiter ?? NaN } } : {}),
      ...(v.distance.between !== undefined ? { between: v.distance.between } : {}),
      reported_by: reporter,
    });
    if (v.outcome === 'offence') mark('wrong', `its output was ${fmt(v.distance.checker)} from the checker's and ${fmt(v.distance.arbiter ?? NaN)} from the arbiter's (threshold ${fmt(v.threshold)})`);
    else {
      this.trust.inconclusive(v.checked);
      mark('inconclusive', 'its checker was found lying');
    }
    log.warn({ guilty, role: off.role, until: new Date(off.until).toISOString(), offence: off.id }, 'a node was proven wrong: quarantined');
    this.quarantined(off);
  }

  /** Acts on a new quarantine: heads running through the node are told, attempts it heads end. */
  private quarantined(off: OffenceRecord): void {
    const notice: Distrust = { peer_id: off.peer, until: off.until, offence: off.id };
    const heads = new Set<string>();
    for (const { attempt } of this.log.activeThrough(off.peer)) {
      if (attempt.head === off.peer) attempt.abort?.();
      else heads.add(attempt.head);
    }
    if (heads.size === 0) return;
    void signNotice(this.d.identity, notice).then((signature) => {
      for (const h of heads) void this.pushNotice(h, notice, signature);
    });
  }

  private async pushNotice(head: string, notice: Distrust, signature: string): Promise<void> {
    const n = this.d.registry.nodes.get(head);
    if (!n) return;
    const ctl = new AbortController();
    try {
      const body = await this.d.transport.open(
        { peerId: head, ...(n.endpoint ? { endpoint: n.endpoint } : {}), ...(n.relayAddr ? { relayAddr: n.relayAddr } : {}) },
        { 'content-type': 'application/json' },
        new TextEncoder().encode(JSON.stringify({ notice, signature })),
        { signal: ctl.signal, idleTimeoutMs: 5_000, path: DISTRUST_PATH },
      );
      for await (const _ of body) void _;
    } catch (e) {
      this.d.logger.info({ head, peer: notice.peer_id, err: (e as Error).message }, 'could not tell a head of a quarantine (its next heartbeat will)');
    }
  }

  /** The verification record of a generation attempt, to end it. */
  record(generation: string): GenerationRecord | undefined {
    return this.log.ofGeneration(generation);
  }

  offences(): readonly OffenceRecord[] {
    return this.trust.offenceLog;
  }
}

export async function signNotice(identity: Identity, notice: Distrust): Promise<string> {
  return encodeBase64Url(await identity.sign(distrustMessage(notice)));
}

function bytes(text: string): Uint8Array {
  try {
    return decodeBase64Url(text);
  } catch {
    throw new MeshError('MESH_ERR_UNAUTHORIZED', 'a signature is not base64url');
  }
}

async function signedByAny(keys: readonly Uint8Array[], message: Uint8Array, signature: Uint8Array): Promise<boolean> {
  for (const k of keys) if (await verifyEd25519(k, message, signature)) return true;
  return false;
}

function fmt(x: number): string {
  return Number.isFinite(x) ? x.toPrecision(3) : String(x);
}
