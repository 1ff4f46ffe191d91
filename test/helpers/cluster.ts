/**
 * Real cluster services for tests and benches, as `.ci/run` installs them
 * from Debian: `nats-server` (2.9) and `haproxy` (2.6).
 *
 * - startNats: on a free loopback port, JetStream on, its store in a temp
 *   dir of its own. The port is the server's own choice (`-p -1`), read back
 *   from its log, so two tests never race for one; a restart reuses it, so
 *   clients configured with the URL find the server again.
 * - startHaproxy: one HTTP front on a free port over the given backends,
 *   health-checked on `/healthz`, so a client keeps one base URL while a
 *   backend dies.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const CANDIDATES = ['/usr/sbin/nats-server', '/usr/bin/nats-server', '/usr/local/bin/nats-server'];

/** The nats-server binary: $NATS_SERVER_BIN, else Debian's path; throws a one-line hint when missing. */
export function natsServerBinary(): string {
  const env = process.env.NATS_SERVER_BIN;
  if (env && existsSync(env)) return env;
  const found = CANDIDATES.find((p) => existsSync(p));
  if (found) return found;
  throw new Error('nats-server not found: apt-get install -y nats-server (or set NATS_SERVER_BIN)');
}

export interface NatsOptions {
  /** Enable JetStream (KV buckets live there). @defaultValue true */
  jetstream?: boolean;
  /** Client port; 0 lets the server pick one. @defaultValue 0 */
  port?: number;
  /** JetStream store; a temp dir removed by stop() when not given. */
  storeDir?: string;
  /** Extra command-line arguments. */
  args?: string[];
}

export interface NatsServer {
  /** `nats://127.0.0.1:PORT` */
  readonly url: string;
  readonly port: number;
  readonly storeDir: string;
  /** The running server's pid (changes on restart). */
  readonly pid: number;
  /** The server's log so far (stderr). */
  log(): string;
  /** SIGTERM (or `signal`) and wait for the exit; keeps the store unless `wipe`. */
  kill(opts?: { signal?: NodeJS.Signals; wipe?: boolean }): Promise<void>;
  /** Start again on the same port (and store, unless it was wiped). */
  restart(opts?: { wipe?: boolean }): Promise<void>;
  /** Kill and remove the store (when it was ours). */
  stop(): Promise<void>;
}

const LISTEN_RE = /Listening for client connections on [^\s]*:(\d+)/;

async function spawnServer(bin: string, port: number, o: Required<Pick<NatsOptions, 'jetstream'>> & { storeDir: string; args: string[] }): Promise<{ child: ChildProcess; port: number; log: () => string }> {
  const args = ['-a', '127.0.0.1', '-p', String(port === 0 ? -1 : port), ...(o.jetstream ? ['-js', '-sd', o.storeDir] : []), ...o.args];
  const child = spawn(bin, args, { stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  const got = await new Promise<number>((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`nats-server did not start within 15 s: ${log.slice(-2000)}`)), 15_000);
    child.stderr!.on('data', (d: Buffer) => {
      log += d.toString();
      if (log.length > 200_000) log = log.slice(-100_000);
      const m = LISTEN_RE.exec(log);
      if (m && log.includes('Server is ready')) {
        clearTimeout(t);
        resolve(Number(m[1]));
      }
    });
    child.once('exit', (code) => {
      clearTimeout(t);
      reject(new Error(`nats-server exited with ${code}: ${log.slice(-2000)}`));
    });
  });
  return { child, port: got, log: () => log };
}

/** Start a nats-server and wait until it accepts clients. */
export async function startNats(opts: NatsOptions = {}): Promise<NatsServer> {
  const bin = natsServerBinary();
  const ownStore = opts.storeDir === undefined;
  const storeDir = opts.storeDir ?? mkdtempSync(join(tmpdir(), 'meshnet-nats-'));
  const o = { jetstream: opts.jetstream ?? true, storeDir, args: opts.args ?? [] };
  let cur = await spawnServer(bin, opts.port ?? 0, o);
  const port = cur.port;
  let past = '';
  const exit = (c: ChildProcess) => new Promise<void>((resolve) => (c.exitCode !== null || c.signalCode !== null ? resolve() : c.once('exit', () => resolve())));
  let alive = true;
  const server: NatsServer = {
    url: `nats://127.0.0.1:${port}`,
    port,
    storeDir,
    get pid() {
      return cur.child.pid ?? -1;
    },
    log: () => past + cur.log(),
    async kill({ signal = 'SIGTERM', wipe = false } = {}) {
      if (alive) {
        const done = exit(cur.child);
        cur.child.kill(signal);
        await done;
        alive = false;
      }
      if (wipe) rmSync(join(storeDir, 'jetstream'), { recursive: true, force: true });
    },
    async restart({ wipe = false } = {}) {
      await server.kill({ wipe });
      past += cur.log();
      cur = await spawnServer(bin, port, o);
      alive = true;
    },
    async stop() {
      await server.kill({ signal: 'SIGKILL' });
      if (ownStore) rmSync(storeDir, { recursive: true, force: true });
    },
  };
  return server;
}

// ------------------------------------------------------------ haproxy

const HAPROXY_CANDIDATES = ['/usr/sbin/haproxy', '/usr/bin/haproxy', '/usr/local/sbin/haproxy'];

/** The haproxy binary: $HAPROXY_BIN, else Debian's path; throws a one-line hint when missing. */
export function haproxyBinary(): string {
  const env = process.env.HAPROXY_BIN;
  if (env && existsSync(env)) return env;
  const found = HAPROXY_CANDIDATES.find((p) => existsSync(p));
  if (found) return found;
  throw new Error('haproxy not found: apt-get install -y haproxy (or set HAPROXY_BIN)');
}

/** A free TCP port on loopback (bound, read, released). */
export async function freePort(): Promise<number> {
  const { createServer } = await import('node:net');
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const port = (srv.address() as { port: number }).port;
      srv.close(() => resolve(port));
    });
  });
}

export interface HaproxyOptions {
  /** Backend base URLs (`http://127.0.0.1:PORT`). */
  backends: string[];
  /** Health check path. @defaultValue '/healthz' */
  healthPath?: string;
  /** Health check period, ms; a backend is down after `fall` failed checks. @defaultValue 500 */
  checkIntervalMs?: number;
  /** @defaultValue 2 */
  fall?: number;
  /** @defaultValue 1 */
  rise?: number;
  /**
   * `option http-no-delay`: haproxy sends each piece of a response as it
   * comes. Without it haproxy holds a streamed (chunked) response's small
   * writes for a fuller packet (MSG_MORE), and a chat's SSE tokens reach the
   * client ~200 ms late, in bursts (docs/benchmarks.md, "Chats through
   * haproxy"). @defaultValue true
   */
  noDelay?: boolean;
}

export interface Haproxy {
  /** `http://127.0.0.1:PORT`: the one base URL clients use. */
  readonly url: string;
  readonly port: number;
  readonly pid: number;
  /** The generated configuration (also what docs/cluster.md shows). */
  readonly config: string;
  log(): string;
  stop(): Promise<void>;
}

/**
 * The configuration haproxy runs with: round robin over the trackers,
 * `/healthz` checked every `checkIntervalMs`, and `retry-on` so that a
 * request whose backend refused or reset the connection before any answer
 * is sent to another one (a tracker that died between two checks costs the
 * client nothing). Long timeouts: a chat streams for as long as it generates.
 */
export function haproxyConfig(o: HaproxyOptions & { port: number }): string {
  const inter = o.checkIntervalMs ?? 500;
  const servers = o.backends.map((b, i) => {
    const u = new URL(b);
    return `    server t${i} ${u.hostname}:${u.port || 80} check inter ${inter} fall ${o.fall ?? 2} rise ${o.rise ?? 1}`;
  });
  return [
    'global',
    '    maxconn 4096',
    'defaults',
    '    mode http',
    '    timeout connect 2s',
    '    timeout client 10m',
    '    timeout server 10m',
    '    timeout http-keep-alive 60s',
    '    option redispatch',
    '    retries 3',
    '    retry-on conn-failure empty-response response-timeout',
    // Streamed chats: each SSE chunk goes out as it comes (without it, tokens wait ~200 ms for a fuller packet).
    ...(o.noDelay === false ? [] : ['    option http-no-delay']),
    'frontend trackers',
    `    bind 127.0.0.1:${o.port}`,
    '    default_backend trackers',
    'backend trackers',
    '    balance roundrobin',
    `    option httpchk GET ${o.healthPath ?? '/healthz'}`,
    '    http-check expect status 200',
    ...servers,
    '',
  ].join('\n');
}

/** Start haproxy in the foreground (`-db`) with a generated configuration; resolves once it accepts connections. */
export async function startHaproxy(opts: HaproxyOptions): Promise<Haproxy> {
  const bin = haproxyBinary();
  const dir = mkdtempSync(join(tmpdir(), 'meshnet-haproxy-'));
  const { writeFileSync } = await import('node:fs');
  const { connect } = await import('node:net');
  for (let tries = 0; ; tries++) {
    const port = await freePort();
    const config = haproxyConfig({ ...opts, port });
    const file = join(dir, 'haproxy.cfg');
    writeFileSync(file, config);
    const child = spawn(bin, ['-db', '-f', file], { stdio: ['ignore', 'pipe', 'pipe'] });
    let log = '';
    const onData = (d: Buffer) => {
      log += d.toString();
      if (log.length > 200_000) log = log.slice(-100_000);
    };
    child.stdout!.on('data', onData);
    child.stderr!.on('data', onData);
    const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
    const up = await new Promise<boolean>((resolve) => {
      const deadline = Date.now() + 10_000;
      const probe = () => {
        if (child.exitCode !== null) return resolve(false);
        const s = connect(port, '127.0.0.1');
        s.once('connect', () => {
          s.destroy();
          resolve(true);
        });
        s.once('error', () => (Date.now() > deadline ? resolve(false) : setTimeout(probe, 50)));
      };
      probe();
    });
    if (!up) {
      child.kill('SIGKILL');
      await exited;
      // Someone took the port between our probe and haproxy's bind: try another.
      if (tries < 3 && /cannot bind|Address already in use/i.test(log)) continue;
      rmSync(dir, { recursive: true, force: true });
      throw new Error(`haproxy did not start: ${log.slice(-2000)}`);
    }
    return {
      url: `http://127.0.0.1:${port}`,
      port,
      pid: child.pid ?? -1,
      config,
      log: () => log,
      async stop() {
        if (child.exitCode === null && child.signalCode === null) {
          child.kill('SIGTERM');
          await exited;
        }
        rmSync(dir, { recursive: true, force: true });
      },
    };
  }
}
