/**
 * A node's heartbeats sent as `beat` messages to a relay with
 * BEAT_BATCH_FEATURE (docs/protocol.md §9.1): each waits for its
 * `beat-answer` by id, for at most its timeout, and fails when the
 * connection it went out on drops. No stream, no frame: one small text
 * message each way, which the relay batches towards the tracker.
 */
import { MeshError } from '../protocol/errors.ts';
import { beatAnswerSchema } from '../protocol/beat-batch.ts';

/** A tracker's (or the relay's) answer to one beat: the status and the JSON body (an answer, or `{error}`). */
export interface BeatReply {
  status: number;
  body: unknown;
}

interface Waiting {
  resolve: (r: BeatReply) => void;
  reject: (e: unknown) => void;
  timer: ReturnType<typeof setTimeout>;
}

export class BeatCalls {
  private readonly waiting = new Map<number, Waiting>();
  private nextId = 0;

  get size(): number {
    return this.waiting.size;
  }

  /** Send one beat through `send` (the connection's text send) and wait for its answer. */
  call(send: (text: string) => void, to: string, body: unknown, timeoutMs: number): Promise<BeatReply> {
    this.nextId = this.nextId >= 0xffffffff ? 0 : this.nextId + 1;
    const id = this.nextId;
    return new Promise<BeatReply>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiting.delete(id);
        reject(new MeshError('MESH_ERR_TIMEOUT', `no answer to the heartbeat within ${timeoutMs} ms`));
      }, timeoutMs);
      this.waiting.set(id, { resolve, reject, timer });
      try {
        send(JSON.stringify({ type: 'beat', id, to, body }));
      } catch (e) {
        clearTimeout(timer);
        this.waiting.delete(id);
        reject(e);
      }
    });
  }

  /** A `beat-answer` from the relay; false when it is malformed or answers nothing waiting (late, after a timeout). */
  onAnswer(msg: object): boolean {
    const p = beatAnswerSchema.safeParse(msg);
    if (!p.success) return false;
    const w = this.waiting.get(p.data.id);
    if (w === undefined) return false;
    this.waiting.delete(p.data.id);
    clearTimeout(w.timer);
    w.resolve({ status: p.data.status, body: p.data.body });
    return true;
  }

  /** The connection dropped: every beat waiting fails with `err`. */
  failAll(err: MeshError): void {
    for (const w of this.waiting.values()) {
      clearTimeout(w.timer);
      w.reject(err);
    }
    this.waiting.clear();
  }
}
