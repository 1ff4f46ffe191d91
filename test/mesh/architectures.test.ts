/**
 * Every published architecture through a real mesh: a relay, one tracker
 * serving all seven presets, and per architecture three `meshnet node`
 * processes (layers 0-1, 1-3, 3-4) loading that preset from the static
 * server. Three chats of 32 greedy tokens each, through the tracker's
 * OpenAI API, must stream exactly the float64 reference's tokens (cut at the
 * first end-of-sequence id, as the head stops there).
 *
 * Activations cross the hops as f32 (`--wire-dtype f32` on the tracker and
 * the pinned nodes): with the bf16 default, rounding at the hops flips greedy
 * choices on these random-weight models within a few tokens.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { Identity } from '../../src/net/identity.ts';
import { fixture } from '../helpers/shard.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { startNode, startTrackerProc, until, type NodeProc, type TrackerProc } from '../helpers/mesh.ts';

const PRESETS = ['tiny-llama31', 'tiny-smollm2', 'tiny-mistral', 'tiny-qwen2', 'tiny-qwen3', 'tiny-phi3', 'tiny-phi4mini'] as const;
const TOKENS = 32;
const CHATS = [
  [{ role: 'user' as const, content: 'Tell me about the quick brown fox.' }],
  [
    { role: 'system' as const, content: 'You are terse.' },
    { role: 'user' as const, content: 'What is a mesh of volunteer nodes?' },
  ],
  [{ role: 'user' as const, content: 'Count: one, two, three, four, five, six, seven.' }],
];

const HOPS: Array<[number, number]> = [[0, 1], [1, 3], [3, 4]];

const utf8d = new TextDecoder();
function referenceIds(preset: (typeof PRESETS)[number]): { prompts: number[][]; ids: number[][] } {
  const f = fixture(preset);
  const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(f.files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
  const ref = new ReferenceModel(f.cfg, f.weights);
  const prompts = CHATS.map((m) => tok.encodeChat(m));
  const ids = prompts.map((p) => {
    const all = ref.greedy(p, TOKENS);
    const eos = all.findIndex((t) => tok.isEos(t));
    return eos >= 0 ? all.slice(0, eos) : all;
  });
  return { prompts, ids };
}

describe('a 3-node mesh per architecture streams the float64 reference through the OpenAI API', () => {
  let st: StaticServer;
  let relay: RelayProcess;
  let tracker: TrackerProc;
  let client: OpenAI;
  const work = mkdtempSync(join(tmpdir(), 'meshnet-arch-test-'));

  beforeAll(async () => {
    for (const p of PRESETS) await ensureModel(p, join(work, 'models', p));
    st = await startStaticServer({ root: join(work, 'models') });
    relay = await startRelayProcess();
    const key = await Identity.generate();
    writeFileSync(join(work, 'tracker.key'), JSON.stringify(await key.export()));
    const models = PRESETS.flatMap((p) => ['--model', `${p}=${st.url}/${p}/`]);
    tracker = await startTrackerProc([...models, '--wire-dtype', 'f32', '--relay', relay.url, '--heartbeat-interval-ms', '1000', '--key-file', join(work, 'tracker.key')]);
    client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
  }, 120_000);

  afterAll(async () => {
    await tracker?.stop();
    await relay?.stop();
    await st?.close();
    rmSync(work, { recursive: true, force: true });
  });

  it.each(PRESETS)('%s', async (preset) => {
    const want = referenceIds(preset);
    // Random weights: the comparison means little if every chat stops at once.
    expect(want.ids.reduce((n, ids) => n + ids.length, 0)).toBeGreaterThanOrEqual(TOKENS);
    const common = ['--relay', relay.url, '--tracker', tracker.url, '--model', preset, '--model-url', `${st.url}/${preset}/`, '--budget-mb', '64', '--wire-dtype', 'f32'];
    const nodes: NodeProc[] = [];
    try {
      // Started together, each waiting for its own span; every one that started is stopped below, even when another failed.
      const started = await Promise.allSettled(HOPS.map(([a, b]) => startNode([...common, '--layers', `${a}-${b}`])));
      for (const s of started) if (s.status === 'fulfilled') nodes.push(s.value);
      for (const s of started) if (s.status === 'rejected') throw s.reason;
      await Promise.all(nodes.map((n) => n.waitFor((e) => e.event === 'registered')));
      await until(async () => (await fetch(`${tracker.url}/api/route?model=${preset}`)).ok, 20_000, `a complete route for ${preset}`);
      for (const [i, messages] of CHATS.entries()) {
        const stream = await client.chat.completions.create({ model: preset, messages, max_tokens: TOKENS, temperature: 0, stream: true });
        const got: number[] = [];
        for await (const c of stream) got.push(...((c.choices[0] as { token_ids?: number[] } | undefined)?.token_ids ?? []));
        expect(got, `${preset} chat ${i}`).toEqual(want.ids[i]);
      }
    } finally {
      await Promise.all(nodes.map((n) => n.stop()));
    }
  }, 120_000);
});
