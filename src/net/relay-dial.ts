/**
 * One socket to a relay from open to registered (docs/protocol.md §1): it
 * reads the relay's challenge, answers it signed with the node's key, and
 * hands the `registered` message over; or it fails (the socket closed, a
 * malformed challenge, no registration in time). Only the handshake is read:
 * from `registered` on, the socket is the caller's (a FrameMux).
 */
import { challengeSchema, registeredSchema, type RegisteredMsg } from '../protocol/envelopes.ts';
import type { RelayLogEntry } from './contract.ts';
import type { Identity } from './identity.ts';
import { WS_OPEN, type SocketMessageEvent, type WebSocketConstructor, type WebSocketLike } from './socket.ts';

/** A socket to `url`, binary frames as Node's Buffer where the host can (a browser's: ArrayBuffer); throws as the constructor does. */
export function openRelaySocket(WebSocketCtor: WebSocketConstructor, url: string): WebSocketLike {
  const socket = new WebSocketCtor(url);
  // Node's `ws` can hand us its Buffer as is ('nodebuffer'); a browser ignores
  // that value, and then 'arraybuffer' it is. Saves a copy of every frame.
  socket.binaryType = 'nodebuffer';
  if (socket.binaryType !== 'nodebuffer') socket.binaryType = 'arraybuffer';
  return socket;
}

export interface RelayDialInit {
  socket: WebSocketLike;
  /** For the log. */
  url: string;
  identity: Identity;
  /** The registration's `info`. */
  info: Record<string, unknown>;
  registerTimeoutMs: number;
  /** The relay registered us (a well-formed `registered`); end() the dial, then the socket is yours. */
  onRegistered(dial: RelayDial, msg: RegisteredMsg): void;
  /** The dial failed (at most once, and never after it ended). */
  onFailed(dial: RelayDial, reason: string): void;
  log(entry: RelayLogEntry): void;
}

export class RelayDial {
  readonly socket: WebSocketLike;
  /** Over: registered, failed or closed; nothing more is read or reported. */
  done = false;
  private registerTimer: ReturnType<typeof setTimeout> | undefined;

  constructor(private readonly init: RelayDialInit) {
    const socket = (this.socket = init.socket);
    this.registerTimer = setTimeout(() => this.fail(`not registered within ${init.registerTimeoutMs} ms`), init.registerTimeoutMs);
    socket.onmessage = (ev) => this.onMessage(ev);
    socket.onclose = (ev) => this.fail(`socket closed (code ${ev.code ?? '?'}${ev.reason ? `: ${ev.reason}` : ''})`);
    // An error is always followed by close; log it, let close decide.
    socket.onerror = (ev) => {
      if (!this.done) init.log({ level: 'debug', event: 'connection', message: `socket error on ${init.url}`, error: ev });
    };
  }

  /** The dial is over (registered, failed or closed): stop its timer and let go of its socket, closing it when `closeReason` is given. */
  end(closeReason?: string): void {
    this.done = true;
    if (this.registerTimer !== undefined) clearTimeout(this.registerTimer);
    this.registerTimer = undefined;
    const socket = this.socket;
    socket.onmessage = null;
    socket.onclose = null;
    // Not null: `ws` reports a close() before the handshake ended as an 'error' event, and one with
    // no listener is an uncaught exception (a LinkPool closed while a link was still dialling).
    socket.onerror = ignoreError;
    if (closeReason === undefined) return;
    try {
      if (socket.readyState <= WS_OPEN) socket.close(1000, closeReason.slice(0, 120));
    } catch {
      // a socket that refuses close() is already going away
    }
  }

  private fail(reason: string): void {
    if (!this.done) this.init.onFailed(this, reason);
  }

  /** Before registration only the handshake is read; frames and envelopes are not ours to answer yet. */
  private onMessage(ev: SocketMessageEvent): void {
    if (this.done) return;
    if (typeof ev.data !== 'string') {
      this.ignore('binary frame before registration');
      return;
    }
    let msg: unknown;
    try {
      msg = JSON.parse(ev.data);
    } catch {
      this.ignore('text message is not JSON');
      return;
    }
    const type = (msg as { type?: unknown } | null)?.type;
    if (type === 'challenge') this.onChallenge(msg);
    else if (type === 'registered') {
      const parsed = registeredSchema.safeParse(msg);
      if (parsed.success) this.init.onRegistered(this, parsed.data);
      else this.ignore('malformed registered message');
    } else if (type === 'error') {
      const m = msg as { code?: unknown; message?: unknown };
      this.init.log({ level: 'warn', event: 'relay-error', message: `relay says ${String(m.code)}: ${String(m.message)}` });
    } else this.ignore(`${JSON.stringify(type)} message before registration`);
  }

  private onChallenge(msg: unknown): void {
    const parsed = challengeSchema.safeParse(msg);
    if (!parsed.success) {
      this.fail('relay sent a malformed challenge');
      return;
    }
    this.init.identity.registerMessage(parsed.data.nonce, this.init.info).then(
      (reg) => {
        if (this.done) return;
        try {
          this.socket.send(JSON.stringify(reg));
        } catch (e) {
          this.fail(`cannot send register: ${(e as Error).message}`);
        }
      },
      (e: unknown) => this.fail(`cannot sign the challenge: ${(e as Error).message}`),
    );
  }

  private ignore(reason: string): void {
    this.init.log({ level: 'warn', event: 'ignored', message: reason });
  }
}

function ignoreError(): void {}
