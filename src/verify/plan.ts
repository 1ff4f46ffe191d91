/**
 * The tracker's check plan for one generation (docs/protocol.md §11): which
 * of the route's hops the head checks once the generation is over, and
 * which holders of the same layers recompute them. The tracker signs it for
 * the head; it travels with `POST /generate` (`X-Meshnet-Check-Plan`,
 * `-Signature`) and again with every `POST /check`, where it is the
 * checker's ticket: a node recomputes a span only for a head the tracker
 * sent to it, for a session of that generation, until the plan expires.
 * Older heads ignore the headers (their hops stay unchecked).
 *
 * The same module has the tracker's signed notice that a node is not to be
 * trusted (`POST /verify/distrust` to heads; heartbeat answers list them).
 */
import { z } from 'zod';

const peerId = z.string().regex(/^[0-9a-f]{32}$/);
const nodeClass = { format: z.enum(['f32', 'f16', 'q4']), backend: z.string().max(40) };

export const planPeerSchema = z.object({
  peer_id: peerId,
  /** base64url raw Ed25519 key: the head verifies attestations and answers with it. */
  public_key: z.string().min(40).max(64),
  ...nodeClass,
  endpoint: z.string().max(500).optional(),
  relay_addr: z.string().max(500).optional(),
});
export type PlanPeer = z.infer<typeof planPeerSchema>;

export const planCheckSchema = z.object({
  /** The hop to check, as it runs on the route. */
  peer: planPeerSchema,
  start_layer: z.number().int().nonnegative(),
  end_layer: z.number().int().positive(),
  /** Holders of those layers off the route, in the order to ask: the checker, fallbacks; the last one is also the arbiter. */
  checkers: z.array(planPeerSchema).min(1).max(4),
});
export type PlanCheck = z.infer<typeof planCheckSchema>;

export const checkPlanSchema = z.object({
  head: peerId,
  model: z.string().min(1).max(200),
  /** The tracker's id of this generation attempt: the head's session ids start with it and a dot. */
  generation: z.string().min(1).max(100),
  /** ms since epoch: checkers refuse the plan after this. */
  expires_at: z.number().int(),
  checks: z.array(planCheckSchema).max(64),
});
export type CheckPlan = z.infer<typeof checkPlanSchema>;

export const CHECK_PLAN_HEADER = 'x-meshnet-check-plan';
export const CHECK_PLAN_SIGNATURE_HEADER = 'x-meshnet-check-plan-signature';

export function checkPlanMessage(head: string, planText: string): Uint8Array {
  return new TextEncoder().encode(`check-plan-v1:${head}:${planText}`);
}

/** The session ids a head uses for a generation are `<generation>.<suffix>` (pipeline-parts sessionIdFor). */
export function sessionOfGeneration(session: string, generation: string): boolean {
  return session.startsWith(`${generation}.`) || session === generation;
}

// ---------------------------------------------------------------- distrust notices

export const distrustSchema = z.object({
  peer_id: peerId,
  /** ms since epoch: the quarantine's end. */
  until: z.number().int(),
  /** Why, for logs: the offence's id at the tracker. */
  offence: z.string().max(100).optional(),
});
export type Distrust = z.infer<typeof distrustSchema>;

export function distrustMessage(d: Distrust): Uint8Array {
  return new TextEncoder().encode(`distrust-v1:${d.peer_id}:${d.until}:${d.offence ?? ''}`);
}

export const DISTRUST_PATH = '/verify/distrust';
/** A head audit found a generation wrong: the tracker asks its head to check every span of it (body {plan, signature}). */
export const WALK_PATH = '/verify/walk';
export const CHECK_PATH = '/check';
