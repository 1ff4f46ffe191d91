/**
 * Loading by hub id against a local hub mimic on two origins
 * (test/helpers/hub-mimic.ts): revision pinning, the 302 to the CDN with
 * Range kept and HF_TOKEN never sent there, 401 on a gated repo, 404 naming
 * repo / revision / file, a truncated body as an error, sharded checkpoints
 * through model.safetensors.index.json, and the Node node's disk cache.
 */
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { cachePath, cachingHubFetch, type HubCacheStats } from '../../src/host/node/hub-cache.ts';
import { HubAccessError, hubBaseUrl, hubEndpoint, hubFetch, parseHubRef, resolveHubModel } from '../../src/model/hub.ts';
import { openSafetensors } from '../../src/model/safetensors.ts';
import { decodeTensorBytes } from '../../src/model/safetensors-format.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { fixture } from '../helpers/shard.ts';
import { startHubMimic, type HubMimic } from '../helpers/hub-mimic.ts';

const TOKEN = 'hf_test_token';
let mimic: HubMimic;
const tiny = fixture('tiny');
const small = fixture('small');
const work = mkdtempSync(join(tmpdir(), 'meshnet-hub-test-'));

beforeAll(async () => {
  mimic = await startHubMimic({
    'org/tiny': { files: tiny.files, refs: { v1: 'a'.repeat(40) } },
    'org/small': { files: small.files },
    'org/gated': { files: tiny.files, gatedToken: TOKEN },
    'org/mirror': { files: tiny.files, noApi: true },
  });
});
afterAll(async () => {
  await mimic?.close();
  rmSync(work, { recursive: true, force: true });
});

/** Bitwise equality of two float arrays (toEqual walks a million elements slowly). */
function sameFloats(a: ArrayLike<number> & { buffer: ArrayBufferLike; byteOffset: number; byteLength: number }, b: typeof a): boolean {
  return a.byteLength === b.byteLength && Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(Buffer.from(b.buffer, b.byteOffset, b.byteLength));
}

const hubAt = (token?: string) => hubFetch(fetch, { endpoint: mimic.endpoint, ...(token ? { token } : {}) });

describe('hub ids', () => {
  it('parse ORG/REPO and an optional revision; bad ones are refused with the expected form', () => {
    expect(parseHubRef('hf:meta-llama/Llama-3.2-1B-Instruct')).toEqual({ repo: 'meta-llama/Llama-3.2-1B-Instruct', revision: 'main' });
    expect(parseHubRef('hf:Qwen/Qwen3-8B@v1.0')).toEqual({ repo: 'Qwen/Qwen3-8B', revision: 'v1.0' });
    for (const bad of ['hf:justone', 'hf:a/b/c', 'hf:../x', 'hf:org/repo@', 'hf:org/re po', 'https://x/y']) expect(() => parseHubRef(bad)).toThrow(/hf:ORG\/REPO|revision|not a hub id/);
    expect(hubEndpoint({})).toBe('https://huggingface.co');
    expect(hubEndpoint({ HF_ENDPOINT: 'http://127.0.0.1:9/' })).toBe('http://127.0.0.1:9');
  });

  it('a branch resolves to its commit sha (API), a sha needs no lookup, and the URL is pinned to it', async () => {
    const r = await resolveHubModel(fetch, 'hf:org/tiny', { endpoint: mimic.endpoint });
    expect(r.sha).toBe(mimic.sha('org/tiny'));
    expect(r.url).toBe(`${mimic.endpoint}/org/tiny/resolve/${r.sha}/`);
    expect((await resolveHubModel(fetch, 'hf:org/tiny@v1', { endpoint: mimic.endpoint })).sha).toBe('a'.repeat(40));
    const before = mimic.log.length;
    const pinned = await resolveHubModel(fetch, `hf:org/tiny@${'b'.repeat(40)}`, { endpoint: mimic.endpoint });
    expect(pinned.url).toBe(hubBaseUrl(mimic.endpoint, 'org/tiny', 'b'.repeat(40)));
    expect(mimic.log.length).toBe(before);
    // A mirror without /api/: the commit its /resolve/ answer names (X-Repo-Commit).
    expect((await resolveHubModel(fetch, 'hf:org/mirror', { endpoint: mimic.endpoint })).sha).toBe(mimic.sha('org/mirror'));
    await expect(resolveHubModel(fetch, 'hf:org/mirror@nope', { endpoint: mimic.endpoint })).rejects.toThrow(/404.*no revision "nope" in org\/mirror|404.*no config\.json at revision "nope"/);
  });

  it('404s name the repo or the revision; a gated repo without a token says to accept the license and set HF_TOKEN', async () => {
    await expect(resolveHubModel(fetch, 'hf:org/tiny@nope', { endpoint: mimic.endpoint })).rejects.toThrow(/404.*no revision "nope" in org\/tiny/);
    await expect(resolveHubModel(fetch, 'hf:org/missing', { endpoint: mimic.endpoint, token: TOKEN })).rejects.toThrow(/404.*no repo org\/missing/);
    const gated = resolveHubModel(fetch, 'hf:org/gated', { endpoint: mimic.endpoint });
    await expect(gated).rejects.toBeInstanceOf(HubAccessError);
    await expect(gated).rejects.toThrow(/accept its license at https:\/\/huggingface\.co\/org\/gated and set HF_TOKEN/);
    await expect(resolveHubModel(fetch, 'hf:org/gated', { endpoint: mimic.endpoint, token: 'wrong' })).rejects.toThrow(/HF_TOKEN was sent but does not grant access/);
    expect((await resolveHubModel(fetch, 'hf:org/gated', { endpoint: mimic.endpoint, token: TOKEN })).sha).toBe(mimic.sha('org/gated'));
  });

  it('follows the 302 to the CDN origin with Range kept; the token reaches the hub origin only', async () => {
    const { url } = await resolveHubModel(fetch, 'hf:org/gated', { endpoint: mimic.endpoint, token: TOKEN });
    const from = mimic.log.length;
    const res = await hubAt(TOKEN)(`${url}model.safetensors`, { headers: { Range: 'bytes=8-15' } });
    expect(res.status).toBe(206);
    expect([...new Uint8Array(await res.arrayBuffer())]).toEqual([...tiny.files.get('model.safetensors')!.subarray(8, 16)]);
    const seen = mimic.log.slice(from);
    expect(seen.map((r) => [r.origin, r.status])).toEqual([['hub', 302], ['cdn', 206]]);
    expect(seen.map((r) => r.range)).toEqual(['bytes=8-15', 'bytes=8-15']);
    expect(seen[0]!.authorization).toBe(`Bearer ${TOKEN}`);
    expect(seen[1]!.authorization).toBeNull();
    // Without a token a gated file is the same clear error, through the loaders too.
    await expect(openSafetensors(hubAt(), url)).rejects.toThrow(/accept its license at https:\/\/huggingface\.co\/org\/gated/);
  });

  it('a missing file is a 404 that names it (the loaders report file, repo and revision from the URL)', async () => {
    const { url } = await resolveHubModel(fetch, 'hf:org/tiny', { endpoint: mimic.endpoint });
    const res = await hubAt()(`${url}nope.json`);
    expect(res.status).toBe(404);
    expect(res.headers.get('x-error-code')).toBe('EntryNotFound');
    // No index.json on a single-file repo: the 404 the reader expects, then model.safetensors through the CDN.
    const reader = await openSafetensors(hubAt(), url);
    expect(reader.files).toEqual(['model.safetensors']);
  });

  it('a body cut short is an error, not corrupted weights (plain fetch and the cache)', async () => {
    const { url } = await resolveHubModel(fetch, 'hf:org/tiny', { endpoint: mimic.endpoint });
    mimic.truncate('org/tiny', 'model.safetensors', true);
    try {
      const res = await hubAt()(`${url}model.safetensors`);
      await expect(res.arrayBuffer()).rejects.toThrow();
      const dir = join(work, 'cut');
      const cached = cachingHubFetch(hubAt(), { endpoint: mimic.endpoint, dir });
      await expect(cached(`${url}model.safetensors`, { headers: { Range: 'bytes=0-7' } })).rejects.toThrow(/truncated|download failed|terminated/);
      expect(existsSync(cachePath(dir, 'org/tiny', mimic.sha('org/tiny'), 'model.safetensors'))).toBe(false);
    } finally {
      mimic.truncate('org/tiny', 'model.safetensors', false);
    }
  });

  it('a body that stalls without closing is an error after the idle timeout, not a hang', async () => {
    const { url } = await resolveHubModel(fetch, 'hf:org/tiny', { endpoint: mimic.endpoint });
    mimic.stall('org/tiny', 'model.safetensors', true);
    try {
      const res = await hubFetch(fetch, { endpoint: mimic.endpoint, idleTimeoutMs: 500 })(`${url}model.safetensors`);
      await expect(res.arrayBuffer()).rejects.toThrow(/stalled: no data for 0\.5 s after \d+ bytes/);
    } finally {
      mimic.stall('org/tiny', 'model.safetensors', false);
    }
  });

  it('loads a sharded checkpoint through model.safetensors.index.json, every tensor byte-exact', async () => {
    const { url } = await resolveHubModel(fetch, 'hf:org/small', { endpoint: mimic.endpoint });
    const reader = await openSafetensors(hubAt(), url);
    expect(reader.files).toEqual(['model-00001-of-00003.safetensors', 'model-00002-of-00003.safetensors', 'model-00003-of-00003.safetensors']);
    const names = ['model.layers.5.self_attn.q_proj.weight', 'lm_head.weight', 'model.embed_tokens.weight'];
    const got = await reader.fetchTensorBytes(names);
    for (const n of names) expect(sameFloats(decodeTensorBytes(got.get(n)!).data, small.weights(n).data)).toBe(true);
    expect(mimic.log.filter((r) => r.origin === 'cdn' && r.path.includes('org%2Fsmall')).every((r) => r.status === 206)).toBe(true);
  });

  it('the Node cache: downloaded once, keyed by repo + sha + file, Range answered from disk, tokenizer files too', async () => {
    const { url, sha } = await resolveHubModel(fetch, 'hf:org/tiny', { endpoint: mimic.endpoint });
    const dir = join(work, 'cache');
    const stats: HubCacheStats = { downloads: 0, hits: 0 };
    const cached = cachingHubFetch(hubAt(), { endpoint: mimic.endpoint, dir, stats });
    const from = mimic.log.length;
    const [a, b] = await Promise.all([openSafetensors(cached, url), openSafetensors(cached, url)]);
    expect(a.files).toEqual(b.files);
    const onDisk = cachePath(dir, 'org/tiny', sha, 'model.safetensors');
    expect(readFileSync(onDisk)).toEqual(Buffer.from(tiny.files.get('model.safetensors')!));
    const cdnGets = mimic.log.slice(from).filter((r) => r.origin === 'cdn');
    expect(cdnGets).toHaveLength(1);
    expect(cdnGets[0]!.range).toBeNull();
    const tok = await ModelTokenizer.load(cached, url);
    expect(tok.vocabSize).toBe(512);
    expect(existsSync(cachePath(dir, 'org/tiny', sha, 'tokenizer.json'))).toBe(true);
    // A second reader (a restart) touches the network only for files never cached (the absent index.json).
    const mark = mimic.log.length;
    const again = await openSafetensors(cachingHubFetch(hubAt(), { endpoint: mimic.endpoint, dir }), url);
    const bytes = await again.fetchTensorBytes(['model.layers.1.mlp.up_proj.weight']);
    expect(sameFloats(decodeTensorBytes(bytes.get('model.layers.1.mlp.up_proj.weight')!).data, tiny.weights('model.layers.1.mlp.up_proj.weight').data)).toBe(true);
    expect(mimic.log.slice(mark).map((r) => r.path)).toEqual([`/org/tiny/resolve/${sha}/model.safetensors.index.json`]);
    expect(stats.downloads).toBeGreaterThanOrEqual(3);
  });
});
