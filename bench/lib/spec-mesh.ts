/**
 * What the speculative decoding benches share (bench/speculative.ts,
 * bench/prompt-lookup.ts): a fixture model on three real `meshnet node`
 * processes chained behind one delaying proxy in front of the relay
 * (bench/lib/wan.ts), heads that hold a draft model, a generation timed from
 * its first token to its last with each decode trip's drafted/accepted
 * counts, and the table row a configuration's runs give.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer } from '../../src/cli/static-server.ts';
import type { FixturePreset } from '../../src/model/fixture.ts';
import { Identity } from '../../src/net/identity.ts';
import { expectedTokens } from '../../src/node/head/speculation/adaptive-k.ts';
import type { GenerateEvent, GenerateRequest, RouteHop } from '../../src/protocol/tracker.ts';
import { generateDirect, signedRouteHeaders, startNode, startTrackerProc, type NodeProc } from '../../test/helpers/mesh.ts';
import { median, startDelayedRelay } from './wan.ts';

export interface SpecRun {
  ids: number[];
  tokS: number;
  /** Per decode trip: drafted, accepted (trips without drafts: 0, 0), tokens emitted. */
  trips: Array<{ drafted: number; accepted: number; tokens: number }>;
  /** From the request to the first token, ms (the prompt's step, with whatever it drafted). */
  firstTokenMs: number;
  /** The longest wait between two tokens, ms (a stall shows here). */
  maxGapMs: number;
  /** What the head logged at warn level or above during the generation (star fallbacks, replays). */
  headLog: string[];
}

export interface SpecMesh {
  /** The heads, in the order asked for (each runs the first span; `drafts[i]` its draft model). */
  heads: NodeProc[];
  /** One generation through `heads[via]` and the two other spans. */
  generate(body: Partial<GenerateRequest>, via?: number): Promise<SpecRun>;
  stop(): Promise<void>;
}

export interface SpecMeshOptions {
  model: FixturePreset;
  /** The three spans' ends: [0, a) [a, b) [b, layers). */
  cuts: [number, number, number];
  oneWayMs: number;
  /** One head per entry: the seed of the draft model it holds (`--draft`, the same preset), a `--draft` value as it is (`self:N`), or null for none. */
  heads: Array<number | string | null>;
  /** Per head, another checkout's bin/meshnet.js to run it from (a baseline); absent: this checkout's. */
  headBins?: Array<string | undefined>;
}

export async function startSpecMesh(o: SpecMeshOptions): Promise<SpecMesh> {
  const [a, b, n] = o.cuts;
  const seeds = [...new Set([0, ...o.heads.filter((s): s is number => typeof s === 'number')])];
  const statics = new Map<number, Awaited<ReturnType<typeof startStaticServer>>>();
  const work = mkdtempSync(join(tmpdir(), 'meshnet-bench-spec-'));
  const nodes: NodeProc[] = [];
  const cleanups: Array<() => Promise<void>> = [];
  const stop = async () => {
    await Promise.all(nodes.map((x) => x.stop()));
    for (const c of cleanups.reverse()) await c();
    for (const s of statics.values()) await s.close();
    rmSync(work, { recursive: true, force: true });
  };
  try {
    for (const seed of seeds) statics.set(seed, await startStaticServer({ root: await ensureModel(o.model, undefined, seed) }));
    const url = statics.get(0)!.url;
    const trackerId = await Identity.generate();
    const keyFile = join(work, 'tracker-key.json');
    writeFileSync(keyFile, JSON.stringify(await trackerId.export()));
    const delayed = await startDelayedRelay(o.oneWayMs);
    cleanups.push(() => delayed.stop());
    const tracker = await startTrackerProc(['--model', `${o.model}=${url}`, '--relay', delayed.relay.url, '--key-file', keyFile, '--heartbeat-interval-ms', '1000']);
    cleanups.push(async () => void (await tracker.stop()));
    process.stderr.write('starting nodes...\n');
    const base = ['--model', o.model, '--model-url', url, '--budget-mb', '2048', '--threads', '1', '--max-context', '512', '--no-links', '--relay', delayed.url, '--tracker', tracker.url];
    const started = await Promise.all([
      startNode([...base, '--layers', `${a}-${b}`]),
      startNode([...base, '--layers', `${b}-${n}`]),
      ...o.heads.map((d, i) => startNode([...base, '--layers', `0-${a}`, ...(d === null ? [] : ['--draft', typeof d === 'number' ? statics.get(d)!.url : d])], o.headBins?.[i])),
    ]);
    nodes.push(...started);
    await Promise.all(nodes.map((x) => x.waitFor((e) => e.event === 'registered')));
    const [mid, tail, ...heads] = started as [NodeProc, NodeProc, ...NodeProc[]];
    const hops: RouteHop[] = [
      { peer_id: mid.peerId, start_layer: a, end_layer: b, relay_addr: mid.relayAddr! },
      { peer_id: tail.peerId, start_layer: b, end_layer: n, relay_addr: tail.relayAddr! },
    ];
    if (!mid.relayAddr?.startsWith(delayed.url)) throw new Error(`the relay gave ${mid.relayAddr}, not the proxy's address`);
    let runId = 0;
    const generate = async (body: Partial<GenerateRequest>, via = 0): Promise<SpecRun> => {
      const head = heads[via]!;
      const headers = await signedRouteHeaders(trackerId, head, hops);
      let tFirst = 0;
      let tLast = 0;
      const ids: number[] = [];
      const trips: SpecRun['trips'] = [];
      let maxGapMs = 0;
      const tStart = performance.now();
      const logFrom = head.stderr().length;
      for await (const ev of generateDirect(head.endpoint, headers, { temperature: 0, session_id: `spec-${++runId}`, ...body }) as AsyncIterable<GenerateEvent>) {
        if (ev.type === 'token') {
          const now = performance.now();
          if (ids.length > 0) maxGapMs = Math.max(maxGapMs, now - tLast);
          tLast = now;
          if (ids.length === 0) tFirst = tLast;
          ids.push(ev.token_id);
          // A trip's first token carries its counts; tokens without them continue the trip (or are plain trips).
          if (ev.drafted !== undefined) trips.push({ drafted: ev.drafted, accepted: ev.accepted ?? 0, tokens: 1 });
          else if (trips.length > 0 && trips.at(-1)!.tokens < trips.at(-1)!.accepted + 1) trips.at(-1)!.tokens++;
          else trips.push({ drafted: 0, accepted: 0, tokens: 1 });
        } else if (ev.type === 'error') throw new Error(`${ev.code}: ${ev.message}`);
      }
      // The prompt's step is no decode trip.
      trips.shift();
      // The node logs JSON lines on stderr.
      const headLog = head.stderr().slice(logFrom).split('\n').filter((l) => /"level":"(warn|error)"/.test(l)).map((l) => l.slice(0, 300));
      return { ids, tokS: (1000 * (ids.length - 1)) / (tLast - tFirst), trips, firstTokenMs: tFirst - tStart, maxGapMs, headLog };
    };
    return { heads, generate, stop };
  } catch (e) {
    await stop();
    throw e;
  }
}

export interface SpecRow {
  mean_k: number;
  alpha: number | null;
  tokens_per_trip: number;
  trips_per_token: number;
  theory_tokens_per_trip: number;
  x_theory: number;
  tokens_per_s: number;
  x_off: number;
}

/**
 * A configuration's runs as a table row: α (maximum likelihood: accepted /
 * (accepted + rejecting trips)), the mean k drafted, tokens per decode trip
 * against the theory (1 − α^(k+1)) / (1 − α) averaged over the trips' k, and
 * the median tokens/s with its ratio to `offTokS`.
 */
export function specRow(rs: SpecRun[], offTokS: number): SpecRow {
  const trips = rs.flatMap((x) => x.trips);
  const drafting = trips.filter((t) => t.drafted > 0);
  const accepted = drafting.reduce((s, t) => s + t.accepted, 0);
  const rejecting = drafting.filter((t) => t.accepted < t.drafted).length;
  const alpha = drafting.length === 0 ? null : accepted / Math.max(1, accepted + rejecting);
  const tokensPerTrip = trips.reduce((s, t) => s + t.tokens, 0) / Math.max(1, trips.length);
  const theory = alpha === null ? 1 : trips.reduce((s, t) => s + expectedTokens(alpha, t.drafted), 0) / Math.max(1, trips.length);
  const tokS = median(rs.map((x) => x.tokS));
  return {
    mean_k: +(trips.reduce((s, t) => s + t.drafted, 0) / Math.max(1, trips.length)).toFixed(2),
    alpha: alpha === null ? null : +alpha.toFixed(3),
    tokens_per_trip: +tokensPerTrip.toFixed(3),
    trips_per_token: +(1 / tokensPerTrip).toFixed(3),
    theory_tokens_per_trip: +theory.toFixed(3),
    x_theory: +(tokensPerTrip / theory).toFixed(3),
    tokens_per_s: +tokS.toFixed(2),
    x_off: +(tokS / offTokS).toFixed(3),
  };
}
