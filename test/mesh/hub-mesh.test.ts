/**
 * A mesh whose tracker model is a hub id: `meshnet tracker --model
 * tiny=hf:org/gated` on the hub mimic (HF_ENDPOINT), a gated repo reached
 * with HF_TOKEN. One `meshnet node` resolves `--model-url hf:org/gated`
 * itself, the other loads what the tracker assigns it, from the pinned URL
 * the tracker hands out; both keep the files in their cache dirs. The chat's
 * greedy ids equal the float64 reference; the token never reaches the CDN.
 * Without HF_TOKEN the tracker says to accept the license and set it.
 */
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import OpenAI from 'openai';
import { afterAll, describe, expect, it } from 'vitest';
import { cachePath } from '../../src/host/node/hub-cache.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { fixture } from '../helpers/shard.ts';
import { startHubMimic, type HubMimic } from '../helpers/hub-mimic.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { spawnMeshnet, until, type Proc } from '../helpers/mesh.ts';

const TOKEN = 'hf_mesh_token';
const MESSAGES = [{ role: 'user' as const, content: 'Tell me about the quick brown fox.' }];
const MAX_TOKENS = 16;

describe('a mesh serving hf:org/gated from the hub mimic', () => {
  let mimic: HubMimic | undefined;
  let relay: RelayProcess | undefined;
  const procs: Proc[] = [];
  const work = mkdtempSync(join(tmpdir(), 'meshnet-hub-mesh-'));

  afterAll(async () => {
    await Promise.all(procs.map((p) => p.stop()));
    await relay?.stop();
    await mimic?.close();
    rmSync(work, { recursive: true, force: true });
  });

  it('pins the revision, hands the pinned URL to nodes, caches files, and chats the reference greedy ids', async () => {
    const f = fixture('tiny');
    const d = new TextDecoder();
    const tok = ModelTokenizer.fromJson(JSON.parse(d.decode(f.files.get('tokenizer.json')!)), JSON.parse(d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
    const all = new ReferenceModel(f.cfg, f.weights).greedy(tok.encodeChat(MESSAGES), MAX_TOKENS);
    const eos = all.findIndex((t) => tok.isEos(t));
    const want = eos >= 0 ? all.slice(0, eos) : all;

    mimic = await startHubMimic({ 'org/gated': { files: f.files, gatedToken: TOKEN } });
    const sha = mimic.sha('org/gated');
    const pinned = `${mimic.endpoint}/org/gated/resolve/${sha}/`;
    relay = await startRelayProcess();
    const env = { HF_ENDPOINT: mimic.endpoint, HF_TOKEN: TOKEN };

    // Without the token: no crash, a line that says what to do.
    const locked = spawnMeshnet(['tracker', '--port', '0', '--log-level', 'warn', '--model', 'tiny=hf:org/gated'], { HF_ENDPOINT: mimic.endpoint, HF_TOKEN: '' });
    procs.push(locked);
    await until(async () => /accept its license at https:\/\/huggingface\.co\/org\/gated and set HF_TOKEN/.test(locked.stderr()), 20_000, 'the license message');

    const tracker = spawnMeshnet(['tracker', '--port', '0', '--log-level', 'warn', '--model', 'tiny=hf:org/gated', '--relay', relay.url, '--heartbeat-interval-ms', '500'], env);
    procs.push(tracker);
    const trackerUrl = (await tracker.waitFor((e) => e.event === 'listening')).url as string;

    const common = ['node', '--port', '0', '--threads', '1', '--relay', relay.url, '--tracker', trackerUrl, '--model', 'tiny', '--max-context', '256'];
    const cacheA = join(work, 'cache-a');
    const cacheB = join(work, 'cache-b');
    // A: its own span, from the hub id it resolves itself.
    // Its budget holds two layers of tiny, not more: the tracker's rebalancing cannot widen a pinned span (which such a node
    // never follows, and would then stay "loading" in the tracker's eyes).
    const a = spawnMeshnet([...common, '--layers', '0-2', '--model-url', 'hf:org/gated', '--budget-mb', '1.45'], { ...env, MESHNET_CACHE_DIR: cacheA });
    procs.push(a);
    await a.waitFor((e) => e.event === 'serving', 60_000);
    type Av = { models: Array<{ nodes: Array<{ serving: { start_layer: number } | null }> }> };
    // The tracker learns of A's span at A's next heartbeat; B must be assigned after that.
    await until(async () => ((await (await fetch(`${trackerUrl}/api/availability?model=tiny`)).json()) as Av).models[0]!.nodes.some((n) => n.serving !== null), 20_000, "A's span at the tracker");
    // B: no span of its own; the tracker assigns one (its budget fits the whole model) with the pinned URL.
    const b = spawnMeshnet([...common, '--budget-mb', '64', '--cache-dir', cacheB], env);
    procs.push(b);
    const reg = await b.waitFor((e) => e.event === 'registered' && e.assignment !== null, 60_000);
    expect(reg.assignment).toMatchObject({ model: 'tiny', end_layer: 4, model_url: pinned });
    await b.waitFor((e) => e.event === 'serving', 60_000);
    await until(async () => (await fetch(`${trackerUrl}/api/route?model=tiny`)).ok, 30_000, 'a complete route');

    const client = new OpenAI({ baseURL: `${trackerUrl}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
    const stream = await client.chat.completions.create({ model: 'tiny', messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0, stream: true });
    const ids: number[] = [];
    for await (const c of stream) ids.push(...((c.choices[0] as { token_ids?: number[] } | undefined)?.token_ids ?? []));
    expect(ids).toEqual(want);

    for (const dir of [cacheA, cacheB]) {
      for (const file of ['config.json', 'model.safetensors']) expect(existsSync(cachePath(dir, 'org/gated', sha, file))).toBe(true);
    }
    expect(existsSync(cachePath(cacheA, 'org/gated', sha, 'tokenizer.json'))).toBe(true);
    // Every file request named the pinned commit; the token went to the hub origin and never to the CDN.
    const files = mimic.log.filter((r) => r.path.includes('/resolve/'));
    expect(files.length).toBeGreaterThan(0);
    expect(files.every((r) => r.path.includes(`/resolve/${sha}/`))).toBe(true);
    expect(mimic.log.filter((r) => r.origin === 'hub' && r.status !== 401).every((r) => r.authorization === `Bearer ${TOKEN}`)).toBe(true);
    const cdn = mimic.log.filter((r) => r.origin === 'cdn');
    expect(cdn.length).toBeGreaterThan(0);
    expect(cdn.every((r) => r.authorization === null)).toBe(true);
  }, 180_000);
});
