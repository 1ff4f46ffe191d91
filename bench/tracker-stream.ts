/**
 * The tracker's CPU per streamed token, alone (issue 11: every ms of CPU per
 * token outside onnxruntime is throughput on a CPU-bound mesh). A real
 * `meshnet tracker` process; in this process, heads that answer /generate
 * over HTTP at once with scripted tokens (no model, so the tracker is the
 * only work measured) and OpenAI clients streaming N chats at once. The
 * tracker's CPU from /proc over the measured rounds, per token delivered:
 * the head proxy (NDJSON in), the event checks, the SSE out, per chat.
 *
 *   npx tsx bench/tracker-stream.ts [--chats 8] [--tokens 100] [--rounds 3] [--gap-ms 20] [--cpu-prof DIR]
 *
 * `--gap-ms`: a head's pause between two tokens of a chat (0: as fast as
 * the tracker reads; 20 is near a chat's pace on the 3-node mesh at 8
 * chats). `--cpu-prof DIR`: the tracker writes a V8 CPU profile there.
 * JSON in bench/results/tracker-stream.json.
 */
import { chmodSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { loadavg } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ensureModel } from '../src/cli/models.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import { Identity } from '../src/net/identity.ts';
import { encodeBase64Url } from '../src/protocol/base64.ts';
import type { GenerateEvent, NodeMessage } from '../src/protocol/tracker.ts';
import { signBody } from '../src/tracker/signing.ts';
import { startTrackerProc } from '../test/helpers/mesh.ts';
import { cpuMs } from './lib/proc-cpu.ts';
import { writeResult } from './lib/stats.ts';

const argv = process.argv.slice(2);
const arg = (name: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
};
const opt = (name: string, d: number) => Number(arg(name) ?? d);
const CHATS = opt('chats', 8);
const TOKENS = opt('tokens', 100);
const ROUNDS = opt('rounds', 3);
const GAP_MS = opt('gap-ms', 20);
const profDir = arg('cpu-prof');
if (profDir) {
  // --cpu-prof is refused in NODE_OPTIONS: the helper spawns process.execPath, so point it at a wrapper (exec keeps the pid).
  const wrapper = join(resolve(profDir), 'node-prof.sh');
  writeFileSync(wrapper, `#!/bin/sh\nexec ${process.execPath} --cpu-prof --cpu-prof-interval=200 --cpu-prof-dir=${resolve(profDir)} "$@"\n`);
  chmodSync(wrapper, 0o755);
  process.execPath = wrapper;
}
const here = fileURLToPath(new URL('.', import.meta.url));
const line = (e: GenerateEvent) => JSON.stringify(e) + '\n';
const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** A head that streams `max_tokens` scripted tokens, one NDJSON line (one write) each. */
async function scriptedHead(): Promise<{ server: Server; url: string }> {
  const server = createServer((req, res) => {
    let body = '';
    req.on('data', (c: Buffer) => (body += c.toString()));
    req.on('end', () => {
      const r = JSON.parse(body) as { max_tokens: number; prefix_token_ids: number[] };
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      res.write(line({ type: 'start', prompt_tokens: 8, route: [] }));
      let closed = false;
      res.on('close', () => (closed = true));
      void (async () => {
        for (let i = r.prefix_token_ids.length; i < r.max_tokens && !closed; i++) {
          if (GAP_MS > 0) await sleep(GAP_MS);
          else await new Promise((s) => setImmediate(s));
          res.write(line({ type: 'token', index: i, token_id: 100 + (i % 1000), text: ` w${i}`, logprob: -0.5 }));
        }
        if (!closed) res.end(line({ type: 'done', finish_reason: 'length', completion_tokens: r.max_tokens, prompt_tokens: 8 }));
      })();
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  return { server, url: `http://127.0.0.1:${(server.address() as AddressInfo).port}` };
}

async function register(trackerUrl: string, identity: Identity, endpoint: string): Promise<void> {
  const msg: NodeMessage = {
    peer_id: identity.peerId,
    public_key: encodeBase64Url(identity.publicKey),
    endpoint,
    info: { model: 'small', backend: 'cpu', memory_budget_mb: 4096, host: 'node' },
    stats: { rpm: 0, layer_ms: 1, queue_depth: 0, kv_free_bytes: 1e12, tokens_served: 0 },
    serving: { start_layer: 0, end_layer: 12 },
    timestamp: Date.now(),
  };
  const res = await fetch(`${trackerUrl}/api/nodes/register`, { method: 'POST', body: JSON.stringify(await signBody(identity, msg)) });
  if (res.status !== 200) throw new Error(`register → ${res.status}: ${await res.text()}`);
}

/** One streamed chat; returns the content chunks received. */
async function chat(trackerUrl: string): Promise<number> {
  const res = await fetch(`${trackerUrl}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'go' }], max_tokens: TOKENS, stream: true }),
  });
  if (res.status !== 200 || !res.body) throw new Error(`chat → ${res.status}: ${await res.text()}`);
  let n = 0;
  let buf = '';
  const dec = new TextDecoder();
  for await (const c of res.body as unknown as AsyncIterable<Uint8Array>) {
    buf += dec.decode(c, { stream: true });
    let k: number;
    while ((k = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, k);
      buf = buf.slice(k + 2);
      if (ev.includes('"content":" w')) n++;
    }
  }
  return n;
}

async function main(): Promise<void> {
  const st = await startStaticServer({ root: await ensureModel('small') });
  // Heartbeats far apart: registrations stand for the whole run, and the tracker's sweep stays out of the figures.
  const tracker = await startTrackerProc(['--model', `small=${st.url}/`, '--heartbeat-interval-ms', '600000']);
  const heads = await Promise.all([0, 1].map(() => scriptedHead()));
  try {
    for (const h of heads) await register(tracker.url, await Identity.generate(), h.url);
    await Promise.all(Array.from({ length: CHATS }, () => chat(tracker.url))); // warm-up
    const pid = tracker.child.pid;
    const before = cpuMs(pid);
    const t0 = performance.now();
    let tokens = 0;
    for (let r = 0; r < ROUNDS; r++) tokens += (await Promise.all(Array.from({ length: CHATS }, () => chat(tracker.url)))).reduce((a, b) => a + b, 0);
    const wall = performance.now() - t0;
    const after = cpuMs(pid);
    if (tokens !== CHATS * ROUNDS * TOKENS) throw new Error(`got ${tokens} tokens, expected ${CHATS * ROUNDS * TOKENS}`);
    const cpu = after.all - before.all;
    const sys = after.sys - before.sys;
    console.log(`${CHATS} chats × ${ROUNDS} rounds × ${TOKENS} tokens, head gap ${GAP_MS} ms: ${tokens} tokens in ${wall.toFixed(0)} ms; tracker ${cpu} ms CPU = ${(cpu / tokens).toFixed(3)} ms/token (kernel ${(sys / tokens).toFixed(3)}); load ${loadavg()[0]!.toFixed(2)}`);
    writeResult(join(here, 'results', 'tracker-stream.json'), { chats: CHATS, rounds: ROUNDS, tokens_per_chat: TOKENS, gap_ms: GAP_MS, tokens, wall_ms: wall, tracker_cpu_ms: cpu, tracker_kernel_ms: sys, cpu_ms_per_token: cpu / tokens, kernel_ms_per_token: sys / tokens, load_average: loadavg() });
  } finally {
    await tracker.stop();
    for (const h of heads) {
      h.server.closeAllConnections();
      h.server.close();
    }
    await st.close();
  }
}

void main().then(() => process.exit(0), (e) => {
  console.error(e);
  process.exit(1);
});
