/**
 * bench/beat-cost — a heartbeat over the relay at the tracker, in process.
 *
 * A tracker (createTracker, no HTTP, no relay) holds N donors of the swarm's
 * 32-layer model (bench/swarm.ts's shape and budgets), each registered and
 * serving its span. Then every donor beats, round robin, as a node does over
 * its relay socket: the NodeMessage as JSON bytes into `tracker.relayBeat`
 * (what the relay bridge calls for `POST /api/nodes/beat`), and the answer
 * JSON out. Bodies are encoded before the clock starts (the node's work).
 * Reported: µs per beat (median of rounds), and the same work split into its
 * parts (JSON.parse, the schema, registry.heartbeat, the answer), each timed
 * alone over the same beats.
 *
 * Then the same beats as a relay with beat-batch hands them over
 * (docs/protocol.md §9.1): `beats` messages of --batch beats each, as text,
 * into `tracker.relayBeats` (JSON.parse of the message, the batch schema,
 * each beat checked, the gauge and admission once per batch) and the
 * `beats-answer` text out. Both are per beat, side by side in one run; the
 * WebSocket message and stream each beat costs on the request path come on
 * top of the first and not of the second (bench/swarm.ts measures those).
 *
 *   npx tsx bench/beat-cost.ts [--donors 5000] [--rounds 5] [--batch 10,50] [--out FILE]
 */
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import pino from 'pino';
import { Identity } from '../src/net/identity.ts';
import { parseModelConfig } from '../src/model/config.ts';
import { nodeMessageSchema, type NodeMessage } from '../src/protocol/tracker.ts';
import { createTracker } from '../src/tracker/app.ts';
import { createTrackerMetrics } from '../src/tracker/metrics.ts';
import { sizeModel } from '../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../src/tracker/options.ts';
import { printTable, quantile, writeResult } from './lib/stats.ts';
import { SWARM_BUDGETS, SWARM_CONFIG } from './lib/swarm-shape.ts';

const argv = process.argv.slice(2);
const opt = (name: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
};
const DONORS = Number(opt('donors') ?? 5000);
const ROUNDS = Number(opt('rounds') ?? 5);
const BATCHES = (opt('batch') ?? '10,50').split(',').map(Number);
const OUT = opt('out') ?? join(fileURLToPath(new URL('.', import.meta.url)), 'results', 'beat-cost.json');


const o = resolveTrackerOptions({ logLevel: 'silent' });
const spec = sizeModel('swarm', 'http://models.test/swarm', parseModelConfig(SWARM_CONFIG), o);
const tracker = createTracker({ options: o, models: [spec], identity: await Identity.generate(), transport: { open: () => Promise.reject(new Error('no transport')) }, logger: pino({ level: 'silent' }), metrics: createTrackerMetrics() });
const reg = tracker.registry;

/** As bench/lib/swarm-donors.ts sends it. */
function message(i: number, serving: { start_layer: number; end_layer: number } | null): NodeMessage {
  const [mb, format] = SWARM_BUDGETS[i % SWARM_BUDGETS.length]!;
  const budget = mb * 2 ** 20;
  const peer = i.toString(16).padStart(32, '0');
  return {
    peer_id: peer,
    public_key: `${'k'.repeat(38)}${i.toString(36).padStart(5, '0')}`,
    relay_addr: `ws://127.0.0.1:9/rpc/${peer}`,
    info: { model: 'swarm', backend: 'webgpu', memory_budget_mb: mb, host: 'browser', version: 'swarm-sim', weight_format: format },
    stats: { rpm: 0, layer_ms: 4 + (i % 8), queue_depth: 0, kv_free_bytes: Math.round(budget / 4), tokens_served: 0, kv_budget_bytes: Math.round(budget / 4), kv_used_bytes: 0, kv_sessions: 0, kv_bytes_per_token: 131072, kv_block_tokens: 16, kv_max_tokens: 8192 },
    serving,
    timestamp: Date.now(),
  } as NodeMessage;
}

const peers: string[] = [];
const spans: Array<{ start_layer: number; end_layer: number } | null> = [];
for (let i = 0; i < DONORS; i++) {
  const n = reg.register(message(i, null));
  peers.push(n.peerId);
  spans.push(n.assignment ? { start_layer: n.assignment.start, end_layer: n.assignment.end } : null);
}
for (let i = 0; i < DONORS; i++) reg.heartbeat(message(i, spans[i]!));
const enc = new TextEncoder();
const dec = new TextDecoder();
const bodies = (): Uint8Array[] => peers.map((_, i) => enc.encode(JSON.stringify(message(i, spans[i]!))));

function timeRounds(label: string, each: (i: number, body: Uint8Array) => void): { label: string; us: number; p10: number; p90: number } {
  const per: number[] = [];
  for (let r = 0; r < ROUNDS + 1; r++) {
    const b = bodies();
    const t0 = performance.now();
    for (let i = 0; i < DONORS; i++) each(i, b[i]!);
    const us = ((performance.now() - t0) * 1000) / DONORS;
    if (r > 0) per.push(us); // the first round warms up
  }
  per.sort((a, b) => a - b);
  return { label, us: quantile(per, 0.5), p10: quantile(per, 0.1), p90: quantile(per, 0.9) };
}

/** Per beat, as `beats` messages of `size` (what the relay sends) into tracker.relayBeats, the answer text out. */
function timeBatched(size: number): { label: string; us: number; p10: number; p90: number } {
  const per: number[] = [];
  for (let r = 0; r < ROUNDS + 1; r++) {
    const texts: string[] = [];
    for (let i = 0; i < DONORS; i += size) {
      const parts: string[] = [];
      for (let j = i; j < Math.min(DONORS, i + size); j++) parts.push(`{"from":"${peers[j]}","body":${JSON.stringify(message(j, spans[j]!))}}`);
      texts.push(`{"type":"beats","batch":${r * DONORS + i},"beats":[${parts.join(',')}]}`);
    }
    const t0 = performance.now();
    for (const text of texts) {
      const answer = tracker.relayBeats(JSON.parse(text) as object);
      if (!answer.startsWith('{"type":"beats-answer"') || answer.includes('"status":4')) bad++;
    }
    const us = ((performance.now() - t0) * 1000) / DONORS;
    if (r > 0) per.push(us);
  }
  per.sort((a, b) => a - b);
  return { label: `whole beat, batched ${size} a message (tracker.relayBeats)`, us: quantile(per, 0.5), p10: quantile(per, 0.1), p90: quantile(per, 0.9) };
}

let bad = 0;
const rows = [
  timeRounds('whole beat (tracker.relayBeat)', (i, body) => {
    if (tracker.relayBeat(peers[i], body).status !== 200) bad++;
  }),
  ...BATCHES.map((size) => timeBatched(size)),
  timeRounds('  JSON.parse', (_i, body) => void JSON.parse(dec.decode(body))),
  timeRounds('  JSON.parse + schema', (_i, body) => void nodeMessageSchema.safeParse(JSON.parse(dec.decode(body)))),
  timeRounds('  JSON.parse + registry.heartbeat', (_i, body) => void reg.heartbeat(JSON.parse(dec.decode(body)) as NodeMessage)),
];
if (bad > 0) throw new Error(`${bad} beats were not answered 200`);
const mem = process.memoryUsage();
printTable(
  `beat cost in process, ${DONORS} donors, ${ROUNDS} rounds (median µs per beat, [p10, p90] of rounds)`,
  ['what', 'µs per beat', 'p10–p90'],
  rows.map((r) => [r.label, r.us.toFixed(1), `${r.p10.toFixed(1)}–${r.p90.toFixed(1)}`]),
);
console.log(`heap used ${(mem.heapUsed / 2 ** 20).toFixed(0)} MiB`);
writeResult(OUT, { bench: 'beat-cost', donors: DONORS, rounds: ROUNDS, batches: BATCHES, rows });
