/**
 * The head's side of chained hops (src/node/hop/chain-hop.ts has the hops'):
 * one step sent down the chain, and the inbox where the last hop's token
 * arrives (`POST /chain/token`) or a hop's failure report (`POST /chain/failed`).
 *
 * The step is done when the token arrives; its body holds every non-first
 * hop's input rows for this step (they travelled down the chain with the
 * activation), which the pipeline files into the hops' input histories for
 * replays. A step fails (ChainStepError, naming the hop when one is known)
 * when a hop reports a failure, hop 1 refuses at once (a two-way answer, or
 * the relay's error), or no token comes within the step timeout; the
 * pipeline then runs that step as a star.
 */
import { MeshError } from '../../protocol/errors.ts';
import { H, type HeaderMap } from '../../protocol/headers.ts';
import type { RouteHop } from '../../protocol/tracker.ts';
import { chainFailure, isChainAnswer } from '../hop/chain-hop.ts';
import type { HopTransport } from '../../net/hop-transport.ts';
import { trace } from '../../protocol/trace.ts';

/** The route as the tracker signed it for this head, with the head's reply address when the tracker signed that too. */
export interface SignedRouteText {
  text: string;
  expires: number;
  signature: string;
  /** X-Meshnet-Chain-Reply and the tracker's signature over it (chainReplySigningMessage); absent: no chain (hops cannot trust where to send the token). */
  reply?: { text: string; signature: string };
}

/** Where the last hop reaches the head (its peer id is the signed head id). */
export interface HeadAddress {
  relay_addr?: string;
  endpoint?: string;
}

export class ChainStepError extends Error {
  constructor(
    /** The hop that failed or refused, when the chain said. */
    readonly peer: string | undefined,
    readonly error: MeshError,
  ) {
    super(`${peer ? `hop ${peer}: ` : ''}${error.message}`);
  }
}

/** What the last hop hands back: the token's JSON and the rows the head files. */
export interface ChainArrival {
  token: string;
  rows: Uint8Array;
}

interface Waiter {
  resolve(a: ChainArrival): void;
  reject(e: ChainStepError): void;
}

/** Tokens the last hops hand back, and failures hops report, by session and position. */
export class ChainInbox {
  private readonly waiting = new Map<string, Waiter>();
  /**
   * Abort callbacks of the waits by the signal they follow: one listener per
   * signal (a generation's), not one per step. An AbortSignal's
   * addEventListener is costly in Node (tens of µs here), and a head paid it
   * per chat per token.
   */
  private readonly bySignal = new WeakMap<AbortSignal, Set<() => void>>();

  private follow(signal: AbortSignal, onAbort: () => void): () => void {
    let set = this.bySignal.get(signal);
    if (!set) {
      const waits = new Set<() => void>();
      set = waits;
      this.bySignal.set(signal, waits);
      signal.addEventListener('abort', () => {
        for (const f of [...waits]) f();
        waits.clear();
      }, { once: true });
    }
    set.add(onAbort);
    const waits = set;
    return () => void waits.delete(onAbort);
  }

  /** Wait for the token of `session`'s step at `position`. */
  wait(session: string, position: number, timeoutMs: number, signal?: AbortSignal): { promise: Promise<ChainArrival>; cancel(): void } {
    const key = `${session}@${position}`;
    let cancel = () => undefined as void;
    const promise = new Promise<ChainArrival>((resolve, reject) => {
      const t = setTimeout(() => {
        this.waiting.delete(key);
        reject(new ChainStepError(undefined, new MeshError('MESH_ERR_TIMEOUT', `no token came back down the chain within ${timeoutMs} ms`)));
      }, timeoutMs);
      const onAbort = () => {
        cancel();
        reject(new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled'));
      };
      let unfollow: (() => void) | undefined;
      cancel = () => {
        clearTimeout(t);
        unfollow?.();
        if (this.waiting.get(key) === waiter) this.waiting.delete(key);
      };
      const waiter: Waiter = {
        resolve: (a) => {
          cancel();
          resolve(a);
        },
        reject: (e) => {
          cancel();
          reject(e);
        },
      };
      this.waiting.set(key, waiter);
      if (signal?.aborted) onAbort();
      else if (signal) unfollow = this.follow(signal, onAbort);
    });
    return { promise, cancel: () => cancel() };
  }

  /** A last hop's token; false when no step waits for it (late, or never asked). */
  deliver(session: string, position: number, arrival: ChainArrival): boolean {
    const w = this.waiting.get(`${session}@${position}`);
    if (!w) return false;
    w.resolve(arrival);
    return true;
  }

  /** A hop's report that the step failed (the first report wins); false when no step waits. */
  fail(session: string, position: number, peer: string | undefined, error: MeshError): boolean {
    const w = this.waiting.get(`${session}@${position}`);
    if (!w) return false;
    w.reject(new ChainStepError(peer, error));
    return true;
  }

  get pending(): number {
    return this.waiting.size;
  }
}

export interface ChainStepInit {
  transport: Pick<HopTransport, 'push'>;
  inbox: ChainInbox;
  headPeerId: string;
  signed: SignedRouteText;
  /** The downstream hops, as signed. */
  hops: readonly RouteHop[];
  /** This step's rows in `dtype`, seq × hidden. */
  body: Uint8Array;
  dtype: string;
  hidden: number;
  seq: number;
  position: number;
  session: string;
  sampling: string;
  /** Sent with position 0: the hops reserve KV room for the whole session. */
  declared: number;
  timeoutMs: number;
  signal?: AbortSignal;
}

/** How long a one-way push to hop 1 waits for the relay's error (no such peer …) before it counts as delivered. */
const PUSH_WINDOW_MS = 2_000;

/** Send one step down the chain; resolves with what the last hop handed back. */
export async function chainStep(s: ChainStepInit): Promise<ChainArrival> {
  const headers: HeaderMap = {
    [H.shape]: `1,${s.seq},${s.hidden}`,
    [H.dtype]: s.dtype,
    [H.session]: s.session,
    [H.position]: String(s.position),
    [H.startLayer]: String(s.hops[0]!.start_layer),
    [H.endLayer]: String(s.hops[0]!.end_layer),
    [H.sampling]: s.sampling,
    [H.route]: s.signed.text,
    [H.routeExpires]: String(s.signed.expires),
    [H.routeSignature]: s.signed.signature,
    [H.chainHead]: s.headPeerId,
    [H.chainIndex]: '0',
    [H.chainBudget]: String(s.timeoutMs),
    'content-type': 'application/octet-stream',
  };
  if (s.signed.reply) {
    headers[H.chainReply] = s.signed.reply.text;
    headers[H.chainReplySignature] = s.signed.reply.signature;
  }
  if (s.position === 0) headers[H.sessionTokens] = String(s.declared);
  const token = s.inbox.wait(s.session, s.position, s.timeoutMs, s.signal);
  const first = s.hops[0]!;
  // One-way where the relay allows it: then only a relay error comes back; two-way (ADR-era relay, HTTP): hop 1 answers 202 once it handed the step on.
  const sent = s.transport.push(first, { method: 'POST', path: '/forward', headers, body: s.body }, s.timeoutMs, PUSH_WINDOW_MS, s.signal, { accept: isChainAnswer });
  trace?.('head-pushed', s.session, s.position);
  const failed = sent.then(
    (r) => {
      if (r.status >= 300) {
        const f = chainFailure(r);
        throw new ChainStepError(f.peer ?? first.peer_id, f.error);
      }
      if (r.status === 200) {
        throw new ChainStepError(first.peer_id, new MeshError('MESH_ERR_UPSTREAM', `hop ${first.peer_id} does not chain (an ADR-era node?)`));
      }
      // Accepted: the token (or a failure report) comes through the inbox, or the inbox times out.
      return new Promise<never>(() => undefined);
    },
    (e: unknown) => {
      throw new ChainStepError(first.peer_id, e instanceof MeshError ? e : new MeshError('MESH_ERR_PEER_GONE', String(e)));
    },
  );
  failed.catch(() => undefined);
  try {
    return await Promise.race([token.promise, failed]);
  } finally {
    token.cancel();
  }
}

/** What the chain needs of the pipeline's per-hop state. */
export interface ChainHopState {
  hop: RouteHop;
  synced: boolean;
  history: { extendTo(total: number, rows: Uint8Array): void };
}

function sameHop(a: RouteHop, b: RouteHop): boolean {
  return a.peer_id === b.peer_id && a.start_layer === b.start_layer && a.end_layer === b.end_layer;
}

/** Failed chain steps after which a generation stays a star (a hop that keeps failing the chain: it may not chain at all). */
const MAX_FAILURES = 3;

/** One generation's chain: whether steps may go down it, and how long one may take. */
export class ChainState {
  off = true;
  signed: SignedRouteText | undefined;
  private planned: readonly RouteHop[] = [];
  /** Moving average of a chained one-token step, ms (sets the step timeout). */
  private stepMs: number | undefined;
  private failures = 0;
  /** `enabled`: the head runs in chain mode. */
  constructor(
    private readonly enabled: boolean,
    signed: SignedRouteText | undefined,
    planned: readonly RouteHop[],
  ) {
    this.set(signed, planned);
  }

  private set(signed: SignedRouteText | undefined, planned: readonly RouteHop[]): void {
    this.signed = signed;
    this.planned = planned;
    // One downstream hop: the chain has the star's two legs, and the star needs no signature on the way.
    // No signed reply address: hops could not trust where the token goes.
    this.off = !this.enabled || signed === undefined || signed.reply === undefined || planned.length < 2;
  }

  /**
   * After a replacement: the tracker's route with the replacement in place.
   * Steps chain again once every hop is in sync (the star step that
   * replayed the replacement made it so) — usable() checks the hops are
   * exactly these.
   */
  renew(signed: SignedRouteText, planned: readonly RouteHop[]): void {
    this.set(signed, planned);
  }

  /**
   * A chain step failed and ran as a star. The star leaves every hop in sync
   * (replayed where it answered 409), so the next step may chain again as
   * long as the hops are still the signed ones (a replacement is not, unless
   * the tracker re-signed the route: renew()); a late push of the failed step
   * meets a hop that is past it and is refused (409) without harm. After
   * MAX_FAILURES failed steps the generation stays a star.
   */
  failed(): void {
    if (++this.failures >= MAX_FAILURES) this.off = true;
  }

  /** Chain while the hops are the signed ones, all in sync, and the route has time left. */
  usable(hops: readonly ChainHopState[]): boolean {
    if (this.off) return false;
    if (hops.length !== this.planned.length || hops.some((h, k) => !sameHop(h.hop, this.planned[k]!) || !h.synced)) return false;
    return Date.now() + 1_000 < this.signed!.expires;
  }

  /**
   * How long to wait for a one-token step's token: a one-way push lost with
   * a hop that died as it arrived is reported by nobody, so a decode step
   * waits a few times its usual length (at least `floorMs`), not the whole
   * `maxMs`; the star then finds the failed hop. Prompts get `maxMs`.
   */
  timeout(seq: number, maxMs: number, floorMs = 2_000): number {
    if (seq > 1 || this.stepMs === undefined) return maxMs;
    return Math.min(maxMs, Math.max(floorMs, Math.round(this.stepMs * 10)));
  }

  observe(seq: number, ms: number): void {
    if (seq !== 1) return;
    this.stepMs = this.stepMs === undefined ? ms : this.stepMs + 0.2 * (ms - this.stepMs);
  }

  /**
   * File the last hop's rows (hops 2..n's inputs, each `stepBytes`) into
   * their input histories; false (nothing filed) when the size is wrong.
   */
  file(hops: readonly ChainHopState[], rows: Uint8Array, total: number, stepBytes: number): boolean {
    if (rows.byteLength !== (hops.length - 1) * stepBytes) return false;
    for (let k = 1; k < hops.length; k++) hops[k]!.history.extendTo(total, rows.subarray((k - 1) * stepBytes, k * stepBytes));
    return true;
  }
}
