/**
 * Heartbeats batched towards a tracker (docs/protocol.md §9.1): the relay's
 * side of BEAT_BATCH_FEATURE. Beats addressed to one tracker wait here until
 * `beatBatchFill` are queued, or at most `beatBatchMs` after the first of
 * them, then leave as ONE `beats` message; the tracker's ONE `beats-answer`
 * is fanned back out, one `beat-answer` per node. A tracker then pays one
 * WebSocket message, one parse and one answer per batch instead of one
 * request stream per beat (what cost it ~150 µs a beat). It pays about as
 * much per message as per beat, so a batch should hold a few dozen beats;
 * the fill sends a busy tracker's batch as soon as it does, so only a
 * tracker with few beats waits the whole window.
 *
 * Every beat gets exactly one answer: the tracker's, or the relay's own error
 * (target not here or not taking batches, backpressure, the tracker leaving,
 * its answer missing or malformed, the deadline, shutdown). A node falls back
 * to the request path on any of them, so an answer here never strands one.
 */
import {
  MAX_BEAT_MESSAGE_CHARS,
  MAX_BEATS_PER_BATCH,
  MeshError,
  beatAnswerEntrySchema,
  beatBatchAnswerSchema,
  beatMessageSchema,
  type MeshErrorCode,
} from '../protocol/index.ts';
import type { RelayMetrics } from './metrics.ts';

/**
 * A peer as the batcher sees it. The stream table's PeerConn has these; the batcher names only what it reads, so
 * that the table can own a batcher without the two modules importing each other.
 */
export interface BeatPeer {
  readonly id: string;
  readonly socket: BeatSocket;
  /** A tracker that declared the batch feature when it registered. */
  readonly acceptsBeats: boolean;
  /**
   * It was sent `registered` (in a cluster, once NATS has it). Before that its client ignores every message,
   * so a batch sent then is never answered: its beats wait here until it is (StreamTable.announced).
   */
  readonly announced: boolean;
}

/** The socket an answer goes back on (the table's PeerSocket). */
export interface BeatSocket {
  /** Bytes queued towards the far side and not yet written. */
  readonly bufferedAmount: number;
}

/** What the batcher needs of the stream table. */
export interface BeatBatcherHost {
  readonly peers: ReadonlyMap<string, BeatPeer>;
  readonly closing: boolean;
  sendTo(socket: BeatSocket, text: string): void;
  now(): number;
}

interface Caller {
  peer: BeatPeer;
  id: number;
}

/** Beats queued for one tracker, not yet sent. */
interface Queue {
  parts: string[];
  callers: Caller[];
  /** When it leaves at the latest (its first beat's arrival plus the window), if its target was told it is registered by then. */
  due: number;
}

/** A batch sent to a tracker, waiting for its answer. */
interface Sent {
  target: BeatPeer;
  callers: Caller[];
  deadline: number;
}

/** Beats queued or in flight towards one tracker before new ones get 503: ten windows of a 10,000-donor relay. */
const MAX_BEATS_PENDING_PER_TARGET = 20_000;

export class BeatBatcher {
  private readonly queues = new Map<BeatPeer, Queue>();
  private readonly sent = new Map<number, Sent>();
  /** Beats queued or sent per target, for the bound above. */
  private readonly pending = new Map<BeatPeer, number>();
  private nextBatch = 0;
  private timer: ReturnType<typeof setTimeout> | undefined;
  /** When `timer` fires. */
  private timerAt = Infinity;
  private readonly flushOnTimer = (): void => {
    this.timer = undefined;
    this.timerAt = Infinity;
    this.flushDue();
  };

  constructor(
    private readonly host: BeatBatcherHost,
    private readonly o: { beatBatchMs: number; beatBatchFill: number; requestTimeoutMs: number; highWaterBytes: number },
    private readonly metrics: RelayMetrics,
  ) {}

  /** Beats queued or waiting for the tracker's answer. */
  get inFlight(): number {
    let n = 0;
    for (const v of this.pending.values()) n += v;
    return n;
  }

  /** A `beat` from a registered peer (already JSON-parsed; `chars` its length as sent). */
  onBeat(peer: BeatPeer, msg: unknown, chars: number): void {
    const p = beatMessageSchema.safeParse(msg);
    if (!p.success) {
      const id = (msg as { id?: unknown }).id;
      const issue = p.error.issues[0]!;
      const why = `malformed beat: ${issue.path.join('.') || 'message'}: ${issue.message}`;
      if (typeof id === 'number' && Number.isInteger(id) && id >= 0 && id <= 0xffffffff) return this.refuse(peer, id, 'MESH_ERR_BAD_REQUEST', why);
      this.metrics.errors.inc({ code: 'MESH_ERR_BAD_REQUEST' });
      this.host.sendTo(peer.socket, JSON.stringify({ type: 'error', code: 'MESH_ERR_BAD_REQUEST', message: why }));
      return;
    }
    const { id, to, body } = p.data;
    if (chars > MAX_BEAT_MESSAGE_CHARS) return this.refuse(peer, id, 'MESH_ERR_TOO_LARGE', `a beat of ${chars} characters is over the limit of ${MAX_BEAT_MESSAGE_CHARS}`);
    if (this.host.closing) return this.refuse(peer, id, 'MESH_ERR_SHUTTING_DOWN', 'relay is shutting down; retry on another relay');
    const target = this.host.peers.get(to);
    // Not here (a tracker on another relay of a cluster: the request path crosses over), or an older tracker: the request path.
    if (target === undefined) return this.refuse(peer, id, 'MESH_ERR_NO_SUCH_PEER', `peer ${to} is not attached to this relay`);
    if (!target.acceptsBeats) return this.refuse(peer, id, 'MESH_ERR_NO_SUCH_PEER', `peer ${to} does not take batched beats`, { batch: 'unsupported' });
    const pending = this.pending.get(target) ?? 0;
    if (pending >= MAX_BEATS_PENDING_PER_TARGET || target.socket.bufferedAmount > this.o.highWaterBytes) {
      return this.refuse(peer, id, 'MESH_ERR_BACKPRESSURE', `peer ${to} is not keeping up (${pending} beats pending)`);
    }
    this.pending.set(target, pending + 1);
    let q = this.queues.get(target);
    if (q === undefined) {
      q = { parts: [], callers: [], due: this.host.now() + this.o.beatBatchMs };
      this.queues.set(target, q);
      this.armFor(q.due);
    }
    // `from` is the relay's word for who sent it, as on the fast path; the body goes on as the node wrote it.
    q.parts.push(`{"from":"${peer.id}","body":${JSON.stringify(body)}}`);
    q.callers.push({ peer, id });
    this.metrics.beats.inc();
    if (q.parts.length >= this.o.beatBatchFill && target.announced) this.flush(target, q);
  }

  /** A `beats-answer` from a peer: fan its answers out to the nodes of that batch. */
  onAnswer(peer: BeatPeer, msg: unknown): void {
    const p = beatBatchAnswerSchema.safeParse(msg);
    if (!p.success) {
      const issue = p.error.issues[0]!;
      this.metrics.errors.inc({ code: 'MESH_ERR_BAD_REQUEST' });
      this.host.sendTo(peer.socket, JSON.stringify({ type: 'error', code: 'MESH_ERR_BAD_REQUEST', message: `malformed beats-answer: ${issue.path.join('.') || 'message'}: ${issue.message}` }));
      return;
    }
    const s = this.sent.get(p.data.batch);
    if (s === undefined || s.target !== peer) return; // late (timed out), or not this peer's to answer
    this.settle(p.data.batch, s);
    const answers = p.data.answers;
    if (p.data.error !== undefined || answers === undefined || answers.length !== s.callers.length) {
      const why = p.data.error ? `${p.data.error.code}: ${p.data.error.message}` : `${answers?.length ?? 'no'} answers to ${s.callers.length} beats`;
      for (const c of s.callers) this.refuse(c.peer, c.id, 'MESH_ERR_UPSTREAM', `the tracker refused the batch (${why})`);
      return;
    }
    for (let i = 0; i < answers.length; i++) {
      const c = s.callers[i]!;
      const a = beatAnswerEntrySchema.safeParse(answers[i]);
      if (!a.success) this.refuse(c.peer, c.id, 'MESH_ERR_UPSTREAM', 'the tracker answered this beat with a malformed entry');
      else this.host.sendTo(c.peer.socket, JSON.stringify({ type: 'beat-answer', id: c.id, status: a.data.status, body: a.data.body }));
    }
  }

  /** `peer` left: beats for it (queued or sent) fail with 502; beats it sent are answered into a closed socket (dropped). */
  peerGone(peer: BeatPeer): void {
    const q = this.queues.get(peer);
    if (q !== undefined) {
      this.queues.delete(peer);
      this.failCallers(q.callers, 'MESH_ERR_PEER_GONE', `peer ${peer.id} went away before the beat was sent`);
    }
    for (const [batch, s] of this.sent) {
      if (s.target !== peer) continue;
      this.settle(batch, s);
      this.failCallers(s.callers, 'MESH_ERR_PEER_GONE', `peer ${peer.id} went away before answering`);
    }
    this.pending.delete(peer);
  }

  /** Batches past their deadline: 504 to each beat. */
  sweep(): void {
    const now = this.host.now();
    for (const [batch, s] of this.sent) {
      if (s.deadline > now) continue;
      this.settle(batch, s);
      this.failCallers(s.callers, 'MESH_ERR_TIMEOUT', `peer ${s.target.id} did not answer the batch within ${this.o.requestTimeoutMs} ms`);
    }
  }

  /** Answer every beat queued or in flight with `code` (shutdown). */
  failAll(code: MeshErrorCode, message: string): void {
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
    this.timerAt = Infinity;
    for (const q of this.queues.values()) this.failCallers(q.callers, code, message);
    this.queues.clear();
    for (const [batch, s] of this.sent) {
      this.settle(batch, s);
      this.failCallers(s.callers, code, message);
    }
    this.pending.clear();
  }

  /** `target` was sent `registered`: the beats that waited for it leave now. */
  announced(target: BeatPeer): void {
    const q = this.queues.get(target);
    if (q !== undefined) this.flush(target, q);
  }

  /** Send the queues whose window is over, then wait for the next one's. */
  private flushDue(): void {
    const now = this.host.now();
    let next = Infinity;
    for (const [target, q] of this.queues) {
      // A target not told it is registered yet keeps its queue (bounded by MAX_BEATS_PENDING_PER_TARGET) until it is (announced()).
      if (!target.announced) continue;
      if (q.due <= now) this.flush(target, q);
      else next = Math.min(next, q.due);
    }
    if (next !== Infinity) this.armFor(next);
  }

  /** The timer fires by `at` (one timer for every queue: there is a queue per tracker, a handful). */
  private armFor(at: number): void {
    if (at >= this.timerAt) return;
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timerAt = at;
    this.timer = setTimeout(this.flushOnTimer, Math.max(0, at - this.host.now()));
    this.timer.unref?.();
  }

  private flush(target: BeatPeer, q: Queue): void {
    this.queues.delete(target);
    // One message as a rule; several only for a queue that waited past MAX_BEATS_PER_BATCH for its target's `registered`.
    for (let i = 0; i < q.parts.length; i += MAX_BEATS_PER_BATCH) {
      const n = Math.min(MAX_BEATS_PER_BATCH, q.parts.length - i);
      const parts = n === q.parts.length ? q.parts : q.parts.slice(i, i + n);
      const callers = n === q.callers.length ? q.callers : q.callers.slice(i, i + n);
      this.nextBatch = this.nextBatch >= 0xffffffff ? 1 : this.nextBatch + 1;
      const batch = this.nextBatch;
      this.sent.set(batch, { target, callers, deadline: this.host.now() + this.o.requestTimeoutMs });
      this.metrics.beatBatches.inc();
      this.host.sendTo(target.socket, `{"type":"beats","batch":${batch},"beats":[${parts.join(',')}]}`);
    }
  }

  private settle(batch: number, s: Sent): void {
    this.sent.delete(batch);
    const left = (this.pending.get(s.target) ?? 0) - s.callers.length;
    if (left > 0) this.pending.set(s.target, left);
    else this.pending.delete(s.target);
  }

  private failCallers(callers: Caller[], code: MeshErrorCode, message: string): void {
    for (const c of callers) this.refuse(c.peer, c.id, code, message);
  }

  /** The relay's own answer to one beat: an error the node reads as the request path reads the relay's error frames. */
  private refuse(peer: BeatPeer, id: number, code: MeshErrorCode, message: string, details?: Record<string, unknown>): void {
    const e = new MeshError(code, message, details);
    this.metrics.errors.inc({ code });
    this.host.sendTo(peer.socket, JSON.stringify({ type: 'beat-answer', id, status: e.status, body: e.toBody() }));
  }
}
