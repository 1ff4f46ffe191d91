/**
 * Batching at each hop in real processes (issue 11): a relay, a tracker and
 * three `meshnet node` processes ([0,1) [1,3) [3,4) of the `tiny` fixture),
 * eight chats at once through the tracker's OpenAI API. Every chat streams
 * the float64 reference's greedy text, and the nodes show that they ran
 * steps of several sessions together: GET /info's `batch.sizes` and the
 * tracker's /metrics (meshnet_tracker_node_batch_runs by size).
 */
import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { fixture } from '../helpers/shard.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { startNode, startTrackerProc, stopMesh, until, type NodeProc, type TrackerProc } from '../helpers/mesh.ts';

const f = fixture('tiny');
const utf8d = new TextDecoder();
const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(f.files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const MAX_TOKENS = 24;
const CHATS = 8;
const TOPICS = ['the quick brown fox', 'a lighthouse', 'two rival bakers', 'a map', 'snow in the desert', 'a violin', 'the moon', 'an orchard'];
const messages = (i: number) => [{ role: 'user' as const, content: `Tell me about ${TOPICS[i]!}.` }];

/** The text a streaming detokenizer makes of the reference's greedy ids (cut at eos). */
function referenceText(i: number): string {
  const ref = new ReferenceModel(f.cfg, f.weights);
  const all = ref.greedy(tok.encodeChat(messages(i)), MAX_TOKENS);
  const eos = all.findIndex((t) => tok.isEos(t));
  const ids = eos >= 0 ? all.slice(0, eos) : all;
  const dec = tok.streamDecoder({ skipSpecialTokens: true });
  return ids.map((t) => dec.push(t)).join('');
}

interface BatchInfo {
  max_batch: number;
  runs: number;
  requests: number;
  sizes: number[];
}

async function batchOf(n: NodeProc): Promise<BatchInfo> {
  return ((await (await fetch(`${n.endpoint}/info`)).json()) as { batch: BatchInfo }).batch;
}

/** Runs that stepped two or more sessions at once. */
const multi = (b: BatchInfo) => b.sizes.reduce((s, runs, size) => s + (size >= 2 ? runs : 0), 0);

describe('concurrent chats through the tracker are batched at each hop', () => {
  let st: StaticServer;
  let relay: RelayProcess;
  let tracker: TrackerProc;
  let nodes: NodeProc[] = [];
  let client: OpenAI;

  beforeAll(async () => {
    st = await startStaticServer({ root: await ensureModel('tiny') });
    relay = await startRelayProcess();
    tracker = await startTrackerProc(['--model', `tiny=${st.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '500']);
    const common = ['--relay', relay.url, '--tracker', tracker.url, '--model', 'tiny', '--model-url', st.url, '--budget-mb', '64'];
    // The middle waits 15 ms before each /forward (a slow donor): requests of different chats pile up there.
    nodes = await Promise.all([startNode([...common, '--layers', '0-1']), startNode([...common, '--layers', '1-3', '--inject-delay-ms', '15']), startNode([...common, '--layers', '3-4'])]);
    await Promise.all(nodes.map((n) => n.waitFor((e) => e.event === 'registered')));
    await until(async () => (await fetch(`${tracker.url}/api/route?model=tiny`)).ok, 20_000, 'a complete route');
    client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
  }, 120_000);

  afterAll(() => stopMesh({ nodes, tracker, relay, st }));

  it('streams every chat its reference text, and the hops report runs of several sessions in /info and the tracker /metrics', async () => {
    const want = TOPICS.map((_, i) => referenceText(i));
    const before = await Promise.all(nodes.map(batchOf));
    expect(before.map((b) => b.max_batch)).toEqual([16, 16, 16]);
    const got = await Promise.all(
      TOPICS.slice(0, CHATS).map(async (_, i) => {
        const r = await client.chat.completions.create({ model: 'tiny', messages: messages(i), max_tokens: MAX_TOKENS, temperature: 0 });
        return r.choices[0]!.message.content ?? '';
      }),
    );
    expect(got).toEqual(want);

    const after = await Promise.all(nodes.map(batchOf));
    // The middle and the tail serve /forward of all eight chats; the head steps its own layers for them.
    for (const b of after.slice(1)) expect(multi(b), `sizes ${b.sizes.join(',')}`).toBeGreaterThan(0);
    // Every request is counted once, in exactly one run.
    for (const b of after) expect(b.sizes.reduce((s, runs, size) => s + runs * size, 0)).toBe(b.requests);

    // The heartbeat carries the histogram to the tracker, which exports it.
    const middle = nodes[1]!.peerId;
    const line = await until(
      async () => {
        const text = await (await fetch(`${tracker.url}/metrics`)).text();
        return text.split('\n').find((l) => l.startsWith('meshnet_tracker_node_batch_runs{') && l.includes(`peer_id="${middle}"`) && !l.includes('size="1"'));
      },
      10_000,
      'a batch of two or more in /metrics',
    );
    expect(Number(line.split(' ').at(-1))).toBeGreaterThan(0);
  }, 120_000);
});
