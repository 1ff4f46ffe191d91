/**
 * Direct links: the relay fast path's frames (PROTOCOL.md §4) over one
 * WebSocket straight to a node that accepts connections (`GET /link` on a
 * Node.js node's endpoint), with no relay process in between.
 *
 *   caller (head)                              node
 *    |  ---- open ws://ENDPOINT/link ------->  |
 *    |  <--- {"type":"challenge"} -----------  |
 *    |  ---- {"type":"register"} ----------->  |   the caller's Ed25519 key, checked
 *    |  <--- {"type":"registered"} ----------  |
 *    |  ==== REQUEST → RESPONSE/DATA, CANCEL   |   the node plays a relay with one peer: itself
 *
 * Why: on few cores every process a hop wakes costs more than the work it
 * does (a wake after another process's compute runs on cold caches), so a
 * hop through the relay (caller → relay → node → relay → caller) pays four
 * wakes where a link pays two; direct HTTP pays two as well but its request
 * path costs about as much as the relay's two extra wakes.
 *
 * The caller's end is an ordinary RelayClient pointed at the link URL (the
 * handshake is the relay's, and it redials with the same backoff); the
 * node's end verifies the caller's key itself and then wraps the socket in a
 * FrameMux, like a relay connection's, whose REQUEST frames must name the
 * node and are rewritten to name the caller, as a relay does. The caller
 * uses a link for a hop only when the node's `registered` names the hop's
 * peer id (an endpoint can be wrong, or name a port on the caller's machine).
 *
 * Host-agnostic: the host accepts the socket (Node.js: `ws` on the node's
 * HTTP server) and injects the WebSocket constructor for the caller side.
 */
import { CLOSE } from '../protocol/close-codes.ts';
import { ONE_WAY_FEATURE, parseRegister } from '../protocol/envelopes.ts';
import { MeshError } from '../protocol/errors.ts';
import { FRAME_HEAD_BYTES } from '../protocol/frames.ts';
import { PEER_ID_BYTES, hexToBytes, peerIdFromPublicKey, randomHex, registrationMessage } from '../protocol/ids.ts';
import { FrameMux } from './frame-mux.ts';
import { verifyEd25519, type Identity } from './identity.ts';
import type { LinkDialer, MeshHandler, MeshRequestFn, PeerRequester, RelayLogEntry } from './contract.ts';
import { RelayClient } from './relay-client.ts';
import { resolveRelayClientOptions, type MuxOptions, type RelayClientOptions } from './relay-options.ts';
import type { WebSocketConstructor, WebSocketLike } from './socket.ts';

/** Path of the link endpoint on a node's HTTP surface. */
export const LINK_PATH = '/link';


export interface AcceptLinkInit {
  /** This node's identity: REQUEST frames must name its peer id. */
  identity: Identity;
  handler: MeshHandler;
  /** Limits of the node side (maxMessageBytes, maxConcurrentRequests, handlerTimeoutMs …). */
  options?: Partial<MuxOptions>;
  registerTimeoutMs?: number;
  /** The caller proved its key and the link carries frames from now on. */
  onOpen?: (callerId: string) => void;
  onLog?: (entry: RelayLogEntry) => void;
}

export interface AcceptedLink {
  /** Caller's peer id once it proved its key; undefined before. */
  readonly callerId: string | undefined;
  /** Settled when the socket is gone. */
  readonly closed: Promise<void>;
  close(): void;
}

/**
 * The node's end of a link: the handshake (challenge, the caller's signed
 * register, "registered"), then a FrameMux that serves every REQUEST with
 * `handler`.
 */
export function acceptLink(socket: WebSocketLike, init: AcceptLinkInit): AcceptedLink {
  const log = init.onLog ?? (() => {});
  const options: MuxOptions = resolveRelayClientOptions(init.options ?? {});
  const nonce = randomHex(16);
  const ownId = hexToBytes(init.identity.peerId);
  let callerId: string | undefined;
  let mux: FrameMux | undefined;
  let state: 'challenged' | 'verifying' | 'open' | 'closed' = 'challenged';
  let resolveClosed: () => void = () => {};
  const closed = new Promise<void>((r) => (resolveClosed = r));

  socket.binaryType = 'nodebuffer';
  if (socket.binaryType !== 'nodebuffer') socket.binaryType = 'arraybuffer';

  const finish = (): void => {
    if (state === 'closed') return;
    state = 'closed';
    clearTimeout(registerTimer);
    resolveClosed();
  };
  const refuse = (code: number, reason: string): void => {
    try {
      socket.send(JSON.stringify({ type: 'error', code: 'MESH_ERR_UNAUTHORIZED', message: reason }));
      socket.close(code, reason.slice(0, 120));
    } catch {
      // already going away
    }
    finish();
  };
  const registerTimer = setTimeout(() => {
    if (state !== 'open') refuse(CLOSE.registerTimeout, 'no registration within the time limit');
  }, init.registerTimeoutMs ?? 10_000);

  socket.onclose = () => finish();
  socket.onerror = () => {};
  socket.onmessage = (ev) => {
    if (state !== 'challenged' || typeof ev.data !== 'string') {
      refuse(CLOSE.policy, 'send one register message, then frames once registered');
      return;
    }
    state = 'verifying';
    void verify(ev.data);
  };
  socket.send(JSON.stringify({ type: 'challenge', nonce }));

  async function verify(text: string): Promise<void> {
    const cred = parseRegister(text);
    if (!cred.ok) return refuse(CLOSE[cred.close], cred.reason);
    const key = cred.publicKey;
    const ok = await verifyEd25519(key, registrationMessage(nonce), cred.signature).catch(() => false);
    if (!ok) return refuse(CLOSE.badSignature, 'bad signature: sign "meshnet-register:" + this connection\'s nonce');
    if (state !== 'verifying') return;
    const id = await peerIdFromPublicKey(key);
    if (state !== 'verifying') return;
    callerId = id;
    const callerIdBytes = hexToBytes(id);
    // The handler is in place before the caller hears "registered": no frame can arrive before it.
    mux = new FrameMux(socket, {
      options,
      name: `link from ${id}`,
      handler: init.handler,
      onLog: log,
      onClose: finish,
      checkRequest: (frame) => {
        if (frame.byteLength < FRAME_HEAD_BYTES + PEER_ID_BYTES) return undefined; // too short: decoding answers 400
        const target = frame.subarray(FRAME_HEAD_BYTES, FRAME_HEAD_BYTES + PEER_ID_BYTES);
        if (!sameBytes(target, ownId)) return new MeshError('MESH_ERR_NO_SUCH_PEER', `this link ends at ${init.identity.peerId}; the frame names another peer`);
        // As a relay does: the handler side sees who called.
        target.set(callerIdBytes);
        return undefined;
      },
    });
    state = 'open';
    clearTimeout(registerTimer);
    socket.send(JSON.stringify({ type: 'registered', peer_id: id, relay_addr: linkAddress(init.identity.peerId), features: [ONE_WAY_FEATURE] }));
    init.onOpen?.(id);
  }

  return {
    get callerId() {
      return callerId;
    },
    closed,
    close() {
      if (mux) mux.close('node shutting down', { code: CLOSE.goingAway });
      else {
        try {
          socket.close(CLOSE.goingAway, 'node shutting down');
        } catch {
          // already closed
        }
      }
      finish();
    },
  };
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.byteLength !== b.byteLength) return false;
  for (let i = 0; i < a.byteLength; i++) if (a[i] !== b[i]) return false;
  return true;
}

export interface LinkPoolInit {
  identity: Identity;
  WebSocket: WebSocketConstructor;
  /** Links kept open at most; the least recently used is closed beyond. @defaultValue 64 */
  maxLinks?: number;
  /** A link unused this long is closed. @defaultValue 300000 */
  idleMs?: number;
  options?: Partial<RelayClientOptions>;
  onLog?: (message: string) => void;
  now?: () => number;
}

interface PooledLink {
  client: RelayClient;
  /** client.request, bound once: HopTransport asks for it per hop per token. */
  request: MeshRequestFn;
  lastUsed: number;
}

/** The caller's end: one link per node endpoint, opened on first sight, redialled by RelayClient's backoff. */
export class LinkPool implements LinkDialer {
  private readonly links = new Map<string, PooledLink>(); // insertion order = LRU order
  private readonly urls = new Map<string, string | undefined>();
  private readonly now: () => number;

  constructor(private readonly init: LinkPoolInit) {
    this.now = init.now ?? Date.now;
  }

  /**
   * The registered link to `endpoint`, or undefined while it is not up (the
   * first call starts dialling; callers use another path meanwhile) or when
   * it ends at another peer than `peerId`.
   */
  get(endpoint: string, peerId?: string): RelayClient | undefined {
    return this.lookup(endpoint, peerId)?.client;
  }

  /** Like get(), as the request function a HopTransport calls. */
  requester(endpoint: string, peerId: string): PeerRequester | undefined {
    return this.lookup(endpoint, peerId)?.request;
  }

  private lookup(endpoint: string, peerId: string | undefined): PooledLink | undefined {
    let key = this.urls.get(endpoint);
    if (key === undefined && !this.urls.has(endpoint)) {
      // Called for every hop of every token: parse each endpoint once.
      if (this.urls.size >= 4096) this.urls.clear();
      key = linkUrl(endpoint);
      this.urls.set(endpoint, key);
    }
    if (key === undefined) return undefined;
    const t = this.now();
    let link = this.links.get(key);
    if (link) {
      this.links.delete(key);
      this.links.set(key, link);
      link.lastUsed = t;
    } else {
      this.sweep(t);
      const client = this.open(key);
      const request: PeerRequester = client.request.bind(client);
      request.push = client.push.bind(client);
      link = { client, request, lastUsed: t };
      this.links.set(key, link);
    }
    if (link.client.state !== 'registered') return undefined;
    // The node says who it is in its registered message; an endpoint can lead somewhere else than the route thinks.
    if (peerId !== undefined && link.client.relayAddr !== linkAddress(peerId)) return undefined;
    return link;
  }

  /** Links open now (registered or dialling). */
  get size(): number {
    return this.links.size;
  }

  close(): void {
    for (const l of this.links.values()) l.client.close();
    this.links.clear();
  }

  private open(url: string): RelayClient {
    const client = new RelayClient({
      ...this.init.options,
      relayUrl: url,
      WebSocket: this.init.WebSocket,
      identity: this.init.identity,
      info: { host: 'link-caller' },
      onLog: (e) => {
        if (e.level === 'warn' || e.level === 'error') this.init.onLog?.(`link ${url}: ${e.event}: ${e.message}`);
      },
    });
    client.start();
    return client;
  }

  private sweep(t: number): void {
    const idle = this.init.idleMs ?? 300_000;
    const max = this.init.maxLinks ?? 64;
    for (const [url, l] of this.links) {
      if (this.links.size < max && t - l.lastUsed <= idle) continue;
      l.client.close();
      this.links.delete(url);
    }
  }
}

/** What a node's `registered` message on a link gives as relay_addr: its own peer id, for the caller to check. */
export function linkAddress(peerId: string): string {
  return `link:${peerId}`;
}

/** `ws(s)://host:port/link` for a node endpoint (`http(s)://host:port[/]`); undefined when it is not a URL. */
export function linkUrl(endpoint: string): string | undefined {
  try {
    const u = new URL(endpoint);
    if (u.protocol === 'http:') u.protocol = 'ws:';
    else if (u.protocol === 'https:') u.protocol = 'wss:';
    else if (u.protocol !== 'ws:' && u.protocol !== 'wss:') return undefined;
    u.pathname = u.pathname.replace(/\/+$/, '') + LINK_PATH;
    u.search = '';
    u.hash = '';
    return u.toString();
  } catch {
    return undefined;
  }
}
