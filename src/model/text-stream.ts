/**
 * Generated text as a stream: token ids in, text deltas out (StreamDecoder),
 * and stop strings over those deltas (StopMatcher). The head runs both per
 * generation; the tracker runs the stop matcher again over what heads send,
 * so a stop string split across a head failover still stops the stream.
 * No dependency: the decode function is the caller's (ModelTokenizer.decode).
 */

/**
 * Text deltas for ids arriving one at a time. A token can end mid-way through
 * a UTF-8 character (byte-level BPE splits emoji); its decode then ends in
 * U+FFFD and nothing is emitted until the character completes. Only a short
 * window of recent ids is re-decoded, so cost per token stays constant.
 */
export class StreamDecoder {
  private ids: number[] = [];
  private prefix = 0;
  private read = 0;

  constructor(private readonly decodeFn: (ids: number[]) => string) {}

  /** Append one id; returns the newly completed text (possibly ""). */
  push(id: number): string {
    this.ids.push(id);
    const prev = this.decodeFn(this.ids.slice(this.prefix, this.read));
    const text = this.decodeFn(this.ids.slice(this.prefix));
    if (text.length > prev.length && !text.endsWith('\uFFFD')) {
      this.prefix = this.read;
      this.read = this.ids.length;
      return text.slice(prev.length);
    }
    return '';
  }

  /** Whatever is still held back (e.g. a genuinely broken byte sequence at the end). */
  flush(): string {
    const prev = this.decodeFn(this.ids.slice(this.prefix, this.read));
    const text = this.decodeFn(this.ids.slice(this.prefix));
    this.prefix = this.read = this.ids.length;
    return text.slice(prev.length);
  }

  get tokenIds(): readonly number[] {
    return this.ids;
  }
}

/**
 * Stop strings over a stream of text pieces: text is released only once it
 * cannot be the start of a stop string, and nothing from the first match on
 * is ever released (OpenAI leaves the stop sequence out).
 */
export class StopMatcher {
  private held = '';
  private done = false;
  private readonly longest: number;

  constructor(private readonly stops: readonly string[]) {
    this.longest = stops.reduce((m, s) => Math.max(m, s.length), 0);
  }

  /** True once a stop string completed: every later push releases nothing. */
  get stopped(): boolean {
    return this.done;
  }

  /** Text safe to emit now, and whether a stop string completed (the text before it is returned, the rest dropped). */
  push(delta: string): { text: string; stopped: boolean } {
    if (this.done) return { text: '', stopped: true };
    if (this.stops.length === 0) return { text: delta, stopped: false };
    const s = this.held + delta;
    let first = -1;
    for (const stop of this.stops) {
      const i = s.indexOf(stop);
      if (i >= 0 && (first < 0 || i < first)) first = i;
    }
    if (first >= 0) {
      this.held = '';
      this.done = true;
      return { text: s.slice(0, first), stopped: true };
    }
    // The longest suffix of s that is a proper prefix of a stop string stays held.
    let keep = 0;
    for (let k = Math.min(this.longest - 1, s.length); k > 0; k--) {
      const tail = s.slice(s.length - k);
      if (this.stops.some((stop) => stop.startsWith(tail))) {
        keep = k;
        break;
      }
    }
    this.held = s.slice(s.length - keep);
    return { text: s.slice(0, s.length - keep), stopped: false };
  }

  /** What is still held back when the stream ends without a match. */
  flush(): string {
    const t = this.done ? '' : this.held;
    this.held = '';
    return t;
  }
}
