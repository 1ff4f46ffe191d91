import { describe, expect, it } from 'vitest';
import { mkdtemp, readFile, rm, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { checkpointTensorNames, fixtureConfig, makeModel } from '../../src/model/fixture.ts';
import { expectedTensorShape, parseModelConfig } from '../../src/model/config.ts';
import { memoryFetch } from '../../src/model/memory-fetch.ts';
import { SafetensorsReader } from '../../src/model/safetensors.ts';
import { parseSafetensorsFile } from '../../src/model/safetensors-format.ts';
import { ModelTokenizer } from '../../src/model/tokenizer.ts';
import { ensureModel, hasModel, MARKER_FILE, REPO_ROOT } from '../../src/cli/models.ts';
import { greedy } from '../helpers/naive-llama.ts';

const sameBytes = (a: Uint8Array, b: Uint8Array): boolean => Buffer.from(a).equals(Buffer.from(b));
const text = (files: Map<string, Uint8Array>, name: string): unknown => JSON.parse(new TextDecoder().decode(files.get(name)));

describe('makeModel', () => {
  it('is deterministic: same seed same bytes, other seed other weights (same tokenizer)', () => {
    const a = makeModel('tiny', 7);
    const b = makeModel('tiny', 7);
    const c = makeModel('tiny', 8);
    expect([...a.keys()]).toEqual([...b.keys()]);
    for (const [name, bytes] of a) expect(sameBytes(bytes, b.get(name)!)).toBe(true);
    expect(sameBytes(a.get('model.safetensors')!, c.get('model.safetensors')!)).toBe(false);
    expect(sameBytes(a.get('tokenizer.json')!, c.get('tokenizer.json')!)).toBe(true);
  });

  it('tiny: HF layout, one file, tied, llama3 rope scaling, every tensor with its config shape', () => {
    const files = makeModel('tiny');
    expect([...files.keys()].sort()).toEqual(['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']);
    const cfg = parseModelConfig(text(files, 'config.json'));
    expect(cfg).toMatchObject({ architecture: 'llama', numLayers: 4, hiddenSize: 64, numHeads: 4, numKvHeads: 2, intermediateSize: 128, vocabSize: 512, tieWordEmbeddings: true, torchDtype: 'bfloat16' });
    expect(cfg.ropeScaling?.type).toBe('llama3');
    const infos = parseSafetensorsFile(files.get('model.safetensors')!, 'model.safetensors');
    expect([...infos.keys()].sort()).toEqual(checkpointTensorNames(cfg).sort());
    for (const [name, t] of infos) {
      expect(t.dtype).toBe('BF16');
      expect(t.shape).toEqual(expectedTensorShape(cfg, name));
      expect(t.offset % 8).toBe(0);
    }
    // Reference writer order: by name, so layers are contiguous blocks.
    const order = [...infos.values()].sort((x, y) => x.offset - y.offset).map((t) => t.name);
    expect(order).toEqual([...order].sort());
  });

  it('small: sharded into 3 files with an index that covers every tensor', () => {
    const files = makeModel('small');
    const index = text(files, 'model.safetensors.index.json') as { metadata: { total_size: number }; weight_map: Record<string, string> };
    const cfg = fixtureConfig('small');
    expect(cfg).toMatchObject({ numLayers: 12, hiddenSize: 512, numHeads: 8, numKvHeads: 2, intermediateSize: 1536, vocabSize: 2048, maxPositionEmbeddings: 2048 });
    expect(Object.keys(index.weight_map).sort()).toEqual(checkpointTensorNames(cfg).sort());
    const shardFiles = [...new Set(Object.values(index.weight_map))].sort();
    expect(shardFiles).toEqual(['model-00001-of-00003.safetensors', 'model-00002-of-00003.safetensors', 'model-00003-of-00003.safetensors']);
    let total = 0;
    for (const f of shardFiles) {
      const infos = parseSafetensorsFile(files.get(f)!, f);
      for (const [name, t] of infos) {
        expect(index.weight_map[name]).toBe(f);
        total += t.byteLength;
      }
    }
    expect(index.metadata.total_size).toBe(total);
    expect(files.has('model.safetensors')).toBe(false);
  });

  it('tiny-qwen2: attention bias and an untied lm_head', () => {
    const cfg = fixtureConfig('tiny-qwen2');
    expect(cfg.architecture).toBe('qwen2');
    expect(cfg.attentionBias).toBe(true);
    const infos = parseSafetensorsFile(makeModel('tiny-qwen2').get('model.safetensors')!, 'model.safetensors');
    expect(infos.get('model.layers.0.self_attn.k_proj.bias')!.shape).toEqual([32]);
    expect(infos.get('lm_head.weight')!.shape).toEqual([512, 64]);
  });

  for (const preset of ['tiny', 'tiny-qwen2'] as const) {
    it(`${preset}: greedy decoding is not degenerate and activations stay O(1)`, async () => {
      const files = makeModel(preset, 0);
      const f = memoryFetch(files);
      const reader = await SafetensorsReader.open(f, 'mem://m/');
      const weights = await reader.loadTensors(reader.tensorInfos.keys());
      const tok = await ModelTokenizer.load(f, 'mem://m/');
      const prompt = tok.encodeChat([{ role: 'user', content: 'What is the weather like today?' }]);
      const g = greedy(fixtureConfig(preset), weights, prompt, 32);
      expect(new Set(g.tokens).size).toBeGreaterThanOrEqual(6);
      for (const s of g.logitStd) {
        expect(s).toBeGreaterThan(1);
        expect(s).toBeLessThan(10);
      }
      for (const rms of g.residualRms.flat()) {
        expect(rms).toBeGreaterThan(0.2);
        expect(rms).toBeLessThan(10);
      }
    });
  }
});

describe('ensureModel and meshnet make-model', () => {
  it('generates once, then reuses the directory', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'meshnet-fixture-'));
    try {
      const out = await ensureModel('tiny', dir, 3);
      expect(out).toBe(dir);
      expect(await hasModel(dir, 'tiny', 3)).toBe(true);
      expect(await hasModel(dir, 'tiny', 4)).toBe(false);
      const before = (await stat(join(dir, 'model.safetensors'))).mtimeMs;
      await new Promise((r) => setTimeout(r, 20));
      await ensureModel('tiny', dir, 3);
      expect((await stat(join(dir, 'model.safetensors'))).mtimeMs).toBe(before);
      expect(sameBytes(new Uint8Array(await readFile(join(dir, 'model.safetensors'))), makeModel('tiny', 3).get('model.safetensors')!)).toBe(true);
      // Another preset into the same directory replaces the old one entirely.
      await ensureModel('small', dir, 0);
      expect(await hasModel(dir, 'small', 0)).toBe(true);
      await expect(stat(join(dir, 'model.safetensors'))).rejects.toThrow();
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it('the CLI writes the files and skips when they are already there', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'meshnet-cli-'));
    const run = promisify(execFile);
    try {
      const bin = join(REPO_ROOT, 'bin', 'meshnet.js');
      const first = await run(process.execPath, [bin, 'make-model', '--preset', 'tiny-qwen2', '--out', dir, '--seed', '5']);
      expect(first.stdout).toMatch(/wrote tiny-qwen2/);
      const marker = JSON.parse(await readFile(join(dir, MARKER_FILE), 'utf8')) as { preset: string; seed: number };
      expect(marker).toMatchObject({ preset: 'tiny-qwen2', seed: 5 });
      const second = await run(process.execPath, [bin, 'make-model', '--preset', 'tiny-qwen2', '--out', dir, '--seed', '5']);
      expect(second.stdout).toMatch(/nothing to do/);
      const bad = await run(process.execPath, [bin, 'make-model', '--preset', 'huge', '--out', dir]).catch((e: { stderr: string }) => e);
      expect((bad as { stderr: string }).stderr).toMatch(/unknown preset "huge"/);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
