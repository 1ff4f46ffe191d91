/**
 * Real processes on loopback for mesh tests and benches: `meshnet node`
 * processes (and a tracker when asked), the fixture checkpoint over the
 * static server, a test route-signing key, and an NDJSON reader of /generate.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { Identity } from '../../src/net/identity.ts';
import { RpcConnection } from '../../src/net/relay-hop.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import { NodeWebSocket } from './ws-host.ts';
import { chainReplySigningMessage, generateEventSchema, routeSigningMessage, type GenerateEvent, type GenerateRequest, type RouteHop } from '../../src/protocol/tracker.ts';

const BIN = fileURLToPath(new URL('../../bin/meshnet.js', import.meta.url));

export interface Proc {
  child: ChildProcess;
  /** Every stdout JSON line so far. */
  events: Array<Record<string, unknown>>;
  stderr: () => string;
  /** Resolves with the first stdout event matching, waiting up to `ms`. */
  waitFor(pred: (e: Record<string, unknown>) => boolean, ms?: number): Promise<Record<string, unknown>>;
  stop(signal?: NodeJS.Signals): Promise<number | null>;
}

/** `bin`: another checkout's bin/meshnet.js (a bench's baseline), default this one's; `nodeArgs`: flags for node itself (--cpu-prof, which NODE_OPTIONS refuses); `stdin`: 'pipe' for a process that takes commands (`child.stdin`). */
export function spawnMeshnet(args: string[], env: Record<string, string> = {}, bin = BIN, nodeArgs: string[] = [], stdin: 'ignore' | 'pipe' = 'ignore'): Proc {
  const child = spawn(process.execPath, [...nodeArgs, bin, ...args], { stdio: [stdin, 'pipe', 'pipe'], env: { ...process.env, ...env } });
  let err = '';
  child.stderr!.on('data', (d) => {
    err += d;
    if (err.length > 200_000) err = err.slice(-100_000);
  });
  const events: Array<Record<string, unknown>> = [];
  const waiters: Array<{ pred: (e: Record<string, unknown>) => boolean; resolve: (e: Record<string, unknown>) => void }> = [];
  createInterface({ input: child.stdout! }).on('line', (line) => {
    let e: Record<string, unknown>;
    try {
      e = JSON.parse(line) as Record<string, unknown>;
    } catch {
      return;
    }
    events.push(e);
    for (const w of [...waiters]) {
      if (w.pred(e)) {
        waiters.splice(waiters.indexOf(w), 1);
        w.resolve(e);
      }
    }
  });
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
  return {
    child,
    events,
    stderr: () => err,
    waitFor(pred, ms = 60_000) {
      const hit = events.find(pred);
      if (hit) return Promise.resolve(hit);
      return new Promise((resolve, reject) => {
        const w = { pred, resolve: (e: Record<string, unknown>) => (clearTimeout(t), resolve(e)) };
        const t = setTimeout(() => {
          waiters.splice(waiters.indexOf(w), 1);
          reject(new Error(`meshnet ${args[0]}: no matching event within ${ms} ms; events ${JSON.stringify(events).slice(0, 500)}; stderr ${err.slice(-2000)}`));
        }, ms);
        waiters.push(w);
        void exited.then((code) => {
          if (waiters.includes(w)) {
            clearTimeout(t);
            waiters.splice(waiters.indexOf(w), 1);
            reject(new Error(`meshnet ${args[0]} exited with ${code}; stderr ${err.slice(-2000)}`));
          }
        });
      });
    },
    stop(signal = 'SIGTERM') {
      if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve(child.exitCode);
      child.kill(signal);
      return exited;
    },
  };
}

export interface NodeProc extends Proc {
  peerId: string;
  endpoint: string;
  relayAddr: string | null;
}

/** Start `meshnet node` and wait for its listening line (and its serving line when `--layers` is given). */
export async function startNode(args: string[], bin?: string): Promise<NodeProc> {
  const p = spawnMeshnet(['node', '--port', '0', '--threads', '1', ...args], {}, bin);
  const l = await p.waitFor((e) => e.event === 'listening');
  if (args.includes('--layers')) await p.waitFor((e) => e.event === 'serving');
  return Object.assign(p, { peerId: l.peer_id as string, endpoint: l.endpoint as string, relayAddr: (l.relay_addr as string | null) ?? null });
}

/** A stand-in tracker key for heads without a tracker. */
export async function testSigner(): Promise<{ identity: Identity; publicKey: string; sign(head: string, hops: RouteHop[], ttlMs?: number): Promise<Record<string, string>> }> {
  const identity = await Identity.generate();
  return {
    identity,
    publicKey: encodeBase64Url(identity.publicKey),
    async sign(head, hops, ttlMs = 60_000) {
      const route = JSON.stringify(hops);
      const expires = Date.now() + ttlMs;
      const sig = await identity.sign(routeSigningMessage(head, expires, route));
      return { 'x-meshnet-route': route, 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': encodeBase64Url(sig) };
    },
  };
}

export function hopOf(n: NodeProc, start: number, end: number, via: 'relay' | 'direct' | 'both' = 'both'): RouteHop {
  const hop: RouteHop = { peer_id: n.peerId, start_layer: start, end_layer: end };
  if (via !== 'relay') hop.endpoint = n.endpoint;
  if (via !== 'direct' && n.relayAddr) hop.relay_addr = n.relayAddr;
  return hop;
}

/** POST /generate directly to a head; yields parsed events as they arrive. */
export async function* generateDirect(endpoint: string, headers: Record<string, string>, body: Partial<GenerateRequest>): AsyncGenerator<GenerateEvent> {
  const res = await fetch(`${endpoint}/generate`, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: JSON.stringify(body) });
  if (res.status !== 200) throw Object.assign(new Error(`HTTP ${res.status}: ${await res.text()}`), { status: res.status });
  const dec = new TextDecoder();
  let buf = '';
  for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
    buf += dec.decode(chunk, { stream: true });
    let i;
    while ((i = buf.indexOf('\n')) >= 0) {
      const line = buf.slice(0, i);
      buf = buf.slice(i + 1);
      if (line.trim()) yield generateEventSchema.parse(JSON.parse(line));
    }
  }
}

export async function collectEvents(it: AsyncIterable<GenerateEvent>): Promise<GenerateEvent[]> {
  const out: GenerateEvent[] = [];
  for await (const e of it) out.push(e);
  return out;
}

export function tokenIds(events: GenerateEvent[]): number[] {
  return events.flatMap((e) => (e.type === 'token' ? [e.token_id] : []));
}

export interface TrackerProc extends Proc {
  url: string;
  publicKey: string;
}

/** Start `meshnet tracker` and wait for its listening line. */
export async function startTrackerProc(args: string[]): Promise<TrackerProc> {
  const p = spawnMeshnet(['tracker', '--port', '0', '--log-level', 'warn', ...args]);
  const l = await p.waitFor((e) => e.event === 'listening');
  return Object.assign(p, { url: l.url as string, publicKey: l.public_key as string });
}

/** What a mesh test started; `stopMesh` stops it in the order that keeps shutdown quiet. */
export interface MeshParts {
  nodes?: readonly Proc[];
  tracker?: Proc;
  relay?: { stop(): Promise<unknown> };
  st?: { close(): Promise<unknown> };
}

/** Stop a mesh test's processes: nodes first (they would otherwise log the tracker and relay going), then tracker, relay, static server. */
export async function stopMesh(m: MeshParts): Promise<void> {
  await Promise.all((m.nodes ?? []).map((n) => n.stop()));
  await m.tracker?.stop();
  await m.relay?.stop();
  await m.st?.close();
}

/** Poll until `check` resolves truthy. */
export async function until<T>(check: () => Promise<T | undefined | false>, ms = 30_000, what = 'condition'): Promise<T> {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await check().catch(() => undefined);
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** Sessions a node holds now (GET /health). */
export async function sessionsOn(n: NodeProc): Promise<number> {
  const r = await fetch(`${n.endpoint}/health`);
  return ((await r.json()) as { sessions: number }).sessions;
}

/**
 * `chain_forwards` of every node the tracker lists as serving past layer 0
 * (the hops after a head), read by GET /info over the relay's /rpc: a page
 * has no HTTP port. Chained steps count there; star steps do not.
 */
export async function chainForwardsAfterHead(trackerUrl: string): Promise<number[]> {
  const nodes = ((await (await fetch(`${trackerUrl}/api/dashboard`)).json()) as { nodes: Array<{ relay_addr: string | null; serving: { start_layer: number } | null }> }).nodes;
  const out: number[] = [];
  for (const n of nodes.filter((x) => x.serving && x.serving.start_layer > 0 && x.relay_addr)) {
    const conn = new RpcConnection(n.relay_addr!, { WebSocket: NodeWebSocket });
    try {
      out.push((JSON.parse(new TextDecoder().decode((await conn.request({ method: 'GET', path: '/info' })).body)) as { chain_forwards: number }).chain_forwards);
    } finally {
      conn.close();
    }
  }
  return out;
}

/** What a node's GET /info says of the paths its hops take (docs/protocol.md §12). */
export interface NodePathInfo {
  peer_id: string;
  start_layer: number;
  hops_sent: Record<string, number>;
  forwards_served: Record<string, number>;
  paths: Array<{ peer_id: string; path: string; sent: Record<string, number>; rtc?: string }>;
  data_channels?: { open: number; opened: number; failed: number; closed: number; refused: number };
}

/** GET /info of every node the tracker lists as serving, over the relay's /rpc (pages have no HTTP port), by first layer. */
export async function nodeInfos(trackerUrl: string): Promise<NodePathInfo[]> {
  const nodes = ((await (await fetch(`${trackerUrl}/api/dashboard`)).json()) as { nodes: Array<{ relay_addr: string | null; serving: unknown }> }).nodes;
  const out: NodePathInfo[] = [];
  for (const n of nodes.filter((x) => x.serving && x.relay_addr)) {
    const conn = new RpcConnection(n.relay_addr!, { WebSocket: NodeWebSocket });
    try {
      out.push(JSON.parse(new TextDecoder().decode((await conn.request({ method: 'GET', path: '/info' })).body)) as NodePathInfo);
    } finally {
      conn.close();
    }
  }
  return out.sort((a, b) => a.start_layer - b.start_layer);
}

/** Hops sent by all of `infos`, per path. */
export function hopsSent(infos: readonly NodePathInfo[]): Record<string, number> {
  const t: Record<string, number> = {};
  for (const i of infos) for (const [k, v] of Object.entries(i.hops_sent ?? {})) t[k] = (t[k] ?? 0) + v;
  return t;
}

/**
 * Route headers for `head` signed with the tracker's key (tests and benches
 * that hold it send routes themselves), with the head's reply address signed
 * as the tracker signs it on /generate, so chain-mode heads chain (without
 * it they run the star).
 */
export async function signedRouteHeaders(trackerKey: Identity, head: NodeProc, hops: RouteHop[], ttlMs = 600_000): Promise<Record<string, string>> {
  const route = JSON.stringify(hops);
  const expires = Date.now() + ttlMs;
  const sig = await trackerKey.sign(routeSigningMessage(head.peerId, expires, route));
  const headers: Record<string, string> = { 'x-meshnet-route': route, 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': encodeBase64Url(sig) };
  if (head.relayAddr) {
    const reply = JSON.stringify({ relay_addr: head.relayAddr });
    headers['x-meshnet-chain-reply'] = reply;
    headers['x-meshnet-chain-reply-signature'] = encodeBase64Url(await trackerKey.sign(chainReplySigningMessage(head.peerId, expires, reply)));
  }
  return headers;
}
