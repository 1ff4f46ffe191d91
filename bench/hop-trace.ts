/**
 * Where a hop's fixed cost goes (docs/architecture.md: 3 nodes with no delay reach
 * ~0.6× one process; the mesh adds ~2.3 ms a hop while a bare relay round
 * trip is 0.19 ms). One chat, greedy, over a real relay and 3 real
 * `meshnet node` processes (head [0,4) in chain mode, middle [4,8), tail
 * [8,12) of `small`), every process started with MESHNET_TRACE so it stamps
 * each stage of a step (src/protocol/trace.ts, src/cli/trace-file.ts):
 *
 *   head:  step → ort… → head-span → head-pushed → uncork
 *   relay: relay-in → relay-out
 *   mid:   in:/forward → hop → run → ort… → exec-done → hop-span → hop-pushed → uncork
 *   tail:  … → hop-pushed (POST /chain/token) → uncork
 *   head:  in:/chain/token → token-in → step-done → ndjson → pulled → step (the next)
 *
 * Steps are cut at the head's `step` stamps (one chat: nothing overlaps), each
 * step's stamps put in time order and labelled `process:stage` (`#n` for the
 * n-th repeat of a stage in a process); each consecutive pair's median gap
 * over the steps that have it, and per step the time in onnxruntime, in each
 * process outside it, and between processes. Variants: `relay` (every leg
 * through the relay) and `link` (direct links between the nodes, tail → head
 * too), interleaved with the un-split model in this process (ms/token, the
 * same executor; its onnxruntime time per token from the same stamps).
 *
 *   npx tsx bench/hop-trace.ts [--tokens 48] [--runs 2] [--variants relay,link] [--baseline DIR]
 *
 * `--baseline DIR`: two more meshes, untraced (stamps cost time on the
 * critical path too): this checkout's, and one from another checkout (a
 * worktree of the commit before a change: `git worktree add --detach DIR
 * <commit>` and a node_modules link), all interleaved: ms/token, the median
 * time between tokens and /proc CPU per token side by side.
 *
 * Table on stdout per variant; JSON in bench/results/hop-trace.json.
 */
import { mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ensureModel } from '../src/cli/models.ts';
import { createNodeBackend } from '../src/host/node/onnx.ts';
import { startStaticServer } from '../src/cli/static-server.ts';
import { parseModelConfig } from '../src/model/config.ts';
import { openSafetensors } from '../src/model/safetensors.ts';
import { ModelTokenizer } from '../src/model/tokenizer.ts';
import { Identity } from '../src/net/identity.ts';
import { encodeBase64Url } from '../src/protocol/base64.ts';
import { setTrace } from '../src/protocol/trace.ts';
import { chainReplySigningMessage, routeSigningMessage, type GenerateEvent, type RouteHop } from '../src/protocol/tracker.ts';
import { ShardExecutor } from '../src/shard/executor.ts';
import { readerWeightLoader } from '../src/shard/weights.ts';
import { startRelayProcess, type RelayProcess } from '../test/helpers/relay-process.ts';
import { generateDirect, hopOf, startNode, type NodeProc } from '../test/helpers/mesh.ts';
import { cpuMs } from './lib/proc-cpu.ts';
import { median, printTable, writeResult } from './lib/stats.ts';
import { analyse, type Stamp } from './lib/step-trace.ts';

const argv = process.argv.slice(2);
if (argv.includes('--help') || argv.includes('-h')) {
  process.stdout.write(`npx tsx bench/hop-trace.ts [options]
  per-stage timeline of one chat's decode steps over 3 node processes and a relay

  --tokens N       new tokens per generation (default 48)
  --runs N         generations per variant, interleaved (default 2)
  --variants LIST  relay,link (default both)
  --baseline DIR   also run untraced meshes of this checkout and of DIR (DIR/bin/meshnet.js), interleaved
  --keep           keep the trace file
  --stderr         print the nodes' stderr at the end
  --help           this text
`);
  process.exit(0);
}
const opt = (name: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
};
const TOKENS = Number(opt('tokens') ?? 48);
const RUNS = Number(opt('runs') ?? 2);
const VARIANTS = (opt('variants') ?? 'relay,link').split(',') as Array<'relay' | 'link'>;
/** Another checkout (its bin/meshnet.js) run as a second mesh, interleaved: before/after on one machine in one run. */
const BASELINE = opt('baseline');
const PROMPT = [{ role: 'user', content: 'Write a short story about a lighthouse keeper and a storm at sea.' }];

/** CPU ms by thread name (/proc/<pid>/task/<tid>/stat: comm, utime + stime): which threads of a node burn the CPU. */
function threadCpu(pid: number): Map<string, number> {
  const out = new Map<string, number>();
  for (const tid of readdirSync(`/proc/${pid}/task`)) {
    try {
      const f = readFileSync(`/proc/${pid}/task/${tid}/stat`, 'utf8');
      const comm = f.slice(f.indexOf('(') + 1, f.lastIndexOf(')'));
      const rest = f.slice(f.lastIndexOf(')') + 2).split(' ');
      out.set(comm, (out.get(comm) ?? 0) + (Number(rest[11]) + Number(rest[12])) * 10);
    } catch {
      // the thread ended
    }
  }
  return out;
}


function readStamps(file: string, from: number, to: number): Stamp[] {
  const out: Stamp[] = [];
  for (const line of readFileSync(file, 'utf8').split('\n')) {
    const f = line.split(' ');
    if (f.length < 4) continue;
    const t = Number(f[0]);
    if (t < from || t > to) continue;
    out.push({ t, pid: Number(f[1]), stage: f[3]! });
  }
  return out.sort((a, b) => a.t - b.t);
}

interface Mesh {
  name: string;
  relay: RelayProcess;
  head: NodeProc;
  mid: NodeProc;
  tail: NodeProc;
  /** Relay, head, middle, tail. */
  pids: number[];
}

async function main(): Promise<void> {
  const loadBefore = loadavg()[0]!;
  const work = mkdtempSync(join(tmpdir(), 'meshnet-hop-trace-'));
  const traceFile = join(work, 'trace.log');
  writeFileSync(traceFile, '');
  const dir = await ensureModel('small');
  const st = await startStaticServer({ root: dir });
  const cfg = parseModelConfig(await (await fetch(`${st.url}/config.json`)).json());
  const L = cfg.numLayers;
  const [A, B] = [Math.round(L / 3), Math.round((2 * L) / 3)];
  const meshes: Mesh[] = [];
  const procs: Array<{ stop(): Promise<unknown> }> = [];
  try {
    const key = await Identity.generate();
    /** A relay and 3 nodes from `bin` (this checkout's when absent); only this checkout's are traced. */
    const startMesh = async (name: string, opts: { bin?: string; trace?: boolean } = {}): Promise<Mesh> => {
      const bin = opts.bin;
      if (opts.trace) process.env.MESHNET_TRACE = traceFile;
      else delete process.env.MESHNET_TRACE;
      const relay = await startRelayProcess([], bin);
      procs.push(relay);
      const base = ['--model', 'small', '--model-url', st.url, '--budget-mb', '2048', '--threads', '1', '--max-context', '512', '--relay', relay.url, '--tracker-key', encodeBase64Url(key.publicKey)];
      const two = await Promise.all([startNode([...base, '--layers', `0-${A}`, '--hop-mode', 'chain'], bin), startNode([...base, '--layers', `${A}-${B}`], bin)]);
      procs.push(...two);
      const tail = await startNode([...base, '--layers', `${B}-${L}`], bin);
      procs.push(tail);
      const [head, mid] = two as [NodeProc, NodeProc];
      return { name, relay, head, mid, tail, pids: [relay.child.pid!, head.child.pid!, mid.child.pid!, tail.child.pid!] };
    };
    process.stderr.write('starting nodes...\n');
    // Stamps cost time on the critical path too: the traced mesh gives the timeline, an untraced one (and the baseline's) the comparison.
    const traced = await startMesh('traced', { trace: true });
    meshes.push(traced);
    if (BASELINE) {
      meshes.push(await startMesh('this checkout'));
      meshes.push(await startMesh(`baseline ${BASELINE}`, { bin: join(BASELINE, 'bin', 'meshnet.js') }));
    }
    delete process.env.MESHNET_TRACE;
    const names = new Map<number, string>(['relay', 'head', 'mid', 'tail'].map((n, i) => [traced.pids[i]!, n]));

    const sign = async (m: Mesh, variant: 'relay' | 'link'): Promise<Record<string, string>> => {
      const hops: RouteHop[] = [hopOf(m.mid, A, B, variant === 'relay' ? 'relay' : 'direct'), hopOf(m.tail, B, L, variant === 'relay' ? 'relay' : 'direct')];
      const route = JSON.stringify(hops);
      const expires = Date.now() + 3_600_000;
      const reply = JSON.stringify(variant === 'relay' ? { relay_addr: m.head.relayAddr } : { endpoint: m.head.endpoint });
      return {
        'x-meshnet-route': route,
        'x-meshnet-route-expires': String(expires),
        'x-meshnet-route-signature': encodeBase64Url(await key.sign(routeSigningMessage(m.head.peerId, expires, route))),
        'x-meshnet-chain-reply': reply,
        'x-meshnet-chain-reply-signature': encodeBase64Url(await key.sign(chainReplySigningMessage(m.head.peerId, expires, reply))),
      };
    };

    const tok = await ModelTokenizer.load(fetch, `${st.url}/`, { extraEosTokenIds: cfg.eosTokenIds });
    const whole = await ShardExecutor.create({ config: cfg, backend: createNodeBackend({ intraOpNumThreads: 1 }), weights: readerWeightLoader(await openSafetensors(fetch, `${st.url}/`)), startLayer: 0, endLayer: L, maxContext: 512 });
    const promptIds = tok.encodeChat(PROMPT);
    // The un-split run's onnxruntime time per token, from the same stamps (in this process).
    let ortAt = 0;
    let ortSum = 0;
    const oneOrts: number[] = [];
    const oneProcess = async (): Promise<{ ms: number; ids: number[]; gaps: number[] }> => {
      setTrace((stage) => {
        if (stage === 'ort') ortAt = performance.now();
        else if (stage === 'ort-done') ortSum += performance.now() - ortAt;
      });
      let r = await whole.forward({ session: 'one', position: 0, tokenIds: promptIds, sampling: { temperature: 0 } });
      const t1 = performance.now();
      const ids: number[] = [];
      const gaps: number[] = [];
      let tPrev = t1;
      let pos = promptIds.length;
      for (let i = 0; i < TOKENS; i++) {
        if (r.kind !== 'token') throw new Error('expected a token');
        ids.push(r.tokenId);
        if (i === TOKENS - 1) break;
        ortSum = 0;
        r = await whole.forward({ session: 'one', position: pos++, tokenIds: [r.tokenId], sampling: { temperature: 0 } });
        oneOrts.push(ortSum);
        const t = performance.now();
        gaps.push(t - tPrev);
        tPrev = t;
      }
      setTrace(undefined);
      whole.dropSession('one');
      return { ms: (performance.now() - t1) / (ids.length - 1), ids, gaps };
    };

    let runId = 0;
    const viaMesh = async (m: Mesh, variant: 'relay' | 'link') => {
      const headers = await sign(m, variant);
      const ids: number[] = [];
      const gaps: number[] = [];
      let tFirst = 0;
      let tLast = 0;
      const cpu0 = m.pids.map((p) => cpuMs(p).all);
      const threads0 = m.pids.map((p) => threadCpu(p));
      const from = performance.timeOrigin + performance.now();
      for await (const ev of generateDirect(m.head.endpoint, headers, { messages: PROMPT, max_tokens: TOKENS, temperature: 0, session_id: `trace-${++runId}` }) as AsyncIterable<GenerateEvent>) {
        if (ev.type === 'token') {
          const t = performance.now();
          if (ids.length > 0) gaps.push(t - tLast);
          tLast = t;
          if (ids.length === 0) tFirst = tLast;
          ids.push(ev.token_id);
        } else if (ev.type === 'error') throw new Error(`${ev.code}: ${ev.message}`);
      }
      const to = performance.timeOrigin + performance.now();
      const cpu1 = m.pids.map((p) => cpuMs(p).all);
      const threads = m.pids.map((p, i) => {
        const t1 = threadCpu(p);
        return Object.fromEntries([...t1].map(([k, v]) => [k, +((v - (threads0[i]!.get(k) ?? 0)) / ids.length).toFixed(2)]).filter(([, v]) => (v as number) > 0));
      });
      return { ms: (tLast - tFirst) / (ids.length - 1), gaps, ids, from, to, cpuPerToken: cpu1.map((c, i) => (c - cpu0[i]!) / ids.length), threads };
    };

    const configs = VARIANTS.flatMap((v) => meshes.map((m) => ({ label: meshes.length > 1 ? `${v}, ${m.name}` : v, variant: v, mesh: m })));
    // Warm-up: graphs, sockets, links.
    await oneProcess();
    for (let w = 0; w < 2; w++) for (const c of configs) await viaMesh(c.mesh, c.variant);
    const results = new Map<(typeof configs)[number], Array<Awaited<ReturnType<typeof viaMesh>>>>();
    const one: number[] = [];
    const oneGaps: number[] = [];
    let reference: number[] = [];
    for (let r = 0; r < RUNS; r++) {
      const o = await oneProcess();
      one.push(o.ms);
      oneGaps.push(...o.gaps);
      reference = o.ids;
      // Alternate the order each run, so neither mesh always follows the other.
      for (const c of r % 2 ? [...configs].reverse() : configs) {
        process.stderr.write(`run ${r + 1}/${RUNS}: ${c.label}\n`);
        results.set(c, [...(results.get(c) ?? []), await viaMesh(c.mesh, c.variant)]);
      }
    }
    // The trace files flush every 250 ms.
    await new Promise((r) => setTimeout(r, 600));
    const oneMs = median(one);
    // Median time between tokens over every token of every run: steadier than per-run means when the load jumps.
    const oneTbt = median(oneGaps);
    const oneOrt = median(oneOrts.slice(-RUNS * (TOKENS - 1)));
    const rows: Array<Record<string, unknown>> = [];
    for (const c of configs) {
      const rs = results.get(c)!;
      const ms = median(rs.map((x) => x.ms));
      const tbt = median(rs.flatMap((x) => x.gaps));
      const cpu = [0, 1, 2, 3].map((i) => median(rs.map((x) => x.cpuPerToken[i]!)));
      const same = rs.every((x) => x.ids.join() === reference.join());
      // bf16 at the hop boundaries may flip a near-tie against one process; every mesh of a variant must agree with every other.
      const first = results.get(configs.find((o) => o.variant === c.variant)!)![0]!.ids.join();
      const sameMesh = rs.every((x) => x.ids.join() === first);
      rows.push({ config: c.label, ms_per_token: +ms.toFixed(3), x_one_process: +(oneMs / ms).toFixed(3), tbt_p50_ms: +tbt.toFixed(3), x_one_process_tbt: +(oneTbt / tbt).toFixed(3), cpu_ms_per_token: { relay: cpu[0], head: cpu[1], mid: cpu[2], tail: cpu[3], all: cpu.reduce((a, b) => a + b, 0) }, same_tokens_as_one_process: same, same_tokens_as_first_mesh: sameMesh });
      if (c.mesh !== traced) continue;
      const a = analyse(rs.flatMap((x) => readStamps(traceFile, x.from, x.to)), names, traced.head.child.pid!);
      printTable(
        `${c.label}: ${ms.toFixed(2)} ms/token (one process ${oneMs.toFixed(2)}: ×${(oneMs / ms).toFixed(3)}); traced step ${a.stepMs.toFixed(2)} ms over ${a.steps} steps; threads' CPU ms/token (last run) ${JSON.stringify(rs.at(-1)!.threads)}`,
        ['from', 'to', 'p50 ms', 'p90 ms'],
        a.gaps.map((g) => [g.from, g.to, g.p50.toFixed(3), g.p90.toFixed(3)]),
      );
      printTable(`${c.label}: per step, summed (medians over steps)`, ['where', 'p50 ms'], [...a.grouped.map((g) => [g.group, g.p50.toFixed(3)]), ['one process: onnxruntime per token', oneOrt.toFixed(3)]]);
      Object.assign(rows.at(-1)!, { step_ms: a.stepMs, steps: a.steps, grouped: a.grouped, gaps: a.gaps });
    }
    printTable(
      `one chat, ${TOKENS} tokens, medians of ${RUNS} interleaved runs; one process ${oneMs.toFixed(2)} ms/token, median between tokens ${oneTbt.toFixed(2)} (onnxruntime ${oneOrt.toFixed(2)}); load ${loadBefore.toFixed(1)} → ${loadavg()[0]!.toFixed(1)} on ${cpus().length} cores`,
      ['config', 'ms/token', '× one process', 'median between tokens ms', '× one process (medians)', 'CPU ms/token (relay, head, mid, tail = all)', 'tokens = one process', 'tokens = first mesh'],
      rows.map((r) => {
        const c = r.cpu_ms_per_token as Record<string, number>;
        return [String(r.config), Number(r.ms_per_token), Number(r.x_one_process), Number(r.tbt_p50_ms), Number(r.x_one_process_tbt), `${c.relay!.toFixed(2)}, ${c.head!.toFixed(2)}, ${c.mid!.toFixed(2)}, ${c.tail!.toFixed(2)} = ${c.all!.toFixed(2)}`, String(r.same_tokens_as_one_process), String(r.same_tokens_as_first_mesh)];
      }),
    );
    // Which path the hops' /forward requests really took (relay, link, http), per node: a link that never came up shows as http.
    for (const m of meshes) {
      const served = await Promise.all([m.mid, m.tail].map(async (n) => ((await (await fetch(`${n.endpoint}/info`)).json()) as { forwards_served?: unknown }).forwards_served));
      console.log(`${m.name}: /forward served by surface: mid ${JSON.stringify(served[0])}, tail ${JSON.stringify(served[1])}`);
      if (argv.includes('--stderr')) for (const n of [m.head, m.mid, m.tail]) console.log(n.stderr().slice(-1500));
    }
    writeResult(fileURLToPath(new URL('./results/hop-trace.json', import.meta.url)), { bench: 'hop-trace', date: new Date().toISOString(), tokens: TOKENS, runs: RUNS, baseline: BASELINE ?? null, one_process_ms_per_token: oneMs, one_process_tbt_p50_ms: oneTbt, one_process_ort_ms_per_token: oneOrt, load: [loadBefore, loadavg()[0]], rows });
    await whole.release();
  } finally {
    await Promise.all(procs.map((p) => p.stop()));
    await st.close();
    if (!argv.includes('--keep')) rmSync(work, { recursive: true, force: true });
    else process.stderr.write(`trace kept in ${traceFile}\n`);
  }
}

await main();
