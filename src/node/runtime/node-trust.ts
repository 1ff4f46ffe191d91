/**
 * A node's part in verification (docs/protocol.md §11): the attestor that
 * signs what it answers, the verifier that runs a head's planned checks and
 * reports them to the tracker, and its own `POST /check`, which recomputes
 * another hop's answer with the span it serves.
 */
import { MeshError } from '../../protocol/errors.ts';
import type { MeshRequest, MeshResponse } from '../../protocol/envelopes.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import { verifyEd25519, type Identity } from '../../net/identity.ts';
import { Attestor } from '../../verify/attestor.ts';
import type { TrackerClient, TrackerKeys } from '../tracker-client.ts';
import { createCheckHandler, type CheckExecutor } from '../verify/check-handler.ts';
import { Verifier } from '../verify/verifier.ts';
import type { RuntimeHost } from './host.ts';

export interface NodeTrustDeps {
  identity: Identity;
  host: Pick<RuntimeHost, 'log'>;
  transport: HopTransport;
  /** The tracker client now; none without a tracker (reports have nowhere to go). */
  tracker: () => TrackerClient | undefined;
  /** The keys a check's plan must be signed with. */
  trackerKey: () => TrackerKeys;
  /** The model served now, as the tracker names it. */
  model: () => string;
  /** The serving span's executor, which `POST /check` recomputes with. */
  executor: () => CheckExecutor | undefined;
}

export interface NodeTrust {
  attestor: Attestor;
  verifier: Verifier;
  /** `POST /check`. */
  checks: (req: MeshRequest) => Promise<MeshResponse>;
}

export function createNodeTrust(d: NodeTrustDeps): NodeTrust {
  const { identity, host } = d;
  const attestor = new Attestor({ peerId: identity.peerId, sign: (b) => identity.sign(b), onError: (e) => host.log('warn', `attestation: ${(e as Error).message}`) });
  const verifier = new Verifier({
    peerId: identity.peerId,
    transport: d.transport,
    verify: verifyEd25519,
    report: (r) => {
      const tracker = d.tracker();
      if (!tracker) return Promise.reject(new MeshError('MESH_ERR_UNAVAILABLE', 'no tracker to report a check to'));
      return tracker.reportCheck(r);
    },
    skipped: (s) => {
      const tracker = d.tracker();
      return tracker ? tracker.reportSkipped(s) : Promise.resolve(undefined);
    },
    onEvent: (e) => {
      if (e.type === 'reported') {
        const a = e.answer as { outcome?: string; guilty?: string } | undefined;
        if (a?.outcome && a.outcome !== 'pass') host.log('warn', `check of ${e.peer}: ${a.outcome}${a.guilty ? ` (${a.guilty} found lying)` : ''}`);
      } else host.log('info', `check of ${e.peer}: ${e.type} (${e.why})`);
    },
  });
  const checks = createCheckHandler({
    peerId: identity.peerId,
    model: d.model,
    executor: d.executor,
    trackerKey: d.trackerKey,
    sign: (b) => identity.sign(b),
    verify: verifyEd25519,
  });
  return { attestor, verifier, checks };
}
