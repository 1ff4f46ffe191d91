import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { startStaticServer } from '../../src/cli/static-server.ts';
import type { StaticServer } from '../../src/cli/static-server.ts';
import { ensureModel } from '../../src/cli/models.ts';
import { fixtureConfig } from '../../src/model/fixture.ts';
import { EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR, layerTensorNames } from '../../src/model/config.ts';
import { ModelFetchError, ModelFormatError } from '../../src/model/errors.ts';
import { memoryFetch } from '../../src/model/memory-fetch.ts';
import { SafetensorsReader } from '../../src/model/safetensors.ts';
import { decodeTensorBytes, parseSafetensorsFile, serializeSafetensors } from '../../src/model/safetensors-format.ts';
import { encodeTensor } from '../../src/protocol/tensor.ts';

const layers = (preset: 'tiny' | 'small', from: number, to: number): string[] => {
  const cfg = fixtureConfig(preset);
  const out: string[] = [];
  for (let l = from; l <= to; l++) out.push(...layerTensorNames(cfg, l));
  return out;
};

/** Decode a tensor straight from the file on disk, independent of the Range reader. */
async function fromDisk(dir: string, file: string, name: string): Promise<Float32Array> {
  const bytes = new Uint8Array(await readFile(join(dir, file)));
  const info = parseSafetensorsFile(bytes, file).get(name)!;
  return decodeTensorBytes({ dtype: info.dtype as 'BF16', shape: info.shape, bytes: bytes.subarray(info.offset, info.offset + info.byteLength) }).data;
}

/** Bitwise equality; vitest's deep equal walks a million-element array far too slowly. */
function expectSameFloats(a: Float32Array, b: Float32Array): void {
  expect(a.length).toBe(b.length);
  expect(Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(Buffer.from(b.buffer, b.byteOffset, b.byteLength))).toBe(true);
}

describe('SafetensorsReader over HTTP Range (static server)', () => {
  let tinyDir: string;
  let smallDir: string;
  let server: StaticServer;
  let base: string;

  beforeAll(async () => {
    [tinyDir, smallDir] = await Promise.all([ensureModel('tiny'), ensureModel('small')]);
    server = await startStaticServer({ root: join(tinyDir, '..') });
    base = server.url;
  });
  afterAll(() => server.close());

  it('tiny: fetches exactly the bytes of the requested layers in one request', async () => {
    server.resetStats();
    const r = await SafetensorsReader.open(fetch, `${base}/tiny/`);
    const openBytes = server.stats.bytesSent;
    // 404 for the index, then one prefetch that holds the whole header.
    expect(server.stats.requests).toBe(2);
    expect(openBytes).toBeLessThanOrEqual(32 * 1024);
    server.resetStats();
    const names = layers('tiny', 1, 2);
    const want = r.tensorBytes(names);
    const progress: Array<[number, number]> = [];
    const got = await r.loadTensors(names, { onProgress: (a, b) => progress.push([a, b]) });
    expect(server.stats.bytesSent).toBe(want);
    expect(server.stats.requests).toBe(1);
    expect(server.stats.ranges[0]!.status).toBe(206);
    expect([...got.keys()].sort()).toEqual([...names].sort());
    expect(progress.at(-1)).toEqual([want, want]);
    for (let i = 1; i < progress.length; i++) expect(progress[i]![0]).toBeGreaterThanOrEqual(progress[i - 1]![0]);
    const q = got.get('model.layers.2.self_attn.q_proj.weight')!;
    expect(q.shape).toEqual([64, 64]);
    expect(q.dtype).toBe('BF16');
    expectSameFloats(q.data, await fromDisk(tinyDir, 'model.safetensors', 'model.layers.2.self_attn.q_proj.weight'));
    // Tied: no lm_head in the file.
    expect(r.has(LM_HEAD_TENSOR)).toBe(false);
  });

  it('small (3 shards): follows the index and fetches only the asked tensors, few requests', async () => {
    server.resetStats();
    const r = await SafetensorsReader.open(fetch, `${base}/small/`);
    expect(r.files).toEqual(['model-00001-of-00003.safetensors', 'model-00002-of-00003.safetensors', 'model-00003-of-00003.safetensors']);
    const headerBytes = server.stats.bytesSent;
    expect(headerBytes).toBeLessThan(3 * 32 * 1024 + 16 * 1024);
    server.resetStats();
    const names = [...layers('small', 4, 7), EMBED_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR];
    const want = r.tensorBytes(names);
    const got = await r.loadTensors(names);
    const files = new Set(names.map((n) => r.info(n).file));
    expect(files.size).toBeGreaterThanOrEqual(2);
    expect(server.stats.bytesSent).toBeLessThanOrEqual(want + 512 * 1024);
    expect(server.stats.requests).toBeLessThanOrEqual(files.size + 2);
    // Nothing outside the asked tensors: layer 8 was not touched.
    expect(want).toBeLessThan(0.45 * (await Promise.all(r.files.map((f) => readFile(join(smallDir, f))))).reduce((a, b) => a + b.byteLength, 0));
    for (const n of [EMBED_TENSOR, LM_HEAD_TENSOR, 'model.layers.5.mlp.down_proj.weight']) {
      expectSameFloats(got.get(n)!.data, await fromDisk(smallDir, r.info(n).file, n));
    }
    expect(got.get('model.layers.5.mlp.down_proj.weight')!.shape).toEqual([512, 1536]);
  });

  it('does not pull large gaps: layers 0 and 2 of small are far apart in the file', async () => {
    const r = await SafetensorsReader.open(fetch, `${base}/small/`);
    server.resetStats();
    const names = [...layers('small', 0, 0), ...layers('small', 2, 2)];
    await r.fetchTensorBytes(names);
    expect(server.stats.bytesSent).toBe(r.tensorBytes(names));
  });

  it('works (slowly) against a server that ignores Range, and says so', async () => {
    server.setIgnoreRange(true);
    try {
      const r = await SafetensorsReader.open(fetch, `${base}/tiny/`);
      const names = layers('tiny', 3, 3);
      const got = await r.loadTensors(names);
      expect(r.rangeIgnoredFiles.has('model.safetensors')).toBe(true);
      expectSameFloats(got.get('model.layers.3.mlp.up_proj.weight')!.data, await fromDisk(tinyDir, 'model.safetensors', 'model.layers.3.mlp.up_proj.weight'));
      expect(server.stats.ranges.some((x) => x.range !== null && x.status === 200)).toBe(true);
    } finally {
      server.setIgnoreRange(false);
    }
  });

  it('a connection cut mid-body fails with a fetch error naming the file', async () => {
    const r = await SafetensorsReader.open(fetch, `${base}/tiny/`);
    server.setAbort({ path: '/tiny/model.safetensors', afterBytes: 1000, times: 1 });
    try {
      const err = await r.loadTensors(layers('tiny', 0, 3)).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(ModelFetchError);
      expect((err as ModelFetchError).file).toBe('model.safetensors');
    } finally {
      server.setAbort(null);
    }
    // The next attempt succeeds.
    expect((await r.loadTensors(layers('tiny', 0, 0))).size).toBe(9);
  });

  it('honours an abort signal', async () => {
    const r = await SafetensorsReader.open(fetch, `${base}/small/`);
    const ac = new AbortController();
    ac.abort();
    await expect(r.loadTensors(layers('small', 0, 11), { signal: ac.signal })).rejects.toMatchObject({ name: 'AbortError' });
  });

  it('a failed connection or a 503 is tried again (up to 3 times); the tensors are the file\'s', async () => {
    let left = 2;
    const flaky: typeof fetch = async (url, init) => {
      const want = String(url).endsWith('model.safetensors') && (init?.headers as Record<string, string> | undefined)?.Range?.startsWith('bytes=0-') === false;
      if (want && left > 0) {
        left--;
        if (left === 1) throw new TypeError('fetch failed', { cause: { code: 'ECONNRESET' } });
        return new Response('busy', { status: 503 });
      }
      return fetch(url, init);
    };
    const r = await SafetensorsReader.open(flaky, `${base}/tiny/`);
    const names = layers('tiny', 1, 1);
    const got = await r.loadTensors(names);
    expect(left).toBe(0);
    expect(r.stats.retries).toBe(2);
    expectSameFloats(got.get('model.layers.1.mlp.up_proj.weight')!.data, await fromDisk(tinyDir, 'model.safetensors', 'model.layers.1.mlp.up_proj.weight'));
  });

  it('a server that never answers fails after 3 attempts with a fetch error naming the file', async () => {
    let calls = 0;
    const dead: typeof fetch = async () => {
      calls++;
      throw new TypeError('fetch failed', { cause: { code: 'ECONNREFUSED' } });
    };
    const err = await SafetensorsReader.open(dead, `${base}/tiny/`).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ModelFetchError);
    expect((err as ModelFetchError).message).toMatch(/3 attempts/);
    expect(calls).toBe(3);
  });

  it('a missing base directory is a fetch error with the status', async () => {
    const err = await SafetensorsReader.open(fetch, `${base}/nope/`).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ModelFetchError);
    expect((err as ModelFetchError).status).toBe(404);
    expect((err as ModelFetchError).file).toBe('model.safetensors');
  });
});

// --- broken checkpoints -------------------------------------------------------

const enc = new TextEncoder();

/** A safetensors file with a hand-written header, for cases the writer refuses to produce. */
function rawFile(header: Record<string, unknown>, dataBytes: number): Uint8Array {
  const h = enc.encode(JSON.stringify(header));
  const out = new Uint8Array(8 + h.byteLength + dataBytes);
  new DataView(out.buffer).setBigUint64(0, BigInt(h.byteLength), true);
  out.set(h, 8);
  return out;
}

function goodFile(): Uint8Array {
  const w = encodeTensor(new Float32Array([1, 2, 3, 4, 5, 6]), 'bf16');
  const b = encodeTensor(new Float32Array([0.5, -0.5]), 'f32');
  return serializeSafetensors([
    ['a.weight', { dtype: 'BF16', shape: [2, 3], data: w }],
    ['b.bias', { dtype: 'F32', shape: [2], data: b }],
  ]);
}

async function openErr(files: Record<string, Uint8Array>, names?: string[]): Promise<ModelFormatError> {
  const err = await (async () => {
    const r = await SafetensorsReader.open(memoryFetch(new Map(Object.entries(files))), 'mem://m/', { headerPrefetchBytes: 16 });
    if (names) await r.loadTensors(names);
  })().then(
    () => null,
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(ModelFormatError);
  return err as ModelFormatError;
}

describe('SafetensorsReader on broken checkpoints', () => {
  it('reads a good file (F32 and BF16) through a small prefetch', async () => {
    const r = await SafetensorsReader.open(memoryFetch(new Map([['model.safetensors', goodFile()]])), 'mem://m/', { headerPrefetchBytes: 16 });
    const t = await r.loadTensors(['a.weight', 'b.bias']);
    expect([...t.get('a.weight')!.data]).toEqual([1, 2, 3, 4, 5, 6]);
    expect([...t.get('b.bias')!.data]).toEqual([0.5, -0.5]);
  });

  it('truncated header', async () => {
    const e = await openErr({ 'model.safetensors': goodFile().subarray(0, 40) });
    expect(e.file).toBe('model.safetensors');
    expect(e.message).toMatch(/truncated/);
    expect((await openErr({ 'model.safetensors': new Uint8Array(5) })).message).toMatch(/truncated|absurd/);
  });

  it('absurd header length', async () => {
    const f = goodFile().slice();
    new DataView(f.buffer).setBigUint64(0, 1n << 40n, true);
    expect((await openErr({ 'model.safetensors': f })).message).toMatch(/absurd/);
  });

  it('header that is not JSON', async () => {
    const f = goodFile().slice();
    f[8] = 0x7a;
    expect((await openErr({ 'model.safetensors': f })).message).toMatch(/not valid JSON/);
  });

  it('unsupported dtype is refused when that tensor is loaded, naming it', async () => {
    const f = rawFile({ 'ids': { dtype: 'I64', shape: [2], data_offsets: [0, 16] }, 'w': { dtype: 'F32', shape: [1], data_offsets: [16, 20] } }, 20);
    const ok = await SafetensorsReader.open(memoryFetch(new Map([['model.safetensors', f]])), 'mem://m/');
    expect((await ok.loadTensors(['w'])).get('w')!.data.length).toBe(1);
    const e = await openErr({ 'model.safetensors': f }, ['ids']);
    expect(e.tensor).toBe('ids');
    expect(e.message).toMatch(/I64 is not supported/);
    const bogus = await openErr({ 'model.safetensors': rawFile({ x: { dtype: 'Q4', shape: [2], data_offsets: [0, 1] } }, 1) });
    expect(bogus.tensor).toBe('x');
    expect(bogus.message).toMatch(/unknown dtype "Q4"/);
  });

  it('missing tensor', async () => {
    const e = await openErr({ 'model.safetensors': goodFile() }, ['c.weight']);
    expect(e.tensor).toBe('c.weight');
    expect(e.file).toBe('model.safetensors');
    expect(e.message).toMatch(/not found/);
  });

  it('shape / byte length mismatch', async () => {
    const e = await openErr({ 'model.safetensors': rawFile({ w: { dtype: 'BF16', shape: [3, 3], data_offsets: [0, 16] } }, 16) });
    expect(e.tensor).toBe('w');
    expect(e.message).toMatch(/needs 18 bytes but data_offsets span 16/);
  });

  it('data_offsets past the end of the file', async () => {
    const e = await openErr({ 'model.safetensors': rawFile({ w: { dtype: 'F32', shape: [4], data_offsets: [0, 16] } }, 8) });
    expect(e.tensor).toBe('w');
    expect(e.message).toMatch(/past the end/);
  });

  it('index pointing at a tensor its file lacks', async () => {
    const index = enc.encode(JSON.stringify({ metadata: {}, weight_map: { 'a.weight': 'model-00001-of-00001.safetensors', 'ghost.weight': 'model-00001-of-00001.safetensors' } }));
    const e = await openErr({ 'model.safetensors.index.json': index, 'model-00001-of-00001.safetensors': goodFile() });
    expect(e.tensor).toBe('ghost.weight');
    expect(e.file).toBe('model-00001-of-00001.safetensors');
  });

  it('malformed index', async () => {
    const e = await openErr({ 'model.safetensors.index.json': enc.encode('{"weight_map": 3}') });
    expect(e.file).toBe('model.safetensors.index.json');
    expect(e.message).toMatch(/weight_map/);
  });
});
