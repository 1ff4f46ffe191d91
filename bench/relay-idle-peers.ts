/**
 * bench/relay-idle-peers — what an idle registered peer costs the relay.
 * Starts a real relay process, reads its RSS, registers N peers (default
 * 1,000) over real WebSockets, lets it settle, and reads the RSS again.
 * Target: ≤ 64 KiB of relay RSS per idle peer.
 *
 *   npx tsx bench/relay-idle-peers.ts [--peers N]
 */
import { spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { WebSocket } from 'ws';
import { makeKeys, nextJson, registerMessage } from '../test/helpers/raw-peer.ts';
import { printTable, writeResult } from './lib/stats.ts';

const root = fileURLToPath(new URL('..', import.meta.url));
const nArg = process.argv.indexOf('--peers');
const N = nArg > 0 ? Number(process.argv[nArg + 1]) : 1000;

function rssKiB(pid: number): number {
  const m = /VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
  return m ? Number(m[1]) : NaN;
}
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

const child = spawn(process.execPath, ['bin/meshnet.js', 'relay', '--port', '0', '--log-level', 'warn'], { cwd: root, stdio: ['ignore', 'pipe', 'inherit'] });
const first = await new Promise<string>((resolve) => createInterface({ input: child.stdout! }).once('line', resolve));
const { url } = JSON.parse(first) as { url: string };

// Warm the relay's code paths with a few peers, then take the baseline.
async function registerPeer(): Promise<WebSocket> {
  const ws = new WebSocket(`${url}/ws`);
  const challenge = await nextJson(ws);
  ws.send(JSON.stringify(registerMessage(makeKeys(), challenge.nonce as string, { protocols: ['mesh-frames/1'], model: 'small', layers: [0, 6], backend: 'wasm' })));
  const reg = await nextJson(ws);
  if (reg.type !== 'registered') throw new Error(JSON.stringify(reg));
  return ws;
}
const warm = await Promise.all(Array.from({ length: 20 }, registerPeer));
await sleep(1500);
const before = rssKiB(child.pid!);
const sockets: WebSocket[] = [];
for (let i = 0; i < N; i += 50) sockets.push(...(await Promise.all(Array.from({ length: Math.min(50, N - i) }, registerPeer))));
await sleep(3000);
const after = rssKiB(child.pid!);
const health = (await (await fetch(`${url.replace('ws', 'http')}/healthz`)).json()) as { peers: number };
const perPeer = (after - before) / N;
printTable('relay RSS with idle registered peers', ['peers', 'RSS before KiB', 'RSS after KiB', 'per peer KiB', 'target KiB'], [[String(health.peers - warm.length), before, after, perPeer, 64]]);
writeResult(`${root}bench/results/relay-idle-peers.json`, { bench: 'relay-idle-peers', peers: N, rss_before_kib: before, rss_after_kib: after, per_peer_kib: perPeer });
for (const ws of [...warm, ...sockets]) ws.terminate();
child.kill('SIGTERM');
process.exit(0);
