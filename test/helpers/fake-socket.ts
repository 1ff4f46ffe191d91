/**
 * An in-memory WebSocket for driving RelayClient frame by frame: the test
 * plays the relay. It keeps the host quirks that matter: events are
 * delivered by assignment to on* properties, binary data arrives as an
 * ArrayBuffer, and `bufferedAmount` can be set to simulate a slow link.
 */
import type { SocketCloseEvent, SocketMessageEvent, WebSocketLike } from '../../src/net/socket.ts';
import { Identity } from '../../src/net/identity.ts';
import type { RelayLogEntry } from '../../src/net/contract.ts';
import { RelayClient, type RelayClientInit } from '../../src/net/relay-client.ts';

export class FakeSocket implements WebSocketLike {
  static instances: FakeSocket[] = [];
  // Like a browser WebSocket: values other than 'blob' and 'arraybuffer' are ignored, not thrown.
  private binaryTypeValue = 'blob';
  get binaryType(): string {
    return this.binaryTypeValue;
  }
  set binaryType(v: string) {
    if (v === 'blob' || v === 'arraybuffer') this.binaryTypeValue = v;
  }
  readyState = 0;
  bufferedAmount = 0;
  sent: Array<string | Uint8Array> = [];
  onopen: ((ev: unknown) => void) | null = null;
  onmessage: ((ev: SocketMessageEvent) => void) | null = null;
  onclose: ((ev: SocketCloseEvent) => void) | null = null;
  onerror: ((ev: unknown) => void) | null = null;
  closedWith: { code?: number; reason?: string } | undefined;

  constructor(readonly url: string) {
    FakeSocket.instances.push(this);
  }

  send(data: string | Uint8Array): void {
    if (this.readyState !== 1) throw new Error('send on a socket that is not open');
    // Copy like a real socket does: the sender may reuse its buffer.
    this.sent.push(typeof data === 'string' ? data : new Uint8Array(data));
  }
  close(code?: number, reason?: string): void {
    if (this.readyState >= 2) return;
    this.closedWith = { code, reason };
    this.readyState = 3;
    queueMicrotask(() => this.onclose?.({ code: code ?? 1005, reason }));
  }

  // ---- the relay's side
  open(): void {
    this.readyState = 1;
    this.onopen?.({});
  }
  text(msg: unknown): void {
    this.onmessage?.({ data: typeof msg === 'string' ? msg : JSON.stringify(msg) });
  }
  binary(bytes: Uint8Array): void {
    const copy = new Uint8Array(bytes.byteLength);
    copy.set(bytes);
    this.onmessage?.({ data: copy.buffer });
  }
  /** The relay drops the connection. */
  drop(code = 1006): void {
    this.readyState = 3;
    this.onclose?.({ code, reason: '' });
  }
  sentJson(): Array<Record<string, unknown>> {
    return this.sent.filter((d): d is string => typeof d === 'string').map((d) => JSON.parse(d) as Record<string, unknown>);
  }
  sentFrames(): Uint8Array[] {
    return this.sent.filter((d): d is Uint8Array => typeof d !== 'string');
  }
}

export const NONCE = '00112233445566778899aabbccddeeff';

export interface Harness {
  client: RelayClient;
  socket: FakeSocket;
  logs: RelayLogEntry[];
  identity: Identity;
  /** The register message the client sent. */
  register: Record<string, unknown>;
}

let sharedIdentity: Promise<Identity> | undefined;

/** A client registered over a FakeSocket; the test is the relay from here on. `registered`: more fields of the relay's `registered` message (features). */
export async function registeredClient(init: Partial<RelayClientInit> = {}, registered: Record<string, unknown> = {}): Promise<Harness> {
  const identity = init.identity ?? (await (sharedIdentity ??= Identity.generate()));
  const logs: RelayLogEntry[] = [];
  const client = new RelayClient({
    relayUrl: 'ws://relay.test',
    WebSocket: FakeSocket,
    identity,
    onLog: (e) => logs.push(e),
    ...init,
  });
  const before = FakeSocket.instances.length;
  client.start();
  const socket = FakeSocket.instances[before]!;
  socket.open();
  socket.text({ type: 'challenge', nonce: NONCE });
  const ready = client.ready(2000);
  await until(() => socket.sent.length > 0);
  const register = JSON.parse(socket.sent[0] as string) as Record<string, unknown>;
  socket.sent.length = 0;
  socket.text({ type: 'registered', peer_id: identity.peerId, relay_addr: `ws://relay.test/rpc/${identity.peerId}`, ...registered });
  await ready;
  return { client, socket, logs, identity, register };
}

export async function until(cond: () => boolean, timeoutMs = 5000): Promise<void> {
  const t0 = Date.now();
  while (!cond()) {
    if (Date.now() - t0 > timeoutMs) throw new Error('condition not met in time');
    await new Promise((r) => setTimeout(r, 1));
  }
}

export const flush = (): Promise<void> => new Promise((r) => setTimeout(r, 0));
