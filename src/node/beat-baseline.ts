/**
 * What a tracker has of this node's fields, so a heartbeat can leave out
 * what did not change (docs/protocol.md §9, `same`). After a 200 from a
 * tracker the node remembers, per field a beat may omit, the JSON text it
 * sent (the acknowledged baseline); the next beat to the same tracker, by
 * the same way, on the same relay registration, omits each field whose text
 * is still that and names it in `same`. The tracker takes those from its
 * record of the node; one that has no record answers 404 and the node
 * registers in full, as after any tracker restart.
 *
 * Any other answer, a registration, another tracker: the baseline is
 * forgotten, and the next beat is whole. A beat that failed may still have
 * been applied, so only a 200 says what the tracker holds. Host-agnostic.
 */
import { SAME_FIELDS, type NodeBeat, type NodeMessage, type SameField } from '../protocol/tracker.ts';

/** A beat as it leaves: its body, and what to remember if the tracker answers it 200. */
export interface BeatToSend {
  body: NodeBeat;
  sent: Baseline;
}

interface Baseline {
  /** Where the beat went: `relay:<tracker peer id>` or `http:<tracker base URL>`. */
  to: string;
  /** The relay registration it was sent on (RelayClient.currentRegistration): a reconnect forgets. */
  on: object | undefined;
  texts: Partial<Record<SameField, string>>;
}

export class BeatBaseline {
  private acked: Baseline | undefined;

  /** `msg` as a beat to `to` (on relay registration `on`): less the fields the tracker acknowledged as they are now. */
  delta(to: string, on: object | undefined, msg: NodeMessage): BeatToSend {
    const base = this.acked !== undefined && this.acked.to === to && this.acked.on === on ? this.acked.texts : undefined;
    const texts: Partial<Record<SameField, string>> = {};
    let same: SameField[] | undefined;
    for (const name of SAME_FIELDS) {
      const v = msg[name];
      if (v === undefined) continue;
      const text = JSON.stringify(v);
      texts[name] = text;
      if (base?.[name] === text) (same ??= []).push(name);
    }
    const sent = { to, on, texts };
    if (same === undefined) return { body: msg, sent };
    const body: NodeBeat = { ...msg, same };
    for (const name of same) delete body[name];
    return { body, sent };
  }

  /**
   * `answer` of `beat`, remembered: acknowledged when `ok` says it is a 200
   * from a tracker that takes `same` (an older one would refuse such beats),
   * else (none, another status, thrown, an older tracker) the baseline is
   * forgotten.
   */
  async settle<T>(beat: BeatToSend, answer: Promise<T>, ok: (a: T) => boolean | undefined): Promise<T> {
    let a: T;
    try {
      a = await answer;
    } catch (e) {
      this.reset();
      throw e;
    }
    if (ok(a)) this.ack(beat);
    else this.reset();
    return a;
  }

  /** The tracker answered `beat` 200: it holds what was sent. */
  ack(beat: BeatToSend): void {
    this.acked = beat.sent;
  }

  /** Anything but a 200, a registration, another tracker: the next beat is whole. */
  reset(): void {
    this.acked = undefined;
  }
}
