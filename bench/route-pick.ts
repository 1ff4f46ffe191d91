/**
 * bench/route-pick — one route pick at swarm scale, in process (no HTTP).
 *
 * A NodeRegistry holds N donors of a 32-layer model (Llama-3-8B's shape,
 * the budgets and formats bench/swarm.ts uses), each serving the span it was
 * assigned, with its own speed, queue and KV room. For each N it times, side
 * by side in one run:
 *   - with room (`now` in the JSON): `registry.pickWithRoom` (KV room
 *     checked on the K cheapest of each span, read off the span groups kept
 *     sorted by cost, then the K-best search and the draw);
 *   - every node: the same pick over every serving node with room (the
 *     registry's O(N) list of serving nodes into the plain route search of
 *     test/helpers/tracker-reference.ts, as the tracker searched before it
 *     kept its sums: every node at every boundary).
 * Both pick among the same cheapest routes (test/tracker/scale.test.ts checks
 * the searches agree); the ratio is what keeping the groups sorted saves.
 * It also times `registry.pick` (what `GET /api/route` does: no KV test).
 *
 * `--cold`: between two picks the registry takes 1,000 heartbeats of other
 * donors and the process allocates ~1 MB, as a loaded tracker does between
 * two route probes (~700 beats a second each), so the picks find the
 * records out of the CPU's caches and young garbage about, as they do
 * there; picks back to back read everything from cache.
 *
 *   npx tsx bench/route-pick.ts [--donors 1000,5000,10000] [--picks 2000] [--cold]
 */
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseModelConfig } from '../src/model/config.ts';
import { mulberry32 } from '../src/model/fixture.ts';
import type { NodeMessage } from '../src/protocol/tracker.ts';
import { sizeModel } from '../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../src/tracker/options.ts';
import { NodeRegistry } from '../src/tracker/registry.ts';
import { pickRoute } from '../src/tracker/routing.ts';
import { naiveFindRoutes } from '../test/helpers/tracker-reference.ts';
import { printTable, quantile, writeResult } from './lib/stats.ts';
import { SWARM_BUDGETS, SWARM_CONFIG } from './lib/swarm-shape.ts';

const argv = process.argv.slice(2);
const opt = (name: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
};
const DONORS = (opt('donors') ?? '1000,5000,10000').split(',').map(Number);
const PICKS = Number(opt('picks') ?? 2000);
const COLD = argv.includes('--cold');
const OUT = opt('out') ?? join(fileURLToPath(new URL('.', import.meta.url)), 'results', 'route-pick.json');


/** Each donor's last heartbeat, so `--cold` can send the next. */
const beats: NodeMessage[] = [];

function swarm(n: number): NodeRegistry {
  beats.length = 0;
  const o = resolveTrackerOptions({ logLevel: 'silent' });
  const spec = sizeModel('swarm', 'http://models.test/swarm', parseModelConfig(SWARM_CONFIG), o);
  const rnd = mulberry32(n);
  const reg = new NodeRegistry([spec], { ...o, random: mulberry32(7) });
  const now = Date.now();
  for (let i = 0; i < n; i++) {
    const [mb, format] = SWARM_BUDGETS[i % SWARM_BUDGETS.length]!;
    const peer = i.toString(16).padStart(32, '0');
    const base: NodeMessage = {
      peer_id: peer,
      public_key: 'k'.repeat(43),
      timestamp: now,
      info: { model: 'swarm', backend: 'webgpu', memory_budget_mb: mb, host: 'browser', weight_format: format },
    } as NodeMessage;
    const rec = reg.register(base);
    if (!rec.assignment) continue;
    const budget = mb * 1024 * 1024;
    const used = Math.floor(rnd() * 0.9 * budget);
    const beat = {
      ...base,
      timestamp: now + 1,
      serving: { start_layer: rec.assignment.start, end_layer: rec.assignment.end },
      stats: { rpm: 0, layer_ms: 2 + rnd() * 20, queue_depth: Math.floor(rnd() * 3), kv_free_bytes: budget - used, tokens_served: 0, kv_budget_bytes: budget, kv_used_bytes: used, kv_bytes_per_token: 4096 },
    } as NodeMessage;
    reg.heartbeat(beat);
    beats.push(beat);
  }
  return reg;
}

let beaten = 0;
// Kept until the next round, as a tracker keeps recent requests a while.
let _garbage: unknown[] = [];
/** What a loaded tracker does between two picks (`--cold`). */
function meanwhile(reg: NodeRegistry): void {
  if (!COLD) return;
  for (let k = 0; k < 1000; k++) {
    const b = beats[beaten++ % beats.length]!;
    const next = { ...b, timestamp: b.timestamp + 1, stats: { ...b.stats! } } as NodeMessage;
    reg.heartbeat(next);
    beats[(beaten - 1) % beats.length] = next;
  }
  _garbage = Array.from({ length: 20_000 }, (_, i) => ({ i, s: `x${i}` }));
}

interface Row {
  donors: number;
  serving: number;
  pick_p50_us: number;
  pick_p99_us: number;
  now_p50_us: number;
  now_p99_us: number;
  every_node_p50_us: number;
  every_node_p99_us: number;
  ratio_p50: number;
}

const TOKENS = 512;
const rows: Row[] = [];
for (const n of DONORS) {
  const reg = swarm(n);
  const end = reg.model('swarm').numLayers;
  const o = resolveTrackerOptions({});
  const random = mulberry32(11);
  const fast: number[] = [];
  const slow: number[] = [];
  const bare: number[] = [];
  // Alternate the ways, so all see the same machine load.
  for (let i = 0; i < PICKS; i++) {
    meanwhile(reg);
    let t0 = performance.now();
    reg.pick('swarm');
    bare.push((performance.now() - t0) * 1000);
    meanwhile(reg);
    t0 = performance.now();
    if (!reg.pickWithRoom('swarm', TOKENS)) throw new Error('no route with room');
    fast.push((performance.now() - t0) * 1000);
    if (i % 20 === 0) {
      t0 = performance.now();
      const all = reg.servingNodes('swarm', new Set(), (x) => reg.kvNeed(x, TOKENS) <= reg.kvFree(x));
      if (!pickRoute(naiveFindRoutes(all, 0, end, o.hopLatencyMs), o.routeSlack, random)) throw new Error('no route (every node)');
      slow.push((performance.now() - t0) * 1000);
    }
  }
  fast.sort((a, b) => a - b);
  slow.sort((a, b) => a - b);
  bare.sort((a, b) => a - b);
  const row: Row = {
    donors: n,
    serving: reg.servingNodes('swarm').length,
    pick_p50_us: quantile(bare, 0.5),
    pick_p99_us: quantile(bare, 0.99),
    now_p50_us: quantile(fast, 0.5),
    now_p99_us: quantile(fast, 0.99),
    every_node_p50_us: quantile(slow, 0.5),
    every_node_p99_us: quantile(slow, 0.99),
    ratio_p50: quantile(slow, 0.5) / quantile(fast, 0.5),
  };
  rows.push(row);
  console.log(JSON.stringify(row));
}

printTable(
  `route picks, one process (${PICKS} picks per size; "every node": 1 in 20; ${COLD ? 'cold: 1,000 beats and ~1 MB of garbage before each' : 'back to back'}), shared 2-core machine`,
  ['donors', 'serving', 'pick p50 µs', 'pick p99 µs', 'with room p50 µs', 'with room p99 µs', 'every node p50 µs', 'every node p99 µs', 'every node / with room (p50)'],
  rows.map((r) => [r.donors, r.serving, r.pick_p50_us, r.pick_p99_us, r.now_p50_us, r.now_p99_us, r.every_node_p50_us, r.every_node_p99_us, r.ratio_p50]),
);
writeResult(OUT, { bench: 'route-pick', picks: PICKS, tokens: TOKENS, cold: COLD, runs: rows });
