/**
 * bench/relay-hop — what one pipeline hop costs through the relay.
 *
 * Side by side in one run, 8 KiB bf16 activation, one request in flight:
 *   (a) direct in-process call of the same handler
 *   (b) ADR-0014 path: a new /rpc socket per hop, JSON/base64
 *   (c) a kept-open /rpc socket, JSON/base64
 *   (d) the fast path: binary frames over the persistent /ws connection
 * p50/p99 latency and bytes on the wire per hop (caller↔relay, both ways,
 * WebSocket framing included), then (d)'s throughput at 64 in flight and
 * the CPU each process spends per hop meanwhile (Linux /proc accounting).
 * Run on loopback, then with a user-space proxy adding 10 ms one way between
 * each peer and the relay (emulated hop round trip: 4 × 10 ms = 40 ms).
 *
 *   npx tsx bench/relay-hop.ts [--quick]
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { connect, createServer } from 'node:net';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { WebSocket } from 'ws';
import { Identity } from '../src/net/identity.ts';
import { RelayClient } from '../src/net/relay-client.ts';
import { RpcConnection, relayHop } from '../src/net/relay-hop.ts';
import type { MeshRequest, MeshResponse } from '../src/protocol/envelopes.ts';
import { NodeWebSocketConstructor } from '../src/host/node/socket.ts';
import { encodeTensor } from '../src/protocol/tensor.ts';
import { startDelayProxy, type DelayProxy } from './lib/delay-proxy.ts';
import { printTable, summarize, writeResult } from './lib/stats.ts';

const quick = process.argv.includes('--quick');
/** What the Node.js host uses (zero mask, no deflate, one write per tick); the bare floor keeps plain `ws`. */
const WS = NodeWebSocketConstructor;
const root = fileURLToPath(new URL('..', import.meta.url));
const PAYLOAD = 8192;
const activation = encodeTensor(Float32Array.from({ length: PAYLOAD / 2 }, (_, i) => Math.sin(i)), 'bf16');
const headers = { 'x-meshnet-shape': '1,1,4096', 'x-meshnet-dtype': 'bf16' };
const request = { method: 'POST', path: '/forward', headers, body: activation };

async function spawnLine(cmd: string, args: string[]): Promise<{ child: ChildProcess; line: Record<string, unknown> }> {
  const child = spawn(cmd, args, { cwd: root, stdio: ['ignore', 'pipe', 'inherit'] });
  const rl = createInterface({ input: child.stdout! });
  const line = await new Promise<string>((resolve, reject) => {
    rl.once('line', resolve);
    child.once('exit', (c) => reject(new Error(`${args.join(' ')} exited ${c}`)));
  });
  return { child, line: JSON.parse(line) as Record<string, unknown> };
}

const echoHandler = async (req: MeshRequest): Promise<MeshResponse> => ({ status: 200, headers: { 'x-meshnet-shape': req.headers['x-meshnet-shape'] ?? '', 'x-meshnet-dtype': 'bf16' }, body: req.body });

type Mode = 'a-direct' | 'b-adr-rpc-per-hop' | 'c-rpc-kept-open' | 'd-fast-path' | 'floor-bare-ws-forwarder';
const MODES: Mode[] = ['a-direct', 'b-adr-rpc-per-hop', 'c-rpc-kept-open', 'd-fast-path', 'floor-bare-ws-forwarder'];

/** A caller on the bare forwarder: one message out, one back, nothing else. */
async function bareCaller(url: string): Promise<{ hop: () => Promise<void>; close: () => void }> {
  const ws = new WebSocket(url);
  await new Promise((r) => ws.once('open', r));
  ws.send('caller');
  const waiting: Array<() => void> = [];
  ws.on('message', () => waiting.shift()?.());
  return {
    hop: () =>
      new Promise<void>((resolve) => {
        waiting.push(resolve);
        ws.send(activation);
      }),
    close: () => ws.close(),
  };
}

interface Callers {
  hop: Record<Mode, () => Promise<void>>;
  client: RelayClient;
  close(): void;
}

async function makeCallers(relayUrl: string, peerId: string, bareUrl: string): Promise<Callers> {
  const bare = await bareCaller(bareUrl);
  const client = new RelayClient({ relayUrl, WebSocket: WS, identity: await Identity.generate() });
  client.start();
  await client.ready(10_000);
  const rpcAddr = `${relayUrl}/rpc/${peerId}`;
  const kept = new RpcConnection(rpcAddr, { WebSocket: WS });
  await kept.open();
  const check = (status: number, bytes: number) => {
    if (status !== 200 || bytes !== PAYLOAD) throw new Error(`bad answer: ${status}, ${bytes} bytes`);
  };
  return {
    client,
    hop: {
      'a-direct': async () => {
        const r = await echoHandler({ method: 'POST', path: '/forward', headers, body: activation });
        check(r.status, (r.body as Uint8Array).byteLength);
      },
      'b-adr-rpc-per-hop': async () => {
        const r = await relayHop(rpcAddr, request, { WebSocket: WS, timeoutMs: 10_000 });
        check(r.status, r.body.byteLength);
      },
      'c-rpc-kept-open': async () => {
        const r = await kept.request(request, { timeoutMs: 10_000 });
        check(r.status, r.body.byteLength);
      },
      'd-fast-path': async () => {
        const r = await client.request(peerId, request, { timeoutMs: 10_000 });
        check(r.status, r.body.byteLength);
      },
      'floor-bare-ws-forwarder': bare.hop,
    },
    close() {
      kept.close();
      client.close();
      bare.close();
    },
  };
}

async function latency(callers: Callers, counts: Record<Mode, number>, rounds: number): Promise<Record<Mode, number[]>> {
  const samples = Object.fromEntries(MODES.map((m) => [m, [] as number[]])) as Record<Mode, number[]>;
  for (const m of MODES) for (let i = 0; i < Math.min(20, counts[m]); i++) await callers.hop[m](); // warm-up
  // Interleave modes in rounds so machine drift hits all of them alike.
  for (let r = 0; r < rounds; r++) {
    for (const m of MODES) {
      const n = Math.ceil(counts[m] / rounds);
      for (let i = 0; i < n; i++) {
        const t0 = performance.now();
        await callers.hop[m]();
        samples[m].push(performance.now() - t0);
      }
    }
  }
  return samples;
}

async function throughput(callers: Callers, inFlight: number, seconds: number, mode: Mode = 'd-fast-path'): Promise<number> {
  let done = 0;
  const until = performance.now() + seconds * 1000;
  await Promise.all(
    Array.from({ length: inFlight }, async () => {
      while (performance.now() < until) {
        await callers.hop[mode]();
        done++;
      }
    }),
  );
  return done / seconds;
}

async function wireBytes(proxy: DelayProxy, callers: Callers, n: number): Promise<Record<Mode, { up: number; down: number }>> {
  const out = {} as Record<Mode, { up: number; down: number }>;
  for (const m of MODES) {
    if (m === 'a-direct' || m === 'floor-bare-ws-forwarder') {
      out[m] = { up: 0, down: 0 };
      continue;
    }
    await callers.hop[m]();
    await new Promise((r) => setTimeout(r, 50));
    proxy.reset();
    for (let i = 0; i < n; i++) await callers.hop[m]();
    await new Promise((r) => setTimeout(r, 100)); // let per-hop socket closes finish
    out[m] = { up: proxy.stats.up / n, down: proxy.stats.down / n };
  }
  return out;
}

/**
 * The emulated round trip as the proxies really deliver it (timers fire a
 * little late): an 8 KiB ping through one delaying proxy to a TCP echo server
 * is 2 delayed legs; a relay hop is 4, so twice that median.
 */
async function measuredHopRtt(delayMs: number): Promise<number> {
  const echo = createServer((s) => s.pipe(s));
  await new Promise<void>((r) => echo.listen(0, '127.0.0.1', r));
  const proxy = await startDelayProxy((echo.address() as { port: number }).port, delayMs);
  const sock = connect(proxy.port, '127.0.0.1');
  sock.setNoDelay(true);
  await new Promise((r) => sock.once('connect', r));
  const ping = Buffer.alloc(PAYLOAD, 7);
  const rtts: number[] = [];
  for (let i = 0; i < 40; i++) {
    const t0 = performance.now();
    await new Promise<void>((resolve) => {
      let got = 0;
      const onData = (d: Buffer) => {
        got += d.byteLength;
        if (got >= PAYLOAD) {
          sock.off('data', onData);
          resolve();
        }
      };
      sock.on('data', onData);
      sock.write(ping);
    });
    rtts.push(performance.now() - t0);
  }
  sock.destroy();
  await proxy.close();
  echo.close();
  return 2 * summarize(rtts).p50;
}

/** CPU time a process has used so far, µs: utime + stime from /proc (Linux, 100 ticks/s); undefined elsewhere. */
function cpuMicros(pid: number | undefined): number | undefined {
  try {
    const f = readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1]!.split(' ');
    return ((Number(f[11]) + Number(f[12])) * 1e6) / 100;
  } catch {
    return undefined;
  }
}

/** CPU µs per hop of the caller (this process), the relay and the responder while `run` does `hops()` hops. */
async function cpuPerHop(relayPid: number | undefined, responderPid: number | undefined, run: () => Promise<number>): Promise<{ caller: number; relay: number | null; responder: number | null }> {
  const c0 = process.cpuUsage();
  const r0 = cpuMicros(relayPid);
  const e0 = cpuMicros(responderPid);
  const hops = await run();
  const c = process.cpuUsage(c0);
  const r1 = cpuMicros(relayPid);
  const e1 = cpuMicros(responderPid);
  const per = (a: number | undefined, b: number | undefined) => (a === undefined || b === undefined ? null : (b - a) / hops);
  return { caller: (c.user + c.system) / hops, relay: per(r0, r1), responder: per(e0, e1) };
}

interface ScenarioResult {
  scenario: string;
  one_way_delay_ms: number;
  /** 4 × delay, as the proxies deliver it (see measuredHopRtt). */
  emulated_hop_rtt_ms: number;
  latency_ms: Record<Mode, { n: number; p50: number; p99: number; mean: number }>;
  wire_bytes_per_hop: Record<Mode, { up: number; down: number }>;
  fast_path_hops_per_s_64_in_flight: number;
  /** CPU per fast-path hop at 64 in flight, µs, by process (null where /proc is not there). */
  fast_path_cpu_us_per_hop_64_in_flight: { caller: number; relay: number | null; responder: number | null };
  bare_forwarder_hops_per_s_64_in_flight: number;
}

async function scenario(relayUrl: string, delayMs: number, relayPort: number, barePort: number): Promise<ScenarioResult> {
  // Responder and caller each reach the relay through their own delaying proxy (or directly on loopback).
  const respProxy = delayMs > 0 ? await startDelayProxy(relayPort, delayMs) : null;
  const callProxy = delayMs > 0 ? await startDelayProxy(relayPort, delayMs) : null;
  const respUrl = respProxy ? `ws://127.0.0.1:${respProxy.port}` : relayUrl;
  const callUrl = callProxy ? `ws://127.0.0.1:${callProxy.port}` : relayUrl;
  const echo = await spawnLine(process.execPath, ['--import', 'tsx', 'bench/lib/echo-peer.ts', respUrl]);
  const peerId = echo.line.peer_id as string;
  // The floor: the same topology (caller, forwarder process, responder process, same proxies) with nothing but ws.
  const bareRespProxy = delayMs > 0 ? await startDelayProxy(barePort, delayMs) : null;
  const bareCallProxy = delayMs > 0 ? await startDelayProxy(barePort, delayMs) : null;
  const bareEcho = await spawnLine(process.execPath, ['--import', 'tsx', 'bench/lib/bare-forwarder.ts', 'echo', `ws://127.0.0.1:${bareRespProxy?.port ?? barePort}`]);
  const callers = await makeCallers(callUrl, peerId, `ws://127.0.0.1:${bareCallProxy?.port ?? barePort}`);

  const counts: Record<Mode, number> =
    delayMs > 0
      ? { 'a-direct': 2000, 'b-adr-rpc-per-hop': quick ? 20 : 60, 'c-rpc-kept-open': quick ? 20 : 60, 'd-fast-path': quick ? 20 : 60, 'floor-bare-ws-forwarder': quick ? 20 : 60 }
      : { 'a-direct': 20000, 'b-adr-rpc-per-hop': quick ? 300 : 1500, 'c-rpc-kept-open': quick ? 1000 : 5000, 'd-fast-path': quick ? 1000 : 5000, 'floor-bare-ws-forwarder': quick ? 1000 : 5000 };
  const samples = await latency(callers, counts, delayMs > 0 ? 2 : 5);
  const seconds = quick ? 1.5 : 4;
  let tput = 0;
  const cpu = await cpuPerHop(relay.child.pid, echo.child.pid, async () => {
    tput = await throughput(callers, 64, seconds);
    return tput * seconds;
  });
  const bareTput = await throughput(callers, 64, quick ? 1.5 : 4, 'floor-bare-ws-forwarder');

  // Bytes: through a 0-delay counting proxy on loopback, or the caller's delaying proxy.
  const countProxy = callProxy ?? (await startDelayProxy(relayPort, 0));
  const countCallers = callProxy ? callers : await makeCallers(`ws://127.0.0.1:${countProxy.port}`, peerId, `ws://127.0.0.1:${barePort}`);
  const bytes = await wireBytes(countProxy, countCallers, delayMs > 0 ? 20 : 200);
  if (countCallers !== callers) countCallers.close();

  callers.close();
  echo.child.kill('SIGTERM');
  bareEcho.child.kill('SIGTERM');
  for (const p of [respProxy, callProxy, callProxy ? null : countProxy, bareRespProxy, bareCallProxy]) await p?.close();
  return {
    scenario: delayMs > 0 ? `wan-${delayMs}ms` : 'loopback',
    one_way_delay_ms: delayMs,
    emulated_hop_rtt_ms: delayMs > 0 ? await measuredHopRtt(delayMs) : 0,
    latency_ms: Object.fromEntries(MODES.map((m) => [m, summarize(samples[m])])) as ScenarioResult['latency_ms'],
    wire_bytes_per_hop: bytes,
    fast_path_hops_per_s_64_in_flight: tput,
    fast_path_cpu_us_per_hop_64_in_flight: cpu,
    bare_forwarder_hops_per_s_64_in_flight: bareTput,
  };
}

const relay = await spawnLine(process.execPath, ['bin/meshnet.js', 'relay', '--port', '0', '--log-level', 'warn']);
const bareFwd = await spawnLine(process.execPath, ['--import', 'tsx', 'bench/lib/bare-forwarder.ts']);
const relayUrl = relay.line.url as string;
const relayPort = relay.line.port as number;
const barePort = bareFwd.line.port as number;
const results: ScenarioResult[] = [];
try {
  results.push(await scenario(relayUrl, 0, relayPort, barePort));
  results.push(await scenario(relayUrl, 10, relayPort, barePort));
} finally {
  relay.child.kill('SIGTERM');
  bareFwd.child.kill('SIGTERM');
}

for (const r of results) {
  const rtt = r.emulated_hop_rtt_ms;
  printTable(
    `relay hop, ${r.scenario} (8 KiB bf16 activation, 1 in flight${rtt ? `; emulated hop round trip 4 × ${r.one_way_delay_ms} ms, measured ${rtt.toFixed(1)} ms` : ''})`,
    ['path', 'n', 'p50 ms', 'p99 ms', ...(rtt ? ['p50/RTT'] : []), 'up B/hop', 'down B/hop', 'over payload B (up/down)'],
    MODES.map((m) => {
      const l = r.latency_ms[m];
      const b = r.wire_bytes_per_hop[m];
      const noBytes = m === 'a-direct' || m === 'floor-bare-ws-forwarder';
      return [m, String(l.n), l.p50, l.p99, ...(rtt ? [l.p50 / rtt] : []), noBytes ? '-' : Math.round(b.up), noBytes ? '-' : Math.round(b.down), noBytes ? '-' : `${Math.round(b.up - PAYLOAD)}/${Math.round(b.down - PAYLOAD)}`];
    }),
  );
  console.log(`  64 in flight: fast path ${Math.round(r.fast_path_hops_per_s_64_in_flight)} hops/s, bare ws forwarder ${Math.round(r.bare_forwarder_hops_per_s_64_in_flight)} hops/s (ratio ${(r.fast_path_hops_per_s_64_in_flight / r.bare_forwarder_hops_per_s_64_in_flight).toFixed(2)})`);
  const cpu = r.fast_path_cpu_us_per_hop_64_in_flight;
  const us = (v: number | null) => (v === null ? '-' : v.toFixed(1));
  console.log(`  CPU per fast-path hop at 64 in flight: caller ${us(cpu.caller)} µs, relay ${us(cpu.relay)} µs, responder ${us(cpu.responder)} µs`);
}
const loop = results[0]!;
console.log(`\nloopback p50: fast path is ${(loop.latency_ms['b-adr-rpc-per-hop'].p50 / loop.latency_ms['d-fast-path'].p50).toFixed(1)}x faster than the ADR path, ${(loop.latency_ms['c-rpc-kept-open'].p50 / loop.latency_ms['d-fast-path'].p50).toFixed(2)}x faster than a kept-open /rpc socket, and ${(loop.latency_ms['d-fast-path'].p50 / loop.latency_ms['floor-bare-ws-forwarder'].p50).toFixed(2)}x the bare ws forwarder`);
writeResult(`${root}bench/results/relay-hop.json`, { bench: 'relay-hop', payload_bytes: PAYLOAD, quick, results });
process.exit(0);
