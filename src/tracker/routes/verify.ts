/**
 * Spot-checks at the tracker (docs/verification.md, docs/protocol.md §11):
 *
 *   POST /api/checks/report       a head's signed evidence → the verdict and the nodes distrusted now
 *   POST /api/checks/skipped      a head's signed word that a planned check could not run (the hop refused, no checker answered)
 *   GET  /v1/verifications/:id    a generation's verification: per node clean, unchecked, pending or wrong
 *   GET  /api/verification        the trust counters, quarantines and recent offences (the dashboard's)
 */
import { MeshError } from '../../protocol/errors.ts';
import type { TrackerContext } from '../context.ts';
import { json, readJson, type App } from '../http.ts';

/** A report carries a few steps' rows of the claim and each check: larger than other control messages. */
const MAX_REPORT_BYTES = 4 << 20;

export function verifyRoutes(app: App, ctx: TrackerContext): void {
  const v = ctx.verification;

  app.post('/api/checks/report', async ({ req }) => {
    const raw = await readJson(req, MAX_REPORT_BYTES);
    const answer = await v.report(raw);
    ctx.metrics.quarantined.set(v.distrusted().length);
    return json(200, answer);
  });

  app.post('/api/checks/skipped', async ({ req }) => json(200, await v.skipped(await readJson(req, ctx.options.maxBodyBytes))));

  app.get('/v1/verifications/:id', ({ req, params }) => {
    const id = params.id ?? '';
    const r = v.log.get(id);
    if (!r) throw new MeshError('MESH_ERR_NOT_FOUND', `no verification record ${id.slice(0, 100)} (records are kept an hour)`);
    return json(200, r.view(v.trust, ctx.options.now(), originOf(req)));
  });

  app.get('/api/verification', () => json(200, verificationSummary(ctx)));
}

export function originOf(req: Request): string {
  try {
    return new URL(req.url).origin;
  } catch {
    return '';
  }
}

/** What /api/dashboard and /api/verification show of checks: per node counters, quarantines, recent offences with their evidence. */
export function verificationSummary(ctx: TrackerContext): Record<string, unknown> {
  const v = ctx.verification;
  const now = ctx.options.now();
  const nodes: Record<string, unknown> = {};
  for (const peer of ctx.registry.nodes.keys()) {
    const r = v.trust.peek(peer);
    nodes[peer] = {
      consecutive: r?.consecutive ?? 0,
      checks: r?.checks ?? 0,
      passes: r?.passes ?? 0,
      offences: r?.offences ?? 0,
      inconclusive: r?.inconclusive ?? 0,
      refusals: r?.refusals ?? 0,
      check_probability: Math.round(v.trust.checkProbability(peer) * 1000) / 1000,
      quarantined_until: r && r.quarantinedUntil > now ? r.quarantinedUntil : null,
    };
  }
  return { enabled: v.enabled, nodes, distrusted: v.distrusted(), offences: [...v.offences()].reverse(), compared_rows: { ...v.comparedRows }, pass_distance_max: { ...v.passDistanceMax }, audits: { ...v.audits.counts } };
}
