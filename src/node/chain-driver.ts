/**
 * The head's side of chained hops (src/node/chain-hop.ts has the hops'):
 * one step sent down the chain, and the inbox where the last hop's token
 * arrives (`POST /chain/token`).
 *
 * The step is done when the token arrives; hop 1's answer (every non-last
 * hop's output, in route order) comes later, off the critical path, and the
 * pipeline files those rows into each hop's input history for replays. A
 * step fails (ChainStepError, naming the hop when one is known) when hop 1's
 * answer is an error before the token came, or no token comes within the
 * step timeout; the pipeline then runs that step as a star.
 */
import type { MeshReply } from '../protocol/envelopes.ts';
import { MeshError } from '../protocol/errors.ts';
import { H, type HeaderMap } from '../protocol/headers.ts';
import type { RouteHop } from '../protocol/tracker.ts';
import { chainFailure, isChainAnswer } from './chain-hop.ts';
import type { HopTransport } from './hop-transport.ts';

/** How the head answers which hop spoke: the route the tracker signed for this head. */
export interface SignedRouteText {
  text: string;
  expires: number;
  signature: string;
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

interface Waiter {
  resolve(body: Uint8Array): void;
}

/** Tokens the last hops hand back, by session and position. */
export class ChainInbox {
  private readonly waiting = new Map<string, Waiter>();

  /** Wait for the token of `session`'s step at `position`. */
  wait(session: string, position: number, timeoutMs: number, signal?: AbortSignal): { promise: Promise<Uint8Array>; cancel(): void } {
    const key = `${session}@${position}`;
    let cancel = () => undefined as void;
    const promise = new Promise<Uint8Array>((resolve, reject) => {
      const t = setTimeout(() => {
        this.waiting.delete(key);
        reject(new ChainStepError(undefined, new MeshError('MESH_ERR_TIMEOUT', `no token came back down the chain within ${timeoutMs} ms`)));
      }, timeoutMs);
      const onAbort = () => {
        cancel();
        reject(new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled'));
      };
      cancel = () => {
        clearTimeout(t);
        signal?.removeEventListener('abort', onAbort);
        if (this.waiting.get(key) === waiter) this.waiting.delete(key);
      };
      const waiter: Waiter = {
        resolve: (body) => {
          cancel();
          resolve(body);
        },
      };
      this.waiting.set(key, waiter);
      signal?.addEventListener('abort', onAbort, { once: true });
    });
    return { promise, cancel: () => cancel() };
  }

  /** A last hop's token; false when no step waits for it (late, or never asked). */
  deliver(session: string, position: number, body: Uint8Array): boolean {
    const w = this.waiting.get(`${session}@${position}`);
    if (!w) return false;
    w.resolve(body);
    return true;
  }

  get pending(): number {
    return this.waiting.size;
  }
}

export interface ChainStepInit {
  transport: Pick<HopTransport, 'send'>;
  inbox: ChainInbox;
  headPeerId: string;
  self: HeadAddress;
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

/** Send one step down the chain; resolves with the token's JSON and hop 1's answer to come (the other hops' outputs). */
export async function chainStep(s: ChainStepInit): Promise<{ token: Uint8Array; copies: Promise<MeshReply> }> {
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
    [H.chainReply]: JSON.stringify(s.self),
    [H.chainIndex]: '0',
    [H.chainBudget]: String(s.timeoutMs),
    'content-type': 'application/octet-stream',
  };
  if (s.position === 0) headers[H.sessionTokens] = String(s.declared);
  const token = s.inbox.wait(s.session, s.position, s.timeoutMs, s.signal);
  const first = s.hops[0]!;
  // Hop 1 answers after the whole chain has: give it time for the answers' way back too.
  const copies = s.transport.send(first, { method: 'POST', path: '/forward', headers, body: s.body }, s.timeoutMs + 5_000, s.signal, { accept: isChainAnswer });
  const failed = copies.then(
    (r) => {
      if (r.status !== 200) {
        const f = chainFailure(r);
        throw new ChainStepError(f.peer, f.error);
      }
      if (r.headers[H.chain] === undefined) throw new ChainStepError(first.peer_id, new MeshError('MESH_ERR_UPSTREAM', `hop ${first.peer_id} does not chain (an ADR-era node?)`));
      // Answered without error: the token is here already (the last hop waits for our 204), or the inbox times out.
      return new Promise<never>(() => undefined);
    },
    (e: unknown) => {
      throw new ChainStepError(first.peer_id, e instanceof MeshError ? e : new MeshError('MESH_ERR_PEER_GONE', String(e)));
    },
  );
  failed.catch(() => undefined);
  copies.catch(() => undefined);
  try {
    return { token: await Promise.race([token.promise, failed]), copies };
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

/** One generation's chain: whether steps may still go down it, and the copies of hops' outputs still on their way. */
export class ChainState {
  off: boolean;
  private copies: Promise<void> = Promise.resolve();
  private broken = false;
  constructor(
    readonly signed: SignedRouteText | undefined,
    private readonly planned: readonly RouteHop[],
  ) {
    // One downstream hop: the chain has the star's two legs, and the star needs no signature on the way.
    this.off = signed === undefined || planned.length < 2;
  }

  /** Chain while the hops are the signed ones (a replacement is not in the signature), all in sync, and the route has time left. */
  usable(hops: readonly ChainHopState[]): boolean {
    if (this.off) return false;
    if (hops.length !== this.planned.length || hops.some((h, k) => h.hop !== this.planned[k] || !h.synced)) return false;
    return Date.now() + 1_000 < this.signed!.expires;
  }

  /** File hop 1's answer (hops 1..n−2's outputs, each `stepBytes`) into hops 2..n's input histories, in step order. */
  file(hops: readonly ChainHopState[], answer: Promise<MeshReply>, total: number, stepBytes: number): void {
    const prev = this.copies;
    this.copies = (async () => {
      await prev;
      try {
        const r = await answer;
        if (r.status !== 200 || r.body.byteLength !== (hops.length - 1) * stepBytes) throw new Error(`hop 1 answered ${r.status} with ${r.body.byteLength} bytes`);
        for (let k = 1; k < hops.length; k++) hops[k]!.history.extendTo(total, r.body.subarray((k - 1) * stepBytes, k * stepBytes));
      } catch {
        this.broken = true;
      }
    })();
  }

  /** True once every copy sent so far is filed; false when one never came, or has not within `waitMs` (a failure is not held up by a hop that answers slowly). */
  async settled(waitMs: number): Promise<boolean> {
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<boolean>((resolve) => (timer = setTimeout(() => resolve(false), waitMs)));
    try {
      return await Promise.race([this.copies.then(() => !this.broken), late]);
    } finally {
      clearTimeout(timer);
    }
  }
}

