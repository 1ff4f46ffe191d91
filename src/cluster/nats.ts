/**
 * One NATS connection for a cluster process (relay or tracker): the servers
 * given with `--nats`, one line naming them when none answers at start, and
 * reconnecting forever afterwards (the client re-subscribes by itself).
 *
 * Debian's nats-server is 2.9: bucket TTL only, no per-key TTL, no event
 * when a key expires; code that needs expiry keeps its own sweeper.
 */
import { connect, type NatsConnection } from '@nats-io/transport-node';

export type NatsStatus = 'connected' | 'reconnecting' | 'closed';

/** No NATS server answered at start. `message` is one line naming the URL(s). */
export class NatsUnreachableError extends Error {
  constructor(
    readonly servers: string[],
    cause: string,
  ) {
    super(`cannot reach NATS at ${servers.join(', ')}: ${cause}`);
    this.name = 'NatsUnreachableError';
  }
}

export interface NatsLogger {
  info(obj: object, msg: string): void;
  warn(obj: object, msg: string): void;
}

export interface ConnectNatsInit {
  /** `nats://host:port` URLs (a comma-separated string is split). */
  servers: string[] | string;
  /** The connection's name in the server's monitoring (e.g. `relay-<id>`). */
  name: string;
  logger?: NatsLogger;
  /** Time for the first connection, ms. @defaultValue 3000 */
  connectTimeoutMs?: number;
  /** Called on every status change. */
  onStatus?: (status: NatsStatus) => void;
}

export interface NatsHandle {
  readonly nc: NatsConnection;
  status(): NatsStatus;
  /** Resolves when the connection is closed for good. */
  readonly closed: Promise<void>;
  /** Flush what was published, then close. */
  close(): Promise<void>;
}

/** Split and check `--nats` values: `nats://a:4222,nats://b:4222`. */
export function parseNatsServers(value: string[] | string): string[] {
  const list = (Array.isArray(value) ? value : [value]).flatMap((v) => v.split(',')).map((v) => v.trim()).filter((v) => v !== '');
  if (list.length === 0) throw new TypeError('no NATS server URL given');
  for (const s of list) {
    let u: URL;
    try {
      u = new URL(s.includes('://') ? s : `nats://${s}`);
    } catch {
      throw new TypeError(`"${s}" is not a NATS URL (nats://host:port)`);
    }
    if (u.protocol !== 'nats:' && u.protocol !== 'tls:') throw new TypeError(`"${s}" is not a NATS URL (nats://host:port)`);
  }
  return list;
}

export async function connectNats(init: ConnectNatsInit): Promise<NatsHandle> {
  const servers = parseNatsServers(init.servers);
  let nc: NatsConnection;
  try {
    nc = await connect({
      servers,
      name: init.name,
      timeout: init.connectTimeoutMs ?? 3_000,
      maxReconnectAttempts: -1,
      reconnectTimeWait: 250,
      reconnectJitter: 100,
      pingInterval: 10_000,
      // Our clients publish with a reply subject to detect "no such subscriber" at once (the relay's 404).
      noEcho: false,
    });
  } catch (e) {
    throw new NatsUnreachableError(servers, (e as Error).message || String(e));
  }
  let status: NatsStatus = 'connected';
  const set = (s: NatsStatus) => {
    if (s === status) return;
    status = s;
    try {
      init.onStatus?.(s);
    } catch {
      // a listener's failure must not stop status tracking
    }
  };
  void (async () => {
    for await (const s of nc.status()) {
      if (s.type === 'disconnect' || s.type === 'reconnecting') {
        if ((status as NatsStatus) !== 'reconnecting') init.logger?.warn({ servers }, 'NATS connection lost; reconnecting');
        set('reconnecting');
      } else if (s.type === 'reconnect') {
        init.logger?.info({ server: s.server }, 'NATS connection back');
        set('connected');
      }
    }
  })().catch(() => undefined);
  const closed = nc.closed().then(() => set('closed'));
  return {
    nc,
    status: () => status,
    closed,
    async close() {
      if (nc.isClosed()) return;
      try {
        await nc.drain();
      } catch {
        await nc.close().catch(() => undefined);
      }
    },
  };
}
