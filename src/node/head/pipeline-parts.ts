/**
 * Pieces of the head's pipeline (pipeline.ts) that need none of its state:
 * a hop's input history, and how hops' answers become tokens and errors.
 */
import type { MeshReply } from '../../protocol/envelopes.ts';
import { MeshError, remoteError } from '../../protocol/errors.ts';
import { H } from '../../protocol/headers.ts';
import { SESSION_ID_RE } from '../../protocol/ids.ts';
import type { GenerateEvent, RouteHop } from '../../protocol/tracker.ts';
import { z } from 'zod';

const tokenAnswerSchema = z.object({
  token_id: z.number().int().nonnegative(),
  text: z.string().optional(),
  logprob: z.number(),
  /** A verification step's answer: drafts accepted (they precede token_id), and every emitted token's log-probability. */
  accepted: z.number().int().nonnegative().max(64).optional(),
  logprobs: z.array(z.number()).max(65).optional(),
});
export type TokenAnswer = z.infer<typeof tokenAnswerSchema>;
const utf8d = new TextDecoder();

/** Input activations a hop has been sent so far, rows of `rowBytes`, in one buffer grown by doubling. */
export class History {
  private buf: Uint8Array;
  rows = 0;
  constructor(private readonly rowBytes: number, initialRows: number) {
    this.buf = new Uint8Array(rowBytes * Math.max(1, initialRows));
  }
  private reserve(rows: number): void {
    const need = rows * this.rowBytes;
    if (need <= this.buf.byteLength) return;
    const next = new Uint8Array(Math.max(need, this.buf.byteLength * 2));
    next.set(this.buf.subarray(0, this.rows * this.rowBytes));
    this.buf = next;
  }
  /** Make the history `total` rows long, given `rows` that end at `total` (the step's input, or all of it). */
  extendTo(total: number, rows: Uint8Array): void {
    if (this.rows === total) return; // already recorded (a retry of the same step)
    const n = rows.byteLength / this.rowBytes;
    if (n === total) {
      this.reserve(total);
      this.buf.set(rows);
    } else if (this.rows + n === total) {
      this.reserve(total);
      this.buf.set(rows, this.rows * this.rowBytes);
    } else throw new MeshError('MESH_ERR_INTERNAL', `hop history has ${this.rows} rows, cannot reach ${total} with ${n} more`);
    this.rows = total;
  }
  view(): Uint8Array {
    return this.buf.subarray(0, this.rows * this.rowBytes);
  }
  /**
   * Keep the first `rows` rows (a verification's rejected rows go). The rows cut are kept aside, by
   * the row they started at, while `keepCut` is set: the hop signed them, and a spot-check rebuilds
   * each step as it was computed (`cutAt`).
   */
  truncate(rows: number, keepCut = false): void {
    const to = Math.min(this.rows, Math.max(0, rows));
    if (keepCut && to < this.rows) this.cuts.set(to, this.buf.slice(to * this.rowBytes, this.rows * this.rowBytes));
    this.rows = to;
  }
  private readonly cuts = new Map<number, Uint8Array>();
  /** The rows a cut at `row` dropped (truncate with keepCut), if any. */
  cutAt(row: number): Uint8Array | undefined {
    return this.cuts.get(row);
  }
}

/** The last hop's token JSON: a star step's answer body, or the text a chained step's token came in. */
export function parseTokenAnswer(body: Uint8Array | string, hop: RouteHop): TokenAnswer {
  let v: unknown;
  try {
    v = JSON.parse(typeof body === 'string' ? body : utf8d.decode(body));
  } catch {
    throw new MeshError('MESH_ERR_UPSTREAM', `the last hop ${hop.peer_id} answered something other than a token JSON; does it hold layer ${hop.end_layer - 1} and the LM head?`);
  }
  const p = tokenAnswerSchema.safeParse(v);
  if (!p.success) throw new MeshError('MESH_ERR_UPSTREAM', `the last hop ${hop.peer_id} answered ${JSON.stringify(v).slice(0, 120)}, not {token_id, text, logprob}`);
  return p.data;
}


/** A hop's 503 MESH_ERR_BUSY as the generation's error: it names the node, so the tracker routes around it or queues. */
export function busyError(hop: RouteHop, reply: MeshReply): MeshError {
  const remote = remoteError(reply.status, reply.body);
  // MESH_ERR_UNAVAILABLE: the hop's GPU device was lost and its span is being rebuilt (device-recovery.ts).
  const message = remote.code === 'MESH_ERR_BUSY' || remote.code === 'MESH_ERR_UNAVAILABLE' ? remote.message : 'no KV room';
  let retry = remote.details.retry_after_ms;
  if (typeof retry !== 'number') {
    const h = Number(reply.headers[H.retryAfter]);
    retry = Number.isFinite(h) && reply.headers[H.retryAfter] !== undefined ? h * 1000 : undefined;
  }
  return new MeshError('MESH_ERR_BUSY', `hop ${hop.peer_id} [${hop.start_layer}, ${hop.end_layer}): ${message}`, { peer_id: hop.peer_id, ...(retry !== undefined ? { retry_after_ms: retry } : {}) });
}

/** Our own span's GPU device was lost and it is being rebuilt (UNAVAILABLE with a Retry-After): like no room, the tracker routes the chat again. */
export function isRebuilding(e: MeshError): boolean {
  return e.code === 'MESH_ERR_UNAVAILABLE' && typeof e.details.retry_after_ms === 'number';
}

export function errorEvent(e: unknown): GenerateEvent {
  if (e instanceof MeshError) {
    const peer = e.details.peer_id;
    const retry = e.details.retry_after_ms;
    return { type: 'error', code: e.code, message: e.message, ...(typeof peer === 'string' ? { peer_id: peer } : {}), ...(typeof retry === 'number' ? { retry_after_ms: retry } : {}) };
  }
  return { type: 'error', code: 'MESH_ERR_INTERNAL', message: e instanceof Error ? e.message : String(e) };
}

let sessionCounter = 0;

/** The KV session id on every hop: the tracker's id when it is header-safe, plus a per-run suffix so two runs never share caches. */
export function sessionIdFor(sessionId: string): string {
  const base = SESSION_ID_RE.test(sessionId) ? sessionId.slice(0, 100) : 'gen';
  return `${base}.${(++sessionCounter).toString(36)}${Math.floor(Math.random() * 1e9).toString(36)}`;
}
