/**
 * A hop's side of attestations (attest.ts): per session the running digest
 * of every step it ran, signed after each step, off the step's critical
 * path. The step's answer (or push) goes out first; hashing and signing run
 * behind it, so an answer carries the latest attestation already finished —
 * normally the previous step's — and the session's last one is handed out
 * when the session ends (`finish`, the answer to DELETE /sessions/<id>).
 *
 * Steps of one session arrive in order (the executor refuses any other with
 * 409), and a step at position 0 restarts the chain as it restarts the KV
 * cache (a replay). Bounded: at most `maxSessions` chains, the least
 * recently used dropped first (its session's KV is long gone by then).
 */
import { attestMessage, attestSeed, chainStep, formatAttestation, sha256, type AttestScope } from './attest.ts';

export interface AttestorInit {
  peerId: string;
  sign(bytes: Uint8Array): Promise<Uint8Array>;
  /** Chains kept at most. @defaultValue 4096 */
  maxSessions?: number;
  onError?(e: unknown): void;
}

interface Chain {
  scope: AttestScope;
  /** Rows the chain will cover once every recorded step is digested. */
  rows: number;
  /** The digest after the last recorded step (resolves once hashed). */
  acc: Promise<Uint8Array>;
  /** The last finished attestation's header entry, and the signing still running. */
  latest?: string;
  latestRows: number;
  signing: Promise<void>;
}

export class Attestor {
  private readonly chains = new Map<string, Chain>();
  private readonly max: number;

  constructor(private readonly init: AttestorInit) {
    this.max = init.maxSessions ?? 4096;
  }

  get sessions(): number {
    return this.chains.size;
  }

  /**
   * A step ran: `input` and `output` are its wire bytes (they must not be
   * changed afterwards). Returns at once; the digest and signature follow.
   */
  record(scope: AttestScope, position: number, rows: number, input: Uint8Array, output: Uint8Array): void {
    let c = this.chains.get(scope.session);
    if (position === 0) {
      // A new session, or a replay from 0: the chain restarts where the KV cache did.
      c = { scope, rows: 0, acc: attestSeed(scope), latestRows: 0, signing: Promise.resolve() };
    } else if (!c || position !== c.rows || !sameScope(c.scope, scope)) {
      // Nothing attested leads up to this step (the chain was dropped): nothing can be signed for it.
      if (c) this.chains.delete(scope.session);
      return;
    }
    this.chains.delete(scope.session);
    this.chains.set(scope.session, c); // most recently used last
    if (this.chains.size > this.max) this.chains.delete(this.chains.keys().next().value!);

    const prev = c.acc;
    const covered = position + rows;
    c.rows = covered;
    const chain = c;
    c.acc = (async () => {
      // After the answer is on its way: hashing starts on the next turn of the event loop.
      await later();
      const [acc, ih, oh] = await Promise.all([prev, sha256(input), sha256(output)]);
      return chainStep(acc, { position, rows, input: ih, output: oh });
    })();
    const acc = c.acc;
    const before = c.signing;
    c.signing = (async () => {
      try {
        const sig = await this.init.sign(attestMessage(scope.session, covered, await acc));
        // The furthest signature wins: an older one finishing late must not replace a newer one.
        if (covered > chain.latestRows) {
          chain.latestRows = covered;
          chain.latest = formatAttestation({ peer: this.init.peerId, rows: covered, signature: sig });
        }
      } catch (e) {
        this.init.onError?.(e);
      }
      await before;
    })();
  }

  /** The latest finished attestation of the session (an X-Meshnet-Attest entry), if any. */
  latest(session: string): string | undefined {
    return this.chains.get(session)?.latest;
  }

  /** The session's final attestation (waits for the signing in flight); forgets the session. */
  async finish(session: string): Promise<string | undefined> {
    const c = this.chains.get(session);
    if (!c) return undefined;
    await c.signing;
    this.chains.delete(session);
    return c.latest;
  }

  /** Forget a session without waiting (its KV was dropped). */
  drop(session: string): void {
    this.chains.delete(session);
  }
}

const later = (): Promise<void> => new Promise((r) => setTimeout(r, 0));

function sameScope(a: AttestScope, b: AttestScope): boolean {
  return a.model === b.model && a.session === b.session && a.startLayer === b.startLayer && a.endLayer === b.endLayer && a.dtype === b.dtype && a.sampling === b.sampling;
}
