/**
 * A hop's side of attestations (attest.ts): per session the running digest
 * of every step it ran, signed off the step's critical path.
 *
 * Cheap by design (docs/verification.md §1): a step only keeps references
 * to its wire bytes. Every `signEvery` steps of a session
 * (or once `signBytes` of rows wait), and when the session ends, the waiting
 * steps are hashed into the chain and ONE signature is made over the chain's
 * head — the chain binds every earlier step, so that signature vouches for
 * all of them. An answer (or push) carries the latest attestation already
 * finished; the session's last one covers every step and is handed out when
 * the session ends (`finish`, the answer to DELETE /sessions/<id>). Hashing
 * is synchronous and the same on every host (attest.ts: pure-JS SHA-256), one
 * timer turn after the answer that triggered it, in slices of at most ~1 ms
 * (32 steps of a big model's rows are milliseconds of pure-JS hashing: the
 * node's next answer must not wait behind them).
 *
 * Steps of one session arrive in order (the executor refuses any other with
 * 409). A step at position 0 restarts the chain as it restarts the KV cache
 * (a replay); a step that starts before the previous one ended is a cut (the
 * rows past its position were rolled back, as after rejected speculative
 * drafts) and is chained like any other: the chain records each step as
 * computed, so the rows it covers are all rows computed, cut ones included.
 * Bounded: at most `maxSessions` chains, the least recently used dropped
 * first (its session's KV is long gone by then).
 */
import { attestMessage, attestSeed, chainStep, formatAttestation, sha256, sha256Stream, type AttestScope } from './attest.ts';

export interface AttestorInit {
  peerId: string;
  sign(bytes: Uint8Array): Promise<Uint8Array>;
  /** Sign once every this many steps of a session (and at its end). 1: every step. @defaultValue 32 */
  signEvery?: number;
  /** Sign as soon as this many bytes of steps wait to be hashed (a long prompt is vouched for at once). @defaultValue 1048576 */
  signBytes?: number;
  /** Chains kept at most. @defaultValue 4096 */
  maxSessions?: number;
  onError?(e: unknown): void;
}

interface Step {
  position: number;
  rows: number;
  input: Uint8Array;
  output: Uint8Array;
}

interface Chain {
  scope: AttestScope;
  /** Rows the chain covers once every recorded step is digested (all computed rows, cut ones included). */
  rows: number;
  /** Where the last recorded step ended: the next step starts there, or before it (a cut). */
  end: number;
  /** Steps recorded but not hashed yet, and their bytes. */
  pending: Step[];
  pendingBytes: number;
  /** The digest after the last hashed step (resolves once hashed). */
  acc: Promise<Uint8Array>;
  /** The last finished attestation's header entry, and the signing still running. */
  latest?: string;
  latestRows: number;
  signing: Promise<void>;
}

export class Attestor {
  private readonly chains = new Map<string, Chain>();
  private readonly max: number;
  private readonly every: number;
  private readonly bytes: number;

  constructor(private readonly init: AttestorInit) {
    this.max = init.maxSessions ?? 4096;
    this.every = Math.max(1, init.signEvery ?? 32);
    this.bytes = init.signBytes ?? 1 << 20;
  }

  get sessions(): number {
    return this.chains.size;
  }

  /**
   * A step ran: `input` and `output` are its wire bytes (they must not be
   * changed afterwards: they are hashed later). Returns at once.
   */
  record(scope: AttestScope, position: number, rows: number, input: Uint8Array, output: Uint8Array): void {
    let c = this.chains.get(scope.session);
    if (position === 0) {
      // A new session, or a replay from 0: the chain restarts where the KV cache did.
      c = { scope, rows: 0, end: 0, pending: [], pendingBytes: 0, acc: Promise.resolve(attestSeed(scope)), latestRows: 0, signing: Promise.resolve() };
    } else if (!c || position > c.end || !sameScope(c.scope, scope)) {
      // Nothing attested leads up to this step (the chain was dropped): nothing can be signed for it.
      if (c) this.chains.delete(scope.session);
      return;
    }
    this.chains.delete(scope.session);
    this.chains.set(scope.session, c); // most recently used last
    if (this.chains.size > this.max) this.chains.delete(this.chains.keys().next().value!);

    c.rows += rows;
    c.end = position + rows;
    c.pending.push({ position, rows, input, output });
    c.pendingBytes += input.byteLength + output.byteLength;
    if (c.pending.length >= this.every || c.pendingBytes >= this.bytes) this.flush(c, true);
  }

  /** The latest finished attestation of the session (an X-Meshnet-Attest entry), if any. */
  latest(session: string): string | undefined {
    return this.chains.get(session)?.latest;
  }

  /** The session's final attestation, covering every step (signs what waits); forgets the session. */
  async finish(session: string): Promise<string | undefined> {
    const c = this.chains.get(session);
    if (!c) return undefined;
    this.chains.delete(session);
    if (c.pending.length > 0) this.flush(c, false);
    await c.signing;
    return c.latest;
  }

  /** Forget a session without waiting (its KV was dropped). */
  drop(session: string): void {
    this.chains.delete(session);
  }

  /** Hash the waiting steps into the chain and sign its head; `defer`: after the current answer is on its way. */
  private flush(c: Chain, defer: boolean): void {
    const steps = c.pending;
    c.pending = [];
    c.pendingBytes = 0;
    const covered = c.rows;
    const prev = c.acc;
    const acc = (async () => {
      if (defer) await later();
      let a = await prev;
      const slice = new Slice();
      for (const s of steps) {
        const input = await digestSliced(s.input, slice);
        const output = await digestSliced(s.output, slice);
        a = chainStep(a, { position: s.position, rows: s.rows, input, output });
      }
      return a;
    })();
    c.acc = acc;
    const before = c.signing;
    const session = c.scope.session;
    c.signing = (async () => {
      try {
        const sig = await this.init.sign(attestMessage(session, covered, await acc));
        // The furthest signature wins: an older one finishing late must not replace a newer one.
        if (covered > c.latestRows) {
          c.latestRows = covered;
          c.latest = formatAttestation({ peer: this.init.peerId, rows: covered, signature: sig });
        }
      } catch (e) {
        this.init.onError?.(e);
      }
      await before;
    })();
  }
}

const later = (): Promise<void> => new Promise((r) => setTimeout(r, 0));

/** Longest stretch of hashing between two turns of the event loop, ms. */
const SLICE_MS = 1;
/** Bytes hashed between two looks at the clock. */
const CHUNK_BYTES = 64 * 1024;

/** When a stretch of hashing has held the event loop long enough to give it back. */
class Slice {
  private since = performance.now();
  due(): boolean {
    if (performance.now() - this.since < SLICE_MS) return false;
    this.since = performance.now();
    return true;
  }
}

/** SHA-256 of `bytes`, giving the event loop a turn whenever a slice is used up (a long prompt's rows in pieces). */
async function digestSliced(bytes: Uint8Array, slice: Slice): Promise<Uint8Array> {
  if (bytes.byteLength <= CHUNK_BYTES) {
    const d = sha256(bytes);
    if (slice.due()) await later();
    return d;
  }
  const h = sha256Stream();
  for (let o = 0; o < bytes.byteLength; o += CHUNK_BYTES) {
    h.update(bytes.subarray(o, o + CHUNK_BYTES));
    if (slice.due()) await later();
  }
  return h.digest();
}

function sameScope(a: AttestScope, b: AttestScope): boolean {
  return a.model === b.model && a.session === b.session && a.startLayer === b.startLayer && a.endLayer === b.endLayer && a.dtype === b.dtype && a.sampling === b.sampling;
}
