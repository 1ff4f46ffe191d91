/**
 * The check plan for one generation (src/verify/plan.ts): for every node of
 * its route, a draw by the node's BOINC odds (trust.ts); for each drawn
 * one, up to three holders of the same layers to recompute it, chosen at
 * random, never the node itself, never a node on the route, never one in
 * quarantine — and, where the mesh allows, of the same weight format (two
 * 4-bit nodes agree to the rounding, a 4-bit and an f32 one only to the
 * quantization: docs/verification.md). Signed for the head.
 */
import type { Identity } from '../../net/identity.ts';
import { encodeBase64Url } from '../../protocol/base64.ts';
import { checkPlanMessage, type CheckPlan, type PlanCheck, type PlanPeer } from '../../verify/plan.ts';
import type { WeightFormat } from '../../verify/thresholds.ts';
import type { TrustBook } from './trust.ts';

/** What the planner reads of a registered node. */
export interface PlannerNode {
  peerId: string;
  publicKey: string;
  model: string;
  format: WeightFormat;
  backend: string;
  serving: { start: number; end: number } | null;
  endpoint?: string;
  relayAddr?: string;
}

export interface PlanInput {
  model: string;
  generation: string;
  head: string;
  /** Every span of the route, the head's own first: [peer, start, end). */
  spans: ReadonlyArray<{ peer: string; start: number; end: number }>;
  /** Check every span whatever the odds (a request that asked for it). */
  force?: boolean;
}

export interface PlannerDeps {
  /** The nodes of `model` (more is fine: the planner keeps those of the model). */
  nodes(model: string): Iterable<PlannerNode>;
  node(peer: string): PlannerNode | undefined;
  trust: TrustBook;
  random(): number;
  now(): number;
  /** How long a plan stays good: the generation and its checks must fit. @defaultValue 20 minutes */
  ttlMs?: number;
}

/** Checkers named per check: the first answers, the next one that answers arbitrates a mismatch. */
const CHECKERS = 3;

export function planPeer(n: PlannerNode): PlanPeer {
  return {
    peer_id: n.peerId,
    public_key: n.publicKey,
    format: n.format,
    backend: n.backend.slice(0, 40),
    ...(n.endpoint ? { endpoint: n.endpoint } : {}),
    ...(n.relayAddr ? { relay_addr: n.relayAddr } : {}),
  };
}

/** The plan, or undefined when no span is drawn (or none can be checked by anyone). */
export function planChecks(d: PlannerDeps, input: PlanInput): CheckPlan | undefined {
  const onRoute = new Set(input.spans.map((s) => s.peer));
  // Read only once a span is drawn: most chats draw none, and a swarm holds thousands of nodes.
  let candidates: PlannerNode[] | undefined;
  const serving = () => (candidates ??= [...d.nodes(input.model)].filter((n) => n.model === input.model && n.serving && !d.trust.quarantined(n.peerId)));
  const checks: PlanCheck[] = [];
  for (const s of input.spans) {
    const node = d.node(s.peer);
    if (!node) continue;
    if (!input.force && !d.trust.draw(s.peer)) continue;
    const holders = serving().filter((n) => !onRoute.has(n.peerId) && n.serving!.start <= s.start && s.end <= n.serving!.end);
    if (holders.length === 0) continue;
    // Same weight format first (random order within), then the rest.
    const shuffled = holders.map((n) => ({ n, k: (n.format === 'q4') === (node.format === 'q4') ? d.random() : 1 + d.random() })).sort((a, b) => a.k - b.k);
    checks.push({ peer: planPeer(node), start_layer: s.start, end_layer: s.end, checkers: shuffled.slice(0, CHECKERS).map((x) => planPeer(x.n)) });
  }
  if (checks.length === 0) return undefined;
  return { head: input.head, model: input.model, generation: input.generation, expires_at: d.now() + (d.ttlMs ?? 20 * 60_000), checks };
}

/** The plan's text and the tracker's signature over it, as the /generate headers carry them. */
export async function signPlan(identity: Identity, plan: CheckPlan): Promise<{ text: string; signature: string }> {
  const text = JSON.stringify(plan);
  return { text, signature: encodeBase64Url(await identity.sign(checkPlanMessage(plan.head, text))) };
}
